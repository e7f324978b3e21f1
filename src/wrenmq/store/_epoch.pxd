# C types for _epoch.py when setup.py compiles it (Cython's augmenting .pxd); the .py
# stays plain Python and is the one truth of what the code does.

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object o)

cdef Py_ssize_t _seal_records, _seal_bytes, _record_overhead
cdef bint _compiled

cdef class Epoch:
    cdef public object id
    cdef public long long base
    cdef public list recs
    cdef public list ops
    cdef public bint durable
    cdef public long long nbytes
    cdef public long long count

cdef class EpochAppender:
    cdef public long long next_offset
    cdef public Epoch _epoch
    cdef public object _tail
    cdef public dict _client_bytes
    cdef public object on_pending
    cdef public object _queue
    cdef public object _last_id
    cdef public long long sealed_bytes
    cdef long long _add(self, object ts_us, int qos, bint retain, bytes topic_b, str client_id,
                        bytes props_b, object payload, int packet_id, bint private) except -1

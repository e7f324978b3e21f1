# C types for _epoch.py when setup.py compiles it (Cython's augmenting .pxd); the .py
# stays plain Python and is the one truth of what the code does.

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* One record's fixed fields into an epoch's `fixed` buffer (_epoch.FIXED: 32 bytes,
       little-endian, as format.py requires of the machine). */
    static void wrenmq_put_fixed(char *f, long long ts, long long start, unsigned int lr,
                                 unsigned int lp, unsigned int lt, unsigned int lc,
                                 unsigned int pid, unsigned int flags) {
        int64_t a = ts, b = start;
        uint32_t c = lr, d = lp;
        uint16_t e = (uint16_t)lt, g = (uint16_t)lc, h = (uint16_t)pid;
        memcpy(f, &a, 8);
        memcpy(f + 8, &b, 8);
        memcpy(f + 16, &c, 4);
        memcpy(f + 20, &d, 4);
        memcpy(f + 24, &e, 2);
        memcpy(f + 26, &g, 2);
        memcpy(f + 28, &h, 2);
        f[30] = (char)flags;
        f[31] = 0;
    }
    """
    void wrenmq_put_fixed(char *f, long long ts, long long start, unsigned int lr, unsigned int lp,
                          unsigned int lt, unsigned int lc, unsigned int pid, unsigned int flags)

cdef Py_ssize_t _seal_records, _seal_bytes, _fixed_size
cdef bint _compiled

cdef class Epoch:
    cdef public object id
    cdef public long long base
    cdef public list ops
    cdef public bint durable
    cdef public long long count
    cdef public long long var_used
    cdef public long long topic_bytes, client_bytes, props_bytes, payload_bytes
    cdef public long long first_ts, max_ts
    cdef public object pool
    cdef public bytearray fixed, var
    cdef public bint released
    cpdef add(self, long long ts, int flags, bytes topic, bytes client, bytes props, bytes payload,
              int pid)

cdef class EpochAppender:
    cdef public long long next_offset
    cdef public Epoch _epoch
    cdef public object _tail
    cdef public dict _client_bytes
    cdef public object on_pending
    cdef public object _queue
    cdef public object _pool
    cdef public object _last_id
    cdef public long long sealed_bytes
    cdef long long _add(self, object ts_us, int qos, bint retain, bytes topic_b, object client_id,
                        bytes props_b, object payload, int packet_id, bint private) except -1

cdef class TopicLog:
    cdef EpochAppender _store
    cdef public bytes topic

cdef void _put_record(bytearray var, bytearray fixed, Py_ssize_t i, Py_ssize_t start, long long ts,
                      int flags, bytes topic, bytes client, bytes props, bytes payload, int pid)

"""File helpers of the commit log: durable writes, block allocation and the durable-mark file.

Nothing here knows the log's format; the segment, recovery and writer code use these to
put bytes on disk in an order a crash cannot turn into a lie.
"""

import os
import struct
import zlib

# The partition's durable end, kept by a writer that fsyncs (`CommitLog(durable_marks=True)`):
# the offset below which every record is on disk (an fdatasync of it returned), and the
# CRC-32 of those 8 bytes. Readers that must never see a record a crash of the machine
# could still take back, and its offset then reused (the Spark source), read up to it.
DURABLE_FILE = "durable"
_DURABLE = struct.Struct("<QI")


def durable_bytes(offset):
    """What DURABLE_FILE holds to say every record below `offset` is on disk."""
    return _DURABLE.pack(offset, zlib.crc32(offset.to_bytes(8, "little")))


def read_durable(directory):
    """The durable end `directory`'s writer last wrote; None if it keeps none (its fsync
    is "never", or it predates the file); 0 if the file cannot be read (a crash left it
    torn: nothing is known durable until the writer writes it again)."""
    path = os.path.join(directory, DURABLE_FILE)
    for _ in range(3):  # (a read racing the writer's 12-byte write can see half of it)
        try:
            with open(path, "rb") as fh:
                data = fh.read(_DURABLE.size)
        except FileNotFoundError:
            return None
        except OSError:
            return 0
        if len(data) == _DURABLE.size:
            offset, crc = _DURABLE.unpack(data)
            if zlib.crc32(data[:8]) == crc:
                return offset
    return 0


_FALLOC_FL_KEEP_SIZE = 1


def _find_fallocate():
    """libc's fallocate(2) with FALLOC_FL_KEEP_SIZE (Python's os has only posix_fallocate,
    which grows the file), or None where there is none."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int

    def fallocate(fd, offset, length):
        if fn(fd, _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return fallocate


# fallocate(fd, offset, length): allocate the blocks of [offset, offset + length) without
# changing the file's size (what readers see); None where the platform has no fallocate.
fallocate = _find_fallocate()


def write_atomic(path, data):
    """Replace `path` with `data`: written to a temporary file, fsynced, renamed over it,
    so a crash leaves the old contents or the new, never half of them."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    IOV_MAX = 1024


def write_parts(fd, parts):
    """Write `parts` in order: writev in runs of at most IOV_MAX, short writes finished."""
    for i in range(0, len(parts), IOV_MAX):
        run = parts[i:i + IOV_MAX] if len(parts) > IOV_MAX else parts
        n = os.writev(fd, run)
        want = sum(map(len, run))
        if n < want:  # rare: signals, quotas
            view = memoryview(b"".join(run))[n:]
            while view:
                view = view[os.write(fd, view):]


def fsync_dir(path):
    """Make the directory's entries (files created, renamed or removed) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

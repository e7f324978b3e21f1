"""One writer per data dir: an exclusive lock on `<data_dir>/wrenmq.lock`.

Two brokers on one data dir would both append to its commit log and both write its state
database, and corrupt both. The Store takes the lock as it opens the data dir for writing
and holds it for as long as it is open (in practice the process's life). It is a
`flock`: the kernel releases it when the process ends however it ends (`kill -9`
included), so a stale lock file never keeps a broker from starting, and a second open of
the data dir is refused also from within the same process.

The file says who holds the lock, as JSON: the process id, the host, when it started and,
once its listeners are open, where its MQTT listeners are (`pipeline replay` uses that to
tell whether its target is the broker that owns the log). Readers (`wrenmq log`, the
Spark source, replay) never take the lock: they read files the writer only appends to.
"""

import datetime as _dt
import errno
import json
import logging
import os
import socket

try:
    import fcntl
except ImportError:  # (not POSIX: no lock, said once at open)
    fcntl = None

log = logging.getLogger("wrenmq.store")

LOCK_FILE = "wrenmq.lock"


class DataDirInUse(OSError):
    """Another process holds the data dir's lock (the message names it and the dir)."""


def _describe_owner(owner):
    if not owner or not isinstance(owner.get("pid"), int):
        return "another process (it has not written its pid yet)"
    parts = [f"pid {owner['pid']}"]
    if owner.get("host") and owner["host"] != socket.gethostname():
        parts.append(f"on host {owner['host']}")
    if owner.get("started"):
        parts.append(f"started {owner['started']}")
    return f"another wrenmq process ({', '.join(parts)})"


def _read(path):
    """The lock file's JSON, or None (no file, empty, or being rewritten)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(65536)
    except OSError:
        return None
    try:
        owner = json.loads(data)
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


class DataDirLock:
    """The exclusive lock on a data dir, taken at construction; `release()` gives it back.

    Raises DataDirInUse when another process (or another open Store of this one) has it."""

    def __init__(self, data_dir):
        self.data_dir = os.path.abspath(data_dir)
        self.path = os.path.join(self.data_dir, LOCK_FILE)
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        self._fd = None
        if fcntl is None:
            log.warning("no fcntl on this platform: %s is not locked against a second broker", self.data_dir)
            return
        # No O_TRUNC: if another process holds the lock, what it wrote (its pid) stays.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OSError(f"cannot lock the data dir {self.data_dir} ({self.path}): {e.strerror}") from None
            raise DataDirInUse(
                f"the data dir {self.data_dir} is in use by {_describe_owner(_read(self.path))}: "
                f"two brokers on one data dir would corrupt its commit log and state database. "
                f"Stop that one, or give this one another data dir ([storage] data_dir, --data-dir); "
                f"lock file {self.path}") from None
        self._fd = fd
        try:
            self._write()
        except OSError:
            self.release()
            raise

    def _write(self):
        data = json.dumps(self.owner).encode() + b"\n"
        # Written over the old content, then cut to length: a reader sees the old or the
        # new text, not an empty file in between (it treats anything unparsable as unknown).
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))

    def announce(self, listeners):
        """Say where this process's MQTT listeners are: [(host, port), ...]."""
        self.owner["listeners"] = [[str(h), int(p)] for h, p in listeners]
        if self._fd is not None:
            self._write()

    def release(self):
        """Empty the file (nobody holds it) and unlock; the file itself stays: removing it
        would let two processes lock two different files of one name."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # (the flock goes with the last descriptor of the open file)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    except OSError:
        return False
    return True


def data_dir_owner(data_dir):
    """What the lock file of `data_dir` says of the broker that has it open, without
    taking the lock: a dict (pid, host, started, listeners [[host, port], ...]) if a
    process on this host holds it by that file, else None."""
    owner = _read(os.path.join(os.path.abspath(data_dir), LOCK_FILE))
    if not owner or not isinstance(owner.get("pid"), int):
        return None
    if owner.get("host") == socket.gethostname() and not _alive(owner["pid"]):
        return None  # killed: the kernel released its lock, the file is stale
    return owner


def _addresses(host):
    try:
        return {ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


def _is_local(ip):
    """True if `ip` is an address of this host (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def serves_at(owner, host, port):
    """True if `owner` (data_dir_owner) has an MQTT listener that host:port reaches."""
    targets = _addresses(host or "127.0.0.1")
    here = owner.get("host") in (None, socket.gethostname())
    for bind, bport in owner.get("listeners", ()):
        if int(bport) != int(port):
            continue
        if bind in ("0.0.0.0", "::", ""):  # any address of the owner's host
            if any(_is_local(ip) for ip in targets) if here else targets & _addresses(owner["host"]):
                return True
        elif targets & _addresses(bind):
            return True
    return False

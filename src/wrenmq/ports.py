"""Loopback ports for what starts processes of its own (demo, benchmarks, the tests)."""

import collections
import random
import socket
import time

_PORTS = random.Random()  # its own: callers (tests, hypothesis) seed the module's
_GIVEN = collections.deque(maxlen=256)


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range. A port from that range can be given to a client as its own while
    it reconnects to a broker that is down (a restart), and the client then connects
    to itself and holds the port the broker is about to bind again (EADDRINUSE)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(10000, low) if low > 10100 else 0
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _GIVEN.append(port)  # (two calls in a row, before either port is bound, differ)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc=None, timeout=20.0, what="the broker"):
    """Until `port` accepts connections; RuntimeError if `proc` (when given) exits first,
    TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} is not listening on port {port}")

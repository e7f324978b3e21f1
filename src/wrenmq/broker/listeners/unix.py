"""`type = "unix"`: MQTT on a Unix domain socket.

The socket file's mode is set before `listen()`, so nobody can connect while it is still
the umask's; a file left by a previous run is removed unless a process still answers on
it; the file is removed at close if it is still the one this listener made.
"""

import asyncio
import errno
import logging
import os
import socket
import stat

from ...net import ListenerError
from ..connection import Connection
from .base import Listener

log = logging.getLogger("wrenmq.listeners")


class UnixListener(Listener):
    type = "unix"

    def __init__(self, broker, cfg, index):
        super().__init__(broker, cfg, index)
        self._unix_id = None  # (st_dev, st_ino) of the socket file this listener made

    @property
    def label(self):
        return self.cfg.label

    @property
    def kind(self):
        return "Unix socket"

    async def start(self):
        self.loop = asyncio.get_running_loop()
        cfg = self.cfg
        path = cfg.path
        _clear_stale_socket(path, self.where)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Before listen(): nobody can connect while the mode is still the umask's.
            os.chmod(path, int(cfg.mode, 8))
            st = os.stat(path)
            self._unix_id = (st.st_dev, st.st_ino)

            def factory():
                conn = Connection(self.broker, self.cfg)
                conn.address = f"unix:{path}"
                return conn

            self.server = await self.loop.create_unix_server(factory, sock=sock, backlog=4096)
        except OSError as e:
            sock.close()
            raise ListenerError(f"{self.where}.path: cannot listen on {path}: {e.strerror or e}") from None
        self.address = (path, None)
        log.info("listening on unix:%s (mode %s)", path, cfg.mode)
        return self

    def close(self):
        if self.server is None:
            return
        self.server.close()
        if self._unix_id is not None:
            path = self.cfg.path
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == self._unix_id:
                    os.unlink(path)
            except OSError:
                pass
            self._unix_id = None


def _clear_stale_socket(path, where):
    """Remove a socket file left by a previous run; refuse if it is in use or not a socket."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenerError(f"{where}.path: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ListenerError(f"{where}.path: cannot check {path}: {e.strerror or e}") from None
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    finally:
        probe.close()
    raise ListenerError(f"{where}.path: {path} is in use by another process")

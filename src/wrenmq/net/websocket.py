"""WebSocket connections (the `websockets` library) as asyncio Transports.

`WebSocketTransport` adapts one WebSocket connection to the asyncio Transport a protocol
such as the broker's `Connection` expects: binary frames both ways, flow control both
ways. `counted` and `QuietLogger` are what the listeners built on websockets' server
share.
"""

import asyncio
import logging

from .front import peer_name

log = logging.getLogger("wrenmq.listeners")


def counted(base, uncount):
    """A subclass of websockets' ServerConnection `base` counted from its accept by its
    listener's factory: `uncount()` runs once, at the first of `uncount`, its close, or
    `abandoned` (tls.TLSAcceptor: its TLS handshake failed, so it gets no connection_lost)."""

    class Counted(base):
        counted = True

        def uncount(self):
            if self.counted:
                self.counted = False
                uncount()

        def connection_lost(self, exc):
            self.uncount()
            super().connection_lost(exc)

        abandoned = uncount

    return Counted


class WebSocketTransport(asyncio.Transport):
    """One WebSocket connection as the asyncio Transport a `Connection` expects.

    - write(): bytes are queued and a writer task sends them as one binary frame per
      batch (MQTT allows any split of packets over frames). Flow control: the bytes not
      yet handed to websockets count against the write buffer limits, and since
      `websockets.send()` waits while the socket's own buffer is over its limit, a slow
      reader makes that count grow: over `high` the protocol gets pause_writing(),
      under `low` resume_writing(), as with a TCP transport.
    - pause_reading(): no more frames are taken from websockets; its queue fills and it
      stops reading the socket (TCP backpressure on the client).
    - close(): queued bytes are sent, then the closing handshake (websockets half-closes
      TCP after it); frames that arrive meanwhile still reach the protocol, which drops
      them. abort(): the TCP connection is dropped. The protocol's connection_lost()
      comes once, at the end.
    """

    def __init__(self, ws, protocol, label):
        super().__init__()
        self._ws = ws
        self._protocol = protocol
        self._label = label  # the listener's, for log lines
        self._loop = asyncio.get_running_loop()
        self._out = []
        self._size = 0  # bytes queued or being sent, not yet accepted by websockets
        self._high = 65536
        self._low = 16384
        self._write_paused = False
        self._can_read = asyncio.Event()
        self._can_read.set()
        self._wake = asyncio.Event()
        self._closing = False
        self._aborted = False
        self._close_code = 1000
        self._close_reason = ""
        self._writer = None

    # -- Transport API --

    def get_extra_info(self, name, default=None):
        ws = self._ws
        if name == "peername":
            return getattr(ws, "proxied_peer", None) or ws.remote_address
        if name == "sockname":
            return ws.local_address
        if name == "websocket":
            return ws
        t = ws.transport
        return t.get_extra_info(name, default) if t is not None else default

    def is_closing(self):
        return self._closing

    def set_protocol(self, protocol):
        self._protocol = protocol

    def get_protocol(self):
        return self._protocol

    def is_reading(self):
        return self._can_read.is_set()

    def pause_reading(self):
        self._can_read.clear()

    def resume_reading(self):
        self._can_read.set()

    def set_write_buffer_limits(self, high=None, low=None):
        if high is None:
            high = 65536 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low

    def get_write_buffer_limits(self):
        return (self._low, self._high)

    def get_write_buffer_size(self):
        t = self._ws.transport
        return self._size + (t.get_write_buffer_size() if t is not None else 0)

    def write(self, data):
        if self._closing or not data:
            return
        self._out.append(bytes(data))
        self._size += len(data)
        self._wake.set()
        if not self._write_paused and self._size > self._high:
            self._write_paused = True
            self._protocol.pause_writing()

    def writelines(self, list_of_data):
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self):
        return False

    def write_eof(self):
        raise NotImplementedError("MQTT over WebSocket has no half-close")

    def close(self):
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._can_read.set()  # let the reader see the end of the connection

    def abort(self):
        if self._aborted:
            return
        self._closing = True
        self._aborted = True
        self._out.clear()
        self._can_read.set()
        self._wake.set()
        t = self._ws.transport
        if t is not None:
            t.abort()

    # -- the two loops --

    async def run(self):
        """Serve the connection until it closes (this is the websockets handler)."""
        from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

        ws = self._ws
        proto = self._protocol
        exc = None
        self._writer = self._loop.create_task(self._write_loop())
        try:
            proto.connection_made(self)
            while True:
                if not self._can_read.is_set() and not await self._wait_resume():
                    break
                msg = await ws.recv()
                if not self._can_read.is_set() and not await self._wait_resume():
                    break  # paused while that frame was awaited, and closed since
                if self._closing:
                    # Closing: drain frames until websockets says it is over; a closed
                    # Connection drops them, counted against its bound (Connection._shut).
                    if not isinstance(msg, str):
                        proto.data_received(msg)
                    continue
                if isinstance(msg, str):
                    log.info("%s sent a text frame on WebSocket listener %s; MQTT needs binary frames, "
                             "closing", peer_name(self), self._label)
                    self._close_code, self._close_reason = 1003, "MQTT needs binary frames"
                    self.close()
                    continue
                proto.data_received(msg)
        except ConnectionClosedOK:
            pass
        except ConnectionClosed as e:
            exc = None if self._aborted else ConnectionResetError(str(e))
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception:
            log.exception("WebSocket connection from %s failed", peer_name(self))
            self.abort()
        finally:
            self._closing = True
            self._out.clear()
            writer = self._writer
            if writer is not None and not writer.done():
                writer.cancel()
            proto.connection_lost(exc)

    async def _wait_resume(self):
        """Wait until reading resumes: True; or until the connection is gone: False."""
        resumed = asyncio.ensure_future(self._can_read.wait())
        closed = asyncio.ensure_future(self._ws.wait_closed())
        try:
            await asyncio.wait((resumed, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            resumed.cancel()
            closed.cancel()
        return self._can_read.is_set()

    async def _write_loop(self):
        from websockets.exceptions import ConnectionClosed

        ws = self._ws
        out = self._out
        try:
            while True:
                while not out:
                    if self._closing:
                        if not self._aborted:
                            await ws.close(self._close_code, self._close_reason)
                        return
                    self._wake.clear()
                    await self._wake.wait()
                data = out[0] if len(out) == 1 else b"".join(out)
                out.clear()
                await ws.send(data)  # one binary frame; waits while the socket buffer is full
                self._size -= len(data)
                if self._write_paused and self._size <= self._low:
                    self._write_paused = False
                    self._protocol.resume_writing()
        except ConnectionClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("WebSocket writer for %s failed", peer_name(self))
            self.abort()


class QuietLogger(logging.LoggerAdapter):
    """websockets logs every connection opened and closed at INFO: make that DEBUG
    (the broker logs clients itself); warnings and errors pass unchanged."""

    def log(self, level, msg, *args, **kwargs):
        super().log(logging.DEBUG if level == logging.INFO else level, msg, *args, **kwargs)

"""The admin listener's HTTP/1.1: h11 (sans-IO) parses and frames, this protocol moves bytes.

One `HttpConnection` (an asyncio Protocol) per accepted socket, on the broker's event loop,
since every handler reads the router's state there. A connection serves one request at a
time (keep-alive, pipelined requests wait their turn): once a request's headers and body
are in, `app(request)` runs as a task and its `Response` is written. A response is either
a body of bytes or a `stream`, an async iterator of byte chunks sent with chunked framing
as they come (Server-Sent Events, or records a thread reads: `stream_from_thread`), each
chunk only once the socket has room (the transport's pause_writing), so a slow reader holds
at most a chunk or two of the server's memory.

Bounds, so nothing a client sends can grow without limit: headers 16 KiB (h11), a body
`MAX_BODY` bytes (413 past it, said before it is read), a request must be complete within
`REQUEST_TIMEOUT` seconds of the previous one ending (or of the accept), and the listener
holds at most a fixed number of connections (listener.py).
"""

import asyncio
import json
import logging
import urllib.parse

import h11

log = logging.getLogger("wrenmq.admin")

MAX_HEADERS = 16 * 1024
MAX_BODY = 4 * 1024 * 1024  # a publish of a 1 MiB payload as base64 fits, with room
REQUEST_TIMEOUT = 30.0
LINGER = 2.0  # seconds a refused request's connection reads and drops what still comes
LINGER_BYTES = 16 * 1024 * 1024
_END = object()

REASONS = {200: "OK", 201: "Created", 204: "No Content", 304: "Not Modified", 400: "Bad Request",
           401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           409: "Conflict", 413: "Content Too Large", 415: "Unsupported Media Type",
           429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable"}


class HttpError(Exception):
    """Answer the request with `status` and a JSON body {"error": message}."""

    def __init__(self, status, message, headers=()):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)


class Request:
    """One request as the handlers see it. `path` is the target's path as sent (still
    percent-encoded: a client id or topic may hold an encoded '/'), `query` its parameters
    decoded (the first value of each name), `headers` lower-case names -> values."""

    __slots__ = ("method", "target", "path", "query", "headers", "body", "peer", "identity", "params")

    def __init__(self, method, target, headers, peer):
        self.method = method
        self.target = target
        split = urllib.parse.urlsplit(target)
        self.path = split.path
        self.query = {k: v for k, v in reversed(urllib.parse.parse_qsl(split.query, keep_blank_values=True))}
        self.headers = headers
        self.body = b""
        self.peer = peer
        self.identity = None  # who asked (auth.Identity), once authenticated
        self.params = {}  # the route's {names}, decoded

    def json(self):
        """The body as JSON (an object); HttpError 400/415 if it is not."""
        ctype = self.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise HttpError(415, "the body must be JSON (Content-Type: application/json)")
        try:
            data = json.loads(self.body or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise HttpError(400, "the body must be a JSON object")
        return data


class Response:
    """What a handler answers: `body` bytes, or `stream`, an async iterator of bytes."""

    __slots__ = ("status", "headers", "body", "stream")

    def __init__(self, status=200, body=b"", content_type="application/json", headers=(), stream=None):
        self.status = status
        self.headers = [("Content-Type", content_type)] if content_type else []
        self.headers.extend(headers)
        self.body = body
        self.stream = stream


def json_response(data, status=200, headers=()):
    return Response(status, json.dumps(data, separators=(",", ":")).encode() + b"\n", headers=headers)


def error_response(status, message, headers=()):
    return json_response({"error": message, "status": status}, status, headers)


async def stream_from_thread(gen, executor):
    """The chunks a blocking generator yields, produced in `executor` one at a time: the
    next is asked for only after the socket took the last (HttpConnection writes a chunk,
    waits for room, then asks), so a reader thread is never more than one chunk ahead and
    never blocks the event loop. The generator is closed (in the executor) when the
    response ends early, e.g. the client went away."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            chunk = await loop.run_in_executor(executor, next, gen, _END)
            if chunk is _END:
                return
            yield chunk
    finally:
        await loop.run_in_executor(executor, gen.close)


async def _close_stream(stream):
    """Close a response's stream (whether it was iterated or not: one that holds something,
    a thread's reader or a slot, gives it back then)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await close()
        except RuntimeError:  # (still running: it is being closed by its own exception)
            pass


class HttpConnection(asyncio.Protocol):
    """One HTTP connection of an admin listener; `app(request)` answers each request."""

    def __init__(self, app, on_close=None):
        self.app = app
        self.on_close = on_close
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADERS)
        self.transport = None
        self.peer = "?"
        self.request = None
        self.body = []
        self.body_size = 0
        self.task = None  # the app's answer to the current request
        self.timer = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed = False
        self.discarded = 0  # bytes read and dropped after a refusal (_refuse)

    # --- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport):
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        self._arm()

    def data_received(self, data):
        if self.closed:
            self.discarded += len(data)
            if self.discarded > LINGER_BYTES:
                self.transport.abort()
            return
        self.conn.receive_data(data)
        if self.task is not None:
            # Busy answering (a stream may last): what a client sends meanwhile waits in its
            # socket, not in this process.
            self.transport.pause_reading()
            return
        self._next()

    def eof_received(self):
        self.conn.receive_data(b"")
        self._next()
        return True  # (half-close: a response still being written goes out; the close follows)

    def connection_lost(self, exc):
        self.closed = True
        self._disarm()
        self.writable.set()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.abandoned()

    def abandoned(self):
        """The connection is over (or never got through its TLS handshake)."""
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()

    def pause_writing(self):
        self.writable.clear()

    def resume_writing(self):
        self.writable.set()

    # --- requests -----------------------------------------------------------------

    def _arm(self):
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(REQUEST_TIMEOUT, self._timed_out)

    def _disarm(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self):
        self.timer = None
        if self.task is None and not self.closed:
            log.debug("admin: closing %s: no complete request within %g s", self.peer, REQUEST_TIMEOUT)
            self.transport.close()

    def _next(self):
        """Take the events h11 has: a request's head, its body, its end."""
        while self.task is None and not self.closed:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                self._refuse(e.error_status_hint or 400, f"bad request: {e}")
                return
            if event is h11.NEED_DATA:
                return
            if event is h11.PAUSED:
                self.transport.pause_reading()  # the next request waits for this answer
                return
            if isinstance(event, h11.Request):
                headers = {}
                for name, value in event.headers:
                    key = name.decode("latin-1")
                    text = value.decode("latin-1")
                    headers[key] = f"{headers[key]}, {text}" if key in headers else text
                self.request = Request(event.method.decode("ascii", "replace"),
                                       event.target.decode("latin-1"), headers, self.peer)
                self.body = []
                self.body_size = 0
                length = headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > MAX_BODY:
                    self._refuse(413, f"the body may have at most {MAX_BODY} bytes")
                    return
            elif isinstance(event, h11.Data):
                self.body_size += len(event.data)
                if self.body_size > MAX_BODY:
                    self._refuse(413, f"the body may have at most {MAX_BODY} bytes")
                    return
                self.body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                request = self.request
                request.body = b"".join(self.body)
                self.body = []
                self._disarm()
                self.task = asyncio.get_running_loop().create_task(self._answer(request))
                return
            elif isinstance(event, h11.ConnectionClosed):
                self.transport.close()
                return

    def _refuse(self, status, message):
        """Answer an unusable request at once, then close. What the client still sends (the
        rest of a body too large) is read and dropped for a moment first, up to
        LINGER_BYTES: closing a socket with unread data resets it, and the client would
        lose the answer."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                self._write(error_response(status, message), head=False, close=True)
            except h11.LocalProtocolError:
                pass
        self.closed = True
        self._disarm()
        t = self.transport
        if t.can_write_eof():
            t.write_eof()
            t.resume_reading()
            asyncio.get_running_loop().call_later(LINGER, t.close)
        else:
            t.close()

    async def _answer(self, request):
        try:
            try:
                response = await self.app(request)
            except HttpError as e:
                response = error_response(e.status, e.message, e.headers)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("admin: %s %s from %s failed", request.method, request.path[:200], self.peer)
                response = error_response(500, "internal error (the broker's log says more)")
            if self.closed:
                await _close_stream(response.stream)
                return
            if response.stream is not None:
                await self._write_stream(response, request.method == "HEAD")
            else:
                self._write(response, head=request.method == "HEAD")
        except asyncio.CancelledError:
            return
        except (h11.LocalProtocolError, ConnectionError) as e:
            log.debug("admin: answer to %s failed: %s", self.peer, e)
            self._abort()
            return
        except Exception:
            # A stream that failed after its 200 went out: the status cannot change any more,
            # so the connection is cut, and the reader sees the answer end without its last chunk.
            log.exception("admin: the answer to %s %s from %s failed while it was sent", request.method,
                          request.path[:200], self.peer)
            self._abort()
            return
        finally:
            self.task = None
        self._cycle()

    def _abort(self):
        if self.transport is not None:
            self.transport.abort()
        self.closed = True

    def _headers(self, response, length, close):
        headers = list(response.headers)
        headers.append(("Cache-Control", "no-store"))
        headers.append(("X-Content-Type-Options", "nosniff"))
        if length is not None:
            headers.append(("Content-Length", str(length)))
        if close:
            headers.append(("Connection", "close"))
        return headers

    def _send(self, event):
        data = self.conn.send(event)
        t = self.transport
        if data and not t.is_closing():  # (a closed transport: what is left goes nowhere)
            t.write(data)

    def _write(self, response, head=False, close=False):
        body = response.body
        status = response.status
        self._send(h11.Response(status_code=status, reason=REASONS.get(status, "").encode(),
                                headers=self._headers(response, None if status in (204, 304) else len(body),
                                                      close)))
        if body and not head and status not in (204, 304):
            self._send(h11.Data(data=body))
        self._send(h11.EndOfMessage())

    async def _write_stream(self, response, head):
        status = response.status
        self._send(h11.Response(status_code=status, reason=REASONS.get(status, "").encode(),
                                headers=self._headers(response, 0 if head else None, False)))
        stream = response.stream
        try:
            if not head:
                async for chunk in stream:
                    if self.closed:
                        return
                    if chunk:
                        self._send(h11.Data(data=chunk))
                    if not self.writable.is_set():
                        await self.writable.wait()
                    if self.closed:
                        return
        finally:
            await _close_stream(stream)
        self._send(h11.EndOfMessage())

    def _cycle(self):
        """The answer is out: on to the next request on this connection, or close it."""
        if self.closed:
            return
        conn = self.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self._arm()
            self.transport.resume_reading()
            self._next()
        else:
            self.transport.close()
            self.closed = True

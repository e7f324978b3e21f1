"""The admin listener's application: routes, and what every request goes through.

`Routes` maps (method, path template) to a handler, `async handler(request) -> Response`.
A template's `{name}` takes one path segment, `{name:path}` the rest of the path (topics
and CIDR networks hold '/'); both arrive percent-decoded in `request.params`. Each route
says whether it changes state (`write`: read-only callers get 403) and whether it is
`public` (no credentials: only /health is).

Modules add their routes with a `register(routes, admin)` function, listed in
`ROUTE_MODULES` (api.py: the JSON API; logread.py: the commit log for readers;
dashboard.py: the page and /metrics). A handler that streams (Server-Sent Events, or a log
read that runs in a thread) returns a `Response` with `stream=`:
`http.stream_from_thread(generator, admin.executor)` runs a blocking generator in the
listener's small thread pool one chunk at a time, so a long read never blocks the event
loop and never runs ahead of the socket.

Every request, in order: its route is found (404, or 405 with Allow), its caller is
identified (auth.py: 401), a write needs a caller who may write (403) and, when a browser
sends one, an Origin that is this listener's own (403: another site's page cannot use a
logged-in browser's Basic credentials), then the handler answers.
"""

import concurrent.futures
import re
import urllib.parse

from .auth import AdminAuth
from .http import HttpError

WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
ROUTE_MODULES = ("wrenmq.admin.api", "wrenmq.admin.logread", "wrenmq.admin.dashboard")
THREADS = 4  # the listener's reader threads (stream_from_thread): at most this many at once


class Route:
    __slots__ = ("method", "template", "regex", "handler", "write", "public", "summary")

    def __init__(self, method, template, handler, write, public, summary):
        self.method = method
        self.template = template
        self.handler = handler
        self.write = write
        self.public = public
        self.summary = summary
        pattern = ""
        for literal, name, kind in re.findall(r"([^{]*)(?:\{(\w+)(?::(path))?\})?", template):
            pattern += re.escape(literal)
            if name:
                pattern += f"(?P<{name}>.+)" if kind else f"(?P<{name}>[^/]+)"
        self.regex = re.compile(pattern + r"\Z")


class Routes:
    def __init__(self):
        self.routes = []

    def add(self, method, template, handler, write=None, public=False, summary=""):
        """Serve `method` `template` with `handler`; `write` defaults to what the method says."""
        if write is None:
            write = method in WRITE_METHODS
        self.routes.append(Route(method, template, handler, write, public, summary))

    def find(self, method, path):
        """(route, params) for a request; HttpError 404 or 405."""
        allowed = []
        for route in self.routes:
            m = route.regex.match(path)
            if m is None:
                continue
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                params = {k: urllib.parse.unquote(v, errors="strict") for k, v in m.groupdict().items()}
                return route, params
            allowed.append(route.method)
        if allowed:
            allow = ", ".join(sorted(set(allowed) | ({"HEAD"} if "GET" in allowed else set())))
            raise HttpError(405, f"{method} is not served at this path (allowed: {allow})", [("Allow", allow)])
        raise HttpError(404, "nothing here (the API is under /api/v1/; its description at "
                             "/api/v1/openapi.json)")


class Admin:
    """What the handlers of one admin listener share: the broker, who may do what, the
    feed of live figures, the routes, the thread pool for blocking reads."""

    def __init__(self, broker, cfg, where, listener):
        import importlib

        self.broker = broker
        self.cfg = cfg
        self.where = where
        self.listener = listener
        self.auth = AdminAuth(broker, cfg, where)
        self.executor = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="wrenmq-admin")
        self.routes = Routes()
        self.feed = None  # feed.Feed, set by the listener once it runs
        for name in ROUTE_MODULES:
            importlib.import_module(name).register(self.routes, self)

    @property
    def node(self):
        """This broker's name: the cluster node's, else the store's node id, else [broker] node_id."""
        broker = self.broker
        if broker.cluster is not None:
            return broker.cluster.node
        if broker.store is not None:
            return broker.store.node_id
        return broker.config.broker.node_id or "wrenmq"

    async def __call__(self, request):
        try:
            route, params = self.routes.find(request.method, request.path)
        except UnicodeDecodeError:
            raise HttpError(400, "the path is not valid percent-encoded UTF-8") from None
        request.params = params
        if not route.public:
            request.identity = await self.auth.identify(request)
            if route.write:
                if not request.identity.write:
                    raise HttpError(403, f"{request.identity.name} may read only")
                self._same_origin(request)
        return await route.handler(request)

    @staticmethod
    def _same_origin(request):
        origin = request.headers.get("origin")
        if origin is None:  # (not a browser, or a same-origin GET)
            return
        host = request.headers.get("host", "")
        if urllib.parse.urlsplit(origin).netloc != host:
            raise HttpError(403, f"a change asked from another site's page (Origin {origin[:100]}) is refused")

    def close(self):
        self.executor.shutdown(wait=False, cancel_futures=True)

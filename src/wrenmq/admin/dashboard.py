"""The dashboard's files, and what an admin listener answers besides the API.

- `/` and `/static/<file>`: the dashboard (static/: HTML, CSS and JavaScript written for
  it, charts drawn as SVG by its own code: nothing fetched from elsewhere, since the
  machines a broker runs on may have no internet). The files ship in the package and are
  read once, when the listener starts. The page asks for the same credentials as the API
  (the browser's Basic prompt) and gets its live figures from /api/v1/events.
- `/metrics`: the Prometheus text a metrics listener serves (broker/metrics.py), with the
  API's credentials.
- `/health`: the probe, without credentials, as on a metrics listener.
"""

import importlib.resources

from ..broker.metrics import CONTENT_TYPE, health, render
from .http import HttpError, Response

_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
          ".ico": "image/x-icon"}
# The page runs only its own files: no inline script, nothing from another origin.
_PAGE_HEADERS = [
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'; form-action 'none'"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
]


def load_static():
    """{name: (content type, bytes)} of the dashboard's files."""
    files = {}
    root = importlib.resources.files("wrenmq.admin") / "static"
    for entry in root.iterdir():
        name = entry.name
        ext = name[name.rfind("."):] if "." in name else ""
        if entry.is_file() and ext in _TYPES:
            files[name] = (_TYPES[ext], entry.read_bytes())
    return files


def register(routes, admin):
    files = load_static()
    sys_topics = admin.broker.sys_topics

    async def page(request):
        ctype, body = files["index.html"]
        return Response(200, body, ctype, _PAGE_HEADERS)

    async def static(request):
        found = files.get(request.params["name"])
        if found is None:
            raise HttpError(404, "no such file")
        return Response(200, found[1], found[0], _PAGE_HEADERS)

    async def metrics(request):
        return Response(200, render(sys_topics).encode(), CONTENT_TYPE)

    async def probe(request):
        code, body = health(admin.broker)
        return Response(int(code), body.encode())

    routes.add("GET", "/", page, summary="The dashboard")
    routes.add("GET", "/static/{name}", static, summary="The dashboard's files")
    routes.add("GET", "/metrics", metrics, summary="The $SYS figures in Prometheus's text format")
    routes.add("GET", "/health", probe, public=True, summary="Health probe (no credentials)")

"""The admin HTTP API, the live dashboard, and the tools that watch and load a broker.

`[[listener]] type = "admin"` serves them (docs/ADMIN.md). This package sits above the
broker: it reads the router's state and changes it only through public methods
(`Router.disconnect_client`, `Broker.publish`, `Broker.bans`), and the broker knows
nothing of it. `install(broker)` is how the assembly (wrenmq/assemble.py: `wrenmq serve`
and `wrenmq.Broker`) adds the listener type to a broker, before its `start()`.

Modules: http.py (HTTP/1.1 on h11), app.py (routes, and the checks every request
passes), auth.py and tokens.py (who may do what), api.py and openapi.py (the JSON API),
feed.py (the live figures, as Server-Sent Events), dashboard.py and static/ (the page),
listener.py (the socket side), commands.py (`wrenmq admin token`), top.py (`wrenmq top`),
client.py and loadtest.py (`wrenmq bench`).
"""


def install(broker):
    """Let `broker` open `type = "admin"` listeners (call before `broker.start()`)."""
    from .listener import open_admin_listener
    broker.listener_types["admin"] = open_admin_listener

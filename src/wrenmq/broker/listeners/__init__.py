"""Listeners: how bytes reach the broker, one module per `[[listener]] type`.

- `tcp.py`: `"mqtt"`, MQTT over TCP, plain or TLS;
- `websocket.py`: `"ws"`, MQTT over WebSocket (ws, wss);
- `unix.py`: `"unix"`, MQTT on a Unix domain socket;
- `metrics.py`: `"metrics"`, Prometheus's scrape over HTTP(S);
- `tls.py`: what MQTT over TLS adds to a connection (the client certificate);
- `base.py`: the `Listener` they share.

`LISTENER_TYPES` maps each type to its opener, `async opener(broker, cfg, index)`
returning a started listener (`address`, `label`, `cfg`, `serves_mqtt`, `mqtt_over_tcp`,
`close()`, `wait_closed()`, `reload_tls()`). A broker starts from a copy
(`Broker.listener_types`), and layers above it add theirs there the same way (the admin
listener: `wrenmq.admin.install`). The TLS handshake and the WebSocket transport are
`net/`'s, shared with the admin listener and the cluster's link port.
"""

from ...net import ListenerError
from .base import Listener, TLSReloadHook
from .metrics import MetricsListener
from .tcp import TcpListener
from .unix import UnixListener
from .websocket import WebSocketListener

LISTENER_TYPES = {cls.type: cls.open for cls in (TcpListener, WebSocketListener, UnixListener, MetricsListener)}

__all__ = ["LISTENER_TYPES", "Listener", "ListenerError", "TLSReloadHook"]

"""Bridges to other MQTT brokers ([[bridge]], docs/BRIDGE.md).

- `topics.py`: which topics a bridge carries, and their names on each side (sans-IO);
- `session.py`: the MQTT client state of a bridge: window, cursor, acknowledgements (sans-IO);
- `link.py`: the I/O edge: the connection to the remote, the reads of the commit log;
- `ownership.py`: in a cluster, the etcd lease that puts each bridge's remote session on one node;
- `manager.py`: the bridges of a broker as one `Extension` ($SYS, metrics);
- `status.py`: `wrenmq bridge status`.

Above `broker` (it publishes through it and reads its store), beside `auth` and `cluster`.
"""

from .manager import Bridges, bridge_extensions

__all__ = ["Bridges", "bridge_extensions"]

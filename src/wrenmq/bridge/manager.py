"""The bridges of one broker, as one extension: started and stopped with it, in its
$SYS tree and on its metrics listener."""

import logging

from ..broker.hooks import Extension
from ..config import cluster_node_name
from .link import Bridge, tls_context

log = logging.getLogger("wrenmq.bridge")

SYS_PREFIX = "$SYS/broker/bridge/"

# (figure, metric name, type, help): per bridge, labelled bridge="<name>".
METRICS = (
    ("connected", "wrenmq_bridge_connected", "gauge", "1 while the bridge's connection to the remote is up."),
    ("messages/out", "wrenmq_bridge_messages_out_total", "counter",
     "Messages sent to the remote (QoS 1/2 counted once the remote acknowledged them)."),
    ("messages/in", "wrenmq_bridge_messages_in_total", "counter", "Messages from the remote published here."),
    ("messages/dropped", "wrenmq_bridge_messages_dropped_total", "counter",
     "Messages not carried: refused by the remote, over its maximum packet size, expired, skipped after "
     "the remote closed the connection on them 5 times, or coming in on a topic not carried in or not valid here."),
    ("messages/denied", "wrenmq_bridge_messages_denied_total", "counter",
     "Messages from the remote the ACL did not let the bridge publish here."),
    ("messages/echoes", "wrenmq_bridge_messages_echoes_total", "counter",
     "Messages that came back from the remote carrying this bridge's own mark (not brought in again)."),
    ("lag/records", "wrenmq_bridge_lag_records", "gauge",
     "Commit log records between the bridge's cursor and the log's end."),
    ("lag/seconds", "wrenmq_bridge_lag_seconds", "gauge",
     "Age of the oldest record the remote has not acknowledged yet (0 when none waits)."),
    ("lost", "wrenmq_bridge_lost_total", "counter",
     "Records [log] retention deleted before the bridge sent them."),
    ("connects", "wrenmq_bridge_connects_total", "counter", "Connections the remote accepted."),
    ("connect_failures", "wrenmq_bridge_connect_failures_total", "counter",
     "Connection attempts that failed (refused, unreachable, TLS, no CONNACK)."),
)


class Bridges(Extension):
    """Every [[bridge]] of a config. In a cluster an etcd lease decides which node holds
    each bridge's remote session (`ownership.py`); every node sends what its own log holds."""

    def __init__(self, config):
        self.config = config
        # TLS files are loaded now, so a bad one stops the start with the key that names it.
        self._ssl = [tls_context(b, f"{config.source}: bridge[{i}]") if b.tls else None
                     for i, b in enumerate(config.bridge)]
        self.bridges = []
        self.ownership = None
        self.broker = None

    async def start(self, broker):
        cfg = self.config
        self.broker = broker
        clustered = cfg.cluster.enabled
        if clustered:
            node = cluster_node_name(cfg)
        elif broker.store is not None:
            node = broker.store.node_id
        else:
            import socket
            node = cfg.broker.node_id or socket.gethostname() or "node"
        cluster_name = cfg.cluster.name if clustered else None
        self.bridges = [Bridge(broker, b, i, node, cluster_name, self._ssl[i]) for i, b in enumerate(cfg.bridge)]
        broker.on_log_growth(self._log_grew)
        for bridge in self.bridges:
            bridge.on_change = self._report
            bridge.start()
        if clustered:
            from .ownership import Ownership
            self.ownership = Ownership(cfg.cluster, node, self.bridges)
            self.ownership.start()
        log.info("%d bridge(s): %s", len(self.bridges), ", ".join(
            f"{b.name} -> {', '.join(b.cfg.address)}" for b in self.bridges))

    async def stop(self):
        if self.ownership is not None:
            await self.ownership.stop()
        for bridge in self.bridges:
            await bridge.stop()

    def _report(self, bridge):
        """A bridge's state changed: its $SYS figures now, not at the next [sys] interval
        (`wrenmq bridge status` reads them)."""
        broker = self.broker
        if broker.config.sys.interval > 0 and broker.running:
            prefix = f"{SYS_PREFIX}{bridge.name}/"
            for key, value in bridge.figures().items():
                broker.publish(prefix + key, str(value), 0, True)

    def _log_grew(self):
        for bridge in self.bridges:
            bridge.wake()

    def sys_values(self):
        values = {}
        for bridge in self.bridges:
            prefix = f"{SYS_PREFIX}{bridge.name}/"
            for key, value in bridge.figures().items():
                values[prefix + key] = value
        return values

    def metrics(self):
        figures = [(b.name, b.figures()) for b in self.bridges]
        return [(name, kind, doc, [({"bridge": n}, f[key]) for n, f in figures])
                for key, name, kind, doc in METRICS]


def bridge_extensions(config):
    """The extensions a broker of `config` runs for its bridges ([] without [[bridge]])."""
    return [Bridges(config)] if config.bridge else []

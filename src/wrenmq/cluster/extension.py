"""`[cluster]` as an extension of the broker, which the assembly adds (wrenmq/assemble.py)."""

from ..broker.hooks import Extension


class ClusterExtension(Extension):
    """The node joins through etcd before the listeners open, so no client publishes before
    its messages can reach the other nodes, and leaves after the other extensions have
    stopped. Once joined it is `broker.cluster` (what connections and the admin API ask);
    the router's `cluster` is set by the node itself. `services`: with `[cluster] replicas`
    > 1, what the process's partitions manager offers the node (ha/services.py)."""

    before_listeners = True

    def __init__(self, cfg, services=None):
        self.cfg = cfg
        self.services = services
        self.cluster = None

    async def start(self, broker):
        from .node import Cluster

        cluster = Cluster(broker, self.cfg, self.services)
        await cluster.start()  # ClusterError if the node cannot join
        self.cluster = broker.cluster = cluster

    async def stop(self):
        if self.cluster is not None:
            await self.cluster.stop()

    def sys_values(self):
        return self.cluster.sys_values() if self.cluster is not None else {}

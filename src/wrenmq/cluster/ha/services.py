"""What the partitions' manager offers the Cluster of a broker it runs (node.py's
`services`): the parts of a node that change when its log is a replicated partition."""


class NodeServices:
    """For the Cluster of one broker the manager runs.

    - `link_port`: the process's link port (port.py) for the node's own broker, whose
      links it hands over; None for a hosted broker, which binds a port of its own;
    - `advertise_host`: the host the other nodes reach this process at;
    - `claim_wait`: seconds a CONNECT may wait for a session whose node is being failed
      over (moves.py): its broker comes back, hosted elsewhere, within the lease and a
      few seconds;
    - `clients_without_lease`: `clients/<client id>` keys outlive the broker's lease: a
      session's node is its partition, which outlives the process;
    - `sys_values()`: the partitions' figures in this broker's $SYS;
    - `log_copies()`, `partition_members(p)`: the partitions whose copies this process
      holds, and who leads each, for readers of the log (admin/logread.py)."""

    def __init__(self, manager, partition, link_port):
        self.manager = manager
        self.partition = partition
        self.link_port = link_port
        self.advertise_host = manager.advertise.rpartition(":")[0]
        self.claim_wait = manager.cluster_cfg.lease_ttl + 10.0
        self.clients_without_lease = True

    def sys_values(self, broker):
        return self.manager.sys_values(self.partition, broker)

    def log_copies(self):
        """{partition: log directory} of every partition this process holds a copy of:
        those it leads (its own, a hosted one) and those it follows. Each copy's durable
        mark stops at what its holder knows is committed (the high watermark: replica.py,
        replicated.py), so a reader of any of them reads only records no failover can
        take back, and the same record at the same offset on each."""
        return self.manager.log_copies()

    def partition_members(self, partition):
        """(leader, in-sync set) of `partition` as etcd last said; (None, ()) unknown."""
        return self.manager.partition_members(partition)

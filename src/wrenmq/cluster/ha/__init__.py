"""High availability: each node's commit log a partition kept on `[cluster] replicas`
nodes (docs/CLUSTER.md, "High availability"; the design: docs/REPLICATION.md).

The sans-IO core is beside this package (`replication.py`: the leader's and follower's
state machines; `replication_control.py`: the rules of the records in etcd;
`replication_frames.py`, `replication_epochs.py`); this package is its I/O layer:

- `manager.py`: `Partitions`, what `wrenmq serve` runs with replicas > 1: a process that
  leads some partitions and follows others, and runs the node's own broker while it
  leads the node's partition;
- `control.py`: the lease, this process's registration (its incarnation), the partition
  records in etcd and their transactions;
- `port.py`: the node's link port, owned by the process: replication connections and the
  own broker's links on one port;
- `wire.py`: the replication connections (FETCH, DATA, ...), reads in threads;
- `leading.py`: a partition led here: ReplicatedStore, PartitionLeader, its broker;
- `following.py`: a partition followed here: ReplicaLog, PartitionFollower;
- `hosting.py`: the brokers the process runs (its own; a lost node's, hosted);
- `gate.py`: frames to other nodes held until the high watermark passes what they follow;
- `services.py`: what a broker's Cluster gets from the manager.
"""

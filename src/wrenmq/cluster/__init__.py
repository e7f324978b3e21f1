"""Several nodes as one broker through etcd: not built yet.

This package is where the cluster layer goes: node membership and leases in etcd, the
subscription interest of each node, forwarding of PUBLISH between nodes, session
takeover across nodes, retained messages and shared groups kept exact cluster-wide.
Nothing imports it today; a broker is one process on one node. `[broker] workers` (the
event loop's work on more than one core) waits for this layer, because the same
guarantees are needed across processes (docs/BENCHMARKS.md, "Multi-core").
"""

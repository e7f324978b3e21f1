"""Several nodes as one broker through etcd ([cluster], docs/CLUSTER.md).

- `interest.py`: who wants what (sans-IO): this node's filters, counted, and the
  other nodes' filters in a trie;
- `frames.py`: the node-to-node link's format (sans-IO);
- `node.py`: the I/O edge: the etcd lease, keys and watch, the links, and what the
  router calls (`route`, `subscribed`, `client_connected`, ...).
"""


class ClusterError(RuntimeError):
    """The node cannot join: etcd unreachable, its name taken by a live node, no etcd client."""

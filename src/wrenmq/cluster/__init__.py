"""Several nodes as one broker through etcd ([cluster], docs/CLUSTER.md).

- `interest.py`: who wants what (sans-IO): this node's filters, counted, and the
  other nodes' filters in a trie;
- `frames.py`: the node-to-node link's format (sans-IO);
- `etcd.py`: the etcd client (aetcd's, with a TLS channel when asked);
- `node.py`: the I/O edge: the etcd lease, keys and watch, the links, and what the
  router calls (`route`, `subscribed`, `client_connected`, ...).
"""


class ClusterError(RuntimeError):
    """The node cannot join: etcd unreachable, its name taken by a live node, no etcd client."""


def etcd_client(cfg, endpoint):
    """An (unconnected) etcd client for `endpoint` ("host:port") of a [cluster] section
    (over TLS with etcd_tls)."""
    try:
        from . import etcd
    except ImportError:
        raise ClusterError("[cluster] needs the etcd client: pip install 'wrenmq[cluster]'") from None
    host, _, port = endpoint.rpartition(":")
    try:
        return etcd.client(cfg, host or "127.0.0.1", int(port))
    except etcd.EtcdTLSError as e:
        raise ClusterError(str(e)) from None

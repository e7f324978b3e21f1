"""Several nodes as one broker through etcd ([cluster], docs/CLUSTER.md).

- `interest.py`: who wants what (sans-IO): this node's filters, counted, and the
  other nodes' filters in a trie;
- `frames.py`: the node-to-node link's format (sans-IO);
- `node.py`: the I/O edge: the etcd lease, keys and watch, the links, and what the
  router calls (`route`, `subscribed`, `client_connected`, ...).
"""


class ClusterError(RuntimeError):
    """The node cannot join: etcd unreachable, its name taken by a live node, no etcd client."""


def etcd_client(cfg, endpoint):
    """An (unconnected) aetcd client for `endpoint` ("host:port") of a [cluster] section."""
    try:
        import aetcd
    except ImportError:
        raise ClusterError("[cluster] needs the etcd client: pip install 'wrenmq[cluster]'") from None
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host or "127.0.0.1", port=int(port), timeout=cfg.etcd_timeout,
                        connect_wait_timeout=max(1, int(cfg.etcd_timeout)),
                        username=cfg.etcd_username or None, password=cfg.etcd_password or None)

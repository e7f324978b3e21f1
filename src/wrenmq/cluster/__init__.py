"""Several nodes as one broker through etcd ([cluster], docs/CLUSTER.md).

- `node.py`: `Cluster`, what the broker starts and the router calls (`route`,
  `subscribed`, `client_connected`, ...), made of the six parts that follow;
- `membership.py`: the etcd lease, this node's keys, the watch of the others';
- `links.py`: the link port (and its TLS), the links to the other nodes, their writes;
- `routes.py`: this node's filters told to the others (etcd and ROUTE frames);
- `forward.py`: messages to the nodes that want them, and from them;
- `replay.py`: HELLO / RESUME and the replay from the log, marks, group choices;
- `moves.py`: sessions that follow their client to another node (RELAY meanwhile);
- sans-IO: `interest.py` (who wants what: this node's filters, counted, and the other
  nodes' filters in a trie), `frames.py` (the link's format), `handover.py` (a
  session as data), and partition replication's core (`replication.py`,
  `replication_control.py`, `replication_epochs.py`, `replication_frames.py`);
- `linkview.py` (each node's view of its links, in etcd) and `status.py` (`wrenmq
  cluster status`); `etcd.py`: the etcd client (aetcd's, with a TLS channel when asked) and
  the session over all of [cluster] etcd's endpoints that every etcd user holds
  (`etcd_session`): it goes on to another member when the one in use is lost.
"""

RETRY = (0.2, 0.5, 1.0, 2.0, 5.0)  # seconds between attempts (etcd, links), the last repeated


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


def etcd_session(cfg):
    """An (unconnected) etcd.Session over every endpoint of a [cluster] section: one client
    at a time, replaced by one of the next member when its owner recovers from a failure."""
    try:
        from . import etcd
    except ImportError:
        raise ClusterError("[cluster] needs the etcd client: pip install 'wrenmq[cluster]'") from None
    return etcd.Session(cfg, lambda endpoint: etcd_client(cfg, endpoint))


def etcd_failure(cfg, exc):
    """What to say of `exc`, the last failure to reach etcd; with etcd_tls, what a failed
    TLS handshake usually means (gRPC names only the TLS library's error)."""
    text = str(exc) or type(exc).__name__
    if cfg.etcd_tls and any(w in text for w in ("TSI_", "SSL", "andshake")):
        if "CERTIFICATE_VERIFY_FAILED" in text:
            text += " (etcd's certificate: is it signed by etcd_cafile, and does it name the endpoint's host?)"
        else:
            text += (" (etcd ended the TLS handshake: an etcd with --client-cert-auth needs etcd_certfile, "
                     "signed by its --trusted-ca-file)")
    return text

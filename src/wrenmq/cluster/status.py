"""`wrenmq cluster status`: what etcd says about a cluster, read the way the nodes read it.

Per node: the address of its link, the etcd endpoint its session uses, how many topic
filters it subscribes to (shared ones apart) and how many clients' last connection is
there; and, as the node of the configuration given (the asking node) sees it, the state
of its links to that node and how long ago it last heard from it (linkview.py). etcd
keeps a dead node's keys until its lease runs out; the asking node's view says it is
down within moments. etcd is read through the first endpoint whose member answers and
serves (one that is down is passed over), as a node's session does.
"""

import asyncio
import json
import time

from . import ClusterError, etcd_failure, etcd_session
from .interest import CLIENTS, NODES, ROUTES, parse_route_key
from .linkview import LINKS


async def _read(cfg, prefix):
    """(every key under `prefix`, the endpoint that answered): each endpoint in turn until
    one's member serves the read."""
    session = etcd_session(cfg)
    last = None
    try:
        for _ in cfg.etcd:
            try:
                await session.reconnect()  # (the first endpoint, then the next)
                return await session.get_prefix(prefix.encode()), session.endpoint
            except Exception as e:
                last = e
    finally:
        await session.close()
    raise ClusterError(f"cannot reach etcd at {', '.join(cfg.etcd)}: {etcd_failure(cfg, last)}")


async def read_status(cfg, asking=None):
    """({node: {"link", "etcd", "filters", "shared", "clients"}}, the view of node `asking`
    of its links (linkview's JSON) or None, the etcd endpoint read through, {partition: its
    row} with [cluster] replicas > 1 (ha/tools.py)) from etcd (cfg: a [cluster] section)."""
    prefix = f"/wrenmq/{cfg.name}/"
    got, endpoint = await _read(cfg, prefix)
    nodes = {}
    view = None
    used = {}  # node -> the etcd endpoint its session uses, as its view of its links says
    from .ha.tools import partitions_from
    partitions, _ = partitions_from([(kv.key.decode("utf-8", "replace"), kv.value, kv.mod_revision,
                                      kv.create_revision) for kv in got], cfg.name)

    def node(name):
        return nodes.setdefault(name, {"link": None, "etcd": None, "filters": 0, "shared": 0, "clients": 0})

    for kv in got:
        rest = kv.key.decode("utf-8", "replace")[len(prefix):]
        if rest.startswith("ha/"):
            continue  # (the partitions' keys: above)
        if rest.startswith(NODES):
            try:
                node(rest[len(NODES):])["link"] = json.loads(kv.value)["link"]
            except (ValueError, KeyError, TypeError):
                node(rest[len(NODES):])["link"] = "?"
        elif rest.startswith(ROUTES):
            parsed = parse_route_key(rest[len(ROUTES):])
            if parsed is not None:
                node(parsed[0])["shared" if parsed[1] else "filters"] += 1
        elif rest.startswith(CLIENTS):
            node(kv.value.decode("utf-8", "replace"))["clients"] += 1
        elif rest.startswith(LINKS):
            try:
                seen = json.loads(kv.value)
                if not isinstance(seen.get("peers"), dict):
                    seen = None
            except (ValueError, AttributeError):
                seen = None
            name = rest[len(LINKS):]
            if seen is not None and isinstance(seen.get("etcd"), str):
                used[name] = seen["etcd"]
            if name == asking:
                view = seen
    for name, v in nodes.items():
        v["etcd"] = used.get(name)
    return nodes, view, endpoint, partitions


def _seen(view, name, asking, now):
    """(state, seconds since last heard or None, seconds in that state or None) of `name`'s
    links as `asking` sees them."""
    if name == asking:
        return "(this node)", None, None
    p = view["peers"].get(name) if view is not None else None
    if not isinstance(p, dict):
        return ("?" if view is not None else None), None, None
    heard = p.get("heard")
    since = p.get("since")
    return (p.get("state", "?"), None if heard is None else max(0.0, now - heard),
            None if since is None else max(0.0, now - since))


def _heard_text(state, ago, silent_after):
    if state in ("down", "silent"):
        return "never" if ago is None else f"{ago:.1f} s ago"
    if state in ("up", "catching up", "out only", "in only"):
        return f"< {silent_after:g} s ago"
    return "-"


def status_command(cfg, as_json=False):
    """Print the cluster's nodes; 0, or 1 with a message if etcd cannot be read."""
    from ..config import cluster_node_name

    asking = cluster_node_name(cfg)
    try:
        nodes, view, endpoint, partitions = asyncio.run(read_status(cfg.cluster, asking))
    except ClusterError as e:
        print(f"wrenmq: cluster {cfg.cluster.name}: {e}")
        return 1
    now = time.time()
    silent_after = float(view.get("silent_after", 0)) if view else 0.0
    for name, v in nodes.items():
        state, ago, since = _seen(view, name, asking, now)
        v["state"] = state
        v["heard_ago"] = None if ago is None else round(ago, 1)
        v["state_for"] = None if since is None else round(since, 1)
    if as_json:
        print(json.dumps({"cluster": cfg.cluster.name, "seen_from": asking if view is not None else None,
                          "etcd": endpoint, "nodes": nodes, "partitions": partitions}, indent=1,
                         sort_keys=True))
        return 0
    live = sorted(n for n, v in nodes.items() if v["link"])
    others = [e for e in cfg.cluster.etcd if e != endpoint]
    print(f"cluster {cfg.cluster.name}: {len(live)} node(s) (etcd {endpoint}"
          + (f"; also {', '.join(others)}" if others else "") + ")")
    if view is not None:
        print(f"links as node {asking} sees them (a link over which nothing came for {silent_after:g} s "
              f"is \"silent\")")
    else:
        print(f"(node {asking} of this configuration is not running: no view of the links; etcd keeps a "
              f"node that died until its lease runs out)")
    print(f"{'node':<24} {'link':<22} {'etcd':<22} {'state':<18} {'last heard':<12} {'filters':>8} {'shared':>7} "
          f"{'clients':>8}")
    for name in sorted(nodes):
        v = nodes[name]
        link = v["link"] or "(gone: keys left)"
        state = v["state"] or "-"
        if v["state_for"] is not None and state in ("down", "silent"):
            state = f"{state} for {v['state_for']:.0f} s"
        heard = "-" if name == asking or view is None else _heard_text(v["state"], v["heard_ago"], silent_after)
        print(f"{name:<24} {link:<22} {v['etcd'] or '-':<22} {state:<18} {heard:<12} {v['filters']:>8} "
              f"{v['shared']:>7} {v['clients']:>8}")
    if partitions:
        from .ha.tools import print_partitions
        print_partitions(partitions)
    return 0


def reassign_command(cfg, lost, new):
    """`wrenmq cluster reassign LOST NEW`: 0 if every partition LOST was a replica of moved."""
    from .ha.tools import reassign

    async def run():
        # (The first member that answers and serves; the transactions compare each record's
        # revision, so a reassign that failed half way is run again as it is.)
        session = etcd_session(cfg.cluster)
        try:
            await session.connect()
        except Exception as e:
            await session.close()
            raise ClusterError(f"cannot reach etcd at {', '.join(cfg.cluster.etcd)}: "
                               f"{etcd_failure(cfg.cluster, e)}") from None
        try:
            return await reassign(session, cfg.cluster.name, lost, new)
        finally:
            await session.close()

    try:
        done = asyncio.run(run())
    except ClusterError as e:
        print(f"wrenmq: cluster {cfg.cluster.name}: {e}")
        return 1
    if not done:
        print(f"node {lost} is a replica of no partition in cluster {cfg.cluster.name}")
        return 1
    for p, ok, what in done:
        print(f"partition {p}: {'moved' if ok else 'not moved'}: {what}")
    return 0 if all(ok for _, ok, _ in done) else 1

"""`wrenmq cluster status`: what etcd says about a cluster, read the way the nodes read it.

Per node: the address of its link, how many topic filters it subscribes to (shared
ones apart) and how many clients' last connection is there.
"""

import asyncio
import json

from . import ClusterError, etcd_client, etcd_failure
from .interest import CLIENTS, NODES, ROUTES, parse_route_key


async def read_status(cfg):
    """{node: {"link", "filters", "shared", "clients"}} from etcd (cfg: a [cluster] section)."""
    prefix = f"/wrenmq/{cfg.name}/"
    last = None
    for endpoint in cfg.etcd:
        client = etcd_client(cfg, endpoint)
        try:
            got = await client.get_prefix(prefix.encode())
            break
        except Exception as e:
            last = e
        finally:
            await client.close()
    else:
        raise ClusterError(f"cannot reach etcd at {', '.join(cfg.etcd)}: {etcd_failure(cfg, last)}")
    nodes = {}

    def node(name):
        return nodes.setdefault(name, {"link": None, "filters": 0, "shared": 0, "clients": 0})

    for kv in got:
        rest = kv.key.decode("utf-8", "replace")[len(prefix):]
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
    return nodes


def status_command(cfg, as_json=False):
    """Print the cluster's nodes; 0, or 1 with a message if etcd cannot be read."""
    try:
        nodes = asyncio.run(read_status(cfg.cluster))
    except ClusterError as e:
        print(f"wrenmq: cluster {cfg.cluster.name}: {e}")
        return 1
    if as_json:
        print(json.dumps({"cluster": cfg.cluster.name, "nodes": nodes}, indent=1, sort_keys=True))
        return 0
    live = sorted(n for n, v in nodes.items() if v["link"])
    print(f"cluster {cfg.cluster.name}: {len(live)} node(s) (etcd {', '.join(cfg.cluster.etcd)})")
    print(f"{'node':<24} {'link':<22} {'filters':>8} {'shared':>7} {'clients':>8}")
    for name in sorted(nodes):
        v = nodes[name]
        link = v["link"] or "(gone: keys left)"
        print(f"{name:<24} {link:<22} {v['filters']:>8} {v['shared']:>7} {v['clients']:>8}")
    return 0

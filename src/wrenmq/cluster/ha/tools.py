"""`wrenmq cluster status` (its partitions part) and `wrenmq cluster reassign LOST NEW`.

Both read etcd as the nodes do (control.py's keys under /wrenmq/<cluster>/ha/): the
partition records, the processes taking part, and each leader's figures (its HW, its log
end and how far each replica has it, written once a second on its lease). `reassign`
runs replication_control.reassign on every partition a lost node is a replica of: that
node leaves the replicas (and the in-sync set), the new node joins them and catches up
before its leader adds it to the in-sync set.
"""

import json

from .. import replication_control as RC
from .control import STATUS, ha_prefix


def partitions_from(kvs, cluster_name):
    """({partition: its row}, {node: incarnation}) from the (key, value, mod revision,
    create revision) of the cluster's keys."""
    prefix = ha_prefix(cluster_name)
    records, live, figures = {}, {}, {}
    for key, value, mod, create in kvs:
        rest = key[len(prefix):] if key.startswith(prefix) else None
        if rest is None:
            continue
        if rest.startswith(RC.PARTITIONS):
            try:
                records[rest[len(RC.PARTITIONS):]] = (RC.PartitionRecord.from_json(value), mod)
            except RC.RecordError:
                continue
        elif rest.startswith(RC.NODES):
            live[rest[len(RC.NODES):]] = create
        elif rest.startswith(STATUS):
            try:
                figures[rest[len(STATUS):]] = json.loads(value)
            except ValueError:
                pass
    rows = {}
    for p, (rec, mod) in sorted(records.items()):
        fig = figures.get(p)
        if fig is not None and (fig.get("leader") != rec.leader or fig.get("epoch") != rec.epoch):
            fig = None  # (a leader's figures of an earlier epoch: its lease has not run out yet)
        replicas = {}
        for n in rec.replicas:
            r = (fig or {}).get("replicas", {}).get(n) or {}
            replicas[n] = {"in_sync": n in rec.isr, "alive": n in live, "end": r.get("end"), "lag": r.get("lag")}
        rows[p] = {"leader": rec.leader, "epoch": rec.epoch, "isr": list(rec.isr), "replicas": replicas,
                   "hw": (fig or {}).get("hw"), "log_end": (fig or {}).get("log_end"),
                   "state": (fig or {}).get("state", "no leader" if rec.leader is None else "?"),
                   "accepting": (fig or {}).get("accepting"), "revision": mod}
    return rows, live


def print_partitions(rows):
    """The table `wrenmq cluster status` prints under its nodes."""
    print()
    print(f"{len(rows)} partition(s) (each node's log; lag: records behind the leader's log end)")
    print(f"{'partition':<16} {'leader':<16} {'epoch':>6} {'state':<10} {'hw':>10}  replicas (in sync *, lag)")
    for p, r in rows.items():
        reps = []
        for n, v in r["replicas"].items():
            lag = "-" if v["lag"] is None else str(v["lag"])
            mark = "*" if v["in_sync"] else ""
            reps.append(f"{n}{mark}" + ("" if n == r["leader"] else f" {lag}") + ("" if v["alive"] else " (down)"))
        state = r["state"] + ("" if r["accepting"] in (None, True) else ", refusing")
        hw = "-" if r["hw"] is None else str(r["hw"])
        print(f"{p:<16} {r['leader'] or '-':<16} {r['epoch']:>6} {state:<10} {hw:>10}  {', '.join(reps)}")


async def reassign(etcd, cluster_name, lost, new):
    """Move `lost`'s replicas to `new` in every partition: [(partition, done, what)]."""
    prefix = ha_prefix(cluster_name)
    got = await etcd.get_prefix(prefix.encode())
    kvs = [(kv.key.decode("utf-8", "replace"), kv.value, kv.mod_revision, kv.create_revision) for kv in got]
    rows, live = partitions_from(kvs, cluster_name)
    out = []
    tx = etcd.transactions
    for key, value, mod, _ in kvs:
        if not key.startswith(prefix + RC.PARTITIONS):
            continue
        p = key[len(prefix) + len(RC.PARTITIONS):]
        try:
            rec = RC.PartitionRecord.from_json(value)
        except RC.RecordError:
            continue
        if lost not in rec.replicas:
            continue
        txn = RC.reassign(prefix, p, rec, mod, lost, new, live)
        if txn is None:
            why = (f"node {lost} is alive" if lost in live else f"node {new} is not taking part" if new not in live
                   else f"node {new} already has a replica")
            out.append((p, False, why))
            continue
        compares = [(tx.mod(c.key.encode()) if c.target == "mod" else tx.create(c.key.encode())) == c.value
                    for c in txn.compares]
        ok, _ = await etcd.transaction(compare=compares, success=[tx.put(txn.key.encode(), txn.value)], failure=[])
        rec = txn.record
        out.append((p, ok, f"replicas {','.join(rec.replicas)}, in sync {','.join(rec.isr)}, leader "
                           f"{rec.leader or '(none: an in-sync replica takes it)'}" if ok else
                    "the record changed meanwhile: run it again"))
    return out

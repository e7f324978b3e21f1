"""`make chaos ROUNDS=N [SEED=S] [ARGS=...]`: faults on a real cluster under load, in random order.

One 3-member etcd and a cluster of `wrenmq serve` nodes (cluster_harness.py) run for the whole
session. Each round takes every fault once, in an order drawn from the seed; each fault runs
the standard workload (chaos_workload.py: persistent subscribers at QoS 1 and 2 on every
node, publishers at QoS 1 and 2 on every node) from before it is injected to after the
cluster is whole again, and the checker (chaos_checker.py) counts what was acknowledged and
lost, QoS 2 duplicates, failovers and the longest unavailability. A table per fault ends
the run; the exit status is 1 if any fault broke a promise.

Faults: kill9 (kill -9 of a node, restarted on its data dir), pause (SIGSTOP past the lease,
then SIGCONT: a zombie), partition (a node cut from the other nodes, etcd reachable),
etcd-cut (a node cut from etcd, its links up), etcd-member (one etcd member killed, then
restarted), and with --replicas above 1, lose-node (kill -9, data dir deleted, an empty node
started under its name). Without replication, clients reconnect to their own node only
(`--failover home`: their sessions are on its disk); with it, to any node.

    python tests/chaos.py --rounds 3 --seed 42 [--replicas 3 --min-insync 2] [--faults kill9,pause]
"""

import argparse
import pickle
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_harness import Cluster, EtcdCluster, under_load  # noqa: E402


class Chaos:
    def __init__(self, args, tmp):
        self.args = args
        self.tmp = tmp
        self.rng = random.Random(args.seed)
        self.failover = args.failover or ("home" if args.replicas == 1 else "any")
        self.etcd = self.cluster = None

    def start(self):
        args = self.args
        self.etcd = EtcdCluster(self.tmp / "etcd", size=3)
        options = {}
        if args.replicas > 1:
            options = {"replicas": args.replicas, "min_insync": args.min_insync}
        self.cluster = Cluster(self.tmp / "cluster", self.etcd, "abcde"[:args.nodes], lease_ttl=args.lease_ttl,
                               cluster_options=options)
        self.cluster.start()

    def close(self):
        if self.cluster is not None:
            self.cluster.close()
        if self.etcd is not None:
            self.etcd.close()

    @property
    def faults(self):
        names = ["kill9", "pause", "partition", "etcd-cut", "etcd-member"]
        if self.args.replicas > 1:
            names.append("lose-node")
        return [n for n in names if not self.args.faults or n in self.args.faults]

    def _node(self):
        return self.rng.choice(sorted(self.cluster.nodes))

    def inject(self, fault):
        """Inject `fault` and end it; a line saying what was done."""
        cl, ttl, rng = self.cluster, self.args.lease_ttl, self.rng
        if fault == "kill9":
            n, down = self._node(), rng.uniform(0.2, 2.0 * ttl)
            cl[n].kill()
            time.sleep(down)
            cl[n].restart()
            return f"node {n} killed, restarted {down:.1f} s later"
        if fault == "pause":
            n, held = self._node(), ttl + rng.uniform(1.0, 3.0)
            cl[n].pause()
            time.sleep(held)
            cl[n].resume()
            return f"node {n} stopped {held:.1f} s (lease {ttl} s)"
        if fault in ("partition", "etcd-cut"):
            n, held = self._node(), ttl + rng.uniform(1.0, 4.0)
            if fault == "partition":
                cl.partition(n)
            else:
                cl.cut_from_etcd(n)
            time.sleep(held)
            cl.heal()
            return f"node {n} cut from {'the other nodes' if fault == 'partition' else 'etcd'} for {held:.1f} s"
        if fault == "etcd-member":
            m, down = rng.randrange(len(self.etcd.members)), rng.uniform(2.0, 2.0 * ttl + 2)
            self.etcd.kill(m)
            time.sleep(down)
            self.etcd.restart(m)
            return f"etcd member {self.etcd.members[m].name} killed for {down:.1f} s"
        if fault == "lose-node":
            n = self._node()
            cl[n].wipe()
            return f"node {n} lost for good (data dir deleted), replaced by an empty node"
        raise ValueError(fault)

    def repair(self):
        """After a fault the cluster did not recover from: everything running and healed."""
        self.cluster.heal()
        for m in self.etcd.members:
            if not m.running:
                self.etcd.restart(m.name)
        for node in self.cluster.nodes.values():
            if node.paused:
                node.resume()
            if not node.running:
                node.start()
        self.cluster.wait_stable(120)

    def run_fault(self, fault):
        """The workload through one fault: (what was done, the Report)."""
        args, done = self.args, []
        report = under_load(self.cluster, lambda: done.append(self.inject(fault)), rate=args.rate,
                            failover=self.failover, before=args.before, after=args.after, recover=args.recover,
                            repair=self.repair)
        return done[0] if done else "not injected", report


COLUMNS = ("fault", "rounds", "acknowledged", "lost", "dup QoS2", "order", "retained", "owners",
           "sessions lost", "nodes left", "failovers", "longest unavail.", "recovery", "failed")


def table(results):
    """The per-fault table: counts summed over rounds, times their maximum."""
    rows = []
    for fault, reports in results.items():
        recoveries = [r.recovery for r in reports]
        rows.append((fault, len(reports), sum(r.acknowledged for r in reports), sum(r.lost for r in reports),
                     sum(r.duplicates for r in reports), sum(r.out_of_order for r in reports),
                     sum(r.retained_bad for r in reports), sum(r.owners_bad for r in reports),
                     sum(r.sessions_lost for r in reports), sum(r.nodes_left for r in reports),
                     sum(r.failovers for r in reports), f"{max(r.unavailable for r in reports):.1f} s",
                     "never" if None in recoveries else f"{max(recoveries):.1f} s",
                     sum(1 for r in reports if not r.ok)))
    widths = [max(len(str(x)) for x in col) for col in zip(COLUMNS, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(COLUMNS), line("-" * w for w in widths), *map(line, rows)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds: each runs every fault once, in random order")
    ap.add_argument("--seed", type=int, default=None, help="seed of the fault order and timing (printed)")
    ap.add_argument("--faults", type=lambda s: [f for f in s.split(",") if f], default=None,
                    help="comma-separated subset of the faults")
    ap.add_argument("--replicas", type=int, default=1, help="[cluster] replicas (above 1 adds lose-node)")
    ap.add_argument("--min-insync", type=int, default=2, help="[cluster] min_insync with --replicas")
    ap.add_argument("--failover", choices=("home", "any"), default=None,
                    help="where clients reconnect: their own node (default without replicas) or any node")
    ap.add_argument("--nodes", type=int, default=3, choices=range(2, 6), help="cluster nodes")
    ap.add_argument("--rate", type=float, default=10.0, help="messages a second per publisher")
    ap.add_argument("--lease-ttl", type=int, default=3, help="[cluster] lease_ttl (s)")
    ap.add_argument("--before", type=float, default=2.0, help="seconds of load before each fault")
    ap.add_argument("--after", type=float, default=2.0, help="seconds of load after the cluster recovered")
    ap.add_argument("--recover", type=float, default=60.0, help="seconds the cluster may take to recover")
    ap.add_argument("--keep", action="store_true", help="keep the nodes' data and logs, and what each client saw per fault "
                    "(clients-<round>-<fault>.pickle: the checker's PublisherLog and SubscriberLog lists)")
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 32)
    tmp = Path(tempfile.mkdtemp(prefix="wrenmq-chaos-"))
    print(f"chaos: seed {args.seed}, {args.rounds} round(s), {args.nodes} nodes, replicas {args.replicas}, "
          f"lease_ttl {args.lease_ttl} s, files in {tmp}", flush=True)
    results, failed = {}, False
    chaos = Chaos(args, tmp)
    try:
        chaos.start()
        print(f"chaos: clients fail over to {chaos.failover} node(s); faults {', '.join(chaos.faults)}", flush=True)
        for rnd in range(1, args.rounds + 1):
            order = chaos.faults
            chaos.rng.shuffle(order)
            for fault in order:
                started = time.monotonic()
                what, report = chaos.run_fault(fault)
                results.setdefault(fault, []).append(report)
                failed |= not report.ok
                if args.keep and getattr(report, "clients", None) is not None:
                    with open(tmp / f"clients-{rnd}-{fault}.pickle", "wb") as f:
                        pickle.dump(report.clients, f)
                print(f"[round {rnd}] {fault}: {what} ({time.monotonic() - started:.0f} s)\n  "
                      f"{'ok' if report.ok else 'FAILED'}: {report.summary()}", flush=True)
    except KeyboardInterrupt:
        print("chaos: interrupted", flush=True)
        failed = True
    except Exception:
        traceback.print_exc()
        failed = True
    finally:
        chaos.close()
    if results:
        print(f"\nchaos: seed {args.seed}, replicas {args.replicas}\n{table(results)}")
    if args.keep or failed:
        print(f"chaos: data and logs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

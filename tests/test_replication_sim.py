"""The replication core under the deterministic simulator (replication_sim.py).

`make test` runs the first WRENMQ_SIM_SEEDS seeds (300 by default) in chunks; `make sim
SEEDS=N` runs many more without the per-test timeout. A failure names its seed, the
fault schedule and the last events, and replays exactly with
`.venv/bin/python tests/replication_sim.py --seed N --trace`.

The simulator has teeth: `test_the_simulator_catches` puts each of a list of known
replication bugs into the core (replication_sim_bugs.py: a subclass overriding one
method, or one rule) and checks that one of the same seeds catches it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import replication_sim as S
import replication_sim_bugs as B

SEEDS = int(os.environ.get("WRENMQ_SIM_SEEDS", "300"))
CHUNK = 50


@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK), ids=lambda s: f"seeds-{s}-{min(s + CHUNK, SEEDS) - 1}")
def test_seeds_keep_every_invariant(first):
    failures = []
    for seed in range(first, min(first + CHUNK, SEEDS)):
        try:
            S.run_seed(seed)
        except S.Violation as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} seeds failed; the first:\n{failures[0]}"


def test_a_seed_replays_exactly():
    a, b = S.run_seed(11), S.run_seed(11)
    assert a.events == b.events and a.oracle.acks == b.oracle.acks and list(a.story) == list(b.story)
    assert a.applied_faults == b.applied_faults
    c = S.run_seed(12)
    assert (c.events, c.applied_faults) != (a.events, a.applied_faults)
    # As a user replays it: another process, another string hash seed.
    runs = [subprocess.run([sys.executable, str(Path(__file__).with_name("replication_sim.py")), "--seed", "11"],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": h})
            for h in ("1", "2")]
    lines = [r.stdout.splitlines()[0] for r in runs]
    faults = sum(1 for f in a.applied_faults if f[4])
    assert lines[0] == lines[1] == (f"seed 11: {a.events} events, {len(a.oracle.acks)} acknowledged, "
                                    f"{faults} faults, {a.counts['leads']} leaderships")


def test_runs_exercise_what_they_claim():
    """Over 40 seeds: acknowledgements, failovers, every fault, truncations, snapshots,
    zombies fenced, leadership handed back."""
    counts = {}
    acks = 0
    for seed in range(40):
        w = S.run_seed(seed)
        acks += len(w.oracle.acks)
        for what, n in w.counts.items():
            counts[what] = counts.get(what, 0) + n
        for f in w.applied_faults:
            if f[4]:
                counts[f[1]] = counts.get(f[1], 0) + 1
    assert acks > 40 * 100
    for what in ("leads", "truncates", "installs snapshot", "fenced", "lease expired", "hands over", "crash",
                 "lose", "pause", "isolate", "etcd_cut", "split", "lossy", "retention", "ambush sprung"):
        assert counts.get(what), (what, counts)


@pytest.mark.parametrize("bug", B.CAUGHT_IN_TEST)
def test_the_simulator_catches(bug):
    seed, what = B.first_catch(bug, range(SEEDS))
    assert seed is not None, f"no seed of {SEEDS} caught: {bug}"
    print(f"{bug}: caught by {what}")

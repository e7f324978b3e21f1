"""The scenarios the benchmark compares, as in mqload's README (shared/tools/mqload).

Each id maps to one mqload command line. Every row also exists with ``--mqtt5``
under the id ``<id>-v5``. The metrics say which JSON field of mqload's output
line is compared and which direction is better.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Metric:
    key: str  # JSON field; "a.b" for a nested field (latency_us.p50)
    label: str  # short name shown in the table
    unit: str  # msg/s, deliv/s, conn/s, us, B, msgs
    higher_is_better: bool

    def get(self, result: dict | None) -> float | None:
        v: object = result
        for part in self.key.split("."):
            if not isinstance(v, dict):
                return None
            v = v.get(part)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        return float(v)


@dataclass(frozen=True)
class Scenario:
    id: str
    tool: str  # mqload scenario: pub, pubsub, conns
    args: tuple[str, ...]
    metrics: tuple[Metric, ...]
    fresh: bool = False  # needs a freshly started broker for every run
    note: str = ""
    extra: tuple[str, ...] = field(default=())

    @property
    def argv(self) -> list[str]:
        return [self.tool, *self.args, *self.extra]

    @property
    def command(self) -> str:
        return "mqload " + " ".join(self.argv)


ROUTED = Metric("routed_msgs_per_sec", "routed msg/s", "msg/s", True)
DELIV = Metric("deliveries_per_sec", "deliveries/s", "deliv/s", True)
LOST = Metric("lost", "lost", "msgs", False)
P50 = Metric("latency_us.p50", "latency p50", "us", False)
P99 = Metric("latency_us.p99", "latency p99", "us", False)
BYTES = Metric("broker_bytes_per_conn", "RSS bytes/conn", "B", False)
CPS = Metric("connects_per_sec", "connects/s", "conn/s", True)

_BASE: list[Scenario] = [
    Scenario("a1", "pub", tuple("--clients 25 --count 1000 --size 1024 --marker".split()), (ROUTED,),
             note="25 publishers x 1000 x 1 KiB, QoS 0, no subscriber"),
    Scenario("a2", "pub", tuple("--clients 25 --count 1000 --size 4096 --marker".split()), (ROUTED,),
             note="25 publishers x 1000 x 4 KiB, QoS 0, no subscriber"),
    Scenario("b0", "pubsub", tuple("--pubs 1 --subs 1 --topic-mode single --count 100000 --size 64".split()),
             (DELIV, LOST), note="1 -> 1, 100k x 64 B, QoS 0"),
    Scenario("b1", "pubsub",
             tuple("--pubs 1 --subs 1 --topic-mode single --count 100000 --size 64 --qos 1 --inflight 100".split()),
             (DELIV, LOST), note="1 -> 1, 100k x 64 B, QoS 1, inflight 100"),
    Scenario("c", "pubsub", tuple("--pubs 1 --subs 50 --topic-mode single --count 2000 --size 64".split()),
             (DELIV, LOST), note="fan-out 1 -> 50, 2000 x 64 B, QoS 0"),
    Scenario("d", "pubsub", tuple("--pubs 50 --subs 1 --count 2000 --size 64".split()),
             (DELIV, LOST), note="fan-in 50 -> 1 (bench/#), 2000 x 64 B each, QoS 0"),
    Scenario("e", "pubsub", tuple("--pubs 1 --subs 1 --topic-mode single --rate 5000 --duration 5 --size 64".split()),
             (P50, P99), note="latency at 5000 msg/s for 5 s, QoS 0"),
    Scenario("f", "conns", tuple("--clients 10000 --hold 5".split()), (BYTES, CPS), fresh=True,
             note="10000 idle connections held 5 s, fresh broker"),
]

# The durability row (the seed workload at QoS 1); run by the suite with fsync on and off.
EXTRA: list[Scenario] = [
    Scenario("q1", "pub", tuple("--clients 25 --count 1000 --size 1024 --qos 1 --inflight 100 --marker".split()),
             (ROUTED,), note="25 publishers x 1000 x 1 KiB, QoS 1, inflight 100 (durability row)"),
]


def _v5(s: Scenario) -> Scenario:
    return Scenario(s.id + "-v5", s.tool, s.args, s.metrics, s.fresh, s.note + " (MQTT 5)", ("--mqtt5",))


SCENARIOS: dict[str, Scenario] = {s.id: s for s in _BASE + EXTRA}
SCENARIOS.update({v.id: v for v in map(_v5, _BASE)})

# Full run: every row, 3.1.1 then 5.0.
DEFAULT_IDS: list[str] = [s.id for s in _BASE] + [s.id + "-v5" for s in _BASE]

# --quick: every row once (see harness.QUICK_* for repeat and timeout).
QUICK_IDS: list[str] = list(DEFAULT_IDS)


def resolve(spec: str) -> list[str]:
    """Parse a --scenarios value: comma-separated ids, plus the groups
    ``all``, ``v3`` (3.1.1 rows), ``v5`` (MQTT 5 rows) and ``quick``."""
    out: list[str] = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok == "all":
            ids = DEFAULT_IDS
        elif tok == "v3":
            ids = [s.id for s in _BASE]
        elif tok == "v5":
            ids = [s.id + "-v5" for s in _BASE]
        elif tok == "quick":
            ids = QUICK_IDS
        elif tok in SCENARIOS:
            ids = [tok]
        else:
            raise ValueError(f"unknown scenario '{tok}' (known: {', '.join(SCENARIOS)}, all, v3, v5, quick)")
        for i in ids:
            if i not in out:
                out.append(i)
    if not out:
        raise ValueError("no scenario selected")
    return out

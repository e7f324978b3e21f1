"""Summaries and tables (plain text and Markdown) of benchmark runs."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .scenarios import SCENARIOS, Metric, Scenario

BROKER_TITLES = {"mosquitto": "Mosquitto", "wrenmq": "wrenmq"}


@dataclass
class Run:
    scenario: str
    broker: str
    rep: int
    argv: list[str]
    rc: int | None = None
    wall_s: float = 0.0
    result: dict | None = None
    error: str | None = None  # why the run produced no (trustworthy) figures
    stderr_tail: str = ""
    broker_pid: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        """The run produced a result line that is not a timeout."""
        return self.error is None and isinstance(self.result, dict) and "error" not in self.result

    @property
    def clean(self) -> bool:
        """Measured, and mqload itself reported no errors (exit 0, ok: true)."""
        return self.measured and self.rc == 0 and bool(self.result.get("ok"))

    def problem(self) -> str | None:
        if self.error:
            return self.error
        if isinstance(self.result, dict):
            if self.result.get("error"):
                return f"mqload: {self.result['error']}"
            if not self.result.get("ok", False):
                return "mqload: " + str(self.result.get("first_error") or f"exit {self.rc}")
        if self.notes:
            return "; ".join(self.notes)
        return None

    def to_json(self) -> dict:
        return {
            "scenario": self.scenario, "broker": self.broker, "rep": self.rep, "argv": self.argv,
            "rc": self.rc, "wall_s": round(self.wall_s, 3), "broker_pid": self.broker_pid,
            "error": self.error, "notes": self.notes, "stderr_tail": self.stderr_tail, "result": self.result,
        }


@dataclass
class Stat:
    values: list[float]

    @property
    def ok(self) -> bool:
        return bool(self.values)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def med(self) -> float:
        return statistics.median(self.values)

    @property
    def max(self) -> float:
        return max(self.values)


def metric_stat(runs: list[Run], metric: Metric) -> Stat:
    vals = [v for r in runs if r.measured and (v := metric.get(r.result)) is not None]
    return Stat(vals)


def fmt_value(v: float, unit: str) -> str:
    if unit in ("msg/s", "deliv/s", "conn/s"):
        if v >= 1e6:
            return f"{v / 1e6:.2f}M"
        if v >= 1e4:
            return f"{v / 1e3:.1f}k"
        if v >= 1e3:
            return f"{v / 1e3:.2f}k"
        return f"{v:.0f}"
    if unit == "us":
        if v >= 1e6:
            return f"{v / 1e6:.2f} s"
        if v >= 1e3:
            return f"{v / 1e3:.1f} ms"
        return f"{v:.0f} us"
    if unit == "B":
        return f"{v:.0f} B"
    return f"{v:.0f}"


def fmt_stat(s: Stat, unit: str, n_runs: int) -> str:
    if n_runs == 0:
        return "-"
    if not s.ok:
        return "FAILED"
    if len(s.values) == 1:
        return fmt_value(s.values[0], unit)
    return f"{fmt_value(s.min, unit)} / {fmt_value(s.med, unit)} / {fmt_value(s.max, unit)}"


def ratio(w: Stat, m: Stat) -> float | None:
    if not (w.ok and m.ok) or m.med == 0:
        return None
    return w.med / m.med


def health(sc: Scenario, runs: list[Run]) -> str:
    """Loss/duplicates (pubsub), unsent messages (pub), failed/dead connections (conns),
    summed over the measured runs; plus the count of runs with errors."""
    if not runs:
        return "-"
    meas = [r for r in runs if r.measured]
    res = [r.result for r in meas]
    if not meas:
        s = "-"
    elif sc.tool == "pubsub":
        s = f"{sum(x.get('lost', 0) for x in res)}/{sum(x.get('dup_or_ooo', 0) for x in res)}"
    elif sc.tool == "pub":
        s = f"{sum(max(0, x.get('expected', 0) - x.get('sent', 0)) for x in res)}/-"
    else:
        failed = sum(x.get("failed", 0) for x in res)
        dead = sum(max(0, x.get("connected", 0) - x.get("alive_after_hold", 0)) for x in res)
        s = f"{failed}/{dead}"
    bad = sum(1 for r in runs if not r.clean)
    if bad:
        s += f" ({bad}/{len(runs)} err)"
    return s


HEALTH_NOTE = ("lost/dup: pubsub rows = messages lost / duplicated-or-out-of-order, pub rows = messages "
               "not sent, f = connections failed / not alive after the hold; summed over runs. "
               "'(n/m err)' = runs where mqload reported errors or produced no figures.")


def rows(runs: list[Run], ids: list[str], brokers: list[str]) -> list[dict]:
    """One row per (scenario, metric)."""
    out = []
    for sid in ids:
        sc = SCENARIOS[sid]
        by_b = {b: [r for r in runs if r.scenario == sid and r.broker == b] for b in brokers}
        for i, m in enumerate(sc.metrics):
            stats = {b: metric_stat(by_b[b], m) for b in brokers}
            row = {
                "scenario": sid, "metric": m.key, "label": m.label, "unit": m.unit,
                "better": "higher" if m.higher_is_better else "lower",
                "first": i == 0,
                "stats": stats, "runs": {b: len(by_b[b]) for b in brokers},
                "health": {b: health(sc, by_b[b]) for b in brokers} if i == 0 else {b: "" for b in brokers},
                "ratio": ratio(stats["wrenmq"], stats["mosquitto"]) if len(brokers) == 2 else None,
            }
            out.append(row)
    return out


def summary_json(rws: list[dict], brokers: list[str]) -> list[dict]:
    out = []
    for r in rws:
        d = {"scenario": r["scenario"], "metric": r["metric"], "unit": r["unit"], "better": r["better"],
             "ratio_wrenmq_over_mosquitto": r["ratio"]}
        for b in brokers:
            s: Stat = r["stats"][b]
            d[b] = {"values": s.values, "min": s.min if s.ok else None, "median": s.med if s.ok else None,
                    "max": s.max if s.ok else None, "runs": r["runs"][b]}
        out.append(d)
    return out


def _ratio_cell(r: dict) -> str:
    if r["ratio"] is None:
        return "-"
    return f"{r['ratio']:.2f}x"


def _columns(rws: list[dict], brokers: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["id", "metric", "better"]
    for b in brokers:
        head.append(f"{BROKER_TITLES[b]} min / med / max")
    if len(brokers) == 2:
        head.append("wrenmq/Mosq (median)")
    head.append("lost/dup " + " | ".join(BROKER_TITLES[b] for b in brokers) if len(brokers) == 2 else "lost/dup")
    body = []
    for r in rws:
        line = [r["scenario"] if r["first"] else "", r["label"], r["better"]]
        for b in brokers:
            line.append(fmt_stat(r["stats"][b], r["unit"], r["runs"][b]))
        if len(brokers) == 2:
            line.append(_ratio_cell(r))
        line.append(" | ".join(r["health"][b] for b in brokers) if r["first"] else "")
        body.append(line)
    return head, body


def text_table(rws: list[dict], brokers: list[str]) -> str:
    head, body = _columns(rws, brokers)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(head), line(["-" * w for w in widths])]
    prev = None
    for r, cells in zip(rws, body):
        if prev is not None and r["first"] and r["scenario"].endswith("-v5") != prev["scenario"].endswith("-v5"):
            out.append("")  # blank line between the 3.1.1 and the MQTT 5 block
        out.append(line(cells))
        prev = r
    return "\n".join(out)


def markdown_table(rws: list[dict], brokers: list[str]) -> str:
    head, body = _columns(rws, brokers)
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(esc(h) for h in head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for cells in body:
        out.append("| " + " | ".join(esc(c) for c in cells) + " |")
    return "\n".join(out)


def one_line(p: str) -> str:
    """A multi-line message (e.g. an error plus a log tail) as 'first ... last' line."""
    lines = [x.strip() for x in p.strip().splitlines() if x.strip()] or [p]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def problems(runs: list[Run]) -> list[str]:
    """First problem per (scenario, broker), for the notes under the table."""
    seen: dict[tuple[str, str], tuple[str, int]] = {}
    for r in runs:
        p = r.problem()
        if p is None:
            continue
        key = (r.scenario, r.broker)
        first, n = seen.get(key, (p, 0))
        seen[key] = (first, n + 1)
    out = []
    for (sid, b), (p, n) in seen.items():
        total = sum(1 for r in runs if r.scenario == sid and r.broker == b)
        out.append(f"{sid} {b}: {n}/{total} run(s): {one_line(p)}")
    return out

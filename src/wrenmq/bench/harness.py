"""python -m wrenmq.bench: wrenmq vs Mosquitto, side by side, with mqload.

For every scenario (ids and mqload commands as in mqload's README, plus the same
rows over MQTT 5 as ``<id>-v5``) and every repeat, the two brokers take turns (the
one that goes first alternates), each run is one mqload process whose JSON line is
kept, and the table shows min / median / max per broker and the ratio of medians.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import report
from .brokers import HOST, Broker, BrokerError, BrokerUnavailable, Mosquitto, Wrenmq, which
from .report import Run
from .scenarios import DEFAULT_IDS, QUICK_IDS, SCENARIOS, resolve

DEFAULT_REPEAT = 3
DEFAULT_RUN_TIMEOUT = 180.0  # seconds, per mqload run (mqload --timeout)
QUICK_REPEAT = 1
QUICK_RUN_TIMEOUT = 60.0
WRENMQ_PORT = 18831
NOFILE_WANT = 65536
BROKERS = ("mosquitto", "wrenmq")


def repo_root() -> Path:
    here = Path(__file__).resolve()
    root = here.parents[3]  # src/wrenmq/bench/harness.py -> repo root
    if (root / "pyproject.toml").is_file():
        return root
    return Path.cwd()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def raise_nofile(want: int = NOFILE_WANT) -> int:
    """Raise RLIMIT_NOFILE for this process (and so for the brokers and mqload it starts)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    if hard != inf and hard < want:
        try:  # root may raise the hard limit too
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            pass
    new = want if hard == inf else min(want, hard)
    if soft != inf and soft < new:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return soft


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m wrenmq.bench",
        description="Benchmark wrenmq against Mosquitto with mqload (shared/tools/mqload).",
        epilog="Scenarios: " + ", ".join(DEFAULT_IDS) + " (groups: all, v3, v5, quick). "
               "Exit code: 0 all runs clean, 1 some run failed or reported errors, 2 setup error.",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"one pass (repeat {QUICK_REPEAT}) over the quick set, {QUICK_RUN_TIMEOUT:.0f} s cap per run")
    p.add_argument("--scenarios", metavar="IDS", help="comma-separated scenario ids (default: all rows)")
    p.add_argument("--repeat", type=int, metavar="N", help=f"runs per scenario and broker (default {DEFAULT_REPEAT})")
    p.add_argument("--only", choices=BROKERS, help="run one broker only")
    p.add_argument("--wrenmq-config", metavar="FILE", help="config file passed to wrenmq serve --config")
    p.add_argument("--wrenmq-args", metavar="ARGS", default="",
                   help="extra arguments for wrenmq serve (one shell-quoted string)")
    p.add_argument("--wrenmq-port", type=int, default=WRENMQ_PORT, metavar="N",
                   help=f"port for wrenmq (default {WRENMQ_PORT})")
    p.add_argument("--no-data-dir", action="store_true",
                   help="do not pass a fresh --data-dir (under .bench/tmp) to wrenmq")
    p.add_argument("--json", metavar="OUT", help="write all raw results (every mqload JSON line) to OUT")
    p.add_argument("--markdown", action="store_true", help="print a Markdown report (for docs/BENCHMARKS.md)")
    p.add_argument("--run-timeout", type=float, metavar="S",
                   help=f"per-run limit passed to mqload --timeout (default {DEFAULT_RUN_TIMEOUT:.0f}, "
                        f"{QUICK_RUN_TIMEOUT:.0f} with --quick)")
    p.add_argument("--pause", type=float, default=0.5, metavar="S", help="pause between runs (default 0.5)")
    p.add_argument("--mqload", metavar="PATH", help="mqload binary (default .bench/mqload/release/mqload)")
    p.add_argument("--mosquitto", metavar="PATH", help="mosquitto binary (default: from PATH or /usr/sbin)")
    p.add_argument("--mosquitto-conf", metavar="FILE", help="Mosquitto config (default: the one beside this module)")
    p.add_argument("--wrenmq", metavar="PATH", help="wrenmq executable (default .venv/bin/wrenmq)")
    p.add_argument("--list", action="store_true", help="list the scenarios and their mqload commands, then exit")
    a = p.parse_args(argv)
    if a.repeat is not None and a.repeat < 1:
        p.error("--repeat must be >= 1")
    try:
        a.ids = resolve(a.scenarios) if a.scenarios else list(QUICK_IDS if a.quick else DEFAULT_IDS)
    except ValueError as e:
        p.error(str(e))
    if a.repeat is None:
        a.repeat = QUICK_REPEAT if a.quick else DEFAULT_REPEAT
    if a.run_timeout is None:
        a.run_timeout = QUICK_RUN_TIMEOUT if a.quick else DEFAULT_RUN_TIMEOUT
    return a


def find_mqload(a: argparse.Namespace, root: Path) -> str | None:
    if a.mqload:
        return a.mqload
    p = root / ".bench" / "mqload" / "release" / "mqload"
    return str(p) if p.is_file() else which("mqload")


def find_wrenmq(a: argparse.Namespace, root: Path) -> str | None:
    if a.wrenmq:
        return a.wrenmq
    for p in (root / ".venv" / "bin" / "wrenmq", Path(sys.executable).parent / "wrenmq"):
        if p.is_file():
            return str(p)
    return which("wrenmq")


def bench_setup() -> tuple[Path, str | None, str | None, Path]:
    """For the standalone bench scripts: (repo root, mqload, wrenmq executable, log dir),
    with the open-files limit raised."""
    root = repo_root()
    raise_nofile()
    ns = argparse.Namespace(mqload=None, wrenmq=None)
    log_dir = root / ".bench" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return root, find_mqload(ns, root), find_wrenmq(ns, root), log_dir


def run_mqload(mqload: str, sid: str, broker: Broker, rep: int, timeout: float) -> Run:
    sc = SCENARIOS[sid]
    argv = [mqload, sc.tool, "--host", HOST, "--port", str(broker.port), *sc.args, *sc.extra,
            "--broker-pid", str(broker.pid), "--timeout", f"{timeout:g}"]
    run = Run(sid, broker.name, rep, argv, broker_pid=broker.pid)
    t0 = time.monotonic()
    try:
        cp = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired as e:
        run.wall_s = time.monotonic() - t0
        run.error = f"mqload still running {timeout + 30:.0f} s after start; killed"
        run.stderr_tail = (e.stderr or b"")[-2000:].decode(errors="replace") if isinstance(e.stderr, bytes) \
            else (e.stderr or "")[-2000:]
        return run
    except OSError as e:
        run.error = f"cannot run mqload: {e}"
        return run
    run.wall_s = time.monotonic() - t0
    run.rc = cp.returncode
    run.stderr_tail = cp.stderr[-2000:]
    for line in reversed(cp.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                run.result = json.loads(line)
            except json.JSONDecodeError:
                continue
            break
    if run.result is None:
        err = cp.stderr.strip().splitlines()
        run.error = f"mqload exit {cp.returncode}, no JSON line" + (f": {err[-1]}" if err else "")
    elif run.result.get("error") == "timeout":
        r = run.result
        run.error = (f"timed out after {timeout:g} s (connected {r.get('connected')}, sent {r.get('sent')}, "
                     f"received {r.get('received')})")
    return run


def describe(run: Run) -> str:
    sc = SCENARIOS[run.scenario]
    if not run.measured:
        return "FAILED: " + report.one_line(run.problem() or "?")
    parts = []
    for m in sc.metrics:
        v = m.get(run.result)
        parts.append(f"{m.label} {report.fmt_value(v, m.unit) if v is not None else 'n/a'}")
    p = run.problem()
    if p:
        parts.append("ERR: " + report.one_line(p))
    return ", ".join(parts)


def collect_meta(a: argparse.Namespace, brokers: dict[str, Broker], mqload: str, nofile: int,
                 argv: list[str]) -> dict:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mq_ver = subprocess.run([mqload, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        mq_ver = "?"
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m wrenmq.bench" + (" " + shlex.join(argv) if argv else ""),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "nofile_limit": nofile,
        "mqload": mq_ver.replace("mqload ", ""),
        "repeat": a.repeat,
        "run_timeout_s": a.run_timeout,
        "scenarios": a.ids,
        "brokers": list(brokers),
    }
    if "mosquitto" in brokers:
        m = brokers["mosquitto"]
        meta["mosquitto_version"] = m.version()
        meta["mosquitto_conf"] = str(m.conf)
        meta["mosquitto_port"] = m.port
    if "wrenmq" in brokers:
        w = brokers["wrenmq"]
        meta["wrenmq_version"] = w.version()
        meta["wrenmq_command"] = w.command_line()
        meta["wrenmq_port"] = w.port
    return meta


def render(meta: dict, runs: list[Run], ids: list[str], names: list[str], markdown: bool, root: Path) -> str:
    rws = report.rows(runs, ids, names)
    probs = report.problems(runs)
    both = len(names) == 2
    conf = meta.get("mosquitto_conf", "")
    try:
        conf = str(Path(conf).resolve().relative_to(root))
    except ValueError:
        pass
    out: list[str] = []
    if markdown:
        out += [f"### wrenmq vs Mosquitto, {meta['date'][:10]}", ""]
        out.append(f"- Command: `{meta['command']}` ({meta['repeat']} run(s) per scenario and broker, "
                   "brokers alternated; cells are min / median / max)")
        out.append(f"- Machine: {meta['nproc']} CPUs (`nproc`), {meta['cpu']}, Linux {meta['kernel']}, "
                   f"load average at start {meta['loadavg_at_start'][0]}")
        if "mosquitto_version" in meta:
            out.append(f"- Mosquitto {meta['mosquitto_version']}, config `{conf}`")
        if "wrenmq_version" in meta:
            out.append(f"- wrenmq {meta['wrenmq_version']}: `{meta['wrenmq_command']}` on Python {meta['python']}")
        out.append(f"- Load generator: mqload {meta['mqload']} (shared/tools/mqload), date {meta['date']}")
        out += ["", report.markdown_table(rws, names), ""]
        if both:
            out.append("Ratio = wrenmq median / Mosquitto median: above 1 is better for wrenmq where "
                       "'better' is higher, below 1 is better where it is lower.")
        out.append(report.HEALTH_NOTE)
        if probs:
            out += ["", "Problems:", ""] + [f"- {p}" for p in probs]
        out += ["", "| id | mqload command |", "|---|---|"]
        out += [f"| {sid} | `{SCENARIOS[sid].command}` |" for sid in ids]
    else:
        out.append(f"wrenmq bench  {meta['date']}  nproc {meta['nproc']}  ({meta['cpu']})  "
                   f"mqload {meta['mqload']}")
        if "mosquitto_version" in meta:
            out.append(f"  mosquitto {meta['mosquitto_version']}  port {meta['mosquitto_port']}  config {conf}")
        if "wrenmq_version" in meta:
            out.append(f"  wrenmq {meta['wrenmq_version']}  {meta['wrenmq_command']}")
        out.append(f"  command: {meta['command']}   repeat {meta['repeat']}, brokers alternated, "
                   "cells min / med / max")
        out += ["", report.text_table(rws, names), ""]
        if both:
            out.append("ratio = wrenmq median / mosquitto median; 'better' says which direction is better "
                       "(higher: ratio > 1 favours wrenmq; lower: ratio < 1 favours wrenmq).")
        out.append(report.HEALTH_NOTE)
        if probs:
            out += ["", "problems:"] + [f"  {p}" for p in probs]
    return "\n".join(out)


def _on_signal(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.list:
        for sid in DEFAULT_IDS:
            sc = SCENARIOS[sid]
            print(f"{sid:<6} {sc.command}\n       {sc.note}")
        return 0
    root = repo_root()
    bench_dir = root / ".bench"
    log_dir = bench_dir / "logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    shutil.rmtree(bench_dir / "tmp", ignore_errors=True)

    mqload = find_mqload(a, root)
    if not mqload or not os.access(mqload, os.X_OK):
        log("bench: mqload not found; build it with `make bench-quick` (or scripts/build-mqload.sh)")
        return 2
    names = [a.only] if a.only else list(BROKERS)
    brokers: dict[str, Broker] = {}
    if "mosquitto" in names:
        mbin = a.mosquitto or which("mosquitto")
        if not mbin:
            log("bench: mosquitto not found; install it with "
                "`bash scripts/ensure-debian-packages.sh mosquitto:mosquitto` (make bench does)")
            return 2
        conf = Path(a.mosquitto_conf) if a.mosquitto_conf else Path(__file__).with_name("mosquitto.conf")
        brokers["mosquitto"] = Mosquitto(mbin, conf.resolve(), log_dir, root)
    if "wrenmq" in names:
        brokers["wrenmq"] = Wrenmq(find_wrenmq(a, root), a.wrenmq_port, log_dir, root,
                                   config=str(Path(a.wrenmq_config).resolve()) if a.wrenmq_config else None,
                                   extra_args=shlex.split(a.wrenmq_args),
                                   data_dir=not a.no_data_dir)
    if len({b.port for b in brokers.values()}) < len(brokers):
        log("bench: Mosquitto and wrenmq would share a port; pick another --wrenmq-port")
        return 2

    nofile = raise_nofile()
    need = max((int(SCENARIOS[s].args[SCENARIOS[s].args.index("--clients") + 1])
                for s in a.ids if SCENARIOS[s].tool == "conns"), default=0)
    if need and nofile < need + 300:
        log(f"bench: warning: open-file limit {nofile} is below {need} connections; f rows will fail")

    meta = collect_meta(a, brokers, mqload, nofile, argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    runs: list[Run] = []
    unavailable: dict[str, str] = {}
    fail_streak = {n: 0 for n in names}
    total = a.repeat * len(a.ids) * len(names)
    k = 0
    t_start = time.monotonic()
    log(f"bench: {len(a.ids)} scenario(s) x {len(names)} broker(s) x {a.repeat} = {total} runs; "
        f"logs in {log_dir}")
    try:
        for rep in range(a.repeat):
            for si, sid in enumerate(a.ids):
                sc = SCENARIOS[sid]
                order = names if (rep + si) % 2 == 0 else names[::-1]
                for name in order:
                    k += 1
                    b = brokers[name]
                    if name in unavailable:
                        run = Run(sid, name, rep, [], error=f"broker unavailable: {unavailable[name]}")
                    else:
                        try:
                            if sc.fresh or not b.alive():
                                b.start()
                            fail_streak[name] = 0
                        except BrokerError as e:
                            run = Run(sid, name, rep, [], error=f"start failed: {e}")
                            fail_streak[name] += 1
                            if isinstance(e, BrokerUnavailable) or fail_streak[name] >= 2:
                                unavailable[name] = str(e).splitlines()[0]
                                log(f"bench: {name} is unavailable for the rest of this run: "
                                    f"{report.one_line(str(e))}")
                        else:
                            run = run_mqload(mqload, sid, b, rep, a.run_timeout)
                            if not b.alive():
                                rc = b.proc.returncode if b.proc else None
                                run.notes.append(f"{name} exited during the run (code {rc})")
                                b.stop()
                            elif sc.fresh:
                                b.stop()
                    runs.append(run)
                    log(f"[{k}/{total}] {sid:<6} {name:<9} rep {rep + 1}/{a.repeat}: {describe(run)}"
                        f"  ({run.wall_s:.1f} s)")
                    if run.argv and a.pause > 0:
                        time.sleep(a.pause)
    except KeyboardInterrupt:
        log("bench: interrupted; reporting what was measured")
        meta["interrupted"] = True
    finally:
        for b in brokers.values():
            b.stop()
        shutil.rmtree(bench_dir / "tmp", ignore_errors=True)

    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    print(render(meta, runs, a.ids, names, a.markdown, root))
    log(f"bench: {len(runs)} runs in {meta['elapsed_s']:.1f} s")
    if a.json:
        rws = report.rows(runs, a.ids, names)
        doc = {
            "meta": meta,
            "scenarios": {sid: {"command": SCENARIOS[sid].command, "note": SCENARIOS[sid].note,
                                "metrics": [m.key for m in SCENARIOS[sid].metrics]} for sid in a.ids},
            "summary": report.summary_json(rws, names),
            "runs": [r.to_json() for r in runs],
        }
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"bench: raw results in {a.json}")
    if meta.get("interrupted"):
        return 130
    return 0 if runs and all(r.clean for r in runs) else 1

"""Progress of running pipeline queries: a rich progress bar for runs to the end of the log
(`--once`), one line per micro-batch (rows, rows/s, lag behind the log end) for `--continuous`.

The queries are polled (`recentProgress`), so no listener runs inside Spark's threads; the lag
is the source's `latestOffset` (the log ends, reported by the source) minus the batch's end.
"""

import json
import os
import signal
import sys
import threading
import time

from .common import Options, open_readers, starting_offsets as _starting_offsets


def _offsets(v):
    if v is None:
        return {}
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return {}
    return {k: int(x) for k, x in v.items()} if isinstance(v, dict) else {}


def checkpoint_offsets(checkpoint):
    """The source offsets of the last committed batch of a checkpoint, or None."""
    commits = os.path.join(checkpoint, "commits")
    try:
        ids = sorted(int(n) for n in os.listdir(commits) if n.isdigit())
    except FileNotFoundError:
        return None
    if not ids:
        return None
    try:
        with open(os.path.join(checkpoint, "offsets", str(ids[-1]))) as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        return None
    return _offsets(lines[2]) if len(lines) > 2 else None


def log_ends(path, source_opts=None):
    """Each partition's durable end: what the source can read (LogReader.durable_end_offset),
    of data dirs or (`wrenmq://...`) a cluster's admin listeners."""
    readers = open_readers(Options({**(source_opts or {}), "path": path}))
    try:
        return {n: r.durable_end_offset for n, r in readers.refresh().items()}
    finally:
        readers.close()


def first_offsets(path, checkpoint, source_opts):
    start = checkpoint_offsets(checkpoint) if checkpoint else None
    if start is not None:
        return start
    opts = Options({**(source_opts or {}), "path": path})
    readers = open_readers(opts)
    try:
        return _starting_offsets(opts, readers.refresh())
    finally:
        readers.close()


def lag(progress):
    total = 0
    for s in progress.get("sources", []):
        end = _offsets(s.get("endOffset"))
        latest = _offsets(s.get("latestOffset"))
        for n, e in latest.items():
            total += max(0, e - end.get(n, 0))
    return total


def batch_line(name, p):
    rows = p.get("numInputRows", 0)
    dur = p.get("durationMs", {}).get("triggerExecution", 0) / 1000.0
    rate = p.get("processedRowsPerSecond") or (rows / dur if dur else 0.0)
    return (f"{time.strftime('%H:%M:%S')} {name} batch {p.get('batchId')}: {rows} rows, "
            f"{rate:,.0f} rows/s, {dur:.2f} s, lag {lag(p)} records")


class Monitor:
    """Follow queries [(name, StreamingQuery)] until they end (or `duration` seconds)."""

    def __init__(self, queries, path, once=True, quiet=False, console=None, checkpoints=None,
                 source_opts=None, duration=None, out=None, stop_at_end=True):
        self.queries = queries
        self.path = path  # the source's: data dir(s), or wrenmq://... (source_opts: its credentials)
        self.once = once
        self.quiet = quiet
        self.console = console
        self.checkpoints = checkpoints or {}
        self.source_opts = source_opts or {}
        self.duration = duration
        self.out = out or sys.stdout
        self.stop_at_end = stop_at_end  # stop the queries when `duration` is up
        self.seen = {name: -1 for name, _ in queries}
        self.rows = {name: 0 for name, _ in queries}
        self.batches = {name: 0 for name, _ in queries}
        self._stop = threading.Event()

    def _new_progress(self, name, q):
        out = []
        for p in q.recentProgress:
            p = json.loads(p.json) if hasattr(p, "json") else p
            if p.get("batchId", -1) > self.seen[name]:
                self.seen[name] = p["batchId"]
                self.rows[name] += p.get("numInputRows", 0)
                self.batches[name] += 1
                out.append(p)
        return out

    def _active(self):
        return any(q.isActive for _, q in self.queries)

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, lambda *_: self._stop.set())
            except ValueError:
                pass
        return old

    def stop_all(self):
        for _, q in self.queries:
            try:
                if q.isActive:
                    q.stop()
            except Exception:
                pass

    def run(self):
        old = self._install_signals()
        t0 = time.monotonic()
        try:
            if self.once and not self.quiet:
                self._run_bar(t0)
            else:
                self._run_lines(t0)
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
        return {"rows": dict(self.rows), "batches": dict(self.batches), "seconds": time.monotonic() - t0}

    def _should_end(self, t0):
        if self._stop.is_set():
            return True
        return self.duration is not None and time.monotonic() - t0 >= self.duration

    def print_new(self):
        for name, q in self.queries:
            for p in self._new_progress(name, q):
                if not self.quiet and (p.get("numInputRows") or not self.once):
                    print(batch_line(name, p), file=self.out, flush=True)

    def _run_lines(self, t0):
        while True:
            self.print_new()
            if not self._active():
                break
            if self._should_end(t0):
                if self.stop_at_end or self._stop.is_set():
                    self.stop_all()
                break
            time.sleep(0.2)

    def _run_bar(self, t0):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)

        ends = log_ends(self.path, self.source_opts)
        tasks = {}
        console = self.console or Console(stderr=True)
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("records"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            for name, _ in self.queries:
                start = first_offsets(self.path, self.checkpoints.get(name), self.source_opts)
                total = sum(max(0, e - start.get(n, 0)) for n, e in ends.items())
                tasks[name] = (bar.add_task(name, total=total, rate=""), start)
            while True:
                for name, q in self.queries:
                    task, start = tasks[name]
                    for p in self._new_progress(name, q):
                        done = 0
                        for s in p.get("sources", []):
                            end = _offsets(s.get("endOffset"))
                            done += sum(max(0, min(e, ends.get(n, e)) - start.get(n, 0)) for n, e in end.items())
                        rate = p.get("processedRowsPerSecond") or 0
                        bar.update(task, completed=done, rate=f"{rate:,.0f} rows/s")
                if not self._active():
                    for name, q in self.queries:
                        task, _ = tasks[name]
                        if q.exception() is None:
                            bar.update(task, completed=bar.tasks[task].total)
                    break
                if self._should_end(t0):
                    self.stop_all()
                    break
                time.sleep(0.2)

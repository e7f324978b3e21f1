"""`wrenmq demo` / `make demo`: the whole path in one command.

A broker (`wrenmq serve`) on a fresh data dir, a simulated fleet (200 devices by default, each
its own MQTT connection, JSON telemetry every second), and two streaming jobs on the log for
about a minute: `archive` (the Parquet lake) and `topic-stats` (10-second windows, published
back to the broker as retained messages under $analytics/topic-stats/...). Then it prints what
landed, read back with pyarrow (and DuckDB when installed), and a retained stats message.
Everything stays in its work dir (`--dir`, or a new temporary folder), which it names at
the start and the end: the paths it prints can be opened afterwards.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

from ..ports import free_port, wait_port

SITES = ("site-a", "site-b", "site-c")


class Fleet:
    """N devices, each a paho MQTT 5 connection, publishing JSON telemetry."""

    def __init__(self, port, devices=200, interval=1.0, seed=7):
        self.port = port
        self.devices = devices
        self.interval = interval
        self.rng = random.Random(seed)
        self.clients = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        for i in range(self.devices):
            site = SITES[i % len(SITES)]
            cid = f"{site}-dev{i:04d}"
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
            c.connect("127.0.0.1", self.port, keepalive=60)
            c.loop_start()
            c.topic = f"{site}/dev{i:04d}/telemetry"
            c.base_temp = 18 + (i % 10)
            self.clients.append(c)
        self._thread = threading.Thread(target=self._run, name="fleet", daemon=True)
        self._thread.start()

    def _run(self):
        n = len(self.clients)
        tick = self.interval / max(1, n)
        seq = 0
        while not self._stop.is_set():
            t0 = time.monotonic()
            for c in self.clients:
                if self._stop.is_set():
                    break
                payload = {"temperature": round(c.base_temp + self.rng.gauss(0, 1.5), 2),
                           "humidity": round(self.rng.uniform(30, 70), 1),
                           "battery": round(self.rng.uniform(3.4, 4.2), 3), "seq": seq}
                c.last = c.publish(c.topic, json.dumps(payload), qos=1)
                self.sent += 1
                time.sleep(tick * 0.5)
            seq += 1
            left = self.interval - (time.monotonic() - t0)
            if left > 0:
                self._stop.wait(left)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for c in self.clients:
            try:
                if getattr(c, "last", None) is not None:
                    c.last.wait_for_publish(5)  # QoS 1, in order: the last ack covers the rest
                c.disconnect()
            except Exception:
                pass
            c.loop_stop()


def _retained_sample(port, prefix, timeout=3.0):
    import queue

    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    got = queue.Queue()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="demo-dashboard", protocol=mqtt.MQTTv5)
    c.on_message = lambda cl, ud, m: got.put((m.topic, m.payload))
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.subscribe(prefix + "/#", qos=1)
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out.append(got.get(timeout=0.3))
        except queue.Empty:
            if out:
                break
    c.disconnect()
    c.loop_stop()
    return out


def demo(devices=200, seconds=60.0, interval=1.0, workdir=None, port=0, master=None, out=None):
    from rich.console import Console

    console = Console(file=out) if out is not None else Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    # The results stay where they are said to be: a new folder unless one is given.
    workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="wrenmq-demo-"))
    data = os.path.join(workdir, "data")
    lake = os.path.join(workdir, "lake")
    port = port or free_port()
    os.makedirs(data, exist_ok=True)
    console.rule("[bold]wrenmq demo")
    console.print(f"work dir {workdir}\nbroker   127.0.0.1:{port} (data dir {data})")
    log_path = os.path.join(workdir, "broker.log")
    with open(log_path, "ab") as blog:
        broker = subprocess.Popen([sys.executable, "-m", "wrenmq", "serve", "--bind", "127.0.0.1",
                                   "--port", str(port), "--data-dir", data],
                                  stdout=blog, stderr=subprocess.STDOUT, cwd=workdir)
    fleet = None
    spark = None
    try:
        wait_port(port, broker)
        fleet = Fleet(port, devices, interval)
        fleet.start()
        console.print(f"fleet    {devices} devices publishing JSON telemetry every {interval:g} s "
                      f"to <site>/<device>/telemetry")
        console.print("spark    starting (local, loopback only, UI off) ...")
        from .jobs import JobOptions, start_archive, start_topic_stats
        from .progress import Monitor
        from .spark import session

        spark = session(master, app_name="wrenmq-demo")
        common = dict(data_dir=data, once=False, trigger="5 seconds", quiet=False)
        arch = JobOptions(output=os.path.join(lake, "archive"), **common)
        stats = JobOptions(output=os.path.join(lake, "topic-stats"), window="10 seconds",
                           watermark="5 seconds", fields=["temperature", "humidity"], publish=True,
                           broker=f"127.0.0.1:{port}", **common)
        queries = [("archive", start_archive(spark, arch)), ("topic-stats", start_topic_stats(spark, stats))]
        console.print(f"jobs     archive -> {arch.output_dir('archive')}\n"
                      f"         topic-stats -> {stats.output_dir('topic-stats')} "
                      f"(+ retained $analytics/topic-stats/...)\n"
                      f"running for {seconds:g} s; one line per micro-batch:")
        mon = Monitor(queries, data, once=False, duration=seconds, out=console.file, stop_at_end=False)
        mon.run()
        fleet.stop()
        console.print("fleet stopped; draining the log ...")
        for _, q in queries:
            q.processAllAvailable()
        mon.print_new()
        for _, q in queries:
            q.stop()
        for _, q in queries:
            if q.exception() is not None:
                raise q.exception()
        console.rule("[bold]what landed")
        _report(console, lake, fleet, port)
        console.print(f"\nthe results stay in {workdir} (lake/: the Parquet; data/: the broker's log); "
                      f"remove the folder when done")
        return 0
    finally:
        if fleet is not None:
            fleet.stop()
        if spark is not None:
            spark.stop()
        broker.terminate()
        try:
            broker.wait(15)
        except subprocess.TimeoutExpired:
            broker.kill()


def _report(console, lake, fleet, port):
    import pyarrow.dataset as ds
    from rich.table import Table

    arch = os.path.join(lake, "archive")
    files = sorted(os.path.relpath(os.path.join(d, f), arch) for d, _, fs in os.walk(arch)
                   for f in fs if f.endswith(".parquet") and "_wrenmq" not in d)
    t = ds.dataset(arch, format="parquet", partitioning="hive").to_table(
        columns=["offset", "prefix", "client_id", "timestamp"])
    console.print(f"published by the fleet: {fleet.sent} messages")
    console.print(f"archive: {t.num_rows} rows in {len(files)} Parquet files, e.g. "
                  f"{os.path.join(arch, files[0]) if files else '-'}")
    if t.num_rows:
        offs = t.column("offset").to_numpy()
        console.print(f"         offsets {offs.min()}..{offs.max()}, distinct {len(set(offs.tolist()))} "
                      f"(no duplicates: {len(set(offs.tolist())) == t.num_rows})")
    try:
        import duckdb

        with duckdb.connect() as con:
            rows = con.execute(f"SELECT prefix, count(*) AS messages, count(DISTINCT client_id) AS devices "
                               f"FROM read_parquet('{arch}/*/*/*.parquet', hive_partitioning=true) "
                               f"GROUP BY prefix ORDER BY prefix").fetchall()
        tab = Table("prefix", "messages", "devices", title="archive by topic prefix (DuckDB)")
        for r in rows:
            tab.add_row(*(str(x) for x in r))
        console.print(tab)
    except ImportError:
        pass
    st = os.path.join(lake, "topic-stats")
    try:
        s = ds.dataset(st, format="parquet", partitioning="hive").to_table()
    except (FileNotFoundError, ValueError):
        s = None
    if s is not None and s.num_rows:
        df = s.to_pandas().sort_values(["window_start", "topic"])
        console.print(f"topic-stats: {len(df)} rows ({df['topic'].nunique()} topics, "
                      f"{df['window_start'].nunique()} closed 10 s windows)")
        tab = Table("window", "topic", "messages", "bytes", "publishers", "temp min/mean/max",
                    title="topic-stats (last closed window, first 5 topics)")
        last = df[df["window_start"] == df["window_start"].max()].head(5)
        for _, r in last.iterrows():
            tab.add_row(f"{r['window_start']:%H:%M:%S}", r["topic"], str(r["messages"]), str(r["bytes"]),
                        str(r["publishers"]),
                        f"{r['temperature_min']:.1f} / {r['temperature_mean']:.1f} / {r['temperature_max']:.1f}")
        console.print(tab)
    else:
        console.print("topic-stats: no window closed yet (run longer)")
    msgs = _retained_sample(port, "$analytics/topic-stats")
    console.print(f"retained stats on the broker: {len(msgs)} topics under $analytics/topic-stats/#")
    if msgs:
        topic, payload = sorted(msgs)[0]
        console.print(f"  {topic}: {payload.decode()}")

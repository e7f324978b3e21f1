"""Connects per second with [auth.http] (its cache warm) against no external auth.

    .venv/bin/python -m wrenmq.bench.auth_connects [--clients 2000] [--rounds 5] [--concurrency 64]

Starts an HTTP auth service (EMQX's contract: {"result": "allow"}, aiohttp's server, in a
process of its own) and `wrenmq serve` twice, one after the other: with no external auth
(anonymous clients on loopback) and with `[auth.http]` pointing at the service. The same
asyncio client (a separate process) connects `--clients` client ids with a user name and
password, CONNECT -> CONNACK -> DISCONNECT, `--concurrency` at a time, `--rounds` times;
round 1 with HTTP auth asks the service for every client (the cache is cold), the later
rounds are answered from the cache. Prints connects/s per round, and the ratio of the
medians of rounds 2..N (warm cache / no external auth).
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..mqtt import constants as C
from ..mqtt.codec import Decoder, encode
from ..mqtt.packets import Connect, Disconnect
from ..ports import free_port, wait_port


def _service(port, ready):
    from aiohttp import web

    async def auth(request):
        await request.read()
        return web.json_response({"result": "allow"})

    app = web.Application()
    app.router.add_post("/auth", auth)
    ready.set()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _one(port, cid, user):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode(Connect(client_id=cid, version=C.MQTT311, username=user, password=b"pw"), C.MQTT311))
    dec = Decoder(C.MQTT311)
    while True:
        data = await reader.read(64)
        if not data:
            raise ConnectionError("closed before CONNACK")
        pkts = dec.feed(data)
        if pkts:
            break
    if pkts[0].reason_code != 0:
        raise ConnectionError(f"refused: {pkts[0].reason_code}")
    writer.write(encode(Disconnect(), C.MQTT311))
    writer.close()
    await writer.wait_closed()


async def _round(port, clients, concurrency):
    sem = asyncio.Semaphore(concurrency)

    async def go(i):
        async with sem:
            await _one(port, f"bench-{i}", f"user-{i % 100}")

    t0 = time.perf_counter()
    await asyncio.gather(*(go(i) for i in range(clients)))
    return clients / (time.perf_counter() - t0)


def _client(port, clients, rounds, concurrency, out):
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    out.put([asyncio.run(_round(port, clients, concurrency)) for _ in range(rounds)])


def _measure(config_text, args, tmp):
    port = free_port()
    cfg = Path(tmp) / f"bench-{port}.toml"
    cfg.write_text(config_text)
    wrenmq = str(Path(sys.executable).with_name("wrenmq"))
    proc = subprocess.Popen([wrenmq, "serve", "--config", str(cfg), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
    try:
        wait_port(port, proc=proc)
        out = multiprocessing.Queue()
        p = multiprocessing.Process(target=_client, args=(port, args.clients, args.rounds, args.concurrency, out))
        p.start()
        rates = out.get(timeout=600)
        p.join(30)
        return rates
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args(argv)
    http_port = free_port()
    ready = multiprocessing.Event()
    svc = multiprocessing.Process(target=_service, args=(http_port, ready), daemon=True)
    svc.start()
    ready.wait(30)
    wait_port(http_port, what="the auth service")
    base = '[storage]\nmode = "memory"\n[sys]\ninterval = 0\n[logging]\nlevel = "warning"\n'
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results["none"] = _measure(base + "[auth]\nallow_anonymous = true\n", args, tmp)
            results["http"] = _measure(
                base + f'[auth]\nallow_anonymous = false\n[auth.http]\nurl = "http://127.0.0.1:{http_port}/auth"\n',
                args, tmp)
    finally:
        svc.terminate()
        svc.join(10)
    for name, rates in results.items():
        print(f"{name:5s} " + "  ".join(f"{r:8.0f}/s" for r in rates))
    none = statistics.median(results["none"][1:])
    warm = statistics.median(results["http"][1:])
    print(f"connects/s, median of rounds 2-{args.rounds}: no external auth {none:.0f}, "
          f"[auth.http] cached {warm:.0f} ({warm / none:.2f}x); [auth.http] cold round 1: "
          f"{results['http'][0]:.0f}")
    print(json.dumps({"none": results["none"], "http": results["http"], "ratio_warm": warm / none,
                      "commit": os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()}))


if __name__ == "__main__":
    main()

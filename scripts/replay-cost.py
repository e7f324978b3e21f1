"""How long one step of a cluster replay holds the event loop: `Store.read` of N records
from the log, then their FORWARD frames (as `Replay._replay`, cluster/replay.py, builds them).

    .venv/bin/python scripts/replay-cost.py CONFIG.toml

CONFIG names the data dir of a broker that has logged a few thousand messages
(docs/benchmarks-history.md, stop 25, has the commands).
"""

import asyncio
import sys
import time

from wrenmq.broker.message import Message
from wrenmq.cluster import frames as F
from wrenmq.config import load
from wrenmq.store.store import Store


async def main(cfg):
    store = Store(cfg)
    store.start(asyncio.get_running_loop())
    first, end = store.start_offset, store.next_offset
    print(f"records {first}-{end - 1}")
    for n in (500, 100, 50):
        steps = []
        for start in range(first, min(end, first + 6000) - n, n):
            t0 = time.perf_counter()
            recs = store.read(start, n)
            t1 = time.perf_counter()
            now = time.monotonic()
            for rec in recs:
                msg = Message(rec.topic, rec.payload, rec.qos, rec.retain, {}, None, rec.client_id, None, None,
                              False, rec.timestamp / 1e6)
                F.encode_forward(F.publish_bytes(msg, now), F.REPLAYED, msg.client_id, msg.timestamp, (), rec.offset)
            steps.append((t1 - t0, time.perf_counter() - t1))
        steps.sort(key=sum)
        read, frames = steps[len(steps) // 2]
        print(f"{n} records: read {read * 1e3:.2f} ms + frames {frames * 1e3:.2f} ms (median of {len(steps)}); "
              f"slowest {sum(steps[-1]) * 1e3:.2f} ms")
    store.close()


if __name__ == "__main__":
    asyncio.run(main(load(sys.argv[1])))

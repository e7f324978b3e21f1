"""What writing through the page cache costs this machine, with and without dropping
the synced pages behind the writes (docs/benchmarks-history.md, stop 26).

    python3 scripts/page-cache-cost.py drop|plain [MiB, default 2048] [directory, default .]

Writes MiB in 256 KiB writes to a new file, fdatasync every 32 MiB; with `drop`, the
synced bytes older than the newest 16 MiB are dropped from the page cache
(POSIX_FADV_DONTNEED) after each sync, so the writes reuse the pages just freed. Prints
the writing thread's CPU per GiB. The order of runs matters: a run reuses what the
previous one freed (its file is deleted at the end), if little time has passed.
"""

import os
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
total = int(sys.argv[2] if len(sys.argv) > 2 else 2048) << 20
where = sys.argv[3] if len(sys.argv) > 3 else "."
if mode not in ("drop", "plain"):
    sys.exit(__doc__)
keep, chunk, sync_every = 16 << 20, 256 << 10, 32 << 20
buf = os.urandom(chunk)
path = os.path.join(where, f"page-cache-cost-{os.getpid()}.tmp")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
try:
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    pos = synced = dropped = 0
    while pos < total:
        os.write(fd, buf)
        pos += chunk
        if pos - synced >= sync_every:
            os.fdatasync(fd)
            synced = pos
            if mode == "drop" and synced - keep > dropped:
                os.posix_fadvise(fd, dropped, synced - keep - dropped, os.POSIX_FADV_DONTNEED)
                dropped = synced - keep
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
finally:
    os.close(fd)
    os.unlink(path)
print(f"{mode}: {total >> 20} MiB, CPU {cpu:.2f} s ({cpu / (total / (1 << 30)):.2f} s per GiB), wall {wall:.2f} s")

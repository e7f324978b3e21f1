"""`wrenmq log`: look into the commit log on disk (stats, tail, verify).

Read-only: it never changes a file, so it is safe to run next to a running broker.
Partitions are the subdirectories of `<data_dir>/log/` (one per node).
"""

import argparse
import base64
import datetime as dt
import json
import logging
import os
import re
import sys
import time

from .reader import LogReader

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d|day|days|w|wk|wks)\s*$", re.I)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_TEXT_PAYLOAD = 200  # printable payloads longer than this are cut in text output
_HEX_PAYLOAD = 32  # bytes of a binary payload shown as hex


class UsageError(Exception):
    pass


# --- parsing -------------------------------------------------------------------------


def parse_time(text, now=None):
    """Microseconds since the epoch for ISO-8601 (naive = UTC) or a relative age like `10m`."""
    now = time.time() if now is None else now
    m = _RELATIVE.match(text)
    if m:
        return int((now - float(m.group(1)) * _UNITS[m.group(2)[0].lower()]) * 1_000_000)
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    try:
        t = dt.datetime.fromisoformat(s)
    except ValueError:
        raise UsageError(f"--since {text!r}: not an ISO-8601 time (2026-01-31T12:00:00Z) "
                         f"or an age like 30s, 10m, 2h, 7d") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return int(t.timestamp() * 1_000_000)


def iso(ts_us):
    """ISO-8601 UTC with microseconds, e.g. 2026-11-22T04:23:26.825123Z."""
    if ts_us is None:
        return None
    t = dt.datetime.fromtimestamp(ts_us / 1_000_000, dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def partitions(data_dir):
    """{name: directory} of the partitions under <data_dir>/log/."""
    root = os.path.join(data_dir, "log")
    try:
        names = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
    except FileNotFoundError:
        raise UsageError(f"no commit log in {data_dir} ({root} does not exist)") from None
    except NotADirectoryError:
        raise UsageError(f"{root} is not a directory") from None
    if not names:
        raise UsageError(f"no partitions in {root}")
    return {n: os.path.join(root, n) for n in names}


# --- formatting --------------------------------------------------------------------


def _human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def payload_text(payload):
    """A payload for a terminal: printable text as is (cut when long), else abbreviated hex."""
    if not payload:
        return "(empty)"
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isprintable():
        if len(text) > _TEXT_PAYLOAD:
            return f"{text[:_TEXT_PAYLOAD]}... ({len(payload)} bytes)"
        return text
    head = payload[:_HEX_PAYLOAD].hex()
    if len(payload) > _HEX_PAYLOAD:
        return f"hex:{head}... ({len(payload)} bytes)"
    return f"hex:{head}"


def _jsonable(v):
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(v).decode()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def _properties(block):
    if not block:
        return None
    try:
        from .store import parse_properties_block

        return _jsonable(parse_properties_block(block))
    except Exception:  # a block the codec does not understand: show it raw
        return {"raw_hex": block.hex()}


def record_json(rec, partition=None):
    try:
        payload, encoding = rec.payload.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(rec.payload).decode(), "base64"
    out = {
        "offset": rec.offset,
        "timestamp": iso(rec.timestamp),
        "timestamp_us": rec.timestamp,
        "topic": rec.topic,
        "qos": rec.qos,
        "retain": rec.retain,
        "client_id": rec.client_id,
        "payload": payload,
        "payload_encoding": encoding,
        "payload_bytes": len(rec.payload),
    }
    if rec.packet_id:
        out["packet_id"] = rec.packet_id
    props = _properties(rec.properties)
    if props is not None:
        out["properties"] = props
    if partition is not None:
        out["partition"] = partition
    return json.dumps(out, ensure_ascii=False)


def record_text(rec):
    flags = f"qos={rec.qos}" + (" retain" if rec.retain else "")
    return f"{rec.offset}  {iso(rec.timestamp)}  {rec.topic}  {flags}  client={rec.client_id}  " \
           f"{payload_text(rec.payload)}"


# --- commands ------------------------------------------------------------------------


def partition_stats(name, directory):
    reader = LogReader(directory)
    st = reader.stats()
    return {
        "partition": name,
        "directory": directory,
        "segments": st["segments"],
        "start_offset": st["start_offset"],
        "end_offset": st["end_offset"],
        "records": st["records"],
        "bytes": st["bytes"],
        "first_timestamp": iso(st["first_timestamp_us"]),
        "last_timestamp": iso(st["last_timestamp_us"]),
        "first_timestamp_us": st["first_timestamp_us"],
        "last_timestamp_us": st["last_timestamp_us"],
    }


def cmd_stats(args, out):
    parts = partitions(args.data_dir)
    stats = [partition_stats(n, d) for n, d in parts.items()]
    if args.json:
        out.write(json.dumps({"data_dir": os.path.abspath(args.data_dir), "partitions": stats}, indent=2)
                  + "\n")
        return 0
    for st in stats:
        last = st["end_offset"] - 1
        offsets = (f"{st['start_offset']}-{last} ({st['records']} records)" if st["records"]
                   else f"none yet (next offset {st['end_offset']})")
        span = (f"{st['first_timestamp']} .. {st['last_timestamp']}" if st["first_timestamp"] else "-")
        out.write(f"partition {st['partition']}  ({st['directory']})\n"
                  f"  segments    {st['segments']}\n"
                  f"  offsets     {offsets}\n"
                  f"  bytes       {st['bytes']} ({_human_bytes(st['bytes'])})\n"
                  f"  time range  {span}\n")
    return 0


def cmd_verify(args, out):
    parts = partitions(args.data_dir)
    problems = 0
    for name, directory in parts.items():
        reader = LogReader(directory)
        found = reader.verify()
        st = reader.stats()
        for line in found:
            out.write(line + "\n")
        problems += len(found)
        if not found:
            out.write(f"partition {name}: OK ({st['segments']} segments, {st['records']} records, "
                      f"offsets {st['start_offset']}-{st['end_offset'] - 1})\n")
    if problems:
        sys.stderr.write(f"wrenmq log verify: {problems} problem(s) found\n")
        return 1
    return 0


def _select_partition(args):
    parts = partitions(args.data_dir)
    if args.partition is not None:
        if args.partition not in parts:
            raise UsageError(f"no partition {args.partition!r} in {args.data_dir}/log "
                             f"(there is: {', '.join(parts)})")
        return args.partition, parts[args.partition]
    if len(parts) > 1:
        raise UsageError(f"several partitions in {args.data_dir}/log: choose one with --partition "
                         f"({', '.join(parts)})")
    return next(iter(parts.items()))


def _last_matching(reader, n, filters):
    """Offset to start from to show the last `n` records (matching `filters`)."""
    end = reader.end_offset
    if n <= 0:
        return end
    first = reader.start_offset
    if not filters:
        return max(first, end - n)
    window = max(1000, 4 * n)
    while True:
        lo = max(first, end - window)
        offs = [r.offset for r in reader.records(lo, end, filters)]
        if len(offs) >= n or lo == first:
            return offs[-n] if len(offs) >= n else lo
        window *= 4


def cmd_tail(args, out):
    name, directory = _select_partition(args)
    reader = LogReader(directory)
    filters = args.topic or None
    if args.limit is not None and args.limit < 0:
        raise UsageError("--limit must be >= 0")
    left = args.limit  # records still to print; None: no bound
    if args.since is not None:
        start = reader.offset_for_time(parse_time(args.since))
    elif args.from_ is not None:
        start = args.from_ if args.from_ >= 0 else max(reader.start_offset, reader.end_offset + args.from_)
    else:
        start = _last_matching(reader, 10 if args.limit is None else args.limit, filters)
        if args.follow:
            left = None  # like tail -f -n N: the last N, then whatever comes
    fmt = record_json if args.format == "json" else record_text
    pos = start

    def emit_until(end):
        nonlocal pos, left
        if pos < reader.start_offset:
            pos = reader.start_offset  # retention removed what was asked for
        for rec in reader.records(pos, end, filters):
            if left is not None and left <= 0:
                return False
            out.write(fmt(rec) + "\n")
            pos = rec.offset + 1
            if left is not None:
                left -= 1
        pos = max(pos, end if end is not None else reader.end_offset)
        return left is None or left > 0

    if not emit_until(None if not args.follow else reader.end_offset) or not args.follow:
        return 0
    out.flush()
    while True:
        time.sleep(args.interval)
        reader.refresh()
        end = reader.end_offset
        if end < pos:
            pos = end  # a recovering broker truncated a torn tail: continue from there
        if end > pos:
            if not emit_until(end):
                return 0
            out.flush()


# --- wiring ----------------------------------------------------------------------------


def add_parser(sub):
    """Add `log` to the `wrenmq` subcommands (an argparse subparsers object)."""
    p = sub.add_parser("log", help="inspect the commit log (stats, tail, verify)",
                       description="Look into the commit log on disk; read-only, safe next to a "
                                   "running broker.")
    lsub = p.add_subparsers(dest="log_command", metavar="ACTION")

    def data_dir(q):
        q.add_argument("--data-dir", metavar="DIR", default="./data",
                       help="the broker's data directory (default ./data)")

    st = lsub.add_parser("stats", help="segments, offsets, records, bytes and time range per partition")
    data_dir(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=main, log_func=cmd_stats)

    tl = lsub.add_parser("tail", help="print records (the last 10 by default)",
                         description="Print records of one partition: the last 10 by default, from an "
                                     "offset (--from; negative counts back from the end) or a time "
                                     "(--since: ISO-8601, UTC unless it says otherwise, or an age like "
                                     "30s, 10m, 2h, 7d).")
    data_dir(tl)
    tl.add_argument("--partition", metavar="NODE", help="partition (node) to read; needed if several")
    where = tl.add_mutually_exclusive_group()
    where.add_argument("--from", dest="from_", metavar="OFFSET", type=int, help="first offset to print")
    where.add_argument("--since", metavar="TIME", help="print records from this time on")
    tl.add_argument("--topic", metavar="FILTER", action="append",
                    help="only topics matching this MQTT filter (repeatable)")
    tl.add_argument("--follow", "-f", action="store_true", help="keep printing new records until Ctrl-C")
    tl.add_argument("--limit", "-n", metavar="N", type=int,
                    help="the last N records (default 10), and with --follow whatever comes after them; "
                         "with --from or --since: at most N records from there")
    tl.add_argument("--format", choices=["text", "json"], default="text",
                    help="text (default) or JSON, one record per line")
    tl.add_argument("--interval", type=float, default=0.5, help=argparse.SUPPRESS)
    tl.set_defaults(func=main, log_func=cmd_tail)

    vf = lsub.add_parser("verify", help="check every batch, record and index; exit 1 on problems")
    data_dir(vf)
    vf.set_defaults(func=main, log_func=cmd_verify)
    p.set_defaults(func=main, log_func=None, log_parser=p)
    return p


def main(args):
    """Run a parsed `wrenmq log ...` command; return the exit status."""
    func = getattr(args, "log_func", None)
    if func is None:
        args.log_parser.print_help()
        return 2
    logging.basicConfig(level=logging.WARNING, format="wrenmq log: %(message)s", stream=sys.stderr)
    out = sys.stdout
    try:
        return func(args, out)
    except UsageError as e:
        print(f"wrenmq log: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (| head): stop quietly, like other command line tools.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out.fileno())
        except (OSError, ValueError):
            pass
        return 0
    finally:
        try:
            out.flush()
        except (BrokenPipeError, ValueError):
            pass


__all__ = ["add_parser", "main", "parse_time", "payload_text", "iso"]

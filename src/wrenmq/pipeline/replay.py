"""`wrenmq pipeline replay`: re-publish a range of the log to a broker.

The range is given by offsets (one number for every partition, or JSON per node) and/or
times, filtered by MQTT topic filters; topics can be re-homed under a new prefix. Messages of
several nodes' logs are merged in timestamp order. Every re-published message keeps its
payload, QoS and MQTT 5 properties and gets two user properties:

    wrenmq-replay-of           <node>:<offset> of the original record
    wrenmq-original-timestamp  its log timestamp (microseconds since the epoch)

(`device-state` uses the latter, so a replay never makes old values look new.) The retain flag
is dropped unless `keep_retain`. The publisher is a paho MQTT 5 client with a bounded window of
unacknowledged messages, a rate limit (messages/s, 0 = as fast as the broker takes them) and
a rich progress bar. This job needs no Spark: it is a sequential copy from the log's files,
or with `brokers` from a running cluster's admin listeners (the rows the Spark source reads).

The target broker is always given. Into the broker that owns the log (the data dir's lock
file says where it listens) the topics must change (a prefix), or `same_topics` be set:
under the original topics its subscribers would get every message again (check_target).
A cluster read over the network does not say where its MQTT listeners are, so from
`brokers` a replay under the original topics always needs `same_topics`.
"""

import datetime as _dt
import heapq
import json
import os
import time
import uuid
from dataclasses import dataclass

from ..store.lock import data_dir_owner, serves_at
from ..store.store import parse_properties_block
from .jobs import ORIGINAL_TIMESTAMP, REPLAY_OF
from .common import (OptionError, Options, check_log, data_dir_specs, open_readers, parse_time_us, parse_topics,
                     time_offset)
from .netlog import read_range

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_US = _dt.timedelta(microseconds=1)


class ReplayRefused(OptionError):
    """The target is the broker that owns the log, and the topics are the original ones."""


@dataclass
class ReplayOptions:
    data_dir: str = "./data"
    # Or a running cluster's log over the network (as JobOptions: its admin listeners).
    brokers: str = None
    source_user: str = None
    source_password: str = None
    source_token: str = None
    cafile: str = None
    broker: str = None        # "host:port" of the broker to publish to: required
    topics: str = None
    from_offset: str = None   # int (every partition) or JSON {"node": offset}
    to_offset: str = None     # exclusive
    from_time: str = None     # ms since the epoch or ISO 8601
    to_time: str = None       # exclusive
    prefix: str = ""          # prepended to every topic (e.g. "replay/")
    strip_prefix: str = ""    # removed from the start of topics first
    rate: float = 0.0         # messages per second, 0 = unlimited
    qos: int = None           # None: the original QoS
    keep_retain: bool = False
    # Replay into the broker that owns the log under the original topics (no prefix): its
    # subscribers get every message again and its log records each twice, so only if asked.
    same_topics: bool = False
    window: int = 1000        # unacknowledged QoS > 0 messages in flight
    client_id: str = None
    quiet: bool = False
    username: str = None
    password: str = None


def _per_node(spec, node):
    if spec is None or spec == "":
        return None
    if isinstance(spec, int):
        return spec
    s = str(spec).strip()
    if s.startswith("{"):
        v = json.loads(s).get(node)
        return None if v is None else int(v)
    return int(s)


def _check_offsets(flag, value):
    if value is None or value == "" or isinstance(value, int):
        return
    s = str(value).strip()
    try:
        if s.startswith("{"):
            d = json.loads(s)
            if not isinstance(d, dict):
                raise ValueError
            for v in d.values():
                int(v)
        else:
            int(s)
    except (ValueError, TypeError):
        raise OptionError(f"{flag}: expected an offset or JSON {{\"<node>\": <offset>, ...}}, got {value!r}") from None


def _broker_address(broker):
    host, sep, port = str(broker or "").rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise OptionError(f"--broker: expected HOST:PORT of the broker to publish to, got {broker!r}")
    return host or "127.0.0.1", int(port)


def check_target(o):
    """ReplayRefused if `o.broker` is the broker that has the log's data dir open (its lock
    file says where it listens) and the topics stay as they were (no prefix, and
    `same_topics` not given)."""
    if o.prefix or o.same_topics:
        return
    host, port = _broker_address(o.broker)
    if o.brokers:
        # The target cannot be told from the cluster's nodes (their MQTT listeners are not
        # known from their admin listeners): under the original topics, it must be said.
        raise ReplayRefused(
            f"replaying a cluster's log (--brokers) into {o.broker} under the original topics: if {o.broker} is "
            f"a node of that cluster, its subscribers get every message again and it records each twice. Give "
            f"--prefix (e.g. --prefix replay/) to publish them under new topics, or --same-topics if {o.broker} "
            f"is another broker or that is what you want.")
    for spec in data_dir_specs(o.data_dir):
        d = os.path.abspath(os.path.expanduser(spec))
        for data_dir in (d, os.path.dirname(d)) if os.path.basename(d) == "log" else (d,):
            owner = data_dir_owner(data_dir)
            if owner is not None and serves_at(owner, host, port):
                raise ReplayRefused(
                    f"{o.broker} is the broker that owns the log in {data_dir} (pid {owner['pid']}): replayed "
                    f"under their original topics, its messages would reach its subscribers again and be "
                    f"recorded twice. Give --prefix (e.g. --prefix replay/) to publish them under new "
                    f"topics, or --same-topics if that is what you want.")


def check_options(o):
    """OptionError for what cannot work, before anything is published: no --broker, a data
    dir without a log, a bad offset or time, or a replay into the log's own broker under
    the same topics (check_target)."""
    if not o.broker:
        raise OptionError("--broker: give the broker to publish to (HOST:PORT)")
    _broker_address(o.broker)
    if o.brokers:
        from .jobs import JobOptions, check_source
        check_source(JobOptions(brokers=o.brokers, user=o.source_user, password=o.source_password,
                                token=o.source_token, cafile=o.cafile))
    else:
        check_log(o.data_dir)
    _check_offsets("--from-offset", o.from_offset)
    _check_offsets("--to-offset", o.to_offset)
    for flag, value in (("--from-time", o.from_time), ("--to-time", o.to_time)):
        try:
            parse_time_us(value)
        except (ValueError, OverflowError):
            raise OptionError(f"{flag}: expected milliseconds since the epoch or an ISO 8601 time, "
                              f"got {value!r}") from None
    check_target(o)


def _source(o):
    """The source's Options for the log `o` replays (data dirs or brokers)."""
    if not o.brokers:
        return Options({"path": o.data_dir})
    opts = {"path": "wrenmq://" + o.brokers}
    for key, value in (("username", o.source_user), ("password", o.source_password),
                       ("token", o.source_token), ("cafile", o.cafile)):
        if value is not None:
            opts[key] = value
    return Options(opts)


def plan(o):
    """[(node, reader, start, end)] for the requested range (readers left open): LogReaders,
    or the partitions a cluster lists (netlog.NetPartitionView) with `--brokers`."""
    out = []
    from_ts = parse_time_us(o.from_time)
    to_ts = parse_time_us(o.to_time)
    readers = open_readers(_source(o)).refresh()
    for node, r in readers.items():
        start, end = r.start_offset, r.durable_end_offset  # (never what a crash can take back)
        f = _per_node(o.from_offset, node)
        if f is not None:
            start = max(start, f)
        t = _per_node(o.to_offset, node)
        if t is not None:
            end = min(end, t)
        if from_ts is not None:
            start = max(start, time_offset(r, from_ts))
        if to_ts is not None:
            end = min(end, time_offset(r, to_ts))
        if end > start:
            out.append((node, r, start, end))
        else:
            r.close()
    return out


def _properties(rec, node, qos_props):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    p = Properties(PacketTypes.PUBLISH)
    props = rec.properties if isinstance(rec.properties, dict) else \
        parse_properties_block(rec.properties) if rec.properties else {}
    if "payload_format_indicator" in props:
        p.PayloadFormatIndicator = props["payload_format_indicator"]
    if "message_expiry_interval" in props:
        p.MessageExpiryInterval = props["message_expiry_interval"]
    if "content_type" in props:
        p.ContentType = props["content_type"]
    if "response_topic" in props:
        p.ResponseTopic = props["response_topic"]
    if "correlation_data" in props:
        p.CorrelationData = props["correlation_data"]
    ups = list(props.get("user_property", ()))
    ups = [(k, v) for k, v in ups if k not in (REPLAY_OF, ORIGINAL_TIMESTAMP)]
    ups += [(REPLAY_OF, f"{node}:{rec.offset}"), (ORIGINAL_TIMESTAMP, str(rec.timestamp))]
    p.UserProperty = ups
    return p


def _records(node, reader, start, end, topics, net=None):
    if net is None:
        for r in reader.records(start, end, topics):
            yield (r.timestamp, node, r.offset, r)
        return
    for rb in read_range(net, node, reader.urls, start, end, topics):
        for row in rb.to_pylist():
            r = NetRecord(row)
            yield (r.timestamp, node, r.offset, r)


class NetRecord:
    """A row the admin listener served (the source's schema) as replay uses a log Record."""

    __slots__ = ("offset", "timestamp", "topic", "qos", "retain", "payload", "properties")

    def __init__(self, row):
        self.offset = row["offset"]
        ts = row["timestamp"]
        self.timestamp = (ts - _EPOCH) // _US
        self.topic = row["topic"]
        self.qos = row["qos"]
        self.retain = row["retain"]
        self.payload = row["payload"]
        props = row["properties"]
        self.properties = None
        if props is not None:
            self.properties = {k: v for k, v in props.items() if v is not None and k != "user_properties"}
            if props.get("user_properties"):
                self.properties["user_property"] = [(u["key"], u["value"]) for u in props["user_properties"]]


def replay(o, console=None):
    """Run the replay; return a summary dict (messages, seconds, per node last offsets).
    Raises OptionError (ReplayRefused) before anything is published (check_options)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    check_options(o)
    topics = parse_topics(o.topics)
    host, port = _broker_address(o.broker)
    parts = plan(o)
    total = sum(e - s for _, _, s, e in parts)
    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5,
                    client_id=o.client_id or f"wrenmq-replay-{uuid.uuid4().hex[:8]}")
    if o.username is not None:
        c.username_pw_set(o.username, o.password)
    c.max_inflight_messages_set(max(1, min(o.window, 65535)))
    c.max_queued_messages_set(0)
    try:
        c.connect(host, port)
    except BaseException:
        for _, r, _, _ in parts:
            r.close()
        raise
    c.loop_start()
    sent = 0
    done = {n: s for n, _, s, _ in parts}
    pending = []
    t0 = time.monotonic()
    bar = task = None
    if not o.quiet:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        bar = Progress(TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("records"), TimeElapsedColumn(), TimeRemainingColumn(),
                       console=console or Console(stderr=True))
        bar.start()
        task = bar.add_task("replay", total=total)
    try:
        net = _source(o).net
        streams = [_records(n, r, s, e, topics, net) for n, r, s, e in parts]
        starts = {n: s for n, _, s, _ in parts}
        last_update = 0.0
        for ts, node, off, rec in heapq.merge(*streams, key=lambda x: (x[0], x[1], x[2])):
            topic = rec.topic
            if o.strip_prefix and topic.startswith(o.strip_prefix):
                topic = topic[len(o.strip_prefix):]
            topic = (o.prefix or "") + topic
            qos = rec.qos if o.qos is None else o.qos
            if o.rate:
                ahead = t0 + sent / o.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            info = c.publish(topic, rec.payload, qos=qos, retain=bool(rec.retain and o.keep_retain),
                             properties=_properties(rec, node, qos))
            if qos:
                pending.append(info)
                if len(pending) >= o.window:
                    pending.pop(0).wait_for_publish(60)
            sent += 1
            done[node] = off + 1
            if bar is not None:
                now = time.monotonic()
                if now - last_update > 0.2:
                    bar.update(task, completed=sum(done[n] - starts[n] for n in done))
                    last_update = now
        for info in pending:
            info.wait_for_publish(60)
        if bar is not None:
            bar.update(task, completed=total)
    finally:
        if bar is not None:
            bar.stop()
        c.disconnect()
        c.loop_stop()
        for _, r, _, _ in parts:
            r.close()
    secs = time.monotonic() - t0
    return {"messages": sent, "seconds": secs, "rate": sent / secs if secs else 0.0,
            "offsets": {n: done[n] for n in sorted(done)}}

"""`wrenmq pipeline JOB ...` and `wrenmq demo`: argument parsing only, Spark imported lazily
(so `wrenmq serve` never loads pyspark)."""

import argparse
import logging
import os
import sys

JOBS = ("archive", "topic-stats", "device-state", "usage", "replay")


def _conf(values):
    out = {}
    for v in values or ():
        k, sep, val = v.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--conf wants KEY=VALUE, got {v!r}")
        out[k.strip()] = val
    return out


def add_parsers(sub):
    p = sub.add_parser(
        "pipeline", help="run a Spark pipeline job over the commit log",
        description="Run a Spark job over the broker's commit log (see docs/PIPELINE.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="jobs:\n"
               "  archive       the log as a Parquet lake partitioned by date and topic prefix\n"
               "  topic-stats   per topic and window: messages, bytes, publishers, JSON field stats\n"
               "  device-state  latest message per topic, JSON payloads flattened to columns\n"
               "  usage         messages and bytes per client id per hour\n"
               "  replay        re-publish a range of the log to a broker (--broker; no Spark needed)\n")
    p.add_argument("job", choices=JOBS, metavar="JOB", help=" | ".join(JOBS))
    p.add_argument("--data-dir", metavar="DIR", help="the broker's data dir (default ./data); a cluster's nodes: several, comma separated")
    p.add_argument("--brokers", metavar="HOST:PORT,...",
                   help="read a running cluster over the network instead: its nodes' admin listeners "
                        "(any one is enough)")
    p.add_argument("--user", "-u", help="--brokers: a user of the admin listeners (readonly_users is enough)")
    p.add_argument("--password", "-P", help="--brokers: its password (or WRENMQ_PASSWORD)")
    p.add_argument("--token", help="--brokers: an admin API token instead (or WRENMQ_TOKEN)")
    p.add_argument("--cafile", metavar="FILE", help="--brokers: CA certificate(s) of HTTPS admin listeners")
    p.add_argument("--output", metavar="DIR", help="where the job writes (default ./lake/JOB)")
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint dir (default OUTPUT/_wrenmq/checkpoint)")
    p.add_argument("--master", metavar="URL", help="Spark master (default local[*])")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--once", dest="once", action="store_true", default=True,
                      help="process what the log holds now, then stop (default)")
    mode.add_argument("--continuous", dest="once", action="store_false",
                      help="keep running, one micro-batch per --trigger interval")
    p.add_argument("--trigger", metavar="INTERVAL", default="5 seconds",
                   help="micro-batch interval with --continuous (default '5 seconds')")
    p.add_argument("--duration", metavar="SECONDS", type=float,
                   help="with --continuous: stop after this many seconds")
    p.add_argument("--topics", metavar="FILTERS", help="MQTT topic filters, comma separated")
    p.add_argument("--starting-offsets", metavar="SPEC", help="earliest | latest | JSON {\"node\": offset}")
    p.add_argument("--starting-timestamp", metavar="TIME", help="ms since the epoch or ISO 8601")
    p.add_argument("--max-records-per-trigger", metavar="N", type=int,
                   help="at most N log records per micro-batch (default: all there are)")
    p.add_argument("--max-records-per-partition", metavar="N", type=int,
                   help="split a node's range into Spark partitions of at most N records (default 250000)")
    p.add_argument("--no-fail-on-data-loss", dest="fail_on_data_loss", action="store_false",
                   help="go on when records were deleted by retention before being read")
    p.add_argument("--conf", metavar="KEY=VALUE", action="append", help="extra Spark setting (repeatable)")
    p.add_argument("--ui", action="store_true", help="enable the Spark UI")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    g = p.add_argument_group("archive")
    g.add_argument("--topic-levels", metavar="N", type=int, default=1,
                   help="topic levels in the partition directory (default 1)")
    g = p.add_argument_group("topic-stats and usage")
    g.add_argument("--window", metavar="DURATION", help="window length (default '1 minute'; usage '1 hour')")
    g.add_argument("--watermark", metavar="DURATION",
                   help="lateness allowed (default '30 seconds'; usage '10 minutes')")
    g.add_argument("--field", metavar="NAME", action="append",
                   help="numeric JSON field for min/mean/max (repeatable, dotted paths; default 'value')")
    g.add_argument("--publish", action="store_true", help="topic-stats: publish results retained to --broker")
    g.add_argument("--publish-prefix", metavar="TOPIC", default="$analytics/topic-stats",
                   help="topic prefix of published stats (default $analytics/topic-stats)")
    g = p.add_argument_group("device-state")
    g.add_argument("--no-flatten", dest="flatten", action="store_false", help="keep payloads as bytes only")
    g = p.add_argument_group("replay")
    g.add_argument("--broker", metavar="HOST:PORT",
                   help="replay: the broker to re-publish to (required); topic-stats --publish: where "
                        "the stats go (default 127.0.0.1:1883)")
    g.add_argument("--from-offset", metavar="N|JSON",
                   help="first offset: one for every node, or JSON {\"node\": offset} (default: the log start)")
    g.add_argument("--to-offset", metavar="N|JSON", help="end offset, exclusive (default: the log end)")
    g.add_argument("--from-time", metavar="TIME", help="first record time: ms since the epoch or ISO 8601")
    g.add_argument("--to-time", metavar="TIME", help="end time, exclusive")
    g.add_argument("--prefix", metavar="PREFIX", default="", help="prepend to every topic, e.g. 'replay/'")
    g.add_argument("--strip-prefix", metavar="PREFIX", default="", help="remove from topics first")
    g.add_argument("--rate", metavar="MSG/S", type=float, default=0.0, help="0 = unlimited (default)")
    g.add_argument("--qos", type=int, choices=(0, 1, 2), help="override the original QoS")
    g.add_argument("--keep-retain", action="store_true", help="keep the original retain flags")
    g.add_argument("--same-topics", action="store_true",
                   help="replay into the broker that owns the log under the original topics (refused "
                        "otherwise: its subscribers get every message again, its log records each twice)")
    p.set_defaults(func=run_pipeline, pipeline_parser=p)

    d = sub.add_parser("demo", help="broker + simulated fleet + archive and topic-stats, for a minute")
    d.add_argument("--devices", type=int, default=200, metavar="N",
                   help="simulated devices, each its own MQTT connection (default 200)")
    d.add_argument("--seconds", type=float, default=60.0, metavar="S",
                   help="how long the fleet publishes and the jobs run (default 60)")
    d.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between a device's messages (default 1)")
    d.add_argument("--dir", metavar="DIR",
                   help="where the broker's data and the results go, kept after (default: a new temporary folder)")
    d.add_argument("--port", type=int, default=0, metavar="N", help="broker port (default: a free one)")
    d.add_argument("--master", metavar="URL", help="Spark master (default local[*])")
    d.set_defaults(func=run_demo)


def _source_args(args):
    """(data_dir, brokers, user, password, token, cafile) of the command line; the password
    and token may come from WRENMQ_PASSWORD and WRENMQ_TOKEN (not seen in `ps`)."""
    if args.brokers and args.data_dir:
        args.pipeline_parser.error("give --data-dir or --brokers, not both")
    if not args.brokers:
        for flag, value in (("--user", args.user), ("--password", args.password), ("--token", args.token),
                            ("--cafile", args.cafile)):
            if value is not None:
                args.pipeline_parser.error(f"{flag} goes with --brokers")
        return args.data_dir or "./data", None, None, None, None, None
    password = args.password if args.password is not None else \
        (os.environ.get("WRENMQ_PASSWORD") if args.user is not None else None)
    token = args.token or (os.environ.get("WRENMQ_TOKEN") if args.user is None else None)
    return None, args.brokers, args.user, password, token, args.cafile


def run_pipeline(args):
    logging.getLogger("wrenmq").setLevel(logging.WARNING)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    data_dir, brokers, user, password, token, cafile = _source_args(args)
    if args.job == "replay":
        if not args.broker:
            args.pipeline_parser.error("replay needs --broker HOST:PORT, the broker to re-publish to")
        return _replay(args, data_dir, brokers, user, password, token, cafile)
    from .common import OptionError
    from .jobs import JobOptions, run

    fields = []
    for f in args.field or ["value"]:
        fields += [x.strip() for x in f.split(",") if x.strip()]
    o = JobOptions(data_dir=data_dir or "./data", brokers=brokers, user=user, password=password, token=token,
                   cafile=cafile, output=args.output, checkpoint=args.checkpoint,
                   master=args.master, once=args.once, trigger=args.trigger, topics=args.topics,
                   starting_offsets=args.starting_offsets, starting_timestamp=args.starting_timestamp,
                   max_records_per_trigger=args.max_records_per_trigger,
                   max_records_per_partition=args.max_records_per_partition,
                   fail_on_data_loss=args.fail_on_data_loss, spark_conf=_conf(args.conf), ui=args.ui,
                   quiet=args.quiet, topic_levels=args.topic_levels, window=args.window,
                   watermark=args.watermark, fields=fields, publish=args.publish,
                   broker=args.broker or "127.0.0.1:1883",
                   publish_prefix=args.publish_prefix, flatten=args.flatten, duration=args.duration)
    try:
        return run(args.job, o)
    except OptionError as e:
        print(f"wrenmq pipeline {args.job}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a failed query: one readable line, not a JVM stack trace
        msg = str(e).strip().splitlines()
        print(f"wrenmq pipeline {args.job}: failed: {msg[0] if msg else type(e).__name__}", file=sys.stderr)
        if logging.getLogger("wrenmq").isEnabledFor(logging.DEBUG):
            raise
        return 1


def _replay(args, data_dir, brokers, user, password, token, cafile):
    from .common import OptionError
    from .replay import ReplayOptions, replay

    o = ReplayOptions(data_dir=data_dir or "./data", brokers=brokers, source_user=user, source_password=password,
                      source_token=token, cafile=cafile, broker=args.broker, topics=args.topics,
                      from_offset=args.from_offset, to_offset=args.to_offset, from_time=args.from_time,
                      to_time=args.to_time, prefix=args.prefix, strip_prefix=args.strip_prefix,
                      rate=args.rate, qos=args.qos, keep_retain=args.keep_retain, quiet=args.quiet,
                      same_topics=args.same_topics)
    try:
        r = replay(o)
    except OptionError as e:
        print(f"wrenmq pipeline replay: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"wrenmq pipeline replay: cannot reach the broker at {args.broker}: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"replayed {r['messages']} messages in {r['seconds']:.1f} s ({r['rate']:,.0f} msg/s)")
    return 0


def run_demo(args):
    from .demo import demo

    return demo(devices=args.devices, seconds=args.seconds, interval=args.interval, workdir=args.dir,
                port=args.port, master=args.master)

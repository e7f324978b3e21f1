"""The `wrenmq` command line."""

import argparse
import asyncio
import logging
import os
import signal
import sys

from . import __version__
from .config import LOG_LEVELS, ConfigError, ListenerConfig, load

log = logging.getLogger("wrenmq")


def _setup_logging(cfg):
    """[logging]: stderr or a file (rotated, reopened on SIGHUP), text or JSON lines
    (logfiles.py); returns the handler, None (after saying why) if the file cannot be opened."""
    from .logfiles import setup_logging
    try:
        return setup_logging(cfg.logging)
    except OSError as e:
        print(f"wrenmq: {cfg.source}: logging.file: cannot open {cfg.logging.file}: {e.strerror or e}",
              file=sys.stderr)
        return None


def _install_uvloop():
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def _serve(args):
    try:
        cfg = load(args.config) if args.config else load()
    except ConfigError as e:
        print(f"wrenmq: {e}", file=sys.stderr)
        return 2
    if args.bind is not None or args.port is not None:
        first = cfg.listener[0] if cfg.listener else ListenerConfig()
        if args.bind is not None:
            first.bind = args.bind
        if args.port is not None:
            first.port = args.port
        cfg.listener[0] = first
    if args.log_level:
        cfg.logging.level = args.log_level
    if args.data_dir is not None:
        cfg.storage.data_dir = args.data_dir
    log_handler = _setup_logging(cfg)
    if log_handler is None:
        return 2
    uv = _install_uvloop()
    log.info("wrenmq %s starting (config: %s, event loop: %s)", __version__, cfg.source,
             "uvloop" if uv else "asyncio")
    return asyncio.run(_run(cfg, log_handler))


async def _run(cfg, log_handler=None):
    from .assemble import build_node
    from .broker.hooks import HookError

    try:
        # With the [auth] hook, the [[hook]]s, [cluster], the bridges, the admin listener;
        # with [cluster] replicas > 1, the partitions' manager that runs that broker.
        broker = build_node(cfg)
    except (ConfigError, HookError) as e:  # e.g. a password or ACL file that cannot be used
        log.error("cannot start: %s", e)
        return 2
    loop = asyncio.get_running_loop()
    # Before the listeners open: a SIGTERM that comes as soon as the port answers (a
    # service manager, a test) must stop the broker cleanly, not kill it by default action.
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(signal, "SIGHUP"):
        from .logfiles import reopen

        def reload():
            if log_handler is not None:
                reopen(log_handler)  # first: what the reload logs goes to the new file
            broker.reload()
        loop.add_signal_handler(signal.SIGHUP, reload)
    from .auth.commands import remove_pid_file, write_pid_file
    from .cluster import ClusterError
    # The pid file before the listeners open, for the same reason: whoever sees the port
    # answer (and signals the broker through the file, as `wrenmq reload` does) finds it.
    pid_file = cfg.broker.pid_file
    if pid_file:
        try:
            write_pid_file(pid_file)
        except OSError as e:
            log.error("cannot write pid file %s: %s", pid_file, e)
            return 1
    try:
        await broker.start()
    except (OSError, ClusterError, HookError) as e:
        log.error("cannot start: %s", e)
        if pid_file:
            remove_pid_file(pid_file)
        return 1
    waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(broker.serve_forever())}
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    log.info("shutting down")
    await broker.stop()
    if pid_file:
        remove_pid_file(pid_file)
    return 1 if broker.failed is not None else 0


def _config_check(args):
    from .broker.hooks import HookError
    try:
        cfg = load(args.file)
        from .auth.hook import load_files
        load_files(cfg.auth.password_file, cfg.auth.acl_file)
        from .assemble import check_hooks
        check_hooks(cfg)
        from .bridge import bridge_extensions
        bridge_extensions(cfg)  # (loads the bridges' TLS files)
    except (ConfigError, HookError) as e:
        print(f"wrenmq: {e}", file=sys.stderr)
        return 2
    print(f"{args.file}: OK ({len(cfg.listener)} listener(s)" + (f", {len(cfg.bridge)} bridge(s))" if cfg.bridge else ")"))
    return 0


def _config_import(args):
    from .config_import import MosquittoImportError, import_mosquitto
    try:
        text, skipped = import_mosquitto(args.file)
    except MosquittoImportError as e:
        print(f"wrenmq: {e}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    print(f"{args.file}: imported; {len(skipped)} line(s) not carried over, listed at the top"
          + (f" of {args.output}" if args.output else ""), file=sys.stderr)
    return 0


def _config_docs(args):
    from .config_docs import config_markdown
    sys.stdout.write(config_markdown())
    return 0


def _cluster_status(args):
    try:
        cfg = load(args.config)
    except ConfigError as e:
        print(f"wrenmq: {e}", file=sys.stderr)
        return 2
    from .cluster.status import status_command
    return status_command(cfg, args.json)


def _cluster_reassign(args):
    try:
        cfg = load(args.config)
    except ConfigError as e:
        print(f"wrenmq: {e}", file=sys.stderr)
        return 2
    from .cluster.status import reassign_command
    return reassign_command(cfg, args.lost, args.new)


def build_parser():
    p = argparse.ArgumentParser(prog="wrenmq", description="MQTT broker with a durable commit log")
    p.add_argument("--version", action="version", version=f"wrenmq {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("serve", help="run the broker")
    s.add_argument("--config", metavar="FILE", help="TOML configuration file")
    s.add_argument("--bind", metavar="ADDR", help="address of the first listener")
    s.add_argument("--port", metavar="N", type=int, help="port of the first listener")
    s.add_argument("--data-dir", metavar="DIR", help="where persistent state lives")
    s.add_argument("--log-level", metavar="LEVEL", choices=LOG_LEVELS,
                   help=f"{', '.join(LOG_LEVELS)} (default: the configuration's [logging] level, info)")
    s.set_defaults(func=_serve)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION")
    cc = csub.add_parser("check", help="validate a configuration file")
    cc.add_argument("file", help="the TOML file")
    cc.set_defaults(func=_config_check)
    ci = csub.add_parser("import", help="print a Mosquitto configuration file as wrenmq's TOML")
    ci.add_argument("file", help="mosquitto.conf (its include_dir files are read too)")
    ci.add_argument("-o", "--output", metavar="FILE", help="write the TOML here instead of to stdout")
    ci.set_defaults(func=_config_import)
    cd = csub.add_parser("docs", help="print every setting as Markdown (docs/CONFIG.md)")
    cd.set_defaults(func=_config_docs)

    k = sub.add_parser("cluster", help="cluster tools")
    ksub = k.add_subparsers(dest="cluster_command", metavar="ACTION")
    ks = ksub.add_parser("status", help="the nodes etcd knows: link, filters, clients")
    ks.add_argument("--config", metavar="FILE", help="TOML configuration file (its [cluster] section)")
    ks.add_argument("--json", action="store_true", help="print JSON")
    ks.set_defaults(func=_cluster_status)
    kr = ksub.add_parser("reassign", help="move a lost node's partition replicas to another node "
                                          "([cluster] replicas > 1)")
    kr.add_argument("lost", help="the node lost for good (it must not be running)")
    kr.add_argument("new", help="the node that takes its replicas (running)")
    kr.add_argument("--config", metavar="FILE", help="TOML configuration file (its [cluster] section)")
    kr.set_defaults(func=_cluster_reassign)

    from .bridge.status import add_parser as add_bridge_parser
    add_bridge_parser(sub)

    from .auth.commands import add_passwd_parser, add_reload_parser
    add_passwd_parser(sub)
    add_reload_parser(sub)

    from .pipeline.cli import add_parsers as add_pipeline_parsers  # argparse only; Spark loads lazily
    add_pipeline_parsers(sub)

    from .store.cli import add_parser as add_log_parser
    add_log_parser(sub)

    from .admin.commands import add_parsers as add_admin_parsers  # admin token, top, bench
    add_admin_parsers(sub)
    return p


def main(argv=None):
    # gRPC (the etcd client) would print lines of its own for a failure that the cluster
    # code reports in its log anyway; GRPC_VERBOSITY set by the user still wins.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":
    sys.exit(main())

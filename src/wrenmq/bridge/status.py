"""`wrenmq bridge status`: the bridges of a running broker, from its $SYS tree.

It connects to the broker as an MQTT client (the first plain MQTT or Unix listener of
the config, or --host/--port), subscribes to $SYS/broker/bridge/#, and prints the
retained figures the broker publishes every [sys] interval seconds.
"""

import json
import os
import socket
import sys
import time

from ..config import ConfigError, load
from ..mqtt import constants as C
from ..mqtt.codec import Decoder, MQTTError, encode
from ..mqtt.packets import Connect, Subscribe, SubscribeTopic
from .manager import SYS_PREFIX

_COLUMNS = (("bridge", "name"), ("state", "state"), ("remote", "address"), ("client id", "client_id"),
            ("owner", "owner"), ("out", "messages/out"), ("in", "messages/in"),
            ("dropped", "messages/dropped"), ("denied", "messages/denied"), ("lag", "lag/records"),
            ("lag s", "lag/seconds"), ("connects", "connects"))


def add_parser(sub):
    b = sub.add_parser("bridge", help="bridge tools")
    bsub = b.add_subparsers(dest="bridge_command", metavar="ACTION")
    s = bsub.add_parser("status", help="each bridge of a running broker: state, remote, messages, lag")
    s.add_argument("--config", metavar="FILE", help="the broker's TOML configuration (where to connect)")
    s.add_argument("--host", metavar="ADDR", help="the broker's address (default: from the config, or 127.0.0.1)")
    s.add_argument("--port", metavar="N", type=int, help="its MQTT port (default: from the config, or 1883)")
    s.add_argument("--username", help="user name, if the broker asks for one")
    s.add_argument("--password", help="its password")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--wait", metavar="S", type=float, default=5.0, help="seconds to wait for the figures")
    s.set_defaults(func=status_command)


def _target(args):
    """(family, address) to connect to."""
    cfg = None
    if args.config:
        cfg = load(args.config)
    if args.host or args.port or cfg is None:
        return socket.AF_INET, (args.host or "127.0.0.1", args.port or 1883), cfg
    for lst in cfg.listener:
        if lst.type == "unix":
            return socket.AF_UNIX, lst.path, cfg
        if lst.type == "mqtt" and not lst.tls:
            host = "127.0.0.1" if lst.bind in ("0.0.0.0", "", "localhost") else ("::1" if lst.bind == "::" else lst.bind)
            return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, lst.port), cfg
    raise ConfigError(f"{cfg.source}: no plain MQTT or Unix listener to read $SYS from (give --host and --port)")


def read_figures(family, address, username=None, password=None, wait=5.0):
    """{bridge name: {figure: value}} from the broker's retained $SYS/broker/bridge/# messages."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(wait)
    sock.connect(address)
    try:
        sock.sendall(encode(Connect(f"wrenmq-bridge-status-{os.getpid()}", C.MQTT311, True, 30, None, username,
                                    password.encode() if password is not None else None), C.MQTT311))
        sock.sendall(encode(Subscribe(1, [SubscribeTopic(SYS_PREFIX + "#", 0)]), C.MQTT311))
        decoder = Decoder(C.MQTT311)
        figures = {}
        deadline = time.monotonic() + wait
        quiet = None  # once the SUBACK is in: retained messages come right after it
        while True:
            now = time.monotonic()
            end = min(deadline, quiet) if quiet is not None else deadline
            if now >= end:
                break
            sock.settimeout(end - now)
            try:
                data = sock.recv(65536)
            except socket.timeout:
                break
            if not data:
                raise ConnectionError("the broker closed the connection")
            for pkt in decoder.feed(data):
                if pkt.TYPE == C.CONNACK and pkt.reason_code:
                    raise ConnectionError(f"the broker refused the connection (return code {pkt.reason_code})")
                if pkt.TYPE == C.SUBACK:
                    if pkt.reason_codes and pkt.reason_codes[0] >= 0x80:
                        raise ConnectionError(f"the broker refused the subscription to {SYS_PREFIX}#")
                    quiet = time.monotonic() + 0.5
                elif pkt.TYPE == C.PUBLISH:
                    name, _, key = pkt.topic[len(SYS_PREFIX):].partition("/")
                    figures.setdefault(name, {"name": name})[key] = pkt.payload.decode("utf-8", "replace")
                    quiet = time.monotonic() + 0.3
        return figures
    finally:
        sock.close()


def status_command(args):
    try:
        family, address, cfg = _target(args)
    except ConfigError as e:
        print(f"wrenmq: {e}", file=sys.stderr)
        return 2
    where = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
    try:
        figures = read_figures(family, address, args.username, args.password, args.wait)
    except (OSError, MQTTError) as e:
        print(f"wrenmq: cannot read the bridges' $SYS figures from {where}: {e}", file=sys.stderr)
        return 1
    if cfg is not None:
        for b in cfg.bridge:  # (configured, not reported yet: shown as such)
            figures.setdefault(b.name, {"name": b.name, "state": "not reported"})
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
        return 0
    if not figures:
        print(f"no bridges reported by {where} (none configured, or [sys] interval = 0)")
        return 0
    rows = [[title for title, _ in _COLUMNS]]
    for name in sorted(figures):
        f = figures[name]
        rows.append([str(f.get(key, "")) or "-" for _, key in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0

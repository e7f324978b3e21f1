"""`wrenmq config import mosquitto.conf`: a Mosquitto configuration as wrenmq's TOML.

Listeners (TLS, WebSocket, Unix sockets), allow_anonymous, password_file and acl_file
(the same files: wrenmq reads Mosquitto's formats), persistence, the limits that have a
counterpart, and `connection` blocks as [[bridge]]s. Every directive that is not carried
over is listed in a comment at the top with its file, line and why; none is dropped
silently. Mosquitto's own defaults are written where wrenmq's differ (anonymous clients,
bridges' MQTT version and client id), so the result does what the file did.

Recognition and the directive table are `mosquitto_config`'s (shared with the message
`wrenmq serve` gives a Mosquitto file).
"""

import glob
import json
import os
import socket

from .mosquitto_config import DIRECTIVES, mosquitto_directives
from .mqtt.topics import filters_overlap


class MosquittoImportError(ValueError):
    """The file cannot be imported (the message says why)."""


_BRIDGE_KEYS = {
    "address", "addresses", "topic", "cleansession", "local_cleansession", "keepalive_interval",
    "idle_timeout", "local_clientid", "remote_clientid", "clientid", "local_username", "local_password",
    "remote_username", "remote_password", "username", "password", "notifications",
    "notifications_local_only", "notification_topic", "restart_timeout", "round_robin", "start_type",
    "threshold", "try_private",
}
_LISTENER_KEYS = {
    "protocol", "certfile", "keyfile", "cafile", "capath", "crlfile", "require_certificate",
    "use_identity_as_username", "use_subject_as_username", "tls_version", "socket_domain",
    "bind_interface", "http_dir", "mount_point", "ciphers", "ciphers_tls1.3", "dhparamfile",
    "tls_engine", "tls_engine_kpass_sha1", "tls_keyform", "psk_hint", "use_username_as_clientid",
    "accept_protocol_versions", "max_topic_alias",
}
# Why what is not carried over is not (where `mosquitto_config.DIRECTIVES` has no setting).
_WHY = {
    "log_dest": "wrenmq logs to stderr (a service manager keeps it)",
    "log_timestamp": "wrenmq's log lines always have one",
    "log_timestamp_format": "wrenmq's log lines have their own format",
    "log_facility": "wrenmq logs to stderr",
    "connection_messages": "wrenmq logs connects and disconnects at info",
    "user": "start wrenmq as the user it is to run as",
    "autosave_interval": "wrenmq writes state changes as they happen",
    "autosave_on_changes": "wrenmq writes state changes as they happen",
    "persistence_file": "the data dir holds wrenmq's state database and commit log",
    "memory_limit": "[limits] queue_memory, subscription_memory and will_memory each bound what they count",
    "set_tcp_nodelay": "wrenmq always sets it",
    "per_listener_settings": "one [auth] for every listener in wrenmq",
    "capath": "wrenmq takes one PEM file of CAs: concatenate the directory's into cafile",
    "notifications_local_only": "no connection-state messages; see $SYS/broker/bridge/<name>/state",
    "local_cleansession": "a bridge keeps no local session",
}
_LOG_LEVELS = {"debug": 0, "all": 0, "subscribe": 1, "unsubscribe": 1, "websockets": 1, "information": 1,
               "notice": 1, "warning": 2, "error": 3, "none": 4}
_LEVEL_NAMES = ("debug", "info", "warning", "error", "critical")
_SECTIONS = ("broker", "limits", "auth", "sys", "storage", "logging")


def _bool(v):
    if v.lower() in ("true", "1", "yes", "on"):
        return True
    if v.lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def _duration(v):
    """Mosquitto's persistent_client_expiration: <n>h, d, w, m (months) or y, in seconds."""
    units = {"h": 3600, "d": 86400, "w": 604800, "m": 2592000, "y": 31536000}
    if len(v) < 2 or v[-1] not in units or not v[:-1].isdigit():
        raise ValueError(f"expected a number and one of h, d, w, m, y, got {v!r}")
    return int(v[:-1]) * units[v[-1]]


class _Reader:
    """Lines of a Mosquitto file and of the files its include_dir names, in Mosquitto's order."""

    def __init__(self):
        self.lines = []  # (where, directive, args, text)
        self.notes = []
        self._seen = set()

    def read(self, path):
        real = os.path.realpath(path)
        if real in self._seen:
            return
        self._seen.add(real)
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError as e:
            raise MosquittoImportError(f"{path}: not UTF-8 text ({e})") from None
        except OSError as e:
            raise MosquittoImportError(f"{path}: cannot read: {e.strerror or e}") from None
        body = [ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if body and not mosquitto_directives(text):
            raise MosquittoImportError(f"{path}: does not read as a Mosquitto configuration file (its lines are not "
                               "mosquitto.conf directives); nothing to import")
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            words = line.split()
            where = f"{path}:{n}"
            if words[0] == "include_dir" and len(words) == 2:
                files = sorted(glob.glob(os.path.join(words[1], "*.conf")))
                self.notes.append(f"{where}: {line}: its {len(files)} .conf file(s) read in place")
                for f in files:
                    self.read(f)
                continue
            args = ["" if w == '""' else w for w in words[1:]]
            self.lines.append((where, words[0], args, line))


def import_mosquitto(path, hostname=None):
    """(the wrenmq TOML equivalent to the Mosquitto file at `path`, [(where, line, why) of
    each line not carried over]); MosquittoImportError if it cannot be read."""
    reader = _Reader()
    reader.read(path)
    conv = _Converter(reader.notes, hostname or socket.gethostname() or "localhost")
    for where, directive, args, text in reader.lines:
        conv.line(where, directive, args, text)
    return conv.toml(path), conv.skipped


class _Converter:
    def __init__(self, notes, hostname):
        self.skipped = []  # (where, text, why)
        self.notes = notes
        self.hostname = hostname
        self.sections = {s: {} for s in _SECTIONS}
        self.default = {}  # the default listener (port, bind_address, options before any `listener`)
        self.listeners = []
        self.current = None  # the listener the next listener options are for
        self.bridges = []
        self.bridge = None
        self.persistence = None
        self.log_level = None
        self.max_connections = []

    def skip(self, where, text, why=None):
        if why is None:
            target = DIRECTIVES.get(text.split()[0], "")
            if target.startswith("("):
                why = target.strip("()").removeprefix("none: ")
            else:
                why = f"set {target} by hand" if target else "no counterpart in wrenmq"
        self.skipped.append((where, text, why))

    # --- one line --------------------------------------------------------------------

    def line(self, where, d, args, text):
        try:
            self._line(where, d, args, text)
        except (ValueError, IndexError) as e:
            self.skip(where, text, f"not understood: {e}" if str(e) else "not understood")

    def _line(self, where, d, args, text):
        if d == "connection":
            name = args[0]
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
            self.bridge = {"name": safe, "_mosquitto_name": name, "_where": where, "topic": [], "_addresses": []}
            if safe != name:
                self.notes.append(f"{where}: bridge {name!r} is named {safe!r} (letters, digits, - _ . only)")
            self.bridges.append(self.bridge)
            return None
        if self.bridge is not None and (d in _BRIDGE_KEYS or d.startswith("bridge_")):
            return self._bridge_line(where, d, args, text)
        if d in _BRIDGE_KEYS or d.startswith("bridge_"):
            self.skip(where, text, "a bridge's setting outside any `connection` block")
            return False
        if d == "listener":
            lst = {"port": int(args[0])}
            if len(args) > 1:
                if lst["port"] == 0 or args[1].startswith("/"):
                    lst.update(type="unix", path=args[1])
                    del lst["port"]
                else:
                    lst["bind"] = args[1]
            self.listeners.append(lst)
            self.current = lst
            return None
        if d == "port":
            self.default["port"] = int(args[0])
            return None
        if d == "bind_address":
            self.default["bind"] = args[0]
            return None
        if d in _LISTENER_KEYS:
            return self._listener_line(where, d, args, text, self.current if self.current is not None else self.default)
        return self._general_line(where, d, args, text)

    def _listener_line(self, where, d, args, text, lst):
        v = args[0] if args else ""
        if d == "protocol":
            if v == "websockets":
                lst["type"] = "ws"
                self.notes.append(f"{where}: WebSocket clients connect on path /mqtt (Mosquitto took any path; "
                                  "set the listener's path for another)")
            elif v != "mqtt":
                raise ValueError(f"unknown protocol {v!r}")
        elif d in ("certfile", "keyfile", "cafile", "crlfile"):
            lst[d] = v
            if d == "certfile":
                lst["tls"] = True
        elif d in ("require_certificate", "use_identity_as_username"):
            lst[d] = _bool(v)
        elif d == "tls_version":
            if v not in ("tlsv1.2", "tlsv1.3"):
                self.skip(where, text, "wrenmq takes TLS 1.2 and later only (min_tls_version)")
                return False
            lst["min_tls_version"] = v[-3:]
        elif d == "socket_domain":
            lst["_domain"] = v
        elif d == "max_topic_alias":
            self.sections["limits"]["topic_alias_maximum"] = int(v)
        else:
            self.skip(where, text)
            return False
        return None

    def _general_line(self, where, d, args, text):
        v = args[0] if args else ""
        s = self.sections
        simple = {
            "max_inflight_messages": ("limits", "max_inflight", lambda x: int(x) or 65535),
            "max_inflight_bytes": ("limits", "max_inflight_bytes", int),
            "max_queued_messages": ("limits", "max_queued_messages", lambda x: int(x) or 10_000_000),
            "max_queued_bytes": ("limits", "max_queued_bytes", int),
            "max_keepalive": ("limits", "max_keepalive", lambda x: min(max(int(x), 1), 65535)),
            "max_qos": ("broker", "maximum_qos", int),
            "retain_available": ("broker", "retain_available", _bool),
            "queue_qos0_messages": ("broker", "queue_qos0_messages", _bool),
            "sys_interval": ("sys", "interval", float),
            "pid_file": ("broker", "pid_file", str),
            "password_file": ("auth", "password_file", str),
            "acl_file": ("auth", "acl_file", str),
            "allow_anonymous": ("auth", "allow_anonymous", _bool),
            "persistence_location": ("storage", "data_dir", str),
            "persistent_client_expiration": ("limits", "max_session_expiry", _duration),
        }
        if d in simple:
            section, key, conv = simple[d]
            s[section][key] = conv(v)
            return None
        if d in ("max_packet_size", "message_size_limit"):
            size = int(v)
            if d == "message_size_limit":
                size += 65536 + 5  # (a payload limit; the packet also carries the topic and properties)
                self.notes.append(f"{where}: message_size_limit bounds payloads; wrenmq bounds whole packets "
                                  f"([limits] max_packet_size = {size}, the payload plus room for the rest)")
            if size:
                s["limits"]["max_packet_size"] = max(64, min(size, 268435460))
            return None
        if d == "max_connections":
            n = int(v)
            self.max_connections.append(0 if n < 0 else n)
            return None
        if d == "per_listener_settings" and not _bool(v):
            return None  # (one [auth] for every listener: what wrenmq does)
        if d == "persistence":
            self.persistence = _bool(v)
            return None
        if d == "log_type":
            level = _LOG_LEVELS.get(v)
            if level is None:
                raise ValueError(f"unknown log type {v!r}")
            self.log_level = level if self.log_level is None else min(self.log_level, level)
            return None
        if d in DIRECTIVES or d.startswith(("plugin_opt_", "auth_opt_")):
            self.skip(where, text, _WHY.get(d))
        else:
            self.skip(where, text, "not a directive of mosquitto.conf(5)")
        return False

    def _bridge_line(self, where, d, args, text):
        b = self.bridge
        v = args[0] if args else ""
        if d in ("address", "addresses"):
            for a in args:
                host, sep, port = a.rpartition(":") if not a.startswith("[") or "]:" in a else (a, "", "")
                b["_addresses"].append(a if sep and port.isdigit() else f"{a}:1883")
        elif d == "topic":
            pattern = args[0]
            direction = args[1] if len(args) > 1 else "out"
            if direction not in ("in", "out", "both"):
                raise ValueError(f"direction {direction!r}")
            t = {"pattern": pattern, "direction": direction, "qos": int(args[2]) if len(args) > 2 else 0}
            if len(args) > 3:
                t["local_prefix"] = args[3]
            if len(args) > 4:
                t["remote_prefix"] = args[4]
            if direction in ("out", "both") and (t.get("local_prefix", "") + pattern).startswith("$"):
                self.skip(where, text, "wrenmq's bridges send from the commit log, which has no $ topics")
                return False
            b["topic"].append(t)
        elif d == "bridge_protocol_version":
            if v not in ("mqttv50", "mqttv311", "mqttv31"):
                raise ValueError(f"unknown version {v!r}")
            b["protocol"] = "5" if v == "mqttv50" else "3.1.1"
            if v == "mqttv31":
                self.notes.append(f"{where}: bridge {b['name']} speaks MQTT 3.1.1 (wrenmq has no 3.1 client)")
        elif d in ("remote_clientid", "clientid"):
            b["client_id"] = v
        elif d in ("remote_username", "username"):
            b["username"] = v
        elif d in ("remote_password", "password"):
            b["password"] = v
        elif d == "cleansession":
            b["clean_start"] = _bool(v)
        elif d == "keepalive_interval":
            b["keepalive"] = max(1, int(v))
        elif d in ("bridge_cafile", "bridge_certfile", "bridge_keyfile"):
            b[d[len("bridge_"):]] = v
            b["tls"] = True
        elif d == "local_username":
            b["local_username"] = v
        elif d in ("bridge_insecure", "notifications") and not _bool(v):
            pass  # (what wrenmq does: host names checked, no notification messages)
        elif d == "restart_timeout":
            b["reconnect_delay"] = float(args[0])
            b["reconnect_max"] = float(args[1] if len(args) > 1 else args[0])
        else:
            self.skip(where, text, _WHY.get(d))
            return False
        return None

    # --- the result ----------------------------------------------------------------------

    def _listeners(self):
        out = []
        default = self.default
        if default.get("port") or any(k != "port" for k in default):
            lst = {"port": default.get("port", 1883), **{k: v for k, v in default.items() if k != "port"}}
            out.append(lst)
        out += self.listeners
        local_only = not out
        if local_only:
            out = [{"port": 1883, "bind": "127.0.0.1"}]
            self.notes.append("no listener in the file: Mosquitto 2 listens on localhost:1883 only (and takes "
                              "anonymous clients there); so does this")
        for lst in out:
            if "bind" not in lst and lst.get("type") != "unix":
                lst["bind"] = "::" if lst.pop("_domain", "") == "ipv6" else "0.0.0.0"
            lst.pop("_domain", None)
        return out, local_only

    def toml(self, path):
        listeners, local_only = self._listeners()
        s = self.sections
        auth = s["auth"]
        if "allow_anonymous" not in auth and not local_only:
            auth["allow_anonymous"] = False
            self.notes.append("allow_anonymous is not set: Mosquitto 2 then refuses clients without a user "
                              "name, and so does this (allow_anonymous = false)")
        if self.max_connections:
            s["limits"]["max_connections"] = max(self.max_connections) if all(self.max_connections) else 0
            if len(self.max_connections) > 1:
                self.notes.append("max_connections: wrenmq has one bound for the broker, not one per listener "
                                  "(the largest is taken)")
        if "max_packet_size" not in s["limits"]:
            self.notes.append("Mosquitto takes packets of up to 256 MB unless told; wrenmq 1 MiB ([limits] "
                              "max_packet_size): raise it if clients send larger messages")
        if self.log_level is not None:
            s["logging"]["level"] = _LEVEL_NAMES[self.log_level]
        bridges = self._bridges()
        sends = any(t["direction"] != "in" for b in bridges for t in b["topic"])
        if self.persistence:
            if "data_dir" not in s["storage"]:
                self.notes.append("persistence_location is not set: Mosquitto wrote mosquitto.db in its working "
                                  "directory; wrenmq keeps its data in ./data (set [storage] data_dir)")
        elif sends:
            self.notes.append("persistence was off, but bridges send from the commit log, so the broker keeps "
                              "one on disk ([storage] mode = \"disk\")")
        else:
            s["storage"]["mode"] = "memory"
            s["storage"].pop("data_dir", None)
        out = [f"# wrenmq configuration imported from {path} by `wrenmq config import`.",
               "# Check it with `wrenmq config check`; docs/CONFIG.md lists every key."]
        if self.skipped:
            out.append("#")
            out.append("# Not carried over (no counterpart in wrenmq, or it does the job its own way):")
            for where, text, why in self.skipped:
                out.append(f"#   {where}: {text}  -- {why}")
        if self.notes:
            out.append("#")
            out.append("# Notes:")
            for note in self.notes:
                out.append(f"#   {note}")
        for lst in listeners:
            out.append("")
            out.append("[[listener]]")
            out += [f"{k} = {_value(v)}" for k, v in lst.items()]
        for name in _SECTIONS:
            if s[name]:
                out.append("")
                out.append(f"[{name}]")
                out += [f"{k} = {_value(v)}" for k, v in s[name].items()]
        for b in bridges:
            out.append("")
            out.append("[[bridge]]")
            topics = b.pop("topic")
            out += [f"{k} = {_value(v)}" for k, v in b.items() if not k.startswith("_")]
            for t in topics:
                out.append("[[bridge.topic]]")
                out += [f"{k} = {_value(v)}" for k, v in t.items()]
        return "\n".join(out) + "\n"

    def _bridges(self):
        out = []
        for b in self.bridges:
            if not b["_addresses"]:
                self.skipped.append((b["_where"], f"connection {b['_mosquitto_name']}", "no address: not imported"))
                continue
            if not b["topic"]:
                self.skipped.append((b["_where"], f"connection {b['_mosquitto_name']}",
                                     "no topic wrenmq can carry: not imported"))
                continue
            bridge = {"name": b["name"], "address": b["_addresses"] if len(b["_addresses"]) > 1 else b["_addresses"][0]}
            protocol = b.pop("protocol", "3.1.1")  # (Mosquitto's default)
            if protocol == "3.1.1" and _echoes(b["topic"]):
                protocol = "5"
                self.notes.append(f"{b['_where']}: bridge {b['name']} speaks MQTT 5, not 3.1.1 (where Mosquitto "
                                  "relies on try_private): what it sends and what it brings in overlap on the "
                                  "remote, and only MQTT 5's no-local keeps its own messages from coming back")
            bridge["protocol"] = protocol
            if "client_id" not in b:
                b["client_id"] = f"{self.hostname}.{b['_mosquitto_name']}"  # (Mosquitto's default)
            for k, v in b.items():
                if k not in ("name", "_addresses", "topic") and not k.startswith("_"):
                    bridge[k] = v
            bridge["topic"] = b["topic"]
            out.append(bridge)
        return out


def _echoes(topics):
    """Whether what goes out and what comes in overlap on the remote."""
    outs = [t.get("remote_prefix", "") + t["pattern"] for t in topics if t["direction"] != "in"]
    ins = [t.get("remote_prefix", "") + t["pattern"] for t in topics if t["direction"] != "out"]
    return any(filters_overlap(a, b) for a in outs for b in ins)


def _value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=False)

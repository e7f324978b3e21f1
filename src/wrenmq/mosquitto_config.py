"""Mosquitto's configuration files: recognised, and mapped to wrenmq's settings.

People coming from Mosquitto give `wrenmq serve --config` their `mosquitto.conf`. TOML
cannot parse it ("Expected '='"), which says nothing useful; `mosquitto_directives`
recognises such a file by the directives it uses, and `mosquitto_message` says what it is
and where each directive goes. `DIRECTIVES` is that mapping, one entry per directive of
mosquitto.conf(5); docs/CONFIG.md prints it ("Coming from Mosquitto"), and
`wrenmq config import` (config_import.py) converts a file with the same table and the
same recognition.
"""

# Mosquitto directive -> the wrenmq setting that does its job ("" = none: wrenmq has no
# counterpart, or does it always, as the note says).
DIRECTIVES = {
    # listeners
    "listener": "`[[listener]]` `port` and `bind` (`listener 8883 0.0.0.0` is port 8883, bind \"0.0.0.0\")",
    "port": "`[[listener]]` `port`",
    "bind_address": "`[[listener]]` `bind`",
    "bind_interface": "`[[listener]]` `bind` (the interface's address)",
    "socket_domain": "`[[listener]]` `bind` (\"0.0.0.0\": IPv4, \"::\": IPv6)",
    "protocol": "`[[listener]]` `type` (`mqtt`; `websockets` is \"ws\")",
    "http_dir": "",
    "mount_point": "",
    "accept_protocol_versions": "",
    "max_connections": "`[limits]` `max_connections` (one bound for the broker, not per listener)",
    "use_username_as_clientid": "",
    "max_qos": "`[broker]` `maximum_qos`",
    "max_topic_alias": "`[limits]` `topic_alias_maximum`",
    # TLS
    "certfile": "`[[listener]]` `certfile`, with `tls = true`",
    "keyfile": "`[[listener]]` `keyfile`",
    "cafile": "`[[listener]]` `cafile`",
    "capath": "`[[listener]]` `cafile` (one PEM file of the CAs)",
    "crlfile": "`[[listener]]` `crlfile`",
    "require_certificate": "`[[listener]]` `require_certificate`",
    "use_identity_as_username": "`[[listener]]` `use_identity_as_username`",
    "use_subject_as_username": "",
    "tls_version": "`[[listener]]` `min_tls_version`",
    "ciphers": "",
    "ciphers_tls1.3": "",
    "dhparamfile": "",
    "tls_engine": "",
    "tls_keyform": "",
    "psk_hint": "",
    "psk_file": "",
    # authentication and access
    "allow_anonymous": "`[auth]` `allow_anonymous`",
    "password_file": "`[auth]` `password_file` (the same file: `mosquitto_passwd` and `wrenmq passwd` write it)",
    "acl_file": "`[auth]` `acl_file` (the same file)",
    "per_listener_settings": "(none: one `[auth]` for every listener)",
    "auth_plugin": "(a Python hook, `wrenmq.Hook`)",
    "plugin": "(a Python hook, `wrenmq.Hook`)",
    "global_plugin": "(a Python hook, `wrenmq.Hook`)",
    "allow_zero_length_clientid": "",
    "auto_id_prefix": "",
    "clientid_prefixes": "",
    # persistence
    "persistence": "`[storage]` `mode` (\"disk\", the default, or \"memory\")",
    "persistence_location": "`[storage]` `data_dir`",
    "persistence_file": "(none: the data dir holds the state database and the commit log)",
    "autosave_interval": "`[storage]` `checkpoint_interval_ms` (state changes are written as they happen)",
    "autosave_on_changes": "",
    "persistent_client_expiration": "`[limits]` `max_session_expiry`",
    # limits
    "max_inflight_messages": "`[limits]` `max_inflight`",
    "max_inflight_bytes": "`[limits]` `max_inflight_bytes`",
    "max_queued_messages": "`[limits]` `max_queued_messages`",
    "max_queued_bytes": "`[limits]` `max_queued_bytes`",
    "max_packet_size": "`[limits]` `max_packet_size`",
    "message_size_limit": "`[limits]` `max_packet_size`",
    "max_keepalive": "`[limits]` `max_keepalive`",
    "memory_limit": "`[limits]` `queue_memory`, `subscription_memory`, `will_memory` (each bounded)",
    "queue_qos0_messages": "`[broker]` `queue_qos0_messages`",
    "retain_available": "`[broker]` `retain_available`",
    "upgrade_outgoing_qos": "",
    "check_retain_source": "",
    "allow_duplicate_messages": "",
    "set_tcp_nodelay": "(none: always on)",
    # the process and its logs
    "sys_interval": "`[sys]` `interval`",
    "pid_file": "`[broker]` `pid_file`",
    "user": "(none: start wrenmq as the user it is to run as)",
    "include_dir": "(none: one file)",
    "log_type": "`[logging]` `level`",
    "log_dest": "(none: wrenmq logs to stderr)",
    "log_facility": "",
    "log_timestamp": "(none: always)",
    "log_timestamp_format": "",
    "connection_messages": "(none: connects and disconnects are logged at `info`)",
    "websockets_log_level": "",
    "websockets_headers_size": "",
    # bridges
    "connection": "`[[bridge]]` `name` (docs/BRIDGE.md)",
    "address": "`[[bridge]]` `address` (the port defaults to 1883)",
    "addresses": "`[[bridge]]` `address` (a list: tried in turn)",
    "topic": "`[[bridge.topic]]` `pattern`, `direction`, `qos`, `local_prefix`, `remote_prefix`",
    "bridge_protocol_version": "`[[bridge]]` `protocol` (\"5\" or \"3.1.1\")",
    "bridge_cafile": "`[[bridge]]` `cafile`, with `tls = true`",
    "bridge_capath": "`[[bridge]]` `cafile` (one PEM file of the CAs)",
    "bridge_certfile": "`[[bridge]]` `certfile`, with `tls = true`",
    "bridge_keyfile": "`[[bridge]]` `keyfile`",
    "bridge_insecure": "(none: the remote's host name is always checked)",
    "cleansession": "`[[bridge]]` `clean_start`",
    "keepalive_interval": "`[[bridge]]` `keepalive`",
    "idle_timeout": "(none: a bridge stays connected)",
    "local_clientid": "(none: a bridge publishes here as `$bridge/<name>`)",
    "local_username": "`[[bridge]]` `local_username` (the ACL's user for what comes in)",
    "local_password": "(none: a bridge does not log in here)",
    "remote_clientid": "`[[bridge]]` `client_id`",
    "remote_username": "`[[bridge]]` `username`",
    "remote_password": "`[[bridge]]` `password`",
    "notifications": "(none: `$SYS/broker/bridge/<name>/state` says whether it is connected)",
    "notification_topic": "(none: `$SYS/broker/bridge/<name>/state` says whether it is connected)",
    "restart_timeout": "`[[bridge]]` `reconnect_delay`, `reconnect_max`",
    "round_robin": "(none: the addresses are tried in turn)",
    "start_type": "(none: a bridge is always started)",
    "threshold": "",
    "try_private": "(none: MQTT 5 no-local keeps a bridge's own messages from coming back)",
}

# The command that converts a Mosquitto file to wrenmq's TOML (the message names it).
CONVERT_COMMAND = "wrenmq config import"


def _directive(line):
    """The directive a Mosquitto line starts with, or None if the line is not one (a TOML
    line: a table header or `key = value`)."""
    if line.startswith("[") or "=" in line.split("#", 1)[0]:
        return None
    word = line.split(None, 1)[0]
    if word in DIRECTIVES or word.startswith(("plugin_opt_", "auth_opt_", "bridge_")):
        return word
    return None


def mosquitto_directives(text):
    """The Mosquitto directives `text` uses (in order of first use) if it reads as a
    Mosquitto configuration file, else [].

    Recognised by what it says, not by TOML failing on it: at least half of its lines
    that are not blank or `#` comments start with a directive of mosquitto.conf(5)
    (`listener 1883`, `allow_anonymous true`, ...) without an `=`, and none is a TOML
    table header. A TOML file with a typo is not taken for one."""
    found = []
    lines = known = 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            return []
        lines += 1
        word = _directive(line)
        if word is not None:
            known += 1
            if word not in found:
                found.append(word)
    return found if known and known * 2 >= lines else []


def mosquitto_message(src, directives):
    """What to tell someone who gave the Mosquitto file `src` (which uses `directives`)
    where wrenmq's TOML is expected."""
    shown = ", ".join(directives[:8]) + (", ..." if len(directives) > 8 else "")
    head = f"{src}: this is a Mosquitto configuration file ({shown}), not wrenmq's TOML. "
    if CONVERT_COMMAND:
        return head + (f"Convert it with `{CONVERT_COMMAND} {src}`; docs/CONFIG.md (\"Coming from "
                       f"Mosquitto\") says where each directive goes.")
    return head + ("Write the TOML with docs/CONFIG.md's table \"Coming from Mosquitto\", which names "
                   "the wrenmq setting of each directive (password and ACL files are used as they are).")


def mapping_markdown():
    """DIRECTIVES as the Markdown table of docs/CONFIG.md."""
    out = ["| Mosquitto | wrenmq |", "|---|---|"]
    for name, target in DIRECTIVES.items():
        out.append(f"| `{name}` | {target or '(none)'} |")
    return "\n".join(out)

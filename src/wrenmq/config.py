"""Configuration: TOML in, validated dataclasses out.

Every key is declared here once, with its type, default, bounds and a one-line
description (docs/CONFIG.md lists the same keys). Loading rejects unknown keys
and wrong types with a single line naming the file, the key and what was
expected, so a typo never starts a broker with a silently ignored setting.
"""

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import get_args, get_origin

from .mosquitto_config import mosquitto_directives, mosquitto_message
from .mqtt.topics import TopicError, filter_covers, filters_overlap, validate_topic_filter


class ConfigError(ValueError):
    pass


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _key(default, doc, lo=None, hi=None, choices=None, one_or_many=False):
    # one_or_many: a list key that also takes a single string (address = "h:p" or ["h:p", ...]).
    meta = {"doc": doc, "lo": lo, "hi": hi, "choices": choices, "one_or_many": one_or_many}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ListenerConfig:
    type: str = _key("mqtt", "\"mqtt\": MQTT over TCP; \"ws\": MQTT over WebSocket (subprotocol mqtt); "
                     "\"unix\": MQTT over a Unix domain socket at `path` (local tools); "
                     "\"metrics\": no MQTT, the $SYS figures for Prometheus over HTTP (GET `path`), and a "
                     "health probe (GET /health); \"admin\": no MQTT, the admin HTTP API under /api/v1/, "
                     "the live dashboard at /, and /metrics and /health as a metrics listener has "
                     "(docs/ADMIN.md).",
                     choices=("mqtt", "ws", "unix", "metrics", "admin"))
    bind: str = _key("127.0.0.1", "Address to listen on; 0.0.0.0 or :: for all interfaces.")
    port: int = _key(1883, "TCP port; 0 picks a free port.", 0, 65535)
    name: str = _key("", "Name used in logs and $SYS; defaults to bind:port (unix: unix:path).")
    path: str = _key("", "ws: the HTTP path clients connect to (empty = /mqtt; other paths get 404); "
                     "metrics: the HTTP path of the figures (empty = /metrics); "
                     "unix: the socket file (required).")
    mode: str = _key("0600", "unix: file mode of the socket (octal), e.g. \"0660\" to let the group in.")
    tls: bool = _key(False, "Serve TLS (mqtt: MQTT over TLS, ws: wss://, metrics and admin: HTTPS); "
                     "needs certfile.")
    certfile: str = _key("", "PEM server certificate (chain); with tls. Reloaded on SIGHUP.")
    keyfile: str = _key("", "PEM private key of certfile; empty if certfile holds the key too.")
    cafile: str = _key("", "PEM CA certificate(s) that sign client certificates.")
    require_certificate: bool = _key(False, "Refuse TLS clients without a certificate signed by cafile.")
    use_identity_as_username: bool = _key(False, "Use the client certificate's CN as the user name "
                                          "(needs require_certificate; the CONNECT's user name and "
                                          "password are ignored).")
    crlfile: str = _key("", "PEM certificate revocation list(s) of cafile: revoked client certificates "
                        "are refused. Reloaded on SIGHUP.")
    min_tls_version: str = _key("1.2", "Oldest TLS version accepted.", choices=("1.2", "1.3"))
    origins: list = _key([], "ws: allowed browser origins (e.g. \"https://app.example.com\"); a "
                         "request with another Origin header gets 403. Clients that send none "
                         "(non-browsers) are let in. Empty = any origin.")
    users: list = _key([], "metrics: user names of [auth] password_file that may read the figures, "
                       "with HTTP Basic authentication (Prometheus: basic_auth); others get 401. "
                       "Empty = no password asked. admin: the users (HTTP Basic) who may read and "
                       "change everything the API and the dashboard offer.")
    readonly_users: list = _key([], "admin: user names of [auth] password_file who may read (GET) the "
                                "API and the dashboard but change nothing (403).")
    token_file: str = _key("", "admin: the API tokens file `wrenmq admin token` writes (hashes only; "
                           "re-read when it changes). Requests send a token as "
                           "`Authorization: Bearer <token>`; a token is read-write or read-only.")
    anonymous: str = _key("none", "admin: what a request without credentials may do: \"none\" "
                          "(401), \"read\" (GET only) or \"write\" (everything). Other than "
                          "\"none\" only on a listener bound to a loopback address.",
                          choices=("none", "read", "write"))
    proxy_protocol: bool = _key(False, "mqtt, ws: every connection starts with a PROXY protocol v1 or v2 "
                                "header (HAProxy, AWS NLB, nginx behind a load balancer); the client's "
                                "address it gives is the one logs, hooks and the limits see. A connection "
                                "without one, or with a malformed one, is closed. Only for listeners that "
                                "the proxy alone can reach.")

    @property
    def label(self):
        """How logs name this listener."""
        if self.name:
            return self.name
        if self.type == "unix":
            return f"unix:{self.path}"
        return f"{self.bind}:{self.port}"

    @property
    def loopback_only(self):
        if self.type == "unix":
            return True
        try:
            return ipaddress.ip_address(self.bind).is_loopback
        except ValueError:
            return self.bind == "localhost"


@dataclass
class BrokerSection:
    node_id: str = _key("", "Name of this node (logs, $SYS, log partitions); defaults to the host name.")
    maximum_qos: int = _key(2, "Highest QoS granted to subscriptions and accepted on PUBLISH.", 0, 2)
    retain_available: bool = _key(True, "Whether retained messages are supported.")
    wildcard_subscriptions: bool = _key(True, "Whether '+' and '#' filters are allowed.")
    shared_subscriptions: bool = _key(True, "Whether $share/<group>/<filter> is allowed.")
    subscription_identifiers: bool = _key(True, "Whether MQTT 5 subscription identifiers are allowed.")
    queue_qos0_messages: bool = _key(False, "Queue QoS 0 messages for offline persistent sessions.")
    pid_file: str = _key("", "`wrenmq serve` writes its process id here before its listeners open "
                         "(and removes it on exit); it does not start if the file names a wrenmq "
                         "that is running. `wrenmq reload --config` signals that process. "
                         "Empty = no pid file.")


@dataclass
class LimitsSection:
    max_keepalive: int = _key(65535, "Largest keepalive (s) accepted; 5.0 clients asking more "
                              "(or 0) get this as server keep alive, 3.1.1 clients are refused.", 1, 65535)
    max_packet_size: int = _key(1048576, "Largest packet (bytes) accepted from a client (told to 5.0 "
                                "clients in CONNACK). A larger one closes the connection (5.0: "
                                "DISCONNECT 0x95) and is logged with its size once per client id. "
                                "Mosquitto accepts up to the protocol's 268435455 (256 MB); the bound "
                                "keeps what one packet can make the broker buffer.", 64, 268435460)
    receive_maximum: int = _key(1024, "In-flight QoS 1/2 PUBLISHes a 5.0 client may send unacknowledged "
                                 "(told in CONNACK; past it DISCONNECT 0x93). A 3.1.1 client, which is "
                                 "not told, may hold as many QoS 2 PUBLISHes without PUBREL; past it "
                                 "its connection closes.", 1, 65535)
    max_inflight: int = _key(1024, "In-flight QoS 1/2 messages the broker sends to one client.", 1, 65535)
    max_queued_messages: int = _key(10000, "Messages queued per session beyond the in-flight window; "
                                    "further messages are dropped and counted, unless the commit log "
                                    "holds them. The retained messages a SUBSCRIBE matches are not "
                                    "held to it (queue_memory bounds them).", 0, 10_000_000)
    max_connections: int = _key(100000, "Simultaneous client connections, counted from their accept (TLS and "
                                         "WebSocket handshakes included); 0 = no limit.", 0)
    topic_alias_maximum: int = _key(64, "Topic aliases a 5.0 client may use towards the broker.", 0, 65535)
    max_session_expiry: int = _key(4294967295, "Cap (s) on session expiry; 4294967295 = no cap.", 0, 4294967295)
    max_message_expiry: int = _key(0, "Cap (s) on message expiry, applied to every message; 0 = no cap.", 0, 4294967295)
    connect_timeout: float = _key(10.0, "Seconds a new connection has to send CONNECT (and finish TLS, WebSocket "
                                  "and authentication). A CONNECT whose session another cluster node hands "
                                  "over waits for that, within the cluster's bound (docs/CLUSTER.md).", 0.1, 3600)
    max_topic_levels: int = _key(128, "Levels allowed in a topic name or filter.", 1, 65535)
    write_buffer_high: int = _key(1048576, "Bytes buffered for one slow client before QoS 0 is dropped "
                                  "and its reading paused.", 4096)
    max_topic_length: int = _key(65535, "Bytes allowed in a topic name or filter.", 1, 65535)
    max_subscriptions: int = _key(10000, "Subscriptions one client may hold (5.0 SUBACK 0x97 beyond); "
                                  "0 = no limit.", 0)
    publish_rate: float = _key(0.0, "PUBLISH packets per second one client may send on average "
                               "(bursts of one second allowed); 0 = no limit.", 0)
    publish_byte_rate: float = _key(0.0, "PUBLISH bytes per second one client may send on average "
                                    "(bursts of one second allowed); 0 = no limit.", 0)
    rate_limit_action: str = _key("throttle", "Over a rate limit: \"throttle\" holds the client's further "
                                  "packets and stops reading it until it is back under (nothing is lost); "
                                  "\"disconnect\" closes it (5.0: DISCONNECT 0x96).",
                                  choices=("throttle", "disconnect"))
    connection_rate: float = _key(0.0, "New connections per second accepted on each listener (bursts "
                                  "of one second allowed); beyond it they are closed at once. 0 = no limit.", 0)
    max_queued_bytes: int = _key(67108864, "Bytes of messages queued for one session (offline or "
                                 "behind its window); beyond it like max_queued_messages, and like it "
                                 "not applied to the retained messages a SUBSCRIBE matches. 0 = no limit.", 0)
    max_inflight_bytes: int = _key(16777216, "Bytes of unacknowledged QoS 1/2 messages sent to one "
                                   "client; further messages wait in its queue. 0 = no limit.", 0)
    max_sessions: int = _key(1000000, "Sessions held, connected or not; past it a CONNECT that would "
                             "start a new session that outlives its connection (session expiry > 0, "
                             "3.1.1 clean session 0) is refused (5.0 CONNACK 0x97, 3.1.1 0x03). "
                             "0 = no limit.", 0)
    max_client_id_length: int = _key(1024, "Bytes a client id may have (MQTT allows 65,535; each session "
                                     "keeps its id, and each message it publishes carries it into the "
                                     "commit log); longer ones are refused (5.0 CONNACK 0x85, 3.1.1 0x02). "
                                     "0 = no limit.", 0, 65535)
    max_retained_messages: int = _key(1000000, "Retained messages from clients held; beyond it a client's "
                                      "retained PUBLISH to a new topic is delivered but not retained "
                                      "(counted, logged). 0 = no limit.", 0)
    max_retained_bytes: int = _key(1073741824, "Memory the clients' retained messages may take, in "
                                   "bytes: each message (payload, topic, about 400 bytes of objects "
                                   "and what its properties take) and the nodes of the retained tree "
                                   "(about 200 bytes and the topic levels each; one or two per topic, "
                                   "however deep). A retained PUBLISH that would take them past it is "
                                   "delivered but not retained, and its topic keeps what it had. "
                                   "0 = no limit.", 0)
    queue_memory: int = _key(1073741824, "Memory the queues of all sessions may take, in bytes: each "
                             "queued message counted once however many queues hold it (payload, "
                             "topic, about 400 bytes of objects and what its MQTT 5 properties take), 128 "
                             "bytes per queue entry, and 8 bytes per node the walk of a SUBSCRIBE's retained "
                             "messages still holds. Beyond it new messages for queues are dropped (and counted) "
                             "unless the commit log holds them. 0 = no limit.", 0)
    subscription_memory: int = _key(2147483648, "Memory the subscriptions of all sessions may take, in "
                                    "bytes, counted as 550 bytes of objects per subscription plus twice "
                                    "its filter's length. Beyond it a SUBSCRIBE to a filter the session "
                                    "does not have yet is refused (5.0 SUBACK 0x97, 3.1.1 0x80), counted "
                                    "and logged; sessions restored at start or handed over by another "
                                    "node keep all theirs. 0 = no limit.", 0)
    will_memory: int = _key(268435456, "Memory the wills of offline sessions waiting out their will "
                            "delay may take, in bytes (payload, topic, what the will's properties "
                            "take and about 650 bytes of objects and timer each). Past it the will of a client that goes is published at once "
                            "instead of after its delay (counted and logged); wills of sessions "
                            "restored at start are all kept. 0 = no limit.", 0)
    max_queued_offline: int = _key(1000, "With the commit log on (storage mode \"disk\"): QoS 1/2 "
                                   "messages an offline persistent session keeps in memory (one whose "
                                   "client left while behind lets go of the newest of a longer queue); the "
                                   "later ones stay in the log, and the session reads them from there "
                                   "when its client is back (none is dropped). At most "
                                   "max_queued_messages. 0 = max_queued_messages.", 0, 10_000_000)


@dataclass
class AuthHttpSection:
    url: str = _key("", "Ask this HTTP service about logins the password file does not decide, with "
                    "EMQX's HTTP authentication contract (docs/SECURITY.md); empty = off. Needs "
                    "`pip install 'wrenmq[http]'`.")
    timeout: float = _key(5.0, "Seconds an answer may take; later counts as the service being down.", 0.05, 60)
    on_error: str = _key("deny", "When the service is down, answers late or with something else than "
                         "200/204: \"deny\" refuses the login (0x86/0x87 as for a wrong password), "
                         "\"ignore\" asks the next source (custom hooks, then the anonymous policy).",
                         choices=("deny", "ignore"))
    cache_seconds: float = _key(60.0, "How long an answer (allow, deny, ignore) is reused for the same "
                                "client id, user name, password, address and listener; 0 = no cache.", 0, 86400)
    cache_size: int = _key(100000, "Answers kept at most (the oldest go first).", 1, 10_000_000)
    headers: dict = _key({}, "Extra HTTP headers sent with each request ([auth.http.headers] table, "
                         "e.g. an Authorization token for the service).")


@dataclass
class AuthJwtSection:
    secret: str = _key("", "Shared secret of HS256/HS384/HS512 tokens. One of secret, public_key and "
                       "jwks_url turns JWT logins on: a password that is a JWT is verified. Needs "
                       "`pip install 'wrenmq[jwt]'` (and 'wrenmq[http]' for jwks_url).")
    public_key: str = _key("", "PEM file of the public key of RS256/ES256 (RS*, PS*, ES*, EdDSA) tokens.")
    jwks_url: str = _key("", "URL of a JSON Web Key Set (an identity provider's jwks_uri): tokens are "
                         "verified by the key their `kid` names; the set is fetched at start and again "
                         "every jwks_refresh seconds, or sooner for an unknown kid.")
    jwks_refresh: float = _key(300.0, "Seconds between fetches of jwks_url.", 1, 86400)
    algorithms: list = _key([], "Algorithms accepted; empty = those of the key given (HS* for secret, "
                            "RS*/PS*/ES*/EdDSA for public_key and jwks_url).")
    username_claim: str = _key("", "Claim whose value becomes the client's user name (what the ACL file, "
                               "logs and hooks see), e.g. \"sub\"; empty = the CONNECT's user name.")
    acl_claim: str = _key("acl", "Claim with the client's publish/subscribe rules, in EMQX's formats "
                          "(docs/SECURITY.md); empty = none read.")
    audience: str = _key("", "Required `aud` claim; empty = not checked.")
    issuer: str = _key("", "Required `iss` claim; empty = not checked.")
    require_exp: bool = _key(True, "Refuse tokens without an `exp` (expiry) claim. The connection of a "
                             "client whose token expires is closed then (5.0: DISCONNECT 0x87).")
    leeway: float = _key(0.0, "Seconds of clock skew allowed when checking exp and nbf.", 0, 3600)


@dataclass
class AuthSection:
    # None = the key is not set (TOML has no null): decided per listener.
    allow_anonymous: bool = _key(None, "Accept clients that send no user name. Not set (shown as "
                                 "None): refused everywhere when password_file is set (as in "
                                 "Mosquitto); without one, accepted on listeners bound to a loopback "
                                 "address only and refused on every other listener. true or false: "
                                 "on every listener.")
    password_file: str = _key("", "Mosquitto-format password file ($6$/$7$ entries, written by "
                              "`wrenmq passwd` or `mosquitto_passwd`); empty = no password check.")
    acl_file: str = _key("", "Mosquitto-format ACL file (user/topic/pattern); empty = no ACL.")
    failed_login_delay: float = _key(1.0, "Seconds before a refused login (wrong password, unknown "
                                     "user) gets its CONNACK; other clients are not held.", 0, 60)
    http: AuthHttpSection = field(default_factory=AuthHttpSection)
    jwt: AuthJwtSection = field(default_factory=AuthJwtSection)


@dataclass
class StorageSection:
    mode: str = _key("disk", "\"disk\": commit log and session state under data_dir; \"memory\": "
                     "nothing survives a restart (tests, embedding).", choices=("disk", "memory"))
    data_dir: str = _key("./data", "Where the commit log (log/) and the state database (state.db) live.")
    fsync: str = _key("always", "\"always\": PUBACK/PUBREC/SUBACK leave only after what they confirm is "
                      "fsynced; \"interval\": only after it is written (a kill -9 of the broker loses "
                      "nothing acknowledged), fsync every fsync_interval_ms (a crash of the machine "
                      "can lose that window); \"never\": written, the fsync left to the OS.",
                      choices=("always", "interval", "never"))
    fsync_interval_ms: int = _key(100, "Period of fsync under fsync = \"interval\".", 1, 60000)
    checkpoint_interval_ms: int = _key(1000, "How often session cursors are saved (a crash redelivers "
                                       "at most this much QoS 1 traffic, never loses any).", 10, 600000)
    max_unwritten_bytes: int = _key(16777216, "Messages accepted but not yet written to the log, at most "
                                    "(bytes): past it, publishers are read again only once the writer "
                                    "has caught up, so a slow disk slows them instead of filling memory. "
                                    "After a flood the broker keeps about this much of written epochs' "
                                    "record buffers for reuse.",
                                    65536)
    min_free_bytes: int = _key(67108864, "Free space the filesystem of data_dir keeps (bytes; 0 = no "
                               "check). Below it the broker takes no new messages rather than run "
                               "the disk full: QoS 1/2 PUBLISHes are refused (MQTT 5: PUBACK/PUBREC "
                               "0x97 quota exceeded; 3.1.1, which has no refusal, closes the "
                               "connection unacknowledged, so the client sends it again later), "
                               "QoS 0 ones are delivered live but not recorded in the log. It "
                               "takes them again once an eighth more than this is free (at most 64 MiB more).", 0)


@dataclass
class LogSection:
    enabled: bool = _key(True, "Record accepted PUBLISHes in the commit log.")
    topics: list = _key(["#"], "MQTT filters of the topics recorded ($SYS is never recorded).")
    segment_bytes: int = _key(67108864, "Size at which a new segment file is started.", 4096)
    index_interval_bytes: int = _key(4096, "Bytes of log between two sparse index entries.", 64)
    direct_io: bool = _key(False, "Write the log's whole 4 KiB blocks with O_DIRECT where the filesystem "
                           "allows it (the partial last block goes through the page cache): the "
                           "device copies the bytes, not the CPU, and the log does not fill the page "
                           "cache. Pays off for sustained floods of large payloads where new "
                           "page-cache pages are dear (docs/BENCHMARKS.md); readers of recent "
                           "records then read them from the disk.")
    retention_bytes: int = _key(0, "Delete the oldest segments while the log is larger (0 = no size limit).", 0)
    retention_hours: float = _key(168.0, "Delete segments whose newest record is older (0 = keep forever).", 0)
    retention_check_interval: float = _key(30.0, "Seconds between retention checks.", 0.1, 86400)
    retention_hard_bytes: int = _key(0, "Above this size segments go even if persistent sessions still "
                                     "need them (the loss is counted); 0 = never.", 0)


@dataclass
class ClusterSection:
    enabled: bool = _key(False, "Join other nodes through etcd to form one broker (docs/CLUSTER.md).")
    name: str = _key("wrenmq", "Cluster name: nodes with the same name and etcd form one broker "
                     "(keys under /wrenmq/<name>/).")
    node: str = _key("", "This node's name, unique in the cluster; empty = <hostname>-<first listener port>.")
    etcd: list = _key(["127.0.0.1:2379"], "etcd endpoints (host:port), one per member of the etcd "
                      "cluster: the node uses the first that answers, and goes on to the next ones in "
                      "turn when the member it uses is lost.")
    etcd_username: str = _key("", "etcd user, when etcd has authentication on (the user needs read and "
                              "write on /wrenmq/<name>/ and leases).")
    etcd_password: str = _key("", "That user's password.")
    etcd_tls: bool = _key(False, "Talk to etcd over TLS (etcd started with --cert-file; its "
                          "certificate must name the host of each etcd endpoint).")
    etcd_cafile: str = _key("", "etcd_tls: PEM CA certificate(s) that sign etcd's certificate; empty = "
                            "the CAs gRPC trusts by default.")
    etcd_certfile: str = _key("", "etcd_tls: this node's PEM client certificate (chain), for an etcd "
                              "started with --client-cert-auth.")
    etcd_keyfile: str = _key("", "etcd_tls: the private key of etcd_certfile; empty if etcd_certfile "
                             "holds the key too.")
    etcd_timeout: float = _key(5.0, "Seconds an etcd request may take before the node counts etcd "
                               "as unreachable.", 0.1, 300)
    lease_ttl: int = _key(10, "Seconds a node that stops answering stays in the cluster (its etcd "
                          "lease); its subscriptions and clients go with it.", 2, 3600)
    bind: str = _key("127.0.0.1", "Address the node-to-node link listens on.")
    port: int = _key(1884, "Port of the node-to-node link; 0 picks a free port.", 0, 65535)
    advertise: str = _key("", "host:port the other nodes connect to; empty = bind:port (set it when "
                          "bind is 0.0.0.0 or ::).")
    secret: str = _key("", "Shared by every node: a link that does not present it is closed.")
    tls: bool = _key(False, "Links over mutual TLS: each node presents certfile and accepts only "
                     "nodes whose certificate cafile signed (and, connecting, whose certificate "
                     "names the host of its advertise address). Without it links are plain TCP: "
                     "keep them on a private network.")
    certfile: str = _key("", "tls: this node's PEM certificate (chain), for both ends of its links.")
    keyfile: str = _key("", "tls: its private key; empty if certfile holds the key too.")
    cafile: str = _key("", "tls: PEM CA certificate(s) that sign the nodes' certificates.")
    link_buffer: int = _key(67108864, "Bytes waiting for one other node, at most (a slow or dead node "
                            "cannot fill this one's memory): past it, what the commit log records "
                            "waits there and is replayed once the link drains or comes back; other "
                            "messages for that node are dropped and counted.", 65536)
    replicas: int = _key(1, "Nodes that keep each node's commit log and sessions (docs/CLUSTER.md, high "
                         "availability); 1: the node alone. More needs [storage] mode = \"disk\".", 1, 16)
    min_insync: int = _key(1, "With replicas > 1: replicas (the leader included) that must hold a QoS 1/2 "
                           "message durably before it is acknowledged; with fewer in sync such PUBLISHes "
                           "are refused (MQTT 5: reason 0x83, 3.1.1: the connection is closed).", 1, 16)
    replica_lag_ms: int = _key(10000, "With replicas > 1: a follower that has not caught up with its "
                               "leader for this long leaves the in-sync set (never below min_insync "
                               "members), and no longer counts as in sync for the refusal above.",
                               100, 3_600_000)
    replica_heartbeat_ms: int = _key(500, "With replicas > 1: a follower's fetch with nothing to read is "
                                     "answered after this long (it carries the high watermark).", 10, 60_000)
    replica_fetch_timeout_ms: int = _key(3000, "With replicas > 1: a follower sends its fetch again when "
                                         "no answer came for this long (more than replica_heartbeat_ms).",
                                         100, 600_000)


@dataclass
class SysSection:
    interval: float = _key(10.0, "Seconds between $SYS updates; 0 disables them.", 0)


@dataclass
class LoggingSection:
    level: str = _key("info", "Log level.", choices=LOG_LEVELS)
    file: str = _key("", "Write the log to this file instead of stderr (appended to). SIGHUP reopens it, "
                     "so logrotate's `postrotate` can send one (or use max_bytes).")
    max_bytes: int = _key(0, "Rotate the file when a line would take it past this size: FILE becomes "
                          "FILE.1, FILE.1 FILE.2, ... up to backup_count; 0 = never.", 0)
    backup_count: int = _key(5, "Rotated files kept (with max_bytes).", 0, 1000)
    format: str = _key("text", "\"text\": one line per event; \"json\": one JSON object per line "
                       "(ts, level, logger, msg, and the event's fields such as client_id, address, "
                       "event).", choices=("text", "json"))


@dataclass
class HookConfig:
    module: str = _key("", "The hook class, as \"package.module:ClassName\" (a subclass of "
                       "wrenmq.broker.hooks.Hook). Required.")
    path: str = _key("", "A directory put first on the import path for it (relative paths: from the "
                     "config file's directory); empty = the usual import path.")
    options: dict = _key({}, "[hook.options]: a table passed to the class as keyword arguments.")


WEBHOOK_EVENTS = ("client.connected", "client.disconnected", "session.subscribed",
                  "session.unsubscribed", "message.publish", "message.dropped")


@dataclass
class WebhookConfig:
    url: str = _key("", "Where the events are POSTed (http:// or https://), as a JSON array per "
                    "request. Required. Needs `pip install 'wrenmq[http]'`.")
    name: str = _key("", "Name in $SYS, the metrics and logs; defaults to webhook<N> (its place in the file).")
    events: list = _key(["client.connected", "client.disconnected"], "Events sent, of: "
                        + ", ".join(WEBHOOK_EVENTS) + ".")
    topics: list = _key(["#"], "MQTT filters: message.publish and message.dropped are sent for "
                        "matching topics only ($SYS never).")
    payload: str = _key("base64", "How message payloads are put in the JSON: \"base64\", \"text\" "
                        "(UTF-8, undecodable bytes replaced) or \"none\" (left out).",
                        choices=("base64", "text", "none"))
    headers: dict = _key({}, "Extra HTTP headers ([webhook.headers] table).")
    batch_size: int = _key(100, "Events per request at most.", 1, 10000)
    batch_delay: float = _key(0.2, "Seconds an event may wait for others to fill its batch.", 0, 60)
    max_queued: int = _key(10000, "Events held while the receiver is slow or down; past it new events "
                           "are dropped and counted.", 1, 10_000_000)
    max_queued_bytes: int = _key(67108864, "Bytes of message payloads those events hold, at most (the "
                                 "messages are shared with the broker, not copied); past it like "
                                 "max_queued.", 1024)
    timeout: float = _key(5.0, "Seconds a request may take.", 0.05, 300)
    retries: int = _key(5, "Times a failed batch is sent again (after retry_delay, doubled each time "
                        "up to 30 s) before it is dropped and counted.", 0, 1000)
    retry_delay: float = _key(0.5, "Seconds before the first retry.", 0.01, 600)


@dataclass
class BridgeTopicConfig:
    pattern: str = _key("", "MQTT filter of the topics carried, between the prefixes (Mosquitto's `topic "
                        "pattern direction qos local-prefix remote-prefix`): local topic = local_prefix + "
                        "topic, remote topic = remote_prefix + topic. Empty: the prefixes are the whole "
                        "topic on each side.")
    direction: str = _key("out", "\"out\": local -> remote (read from the commit log at the bridge's "
                          "cursor); \"in\": remote -> local (a subscription on the remote); \"both\".",
                          choices=("in", "out", "both"))
    qos: int = _key(1, "Highest QoS used on the remote: messages out go at the lower of theirs and this; "
                    "the subscription of \"in\" asks for it.", 0, 2)
    local_prefix: str = _key("", "Prefix of the local topics (no wildcards), e.g. \"from-cloud/\".")
    remote_prefix: str = _key("", "Prefix of the remote topics (no wildcards), e.g. \"site1/\".")


@dataclass
class BridgeConfig:
    name: str = _key("", "Unique name of the bridge (letters, digits, - _ .): in $SYS, the metrics and "
                     "logs, and its cursor's name in the state database. Required.")
    address: list = _key([], "host:port of the remote broker (\"[::1]:1883\" for IPv6); a list is tried "
                         "in turn, one address per connection attempt. Required.", one_or_many=True)
    protocol: str = _key("5", "MQTT version spoken to the remote: \"5\" (no-local keeps messages the "
                         "bridge publishes from coming back) or \"3.1.1\".", choices=("5", "3.1.1"))
    client_id: str = _key("", "Client id on the remote; empty = <node id>-<name> (in a cluster "
                          "<cluster name>-<name>: the remote session moves with the bridge).")
    username: str = _key("", "User name on the remote; empty = none.")
    password: str = _key("", "Password on the remote (with username).")
    clean_start: bool = _key(False, "Start a new remote session at each connect. False keeps it across "
                             "reconnects, so what the remote holds for \"in\" topics while the link is "
                             "down arrives when it is back.")
    keepalive: int = _key(60, "Seconds between PINGREQs when nothing else is sent; a remote silent for "
                          "1.5 times this is taken as gone and the bridge reconnects.", 1, 65535)
    tls: bool = _key(False, "Connect over TLS (the remote's certificate is verified, and its host name).")
    cafile: str = _key("", "tls: PEM CA certificate(s) that sign the remote's certificate; empty = the "
                       "system's CAs.")
    certfile: str = _key("", "tls: PEM client certificate (chain) presented to the remote.")
    keyfile: str = _key("", "tls: private key of certfile; empty if certfile holds the key too.")
    local_username: str = _key("", "User name the messages coming in are published under locally: "
                               "[auth] acl_file's rules for it decide what the bridge may publish here "
                               "(empty: the rules for clients without a user name).")
    max_inflight: int = _key(256, "QoS 1/2 messages sent to the remote and not yet acknowledged, at most "
                             "(the remote's receive maximum lowers it).", 1, 65535)
    reconnect_delay: float = _key(1.0, "Seconds before the first reconnect; doubled at each failure "
                                  "up to reconnect_max.", 0.01, 3600)
    reconnect_max: float = _key(60.0, "Longest wait between reconnects, in seconds.", 0.01, 86400)
    topic: list = _key([], "What the bridge carries: [[bridge.topic]] tables (at least one).")


@dataclass
class Config:
    listener: list = _key([], "Listeners ([[listener]] tables); one on 127.0.0.1:1883 when none is given.")
    broker: BrokerSection = field(default_factory=BrokerSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    auth: AuthSection = field(default_factory=AuthSection)
    sys: SysSection = field(default_factory=SysSection)
    storage: StorageSection = field(default_factory=StorageSection)
    log: LogSection = field(default_factory=LogSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    bridge: list = _key([], "Bridges to other brokers ([[bridge]] tables, docs/BRIDGE.md).")
    hook: list = _key([], "Hooks loaded by `wrenmq serve`, in order ([[hook]] tables).")
    webhook: list = _key([], "HTTP endpoints told of client and message events ([[webhook]] tables).")
    source: str = field(default="<defaults>", metadata={"internal": True})

    def __post_init__(self):
        if not self.listener:
            self.listener = [ListenerConfig()]


# Arrays of tables: [[listener]], [[bridge]], [[hook]], [[webhook]] at the top,
# [[bridge.topic]] in a bridge.
LIST_TYPES = {"listener": ListenerConfig, "bridge": BridgeConfig, "hook": HookConfig,
               "webhook": WebhookConfig}
NESTED_LIST_TYPES = {(BridgeConfig, "topic"): BridgeTopicConfig}
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _describe(value):
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"{type(value).__name__} {value!r}"


def _check_value(src, path, f, value):
    typ = f.type
    meta = f.metadata
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{src}: {path}: expected an integer, got {_describe(value)}")
    if typ is not int and not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
        raise ConfigError(f"{src}: {path}: expected {_TYPE_NAMES.get(typ, typ)}, got {_describe(value)}")
    lo, hi, choices = meta.get("lo"), meta.get("hi"), meta.get("choices")
    if typ is float and (math.isnan(value) or (math.isinf(value) and hi is None)):
        raise ConfigError(f"{src}: {path}: expected a finite number, got {value}")
    if lo is not None and value < lo:
        raise ConfigError(f"{src}: {path}: expected a value >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{src}: {path}: expected a value <= {hi}, got {value}")
    if choices and value not in choices:
        raise ConfigError(f"{src}: {path}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _build(cls, data, src, prefix):
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        f = fields.get(key)
        if f is None:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{src}: {path}: unknown key (known here: {known})")
        table_cls = LIST_TYPES.get(key) if cls is Config else NESTED_LIST_TYPES.get((cls, key))
        if table_cls is not None:
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                table = f"{prefix.rstrip('.').split('[')[0]}.{key}" if prefix else key
                raise ConfigError(f"{src}: {path}: expected an array of tables ([[{table}]]), got {_describe(value)}")
            kwargs[key] = [_build(table_cls, v, src, f"{path}[{i}].") for i, v in enumerate(value)]
        elif dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            if not isinstance(value, dict):
                raise ConfigError(f"{src}: {path}: expected a table ([{path}]), got {_describe(value)}")
            kwargs[key] = _build(f.default_factory, value, src, f"{path}.")
        elif f.type is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"{src}: {path}: expected a table, got {_describe(value)}")
            kwargs[key] = dict(value)
        elif get_origin(f.type) is list or f.type is list:
            if f.metadata.get("one_or_many") and isinstance(value, str):
                value = [value]
            item = (get_args(f.type) or (str,))[0]
            if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
                raise ConfigError(f"{src}: {path}: expected an array of {_TYPE_NAMES.get(item, item)}s, got {_describe(value)}")
            kwargs[key] = list(value)
        else:
            kwargs[key] = _check_value(src, path, f, value)
    return cls(**kwargs)


def _validate_listener(src, i, lst):
    def fail(key, msg):
        raise ConfigError(f"{src}: listener[{i}].{key}: {msg}")

    if lst.type == "unix":
        if not lst.path:
            fail("path", "required for type = \"unix\" (the socket file)")
        if lst.tls:
            fail("tls", "not supported for type = \"unix\"")
        if not lst.name:
            lst.name = lst.label  # connections and hooks name the listener after it: unix:PATH
    elif lst.type in ("ws", "metrics"):
        if lst.path and not lst.path.startswith("/"):
            fail("path", f"expected an HTTP path starting with '/', got {lst.path!r}")
    elif lst.path:
        fail("path", "only for type = \"ws\", \"metrics\" or \"unix\"")
    if lst.type in ("metrics", "admin") and lst.use_identity_as_username:
        fail("use_identity_as_username", f"not for type = \"{lst.type}\" (no MQTT user there)")
    if lst.origins and lst.type != "ws":
        fail("origins", "only for type = \"ws\"")
    if lst.users and lst.type not in ("metrics", "admin"):
        fail("users", "only for type = \"metrics\" or \"admin\" (MQTT clients log in with [auth] "
                      "password_file)")
    _validate_admin(fail, lst)
    for origin in lst.origins:
        if "://" not in origin:
            fail("origins", f"expected origins like \"https://host[:port]\", got {origin!r}")
    try:
        mode = int(lst.mode, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        fail("mode", f"expected an octal file mode such as \"0660\", got {lst.mode!r}")
    if lst.tls and not lst.certfile:
        fail("certfile", "required when tls = true")
    _check_tls_files(fail, lst, "tls", ("certfile", "keyfile", "cafile", "crlfile"))
    if not lst.tls:
        for key in ("require_certificate", "use_identity_as_username"):
            if getattr(lst, key):
                fail(key, "only used with tls = true (is tls missing?)")
        return
    if lst.require_certificate and not lst.cafile:
        fail("cafile", "required when require_certificate = true (the CA of the client certificates)")
    if lst.use_identity_as_username and not lst.require_certificate:
        fail("use_identity_as_username", "needs require_certificate = true")
    if lst.crlfile and not lst.cafile:
        fail("crlfile", "needs cafile (the CA whose revocations it lists)")


def _validate_admin(fail, lst):
    """The keys of an admin listener: only there, and at least one way in."""
    if lst.type != "admin":
        for key in ("readonly_users", "token_file"):
            if getattr(lst, key):
                fail(key, "only for type = \"admin\"")
        if lst.anonymous != "none":
            fail("anonymous", "only for type = \"admin\" (MQTT listeners: [auth] allow_anonymous)")
        return
    both = set(lst.users) & set(lst.readonly_users)
    if both:
        fail("readonly_users", f"{', '.join(sorted(both))} also in users (pick one)")
    if lst.anonymous != "none" and not lst.loopback_only:
        fail("anonymous", f"{lst.anonymous!r} only on a listener bound to a loopback address "
                          f"(this one binds {lst.bind!r}): elsewhere every request needs credentials")
    if lst.token_file and not os.path.isfile(lst.token_file):
        fail("token_file", f"file not found: {lst.token_file} (create it with `wrenmq admin token add "
                           f"NAME --file {lst.token_file}`)")
    if not (lst.users or lst.readonly_users or lst.token_file) and lst.anonymous == "none":
        fail("users", "an admin listener needs a way in: users, readonly_users (with [auth] "
                      "password_file), token_file, or anonymous on a loopback address")


def _check_tls_files(fail, section, flag, keys):
    """The files of a TLS setting (`section`.`flag`): each one given must exist while the
    flag is on, and none may be given while it is off."""
    on = getattr(section, flag)
    for key in keys:
        value = getattr(section, key)
        if value and not on:
            fail(key, f"only used with {flag} = true (is {flag} missing?)")
        if value and not os.path.isfile(value):
            fail(key, f"file not found: {value}")


def _validate_cluster(src, c, storage_mode):
    def fail(key, msg):
        raise ConfigError(f"{src}: cluster.{key}: {msg}")

    for key in ("name", "node"):
        value = getattr(c, key)
        if "/" in value or any(ord(ch) < 32 for ch in value):
            fail(key, f"no '/' or control characters, got {value!r}")
    if not c.name:
        fail("name", "must not be empty")
    if not c.etcd:
        fail("etcd", "at least one endpoint (host:port)")
    for ep in c.etcd + ([c.advertise] if c.advertise else []):
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            fail("etcd" if ep in c.etcd else "advertise", f"expected host:port, got {ep!r}")
    _check_tls_files(fail, c, "etcd_tls", ("etcd_cafile", "etcd_certfile", "etcd_keyfile"))
    if c.etcd_keyfile and not c.etcd_certfile:
        fail("etcd_keyfile", "needs etcd_certfile")
    if c.tls:
        for key in ("certfile", "cafile"):
            if not getattr(c, key):
                fail(key, "required when tls = true")
    _check_tls_files(fail, c, "tls", ("certfile", "keyfile", "cafile"))
    if c.enabled and not c.advertise and c.bind in ("0.0.0.0", "::", ""):
        fail("advertise", f"required when bind is {c.bind!r} (the address other nodes connect to)")
    if c.min_insync > c.replicas:
        fail("min_insync", f"{c.min_insync} is more than replicas ({c.replicas})")
    if c.replicas > 1:
        if c.replica_fetch_timeout_ms <= c.replica_heartbeat_ms:
            fail("replica_fetch_timeout_ms", f"must be more than replica_heartbeat_ms ({c.replica_heartbeat_ms})")
        for needed, what in ((c.enabled, "a cluster (enabled = true)"), (storage_mode == "disk", "[storage] mode "
                             "= \"disk\" (the replicas are copies of the commit log)")):
            if not needed:
                fail("replicas", f"{c.replicas} needs {what}")


_BRIDGE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _check_address(fail, key, address):
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(key, f"expected host:port, got {address!r}")


def _validate_bridges(cfg):
    """[[bridge]]: each key, and what the bridge needs of the rest of the file."""
    src = cfg.source
    names = set()
    for i, b in enumerate(cfg.bridge):
        def fail(key, msg, i=i):
            raise ConfigError(f"{src}: bridge[{i}].{key}: {msg}")

        if not b.name:
            fail("name", "required (the bridge's name in $SYS, the metrics and logs)")
        if not _BRIDGE_NAME.fullmatch(b.name):
            fail("name", f"letters, digits, '-', '_' and '.' only, got {b.name!r}")
        if b.name in names:
            fail("name", f"another bridge is called {b.name!r}")
        names.add(b.name)
        if not b.address:
            fail("address", "required: the remote broker's host:port")
        for a in b.address:
            _check_address(fail, "address", a)
        if len(b.client_id.encode()) > 65535:
            fail("client_id", "longer than MQTT's 65,535 bytes")
        if b.password and not b.username:
            fail("password", "needs username")
        _check_tls_files(fail, b, "tls", ("cafile", "certfile", "keyfile"))
        if b.keyfile and not b.certfile:
            fail("keyfile", "needs certfile")
        if b.reconnect_max < b.reconnect_delay:
            fail("reconnect_max", f"must be at least reconnect_delay ({b.reconnect_delay})")
        if not b.topic:
            fail("topic", "at least one [[bridge.topic]] (what the bridge carries)")
        outs, ins = [], []  # (remote filter, topic index)
        for j, t in enumerate(b.topic):
            def tfail(key, msg, j=j):
                fail(f"topic[{j}].{key}", msg)

            for key in ("local_prefix", "remote_prefix"):
                value = getattr(t, key)
                if "+" in value or "#" in value or "\0" in value:
                    tfail(key, f"no wildcards (+, #) in a prefix, got {value!r}")
            if not t.pattern and not (t.local_prefix and t.remote_prefix):
                tfail("pattern", "empty: then local_prefix and remote_prefix are the whole topics, and "
                      "both must be set")
            for key, flt in (("local_prefix", t.local_prefix + t.pattern),
                             ("remote_prefix", t.remote_prefix + t.pattern)):
                try:
                    validate_topic_filter(flt)
                except TopicError as e:
                    try:
                        if t.pattern:
                            validate_topic_filter(t.pattern)
                    except TopicError:
                        key = "pattern"
                    tfail(key, f"{flt!r} is not a valid topic filter ({e})")
            local = t.local_prefix + t.pattern
            if t.direction in ("out", "both"):
                if local.startswith("$SYS"):
                    tfail("pattern", f"{local!r}: $SYS topics are not in the commit log, which the "
                          "bridge sends from")
                if cfg.storage.mode != "disk" or not cfg.log.enabled:
                    tfail("direction", f"{t.direction!r} sends from the commit log: needs [storage] mode "
                          "= \"disk\" and [log] enabled = true")
                if not any(filter_covers(f, local) for f in cfg.log.topics):
                    tfail("pattern", f"{local!r} is not all recorded by [log] topics "
                          f"({', '.join(cfg.log.topics)}), and the bridge sends from the commit log")
                outs.append((t.remote_prefix + t.pattern, j))
            if t.direction in ("in", "both"):
                if local.startswith("$"):
                    tfail("local_prefix", f"{local!r}: local topics starting with '$' are the broker's own")
                ins.append((t.remote_prefix + t.pattern, j))
        if b.protocol == "3.1.1":
            for out, jo in outs:
                for flt, ji in ins:
                    if filters_overlap(out, flt):
                        key = f"topic[{max(jo, ji)}]." + ("direction" if jo == ji else "pattern")
                        fail(key, f"on the remote, what goes out ({out!r}) overlaps what comes in "
                             f"({flt!r}): MQTT 3.1.1 has no no-local, so the remote would send the bridge's "
                             "own messages back; use protocol = \"5\", or prefixes that keep them apart")


def _check_url(src, key, url):
    if not url.startswith(("http://", "https://")) or len(url) < 10:
        raise ConfigError(f"{src}: {key}: expected an http:// or https:// URL, got {url!r}")


def _check_headers(src, key, headers):
    for name, value in headers.items():
        if not isinstance(value, str):
            raise ConfigError(f"{src}: {key}.{name}: expected a string, got {_describe(value)}")


def _validate_extensions(cfg):
    """PROXY protocol, [[hook]], [auth.http], [auth.jwt] and [[webhook]]: what types alone
    cannot say."""
    src = cfg.source
    for i, lst in enumerate(cfg.listener):
        if lst.proxy_protocol and lst.type not in ("mqtt", "ws"):
            raise ConfigError(f"{src}: listener[{i}].proxy_protocol: only for type = \"mqtt\" or \"ws\"")
    for i, h in enumerate(cfg.hook):
        mod, sep, cls = h.module.partition(":")
        if not sep or not mod or not cls.isidentifier() or \
                not all(part.isidentifier() for part in mod.split(".")):
            raise ConfigError(f"{src}: hook[{i}].module: expected \"package.module:ClassName\", "
                              f"got {h.module!r}")
    http = cfg.auth.http
    if http.url:
        _check_url(src, "auth.http.url", http.url)
    _check_headers(src, "auth.http.headers", http.headers)
    jwt = cfg.auth.jwt
    keys = [k for k in ("secret", "public_key", "jwks_url") if getattr(jwt, k)]
    if len(keys) > 1:
        raise ConfigError(f"{src}: auth.jwt.{keys[1]}: only one of secret, public_key and jwks_url")
    if jwt.public_key and not os.path.isfile(jwt.public_key):
        raise ConfigError(f"{src}: auth.jwt.public_key: file not found: {jwt.public_key}")
    if jwt.jwks_url:
        _check_url(src, "auth.jwt.jwks_url", jwt.jwks_url)
    names = set()
    for i, w in enumerate(cfg.webhook):
        where = f"webhook[{i}]"
        if not w.url:
            raise ConfigError(f"{src}: {where}.url: required (where the events are POSTed)")
        _check_url(src, f"{where}.url", w.url)
        _check_headers(src, f"{where}.headers", w.headers)
        if not w.name:
            w.name = f"webhook{i}"
        if w.name in names or not w.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{src}: {where}.name: letters, digits, - and _, unique; got {w.name!r}")
        names.add(w.name)
        for e in w.events:
            if e not in WEBHOOK_EVENTS:
                raise ConfigError(f"{src}: {where}.events: {e!r} is not one of {', '.join(WEBHOOK_EVENTS)}")
        for f in w.topics:
            try:
                validate_topic_filter(f)
            except TopicError as e:
                raise ConfigError(f"{src}: {where}.topics: {f!r} is not a valid topic filter ({e})") from None


def cluster_node_name(cfg):
    """[cluster] node, or its default: <host name>-<first listener's port>."""
    if cfg.cluster.node:
        return cfg.cluster.node
    import socket
    port = cfg.listener[0].port if cfg.listener else 0
    host = socket.gethostname() or "node"
    return f"{host}-{port}" if port else host


def validate(cfg):
    """Cross-key checks that types alone cannot express."""
    src = cfg.source
    seen = set()
    for i, lst in enumerate(cfg.listener):
        _validate_listener(src, i, lst)
        for key in ("users", "readonly_users"):
            if getattr(lst, key) and not cfg.auth.password_file:
                raise ConfigError(f"{src}: listener[{i}].{key}: needs [auth] password_file (where their "
                                  "passwords are)")
        key = ("unix", lst.path) if lst.type == "unix" else (lst.bind, lst.port)
        if (lst.port or lst.type == "unix") and key in seen:
            raise ConfigError(f"{src}: listener[{i}]: duplicate listener {lst.label}")
        seen.add(key)
    _validate_cluster(src, cfg.cluster, cfg.storage.mode)
    _validate_bridges(cfg)
    _validate_extensions(cfg)
    for f in cfg.log.topics:
        try:
            validate_topic_filter(f)
        except TopicError as e:
            raise ConfigError(f"{src}: log.topics: {f!r} is not a valid topic filter ({e})") from None
    return cfg


def load(path=None, text=None):
    """Load a config file (or TOML text); no argument gives the embedded defaults."""
    if path is None and text is None:
        return Config()
    src = str(path) if path is not None else "<string>"
    try:
        if text is None:
            with open(path, "rb") as fh:
                raw = fh.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{src}: not valid TOML: not UTF-8 text ({e})") from None
        data = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{src}: file not found") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"{src}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        found = mosquitto_directives(text)
        if found:  # (someone's mosquitto.conf: say so, and where its settings go)
            raise ConfigError(mosquitto_message(src, found)) from None
        raise ConfigError(f"{src}: not valid TOML: {e}") from None
    cfg = _build(Config, data, src, "")
    cfg.source = src
    return validate(cfg)

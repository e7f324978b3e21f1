"""The $SYS figures in Prometheus's text format, for a `type = "metrics"` listener.

Users of other brokers run an exporter that subscribes to `$SYS/#` and republishes it
for Prometheus; here a listener answers `GET /metrics` itself. The figures are the
$SYS ones (`SysTopics.snapshot`, one source for both), read on the event loop when a
scrape arrives: nothing is computed between scrapes and nothing here touches the hot
path. Rates and averages are Prometheus's job, so $SYS's load averages are left out.
"""

import http
import json

from .. import __version__

# ($SYS topic, metric name, type, help). Counters end in _total, as Prometheus expects.
METRICS = (
    ("$SYS/broker/clients/connected", "wrenmq_clients_connected", "gauge",
     "Clients connected now."),
    ("$SYS/broker/clients/maximum", "wrenmq_clients_connected_max", "gauge",
     "Most clients connected at once since the broker started."),
    ("$SYS/broker/clients/total", "wrenmq_sessions", "gauge",
     "Sessions held: the connected clients' and the persistent sessions of offline ones."),
    ("$SYS/broker/connections/total", "wrenmq_connections_total", "counter",
     "Clients that connected (CONNACK accepted) since the broker started."),
    ("$SYS/broker/connections/refused", "wrenmq_connections_refused_total", "counter",
     "Connections closed before their CONNECT was read ([limits] connection_rate, max_connections; "
     "also metrics connections past the listener's bound)."),
    ("$SYS/broker/clients/rate_limited", "wrenmq_clients_rate_limited_total", "counter",
     "Times a client's input was paused by [limits] publish_rate or publish_byte_rate."),
    ("$SYS/broker/publish/messages/received", "wrenmq_publish_received_total", "counter",
     "PUBLISH packets received from clients."),
    ("$SYS/broker/publish/messages/sent", "wrenmq_publish_sent_total", "counter",
     "PUBLISH packets sent to clients."),
    ("$SYS/broker/publish/messages/dropped", "wrenmq_publish_dropped_total", "counter",
     "Messages not delivered to a subscriber: its connection congested (QoS 0), its queue full, "
     "or the packet over its maximum packet size."),
    ("$SYS/broker/publish/messages/denied", "wrenmq_publish_denied_total", "counter",
     "PUBLISH packets refused by the ACL or an authorization hook."),
    ("$SYS/broker/publish/messages/refused", "wrenmq_publish_refused_total", "counter",
     "QoS 1/2 PUBLISH packets refused because the disk was low ([storage] min_free_bytes)."),
    ("$SYS/broker/messages/expired", "wrenmq_messages_expired_total", "counter",
     "Messages dropped because their message expiry interval ran out before delivery."),
    ("$SYS/broker/bytes/received", "wrenmq_received_bytes_total", "counter",
     "MQTT bytes received from clients (TLS and WebSocket framing not counted)."),
    ("$SYS/broker/bytes/sent", "wrenmq_sent_bytes_total", "counter",
     "MQTT bytes sent to clients (TLS and WebSocket framing not counted)."),
    ("$SYS/broker/subscriptions/count", "wrenmq_subscriptions", "gauge",
     "Subscriptions held (shared ones included)."),
    ("$SYS/broker/subscriptions/denied", "wrenmq_subscriptions_denied_total", "counter",
     "Subscriptions refused by the ACL or an authorization hook."),
    ("$SYS/broker/subscriptions/refused", "wrenmq_subscriptions_refused_total", "counter",
     "Subscriptions refused because they would take the subscriptions past [limits] subscription_memory."),
    ("$SYS/broker/wills/held bytes", "wrenmq_wills_held_bytes", "gauge",
     "Memory the wills of offline sessions waiting out their delay take, in bytes (what [limits] will_memory bounds)."),
    ("$SYS/broker/wills/published early", "wrenmq_wills_published_early_total", "counter",
     "Wills published when their client went, not after their delay, because of [limits] will_memory."),
    ("$SYS/broker/subscriptions/bytes", "wrenmq_subscriptions_bytes", "gauge",
     "Memory the subscriptions of all sessions take, in bytes, as [limits] subscription_memory counts it."),
    ("$SYS/broker/retained messages/count", "wrenmq_retained_messages", "gauge",
     "Retained messages held."),
    ("$SYS/broker/retained messages/bytes", "wrenmq_retained_bytes", "gauge",
     "Memory the clients' retained messages take, in bytes: messages and the retained tree's nodes (what [limits] max_retained_bytes bounds)."),
    ("$SYS/broker/clients/refused sessions", "wrenmq_sessions_refused_total", "counter",
     "CONNECTs refused because a new persistent session would pass [limits] max_sessions."),
    ("$SYS/broker/retained messages/refused", "wrenmq_retained_refused_total", "counter",
     "Retained PUBLISHes delivered but not retained: [limits] max_retained_messages or max_retained_bytes."),
    ("$SYS/broker/store/messages/count", "wrenmq_queued_messages", "gauge",
     "Messages queued or in flight for sessions."),
    ("$SYS/broker/store/messages/bytes", "wrenmq_queued_bytes", "gauge",
     "Memory the sessions' queues take, in bytes: each entry, and each message they hold counted once "
     "(what [limits] queue_memory bounds)."),
    # The commit log (present with [storage] mode = "disk").
    ("$SYS/broker/log/end_offset", "wrenmq_log_end_offset", "gauge",
     "Offset the next record of the commit log gets."),
    ("$SYS/broker/log/start_offset", "wrenmq_log_start_offset", "gauge",
     "Oldest offset still in the commit log (retention moves it)."),
    ("$SYS/broker/log/appended", "wrenmq_log_appended_records_total", "counter",
     "Records written to the commit log since the broker started."),
    ("$SYS/broker/log/bytes_appended", "wrenmq_log_appended_bytes_total", "counter",
     "Bytes written to the commit log since the broker started."),
    ("$SYS/broker/log/unwritten_bytes", "wrenmq_log_unwritten_bytes", "gauge",
     "Bytes of records handed to the log writer and not yet written."),
    ("$SYS/broker/log/writer_waits", "wrenmq_log_writer_waits_total", "counter",
     "Times client input waited for the log writer (max_unwritten_bytes reached)."),
    ("$SYS/broker/log/syncs", "wrenmq_log_syncs_total", "counter",
     "fsyncs of the commit log."),
    ("$SYS/broker/log/sealed_syncs", "wrenmq_log_sealed_syncs_total", "counter",
     "fsyncs of rolled segments handed to the sync thread (fsync = \"interval\")."),
    ("$SYS/broker/log/batches", "wrenmq_log_batches_total", "counter",
     "Batches written to the commit log (records per batch: appended / batches)."),
    ("$SYS/broker/log/writer_wakes", "wrenmq_log_writer_wakes_total", "counter",
     "Times the log's writer thread woke up and took records to write."),
    ("$SYS/broker/store/disk_free_bytes", "wrenmq_store_disk_free_bytes", "gauge",
     "Free bytes of the data directory's filesystem at the last look (about once a second)."),
    ("$SYS/broker/store/disk_low", "wrenmq_store_disk_low", "gauge",
     "1 while the data directory has less free than [storage] min_free_bytes: no new messages taken."),
    ("$SYS/broker/log/segments", "wrenmq_log_segments", "gauge",
     "Segment files of the commit log."),
    ("$SYS/broker/log/retention/lost", "wrenmq_log_retention_lost_total", "counter",
     "Records removed by retention before every persistent session had read them."),
    ("$SYS/broker/log/truncated_bytes", "wrenmq_log_truncated_bytes", "gauge",
     "Bytes cut from the log's tail at start-up (a torn write from a crash)."),
    ("$SYS/broker/cluster/nodes", "wrenmq_cluster_nodes", "gauge",
     "Nodes in the cluster, this one included, as etcd last said."),
    ("$SYS/broker/cluster/links_up", "wrenmq_cluster_links_up", "gauge",
     "Other nodes this node's link to is connected."),
    ("$SYS/broker/cluster/etcd/connected", "wrenmq_cluster_etcd_connected", "gauge",
     "1 while the node's etcd session (lease, watch) is up."),
    ("$SYS/broker/cluster/etcd/switches", "wrenmq_cluster_etcd_switches_total", "counter",
     "Times the node's etcd session went on to another etcd member ([cluster] etcd) than the one it "
     "had (that member was lost, or did not answer)."),
    ("$SYS/broker/cluster/messages/forwarded", "wrenmq_cluster_forwarded_messages_total", "counter",
     "Messages written to other nodes' links (once per node)."),
    ("$SYS/broker/cluster/messages/received", "wrenmq_cluster_received_messages_total", "counter",
     "Messages received from other nodes."),
    ("$SYS/broker/cluster/messages/dropped", "wrenmq_cluster_dropped_messages_total", "counter",
     "Messages for another node dropped: its link was down or full past [cluster] link_buffer "
     "(only what the commit log does not record; the rest is replayed from the log)."),
    ("$SYS/broker/cluster/messages/replayed", "wrenmq_cluster_replayed_messages_total", "counter",
     "Messages sent to another node again from the commit log: its link came up or drained."),
    ("$SYS/broker/cluster/messages/duplicates", "wrenmq_cluster_duplicate_messages_total", "counter",
     "Messages from another node dropped here because they had arrived before."),
    ("$SYS/broker/cluster/messages/relayed", "wrenmq_cluster_relayed_messages_total", "counter",
     "Messages another node sent here for a session that had just moved to a third node, passed on "
     "to that node (RELAY)."),
    ("$SYS/broker/cluster/messages/replay_lost", "wrenmq_cluster_replay_lost_total", "counter",
     "Records another node needed replayed that [log] retention had deleted first, or whose shared "
     "group choice was forgotten (more than 100,000 owed to a node that is down)."),
    ("$SYS/broker/cluster/messages/groups_kept", "wrenmq_cluster_groups_kept", "gauge",
     "Shared-group choices this node keeps for replays to other nodes: until each says it has the message "
     "(once a second), at most 100,000 per node."),
    ("$SYS/broker/cluster/links/refused", "wrenmq_cluster_links_refused_total", "counter",
     "Sockets on the link port closed at once: 256 links open or in their TLS handshake."),
    ("$SYS/broker/cluster/links/fell_behind", "wrenmq_cluster_links_fell_behind_total", "counter",
     "Times a link to another node was full past [cluster] link_buffer and went on from the commit log."),
    ("$SYS/broker/cluster/routes/late", "wrenmq_cluster_routes_late_total", "counter",
     "SUBACKs sent without every linked node's confirmation of the new filter (1 s passed)."),
    ("$SYS/broker/cluster/takeovers", "wrenmq_cluster_takeovers_total", "counter",
     "Sessions ended here because their client connected to another node (clean start 1, or "
     "while this node was away)."),
    ("$SYS/broker/cluster/sessions/handed_over", "wrenmq_cluster_sessions_handed_over_total", "counter",
     "Sessions sent to another node because their client reconnected there."),
    ("$SYS/broker/cluster/sessions/taken_over", "wrenmq_cluster_sessions_taken_over_total", "counter",
     "Sessions received from another node for a client that reconnected here."),
    # [auth.http], [auth.jwt] and [[webhook]] (present when configured).
    ("$SYS/broker/auth/http/requests", "wrenmq_auth_http_requests_total", "counter",
     "Requests made to the [auth.http] service."),
    ("$SYS/broker/auth/http/cache hits", "wrenmq_auth_http_cache_hits_total", "counter",
     "Logins [auth.http] answered from its cache."),
    ("$SYS/broker/auth/http/errors", "wrenmq_auth_http_errors_total", "counter",
     "[auth.http] requests that failed (no connection, timeout, a status other than 200/204)."),
    ("$SYS/broker/auth/jwt/refused", "wrenmq_auth_jwt_refused_total", "counter",
     "JWT logins refused (signature, expiry, claims)."),
    ("$SYS/broker/webhooks/sent", "wrenmq_webhook_events_sent_total", "counter",
     "Webhook events the receivers took (all [[webhook]]s)."),
    ("$SYS/broker/webhooks/dropped", "wrenmq_webhook_events_dropped_total", "counter",
     "Webhook events dropped because an endpoint's queue was full (max_queued, max_queued_bytes)."),
    ("$SYS/broker/webhooks/failed", "wrenmq_webhook_events_failed_total", "counter",
     "Webhook events given up after their retries."),
    ("$SYS/broker/webhooks/failed requests", "wrenmq_webhook_requests_failed_total", "counter",
     "Webhook POSTs that failed (each retry counts)."),
    ("$SYS/broker/webhooks/queued", "wrenmq_webhook_events_queued", "gauge",
     "Webhook events waiting to be sent."),
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render(sys_topics):
    """The exposition text of the broker's current figures (call it on the event loop)."""
    values = sys_topics.snapshot()
    started = sys_topics.router.stats.started
    out = [
        "# HELP wrenmq_build_info The running wrenmq's version.",
        "# TYPE wrenmq_build_info gauge",
        f'wrenmq_build_info{{version="{_label(__version__)}"}} 1',
        "# HELP wrenmq_start_time_seconds When the broker started, in seconds since the epoch.",
        "# TYPE wrenmq_start_time_seconds gauge",
        f"wrenmq_start_time_seconds {started:.3f}",
    ]
    out.append("# HELP wrenmq_listener_connections Open network connections per MQTT listener "
               "(those whose CONNECT is not read yet included).")
    out.append("# TYPE wrenmq_listener_connections gauge")
    for listener, n in sys_topics.broker.listener_connections().items():
        out.append(f'wrenmq_listener_connections{{listener="{_label(listener)}"}} {n}')
    for topic, name, kind, doc in METRICS:
        value = values.get(topic)
        if value is None:  # (the log's figures, without a commit log)
            continue
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name} {int(value)}")
    for ext in sys_topics.broker.extensions:
        for name, kind, doc, samples in ext.metrics():
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                tags = ",".join(f'{k}="{_label(str(v))}"' for k, v in labels.items())
                out.append(f"{name}{{{tags}}} {value:g}" if isinstance(value, float) else f"{name}{{{tags}}} {int(value)}")
    out.append("")
    return "\n".join(out)


def health(broker):
    """GET /health (metrics and admin listeners), as (status code, JSON body): 200 and
    {"status": "ok"} while the broker takes messages, "disk_low" while [storage]
    min_free_bytes stops it (it still serves); 503 and "failed" once the store can no
    longer write (it is stopping)."""
    store = broker.store
    if broker.failed is not None:
        status, code = "failed", http.HTTPStatus.SERVICE_UNAVAILABLE
    elif store is not None and store.disk_low:
        status, code = "disk_low", http.HTTPStatus.OK
    else:
        status, code = "ok", http.HTTPStatus.OK
    return code, json.dumps({"status": status}) + "\n"


def _label(value):
    """A label value escaped as the text format requires."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

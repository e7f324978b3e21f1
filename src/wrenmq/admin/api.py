"""The JSON API under /api/v1/ (docs/ADMIN.md; its OpenAPI description: openapi.py).

Handlers run on the event loop and read the router's state as it is at that moment; what
they change, they change through the broker's public methods (`Router.disconnect_client`,
`Broker.publish`, `Broker.bans`). Lists are paged: `limit` (at most MAX_LIMIT) and
`cursor` (the `next` of the previous page, opaque), ordered by their key (client id;
client id and filter; topic). A list walks every session to filter them, in slices with a
loop turn between them, so a broker with a million sessions is not held up for the walk.

In a cluster, what is spread over the nodes (clients and sessions, subscriptions, the
log's partitions, a client wherever it is, bans) is answered for the whole cluster: this
node asks the others (peers.py) and merges their answers in key order; `?local=true`
asks for this node's part only. Retained messages are on every node already.
"""

import asyncio
import base64
import binascii
import heapq
import json
import logging
import time

from .. import __version__
from ..broker.bans import KINDS, BanError
from ..mqtt.topics import TopicError, validate_topic_filter
from ..mqtt import constants as C
from .http import HttpError, Response, json_response
from .peers import Peers

log = logging.getLogger("wrenmq.admin")

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
SLICE = 20_000  # sessions looked at per loop turn by a list
PAYLOAD_SHOWN = 4096  # bytes of a retained payload a list shows (the single GET shows it all)
_PROTOCOLS = {3: "3.1", 4: "3.1.1", 5: "5.0"}


def register(routes, admin):
    api = Api(admin)
    add = routes.add
    add("GET", "/api/v1/clients", api.clients, summary="Clients and sessions (paged, filtered)")
    add("GET", "/api/v1/clients/{client_id}", api.client, summary="One client, with its subscriptions")
    add("DELETE", "/api/v1/clients/{client_id}", api.kick,
        summary="Disconnect a client (DISCONNECT 0x98); ?session=true ends its session too")
    add("GET", "/api/v1/subscriptions", api.subscriptions, summary="Subscriptions (paged, filtered)")
    add("GET", "/api/v1/retained", api.retained, summary="Retained messages matching ?filter= (paged)")
    add("GET", "/api/v1/retained/{topic:path}", api.retained_one, summary="One retained message, whole")
    add("DELETE", "/api/v1/retained/{topic:path}", api.retained_delete, summary="Clear a retained message")
    add("POST", "/api/v1/publish", api.publish, summary="Publish a message as the broker")
    add("GET", "/api/v1/banned", api.banned, summary="Bans in force")
    add("POST", "/api/v1/banned", api.ban, summary="Ban a client id, user name or address")
    add("DELETE", "/api/v1/banned/{kind}/{value:path}", api.unban, summary="Lift a ban")
    add("GET", "/api/v1/stats", api.stats, summary="The $SYS figures, rates and listeners")
    add("GET", "/api/v1/log", api.log, summary="The commit log: partitions, offsets, sizes, retention")
    add("GET", "/api/v1/nodes", api.nodes, summary="This node, and the cluster's other nodes and links")
    add("GET", "/api/v1/events", api.events, summary="Live figures as Server-Sent Events")
    add("GET", "/api/v1/whoami", api.whoami, summary="Who the credentials are, and whether they may write")
    add("GET", "/api/v1/openapi.json", api.openapi, summary="This API's OpenAPI 3.1 description")


# --- request parameters ---------------------------------------------------------------


def int_param(query, name, default, lo, hi):
    text = query.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise HttpError(400, f"{name}: expected an integer, got {text[:40]!r}") from None
    if not lo <= value <= hi:
        raise HttpError(400, f"{name}: expected {lo} to {hi}, got {value}")
    return value


def bool_param(query, name):
    text = query.get(name)
    if text is None or text == "":
        return None
    low = text.lower()
    if low in ("1", "true", "yes"):
        return True
    if low in ("0", "false", "no"):
        return False
    raise HttpError(400, f"{name}: expected true or false, got {text[:40]!r}")


def encode_cursor(key):
    return base64.urlsafe_b64encode(json.dumps(key).encode()).rstrip(b"=").decode()


def decode_cursor(query):
    text = query.get("cursor")
    if not text:
        return None
    try:
        key = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise HttpError(400, "cursor: not a cursor this API gave") from None
    return tuple(key) if isinstance(key, list) else key


def take_page(keyed, limit, after):
    """The `limit` smallest (key, item) after key `after`, and the cursor of the next page."""
    if after is not None:
        try:
            keyed = [e for e in keyed if e[0] > after]
        except TypeError:
            raise HttpError(400, "cursor: not a cursor of this list") from None
    page = heapq.nsmallest(limit + 1, keyed, key=lambda e: e[0])
    nxt = encode_cursor(page[limit - 1][0]) if len(page) > limit else None
    return [e[1] for e in page[:limit]], nxt


def wall(mono, now_mono, now_wall):
    """A monotonic time of the router's clock as seconds since the epoch."""
    return round(now_wall - (now_mono - mono), 3)


def payload_fields(payload, limit=None):
    """A payload as JSON: `payload` (text, when it is UTF-8) or `payload_base64`, cut to
    `limit` bytes (`truncated` says so), and its `size`."""
    size = len(payload)
    shown = payload if limit is None or size <= limit else payload[:limit]
    out = {"size": size}
    if limit is not None and size > limit:
        out["truncated"] = True
    try:
        out["payload"] = shown.decode("utf-8")
    except UnicodeDecodeError:
        out["payload_base64"] = base64.b64encode(shown).decode()
    return out


def properties_json(props):
    out = {}
    for name, value in props.items():
        if name == "user_property":
            out["user_properties"] = [list(p) for p in value]
        elif isinstance(value, (bytes, bytearray)):
            out[name + "_base64"] = base64.b64encode(value).decode()
        else:
            out[name] = value
    return out


# --- the API ---------------------------------------------------------------------------


def failure(status, data):
    """A failed answer of another node (peers.ask_all) as one line."""
    if status is None:
        return str(data)
    return f"{status}: {data.get('error') if isinstance(data, dict) else data}"


class Api:
    def __init__(self, admin):
        self.admin = admin
        self.broker = admin.broker
        self.router = admin.broker.router
        self._bans_written = asyncio.Lock()
        self.peers = Peers(admin)

    def _wide(self, request):
        """Whether to answer for the whole cluster (other nodes to ask, and not ?local=true)."""
        return self.peers.active and not bool_param(request.query, "local")

    async def _merge(self, request, out, limit, key):
        """Add the other nodes' pages of the same list to `out` (this node's page), in key order."""
        answers = await self.peers.ask_all(request, "GET", request.path)
        items, total, more = list(out["items"]), out["total"], out["next"] is not None
        unreachable = {}
        for node, (status, data) in answers.items():
            if status == 200 and isinstance(data, dict):
                items += data["items"]
                total += data["total"]
                more = more or data["next"] is not None
            else:
                unreachable[node] = failure(status, data)
        items.sort(key=key)
        more = more or len(items) > limit
        items = items[:limit]
        out.update(items=items, total=total, next=encode_cursor(key(items[-1])) if more and items else None)
        if unreachable:
            out["unreachable"] = unreachable
        return out

    async def _elsewhere(self, request, method):
        """The answer of the node that has what this one has not (a client), or None."""
        if not self._wide(request):
            return None
        answers = await self.peers.ask_all(request, method, request.path)
        for node, (status, data) in sorted(answers.items()):
            if status is not None and status != 404:
                return json_response(data, status) if data is not None else Response(status, content_type=None)
        return None

    async def _tell_others(self, request, method, body=None):
        """Do the same on every other node (bans); {node: status or failure}."""
        if not self._wide(request):
            return None
        answers = await self.peers.ask_all(request, method, request.path, body=body)
        return {node: status if status in (200, 201, 204, 404) else failure(status, data)
                for node, (status, data) in answers.items()}

    # --- clients ---

    def client_json(self, session, now_mono, now_wall, detail=False):
        conn = session.conn
        out = {
            "client_id": session.client_id,
            "connected": conn is not None,
            "node": self.admin.node,
            "address": session.address,
            "listener": session.listener,
            "protocol": _PROTOCOLS.get(session.version, str(session.version)),
            "username": session.username,
            "keepalive": conn.keepalive if conn is not None else None,
            "connected_at": wall(session.connected_at, now_mono, now_wall) if session.connected_at else None,
            "session_expiry_interval": session.expiry_interval,
            "expires_at": wall(session.expires_at, now_mono, now_wall) if session.expires_at else None,
            "subscriptions": len(session.subscriptions),
            "inflight": len(session.inflight),
            "queued": len(session.queue),
            "queued_bytes": session.queued_bytes,
            "behind_in_log": session.resume_from is not None,
            "dropped": session.dropped,
            "packets_in": conn.packets_in if conn is not None else None,
            "bytes_in": conn.bytes_in if conn is not None else None,
            "bytes_out": conn.bytes_out if conn is not None else None,
        }
        if detail:
            out["subscriptions"] = [self.subscription_json(session, sub) for _, sub in
                                    sorted(session.subscriptions.items())]
            will = session.will
            out["will"] = None if will is None else {
                "topic": will.topic, "qos": will.qos, "retain": will.retain,
                "delay": session.will_delay, "size": len(will.payload)}
        return out

    @staticmethod
    def subscription_json(session, sub):
        return {
            "client_id": session.client_id,
            "filter": sub.full_filter,
            "topic_filter": sub.filter,
            "share": sub.group,
            "qos": sub.qos,
            "no_local": sub.no_local,
            "retain_as_published": sub.retain_as_published,
            "retain_handling": sub.retain_handling,
            "subscription_identifier": sub.sub_id,
        }

    async def _sessions(self, keep):
        """The sessions `keep(session)` accepts, walked SLICE at a time with a loop turn
        between slices (a session gone meanwhile is left out)."""
        sessions = self.router.sessions
        ids = list(sessions)
        out = []
        for start in range(0, len(ids), SLICE):
            if start:
                await asyncio.sleep(0)
            for cid in ids[start:start + SLICE]:
                session = sessions.get(cid)
                if session is not None and keep(session):
                    out.append(session)
        return out

    async def clients(self, request):
        q = request.query
        limit = int_param(q, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        after = decode_cursor(q)
        prefix = q.get("prefix") or ""
        user = q.get("user")
        address = q.get("address") or ""
        connected = bool_param(q, "connected")

        def keep(s):
            return s.client_id.startswith(prefix) and (user is None or s.username == user) and \
                (not address or (s.address or "").startswith(address)) and \
                (connected is None or (s.conn is not None) == connected)

        found = await self._sessions(keep)
        page, nxt = take_page([(s.client_id, s) for s in found], limit, after)
        now_mono, now_wall = self.router.clock(), time.time()
        out = {"items": [self.client_json(s, now_mono, now_wall) for s in page], "total": len(found), "next": nxt}
        if self._wide(request):
            await self._merge(request, out, limit, lambda c: c["client_id"])
        return json_response(out)

    def _session(self, client_id):
        session = self.router.sessions.get(client_id)
        if session is None:
            raise HttpError(404, f"no client or session {client_id[:200]!r} on this node")
        return session

    async def client(self, request):
        if request.params["client_id"] not in self.router.sessions:
            answer = await self._elsewhere(request, "GET")
            if answer is not None:
                return answer
        session = self._session(request.params["client_id"])
        return json_response(self.client_json(session, self.router.clock(), time.time(), detail=True))

    async def kick(self, request):
        cid = request.params["client_id"]
        end = bool(bool_param(request.query, "session"))
        if cid not in self.router.sessions:
            answer = await self._elsewhere(request, "DELETE")
            if answer is not None:
                return answer
        session = self._session(cid)
        was_connected = session.conn is not None
        if not was_connected and not end:
            raise HttpError(409, f"{cid[:200]!r} is not connected (add ?session=true to end its session)")
        self.router.disconnect_client(cid, C.ADMINISTRATIVE_ACTION, end)
        log.info("admin: %s disconnected client %s%s", request.identity.name, cid,
                 " and ended its session" if end else "")
        return json_response({"client_id": cid, "disconnected": was_connected, "session_ended": end})

    # --- subscriptions ---

    async def subscriptions(self, request):
        q = request.query
        limit = int_param(q, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        after = decode_cursor(q)
        prefix = q.get("filter") or ""
        cid = q.get("client_id")
        if cid is not None:
            session = self.router.sessions.get(cid)
            sessions = [session] if session is not None else []
        else:
            sessions = await self._sessions(lambda s: bool(s.subscriptions))
        keyed = [((s.client_id, f), (s, sub)) for s in sessions for f, sub in s.subscriptions.items()
                 if f.startswith(prefix)]
        page, nxt = take_page(keyed, limit, after)
        out = {"items": [self.subscription_json(s, sub) for s, sub in page], "total": len(keyed), "next": nxt}
        if self._wide(request):
            await self._merge(request, out, limit, lambda s: (s["client_id"], s["filter"]))
        return json_response(out)

    # --- retained messages ---

    def retained_json(self, msg, limit):
        out = {"topic": msg.topic, "qos": msg.qos, "client_id": msg.client_id or None,
               "timestamp": round(msg.timestamp, 3) if msg.timestamp else None}
        out.update(payload_fields(msg.payload, limit))
        if msg.properties:
            out["properties"] = properties_json(msg.properties)
        return out

    async def retained(self, request):
        q = request.query
        limit = int_param(q, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        after = decode_cursor(q)
        flt = q.get("filter") or "#"
        try:
            validate_topic_filter(flt)
        except TopicError as e:
            raise HttpError(400, f"filter: {e}") from None
        found = self.router.retained.match(flt)
        page, nxt = take_page([(m.topic, m) for m in found], limit, after)
        return json_response({"items": [self.retained_json(m, PAYLOAD_SHOWN) for m in page],
                              "total": len(found), "next": nxt})

    async def retained_one(self, request):
        topic = request.params["topic"]
        msg = self.router.retained.get(topic)
        if msg is None:
            raise HttpError(404, f"no retained message on {topic[:200]!r}")
        return json_response(self.retained_json(msg, None))

    async def retained_delete(self, request):
        topic = request.params["topic"]
        if self.router.retained.get(topic) is None:
            raise HttpError(404, f"no retained message on {topic[:200]!r}")
        # An empty retained message clears it, as a client clears one: on disk, and on
        # every node of a cluster (subscribers get the empty message, as they would then).
        self.broker.publish(topic, b"", 0, True)
        log.info("admin: %s cleared the retained message of %s", request.identity.name, topic)
        return Response(204, content_type=None)

    # --- publish ---

    def _check_topic(self, topic, what="topic"):
        router = self.router
        if not isinstance(topic, str) or not topic:
            raise HttpError(400, f"{what}: expected a non-empty string")
        if "+" in topic or "#" in topic or "\x00" in topic:
            raise HttpError(400, f"{what}: a topic name has no wildcards (+, #) and no NUL")
        if topic.startswith("$SYS") or topic.startswith("$share/"):
            raise HttpError(400, f"{what}: $SYS and $share/ topics are the broker's own")
        if topic.count("/") >= router.max_levels:
            raise HttpError(400, f"{what}: more than {router.max_levels} levels")
        limit = router.max_topic_length or 65535
        if len(topic.encode()) > limit:
            raise HttpError(400, f"{what}: longer than {limit} bytes")

    def _payload(self, data):
        if "payload_base64" in data:
            if "payload" in data:
                raise HttpError(400, "give payload or payload_base64, not both")
            try:
                return base64.b64decode(data["payload_base64"], validate=True)
            except (binascii.Error, ValueError, TypeError):
                raise HttpError(400, "payload_base64: not valid base64") from None
        payload = data.get("payload", "")
        if not isinstance(payload, str):
            raise HttpError(400, "payload: expected a string (binary: payload_base64)")
        return payload.encode()

    def _properties(self, props):
        if props is None:
            return None
        if not isinstance(props, dict):
            raise HttpError(400, "properties: expected an object")
        out = {}
        for name, value in props.items():
            if name == "payload_format_indicator" and value in (0, 1) and not isinstance(value, bool):
                out[name] = value
            elif name == "message_expiry_interval" and isinstance(value, int) and not isinstance(value, bool) \
                    and 0 <= value <= 0xFFFFFFFF:
                out[name] = value
            elif name == "content_type" and isinstance(value, str):
                out[name] = value
            elif name == "response_topic":
                self._check_topic(value, "properties.response_topic")
                out[name] = value
            elif name in ("correlation_data", "correlation_data_base64"):
                try:
                    out["correlation_data"] = base64.b64decode(value, validate=True) \
                        if name.endswith("_base64") else value.encode()
                except (binascii.Error, ValueError, TypeError, AttributeError):
                    raise HttpError(400, f"properties.{name}: expected "
                                         f"{'base64' if name.endswith('_base64') else 'a string'}") from None
            elif name == "user_properties":
                pairs = list(value.items()) if isinstance(value, dict) else value
                if not isinstance(pairs, list) or not all(
                        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p)
                        for p in pairs):
                    raise HttpError(400, "properties.user_properties: expected [[name, value], ...] "
                                         "or {name: value}")
                out["user_property"] = [tuple(p) for p in pairs]
            else:
                raise HttpError(400, f"properties.{name}: unknown, or a value of the wrong type (known: "
                                     "payload_format_indicator, message_expiry_interval, content_type, "
                                     "response_topic, correlation_data(_base64), user_properties)")
        return out

    async def publish(self, request):
        data = request.json()
        topic = data.get("topic")
        self._check_topic(topic)
        payload = self._payload(data)
        qos = data.get("qos", 0)
        if qos not in (0, 1, 2) or isinstance(qos, bool):
            raise HttpError(400, "qos: expected 0, 1 or 2")
        if qos > self.router.maximum_qos:
            raise HttpError(400, f"qos: this broker's maximum is {self.router.maximum_qos}")
        retain = data.get("retain", False)
        if not isinstance(retain, bool):
            raise HttpError(400, "retain: expected true or false")
        if retain and not self.router.retain_available:
            raise HttpError(400, "retain: this broker does not keep retained messages")
        limit = self.broker.config.limits.max_packet_size
        if len(payload) + len(topic) > limit:
            raise HttpError(413, f"the message is larger than [limits] max_packet_size ({limit} bytes)")
        unknown = set(data) - {"topic", "payload", "payload_base64", "qos", "retain", "properties"}
        if unknown:
            raise HttpError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
        props = self._properties(data.get("properties"))
        matched = self.broker.publish(topic, payload, qos, retain, props)
        return json_response({"topic": topic, "matched": bool(matched), "size": len(payload)})

    # --- bans ---

    async def banned(self, request):
        bans = sorted(self.broker.bans.list(), key=lambda b: (b.kind, b.value))
        return json_response({"items": [b.as_dict() for b in bans], "total": len(bans),
                              "refused": self.broker.bans.refused})

    async def _save_bans(self):
        bans = self.broker.bans
        snapshot = bans.dump()
        async with self._bans_written:
            await asyncio.get_running_loop().run_in_executor(self.admin.executor, bans.write, snapshot)

    async def ban(self, request):
        data = request.json()
        kind, value = data.get("kind"), data.get("value")
        if kind not in KINDS:
            raise HttpError(400, f"kind: expected one of {', '.join(KINDS)}")
        until = data.get("until")
        duration = data.get("duration")
        if duration is not None:
            if until is not None:
                raise HttpError(400, "give until or duration, not both")
            if not isinstance(duration, (int, float)) or isinstance(duration, bool) or duration <= 0:
                raise HttpError(400, "duration: expected seconds > 0")
            until = time.time() + duration
        reason = data.get("reason", "")
        if not isinstance(reason, str):
            raise HttpError(400, "reason: expected a string")
        try:
            ban = self.broker.bans.add(kind, value, until, reason)
        except BanError as e:
            raise HttpError(400, str(e)) from None
        bans = self.broker.bans
        kicked = []
        for session in await self._sessions(lambda s: s.conn is not None):
            if session.conn is not None and bans.match(session.client_id, session.username,
                                                       session.address or "") is not None:
                self.router.disconnect_client(session.client_id, C.ADMINISTRATIVE_ACTION)
                kicked.append(session.client_id)
        await self._save_bans()
        log.info("admin: %s banned %s %s%s; %d connected client(s) disconnected", request.identity.name,
                 kind, ban.value, f" until {time.ctime(until)}" if until else "", len(kicked))
        out = ban.as_dict()
        out["disconnected"] = kicked
        others = await self._tell_others(request, "POST", {"kind": kind, "value": value, "until": until,
                                                           "reason": reason})
        if others is not None:
            out["nodes"] = others
        return json_response(out, 201)

    async def unban(self, request):
        kind, value = request.params["kind"], request.params["value"]
        if kind not in KINDS:
            raise HttpError(404, f"no ban kind {kind[:40]!r} (kinds: {', '.join(KINDS)})")
        others = await self._tell_others(request, "DELETE")
        if not self.broker.bans.remove(kind, value):
            if others and any(s == 204 for s in others.values()):
                return Response(204, content_type=None)
            raise HttpError(404, f"no ban of {kind} {value[:200]!r}")
        await self._save_bans()
        log.info("admin: %s lifted the ban of %s %s", request.identity.name, kind, value)
        return Response(204, content_type=None)

    # --- figures ---

    async def stats(self, request):
        broker = self.broker
        values = broker.sys_topics.snapshot()
        sample = self.admin.feed.history[-1] if self.admin.feed and self.admin.feed.history else None
        started = self.router.stats.started
        return json_response({
            "node": self.admin.node,
            "version": __version__,
            "started": round(started, 3),
            "uptime": round(time.time() - started, 3),
            "sys": values,
            "rates": sample["rates"] if sample is not None else {},
            "listeners": broker.listener_connections(),
            "bans": len(broker.bans),
        })

    async def log(self, request):
        broker = self.broker
        cfg = broker.config.log
        store = broker.store
        out = {
            "enabled": store is not None and store.log is not None,
            "topics": list(cfg.topics),
            "retention": {"bytes": cfg.retention_bytes, "hours": cfg.retention_hours,
                          "hard_bytes": cfg.retention_hard_bytes},
            "partitions": [],
        }
        if store is not None and store.log is not None:
            st = store.log.stats()
            out["partitions"].append({
                "partition": store.node_id,
                "node": self.admin.node,
                "start_offset": store.start_offset,
                "end_offset": store.next_offset,
                "written_through": store.written_through,
                "records": store.next_offset - store.start_offset,
                "bytes": st["bytes"],
                "segments": st["segments"],
                "first_timestamp": st["first_timestamp_us"] / 1e6 if st["first_timestamp_us"] else None,
                "last_timestamp": st["last_timestamp_us"] / 1e6 if st["last_timestamp_us"] else None,
                "appended": store.appended,
                "bytes_appended": store.bytes_appended,
                "unwritten_bytes": store.unwritten_bytes,
                "lost_to_retention": store.lost_to_retention,
                "disk_free_bytes": store.disk_free if store.min_free else None,
                "disk_low": store.disk_low,
            })
        if self._wide(request):
            answers = await self.peers.ask_all(request, "GET", request.path)
            for node, (status, data) in sorted(answers.items()):
                if status == 200:
                    out["partitions"] += data["partitions"]
                else:
                    out.setdefault("unreachable", {})[node] = failure(status, data)
        return json_response(out)

    async def nodes(self, request):
        me = {"name": self.admin.node, "self": True, "up": True, "admin": self.admin.listener.url,
              "link": None}
        cluster = self.broker.cluster
        out = {"cluster": None, "nodes": [me]}
        if cluster is not None:
            me["link"] = cluster.advertise
            out["cluster"] = cluster.name
            admins = await self.peers.urls()
            figures = await self.peers.ask_all(request, "GET", "/api/v1/stats", params={}) \
                if not bool_param(request.query, "local") else {}
            for name, peer in sorted(cluster.peers.items()):
                node = {"name": name, "self": False, "up": bool(peer.up), "link": peer.address,
                        "admin": admins.get(name)}
                status, data = figures.get(name, (None, None))
                if status == 200:
                    node["connected"] = data["sys"].get("$SYS/broker/clients/connected")
                    node["rates"] = data["rates"]
                out["nodes"].append(node)
            out["etcd_connected"] = bool(cluster.etcd_up)
            out["etcd_endpoint"] = cluster.etcd_endpoint
        sample = self.admin.feed.history[-1] if self.admin.feed.history else None
        if sample is not None:
            me["connected"] = sample["figures"]["connected"]
            me["rates"] = sample["rates"]
        return json_response(out)

    async def events(self, request):
        return Response(200, content_type="text/event-stream", stream=self.admin.feed.events(),
                        headers=[("X-Accel-Buffering", "no")])

    async def whoami(self, request):
        out = request.identity.as_dict()
        out["node"] = self.admin.node
        out["version"] = __version__
        return json_response(out)

    async def openapi(self, request):
        from .openapi import document
        return json_response(document(self.admin.routes))

"""This node's membership of the cluster, kept in etcd.

Under `/wrenmq/<cluster name>/`, every key of a node hangs on that node's lease, so a
node that dies leaves the cluster when its lease runs out:

    nodes/<node>                     {"link": "host:port"}: where its link listens
    routes/<node>/n/<filter>         it has subscribers to <filter> (value @<change number>)
    routes/<node>/s/<share>/<filter> it has members of $share/<share>/<filter>
                                     (value 1@<n> while one of them is connected, else 0@<n>)
    clients/<client id>              <node>: the client's last connection is there (a node
                                     that (re)joins does not take it back: `_register_held`)
    links/<node>                     its view of its links to the others (linkview.py)

A node takes the lease and its name (`register`), writes its filters and clients,
reads the rest, and watches the prefix from there on: a node registered is linked to
(links.py), one gone is dropped, the others' filters go to `Cluster.remote`, and a
client registered elsewhere ends its session here. Writes are gathered per loop turn
into transactions (`write`). When etcd goes, the node routes with what it knows and
comes back, through the next of the [cluster] etcd endpoints each time (the member it
used may be the one that went: etcd.Session): it writes what changed and reads
everything again if its lease lived (kept alive on that member from then on), else it
joins again.
"""

import asyncio
import json
import logging
import time

from . import ClusterError, etcd_failure, etcd_session
from .interest import CLIENTS, NODES, ROUTES, parse_route_key, parse_route_value

log = logging.getLogger("wrenmq.cluster")

_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
_TXN_BYTES = 1 << 20  # and its default --max-request-bytes 1.5 MiB


def _written_at(responses):
    """The etcd revision of a transaction's writes (from its responses), 0 if none."""
    revision = 0
    for r in responses:
        for field in ("response_put", "response_delete_range"):
            if r.HasField(field):
                revision = max(revision, getattr(r, field).header.revision)
    return revision


class Membership:
    """The etcd session of a Cluster: its lease, registration, writes and watch."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.cfg = cluster.cfg
        self.etcd = None  # etcd.Session: the member in use, and the others to go on to
        self.lease = None
        self.etcd_up = False
        self.stopping = False
        self.revision = 0  # how far this node has read etcd (the watch, or a full read)
        self.written = 0  # the etcd revision of this node's last write there
        # The etcd revision by which this node's filters were all in etcd when it last
        # (re)joined; None while it (re)joins: HELLOs wait for it (Replay.resume), so a
        # node replaying to this one can know its filters first.
        self.announced = None
        self.takeovers = 0  # sessions ended here: their client connected to another node
        # What this node tells the others besides its link address (advertise_info), in its
        # registration: put again with it when the node re-joins.
        self.info = {}
        self._pending = {}  # etcd key -> value to put, or None to delete
        self._pending_clients = set()  # client ids whose registration is in _pending or in flight
        self._owned = {}  # client id -> revision of this node's registration
        self._foreign = {}  # client id -> newest revision of another node's, seen while ours was in flight
        self._flushing = None
        self._main = None

    # --- joining and leaving --------------------------------------------------------

    @property
    def endpoint(self):
        """The etcd endpoint ("host:port") in use; None while none is."""
        return self.etcd.endpoint if self.etcd is not None else None

    async def connect(self):
        """Reach etcd at the first of the endpoints that answers; ClusterError if none does."""
        cfg = self.cfg
        self.etcd = etcd_session(cfg)
        try:
            await self.etcd.connect()
        except Exception as e:
            raise ClusterError(f"cannot reach etcd at {', '.join(cfg.etcd)} ([cluster] etcd): "
                               f"{etcd_failure(cfg, e)}") from None

    async def register(self):
        """Take a lease, claim the node name, publish interest and clients, read the rest."""
        cluster = self.cluster
        etcd = self.etcd
        self.announced = None  # (the links' HELLOs wait until the filters are written)
        self.lease = await etcd.lease(self.cfg.lease_ttl)
        key = f"{cluster.prefix}{NODES}{cluster.node}".encode()
        tx = etcd.transactions
        # A node restarted right after a crash finds its old registration until the old
        # lease runs out: wait that long before calling the name taken.
        deadline = time.monotonic() + self.cfg.lease_ttl + 2
        waited = False
        while True:
            ok, responses = await etcd.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, self._registration(), lease=self.lease)],
                failure=[])
            if ok or time.monotonic() >= deadline:
                break
            if not waited:
                log.info("cluster: node name %r is registered; waiting up to %d s for that registration "
                         "to expire (a restart after a crash)", cluster.node, self.cfg.lease_ttl)
                waited = True
            await asyncio.sleep(0.5)
            await self.lease.refresh()  # ours must outlive the wait
        if not ok:
            await self.lease.revoke()
            self.lease = None
            raise ClusterError(f"node name {cluster.node!r} is already taken in cluster {cluster.name!r} "
                               f"(a live node holds it; set [cluster] node)")
        await cluster.links.serve()  # (the links' HELLOs are answered once the filters are written)
        router = cluster.router
        # This node's clients as they are now. One that connected here while etcd was
        # unreachable has its registration still to write, the newest as any
        # connection's; the other sessions held here are registered only where no other
        # node has registered their client since.
        connected = {cid for cid in self._pending_clients if cid in router.sessions}
        self._pending.clear()
        self._owned.clear()
        self._pending_clients.clear()
        for cid in connected:
            self._register_client(cid)
        await self._register_held(connected)
        # And its interest; from here on the router reports changes (router.cluster is
        # set in the same step: nothing is missed).
        self._pending.update(cluster.routes.recount(router.sessions))
        router.cluster = cluster
        self.written = max(self.written, _written_at(responses))
        await self._flush_pending()
        self._announce()
        await self._resync()

    async def _register_held(self, connected):
        """Register the clients of the sessions this node holds as it (re)joins (restored
        from disk at start, or kept while its lease ran out and took their registrations
        along), but those in `connected`, where no other node has registered them since,
        and end the others here.

        Every `clients/<client id>` key this node wrote hung on its old lease, gone now: a
        key there is another node's newer registration (the client reconnected there while
        this node was away), and taking it back would close that client's live connection
        and bring back the session it left. So each key is put only if it is still absent
        (or, should it name this node, unchanged), in one transaction per batch that reads
        the batch's keys when a compare fails; a key found absent is tried again, one
        registered elsewhere ends its session here. A client that connects here meanwhile
        (a rejoin: the listeners are open) registers as any connection does, and that
        newer registration decides: its session here is left alone."""
        cluster = self.cluster
        router = cluster.router
        etcd = self.etcd
        tx = etcd.transactions
        prefix = f"{cluster.prefix}{CLIENTS}"
        me = cluster.node.encode()
        held = {cid: session for cid, session in router.sessions.items() if cid not in connected}
        expect = dict.fromkeys(held, 0)  # client id -> the mod revision its key must have (0: absent)
        while expect:
            batch, size = [], 0
            for cid, revision in expect.items():
                key = f"{prefix}{cid}".encode()
                size += 3 * len(key) + len(me)  # (the key is in the compare, the put and the read)
                if len(batch) == _TXN_OPS or (batch and size > _TXN_BYTES):
                    break
                batch.append((cid, key, revision))
            ok, responses = await etcd.transaction(
                compare=[tx.mod(key) == revision for _, key, revision in batch],
                success=[tx.put(key, me, lease=self._client_lease()) for _, key, _ in batch],
                failure=[tx.get(key) for _, key, _ in batch])
            if ok:
                written = _written_at(responses)
                self.written = max(self.written, written)
                for cid, _, _ in batch:
                    del expect[cid]
                    if self._still_held(cid, held):
                        self._owned[cid] = written
                continue
            for (cid, _, _), found in zip(batch, responses):  # (found: [(value, kv)], [] if absent)
                if not found:
                    expect[cid] = 0
                elif found[0][0] == me:
                    expect[cid] = found[0][1].mod_revision
                else:
                    del expect[cid]
                    if self._still_held(cid, held):
                        self._ended_elsewhere(held[cid], found[0][0].decode("utf-8", "replace"))

    def _client_lease(self):
        """The lease of this node's `clients/<client id>` keys: its own, or none with
        [cluster] replicas > 1, where a client's registration names its session's partition,
        which outlives this process's lease (the broker hosted for it after a failover
        answers the claims: moves.py)."""
        services = self.cluster.services
        return None if services is not None and services.clients_without_lease else self.lease

    def _still_held(self, cid, held):
        """Client `cid`'s session is still the one `_register_held` found, and its client
        has not connected here since (that connection's registration decides)."""
        return cid not in self._pending_clients and self.cluster.router.sessions.get(cid) is held[cid]

    def _ended_elsewhere(self, session, node):
        """`session` was held here while its client registered on `node` (this node was
        away): it ends here. Without a connection here, without its will: the client came
        back, so MQTT sends none. A connection here is older than that registration (its
        own was written before this node went away): it is taken over, as when the watch
        tells."""
        self.takeovers += 1
        router = self.cluster.router
        if session.conn is not None:
            router.moved_away(session.client_id)
            return
        log.info("cluster: client %s reconnected on node %s while this node was away: its session here ends",
                 session.client_id, node)
        router.end_session(session, publish_will=False)

    def _registration(self):
        return json.dumps({**self.info, "link": self.cluster.advertise}).encode()

    def advertise_info(self, key, value):
        """Tell the other nodes `key` = `value` about this node (where its admin listener is,
        say), in its registration in etcd; `read_info` reads them back."""
        self.info[key] = value
        if self.lease is not None:
            self.cluster.loop.create_task(self._put_registration())

    async def _put_registration(self):
        cluster = self.cluster
        try:
            await self.etcd.put(f"{cluster.prefix}{NODES}{cluster.node}".encode(), self._registration(),
                                lease=self.lease)
        except Exception as e:  # the next re-join writes it again
            log.warning("cluster: could not update this node's registration in etcd: %s", e)

    async def read_info(self, key):
        """{node: value} of `key` as each node told it (advertise_info), read from etcd now."""
        prefix = self.cluster.prefix
        got = await asyncio.wait_for(self.etcd.get_prefix(f"{prefix}{NODES}".encode()), self.cfg.etcd_timeout)
        out = {}
        start = len(prefix) + len(NODES)
        for kv in got:
            try:
                value = json.loads(kv.value).get(key)
            except (ValueError, AttributeError):
                continue
            if value is not None:
                out[kv.key.decode("utf-8", "replace")[start:]] = value
        return out

    def watch(self):
        """Keep the lease alive and watch the cluster's keys, rejoining when etcd goes."""
        self._main = self.cluster.loop.create_task(self._run())

    def halt(self):
        """Stop watching and writing (the node is leaving)."""
        self.stopping = True
        if self._main is not None:
            self._main.cancel()
        if self._flushing is not None:
            self._flushing.cancel()

    async def leave(self):
        """Write what is still to be written, revoke the lease (the others drop this node's
        keys now) and close the client.

        The writes first: a client whose session this node has just taken over from another
        node is registered there still, until this node's registration is written. Left
        unwritten, that registration would name the old node when this node is back, and
        this node would end the session it holds on its disk as taken elsewhere meanwhile
        (`_register_held`)."""
        if self.etcd is None:
            return
        loop = self.cluster.loop
        deadline = loop.time() + self.cfg.etcd_timeout  # (both, as long as the revoke alone took)
        try:
            if self._pending and self.etcd_up:
                await asyncio.wait_for(self._flush_pending(), self.cfg.etcd_timeout)
        except Exception as e:
            log.warning("cluster: could not write this node's last client registrations on leaving (%s)", e)
        try:
            if self.lease is not None:
                await asyncio.wait_for(self.lease.revoke(), max(0.1, deadline - loop.time()))
        except Exception as e:
            log.warning("cluster: could not revoke the lease on leaving (%s); the node's keys "
                        "go when it runs out", e)
        await self.etcd.close()

    async def close(self):
        """Close the client (a start that failed)."""
        if self.etcd is not None:
            await self.etcd.close()

    def _announce(self):
        """This node's filters are all in etcd (it has just (re)joined): the HELLOs that
        waited for it are answered now."""
        self.announced = self.written
        self.cluster.replay.answer_waiting()

    async def _resync(self):
        """Read every key of the cluster (the other nodes, their interest, the clients) and
        the revision the watch goes on from."""
        cluster = self.cluster
        got = await self.etcd.get_prefix(cluster.prefix.encode())
        nodes = f"{cluster.prefix}{NODES}".encode()
        registered = {kv.key[len(nodes):].decode("utf-8", "replace") for kv in got if kv.key.startswith(nodes)}
        peers = cluster.links.peers
        for name in [name for name in peers if name not in registered]:
            self._node_left(name)  # (left while this node did not watch: before clear() forgets its groups)
        cluster.remote.clear()
        seen = set()
        for kv in got:
            name = self._apply(kv.key, kv.value, kv.mod_revision, True)
            if name:
                seen.add(name)
        cluster.remote.restore_told()
        for name in list(peers):
            if name not in seen:
                self._node_left(name)
        self.revision = got.header.revision
        self.etcd_up = True

    # --- the etcd session: keepalive, watch, reconnect --------------------------

    async def _run(self):
        while not self.stopping:
            try:
                await self._watch_and_keep_alive()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.etcd_up = False
                log.warning("cluster: etcd session lost (%s: %s); routing with what is known, rejoining",
                            type(e).__name__, e)
            await self._rejoin()

    async def _rejoin(self):
        """Back to etcd, through the next endpoint each attempt, with a backoff (a log line
        a minute while it fails): `_resume`."""
        attempts = await self.etcd.recover(self._resume, lambda: self.stopping, "cluster: rejoining through etcd")
        if attempts:
            log.info("cluster: etcd session back through %s (after %d attempt(s))", self.endpoint, attempts)

    async def _resume(self):
        """On the member just reached: if the lease lived, keep it alive there at once (the
        switch may have taken most of its TTL), write what changed and read everything
        again; else join again."""
        if self.lease is not None and await self.etcd.keep_alive(self.lease) > 0:
            await self._flush_pending()
            if self.announced is None:  # (a register that failed after its claim)
                self._announce()
            await self._resync()
        else:
            log.warning("cluster: this node's lease ran out; joining again")
            await self.register()

    async def _watch_and_keep_alive(self):
        prefix = self.cluster.prefix
        watch = await self.etcd.watch_prefix(prefix.encode(), start_revision=self.revision + 1, prev_kv=True)
        keepalive = self.cluster.loop.create_task(self._keep_alive())
        try:
            events = watch.__aiter__()
            while True:
                nxt = asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait((nxt, keepalive), return_when=asyncio.FIRST_COMPLETED)
                if keepalive in done:
                    nxt.cancel()
                    keepalive.result()  # raises what stopped it
                    raise ConnectionError("keepalive stopped")
                ev = nxt.result()
                kv = ev.kv
                self.revision = kv.mod_revision
                if ev.kind == "PUT":
                    self._apply(kv.key, kv.value, kv.mod_revision, False)
                else:
                    self._apply(kv.key, None, kv.mod_revision, False, ev.prev_kv.value if ev.prev_kv else None)
        finally:
            keepalive.cancel()
            try:
                await watch.cancel()
            except Exception:
                pass

    async def _keep_alive(self):
        period = max(0.5, self.cfg.lease_ttl / 3)
        while True:
            await asyncio.sleep(period)
            if await self.etcd.keep_alive(self.lease) <= 0:
                raise ConnectionError("lease expired")

    # --- what etcd says ------------------------------------------------------------

    def _apply(self, key, value, revision, initial, deleted_value=None):
        """One key of the cluster prefix was put (`value`) or deleted (None; `deleted_value`:
        what it held, if etcd said). Returns the node name when the key is a node's
        registration."""
        cluster = self.cluster
        rest = key.decode("utf-8", "replace")[len(cluster.prefix):]
        if rest.startswith(NODES):
            name = rest[len(NODES):]
            if name == cluster.node:
                if value is None and not self.stopping and not initial:
                    log.warning("cluster: etcd dropped this node's registration")
                    raise ConnectionError("registration lost")
                return name
            if value is None:
                self._node_left(name)
                return None
            try:
                address = json.loads(value)["link"]
            except (ValueError, KeyError, TypeError):
                log.warning("cluster: ignoring node %s with a malformed registration", name)
                return None
            cluster.links.add_peer(name, address)
            return name
        if rest.startswith(ROUTES):
            parsed = parse_route_key(rest[len(ROUTES):])
            if parsed is None or parsed[0] == cluster.node:
                return None
            node, group, flt = parsed
            if value is None:
                cluster.remote.deleted(node, group, flt,
                                       parse_route_value(deleted_value)[1] if deleted_value is not None else -1)
            else:
                cluster.remote.put(node, group, flt, *parse_route_value(value))
            return None
        if rest.startswith(CLIENTS) and value is not None:
            cid = rest[len(CLIENTS):]
            if value.decode("utf-8", "replace") != cluster.node:
                self._client_elsewhere(cid, revision)
        return None

    def _node_left(self, name):
        self.cluster.links.drop_peer(name)
        self.cluster.remote.left(name)  # (its shared groups are kept until it is back: Forwarding.route)

    def _client_elsewhere(self, cid, revision):
        if cid in self._pending_clients:
            if revision > self._foreign.get(cid, 0):
                self._foreign[cid] = revision
            return
        mine = self._owned.get(cid)
        if mine is not None and revision < mine:
            return
        self._owned.pop(cid, None)
        router = self.cluster.router
        if cid in router.sessions:
            self.takeovers += 1
            router.moved_away(cid)

    async def read_routes(self, node):
        """Node `node`'s filters as etcd has them now: [(node, group, filter, a member
        connected, change number)]; raises what the read raised."""
        prefix = self.cluster.prefix
        key = f"{prefix}{ROUTES}{node}/".encode()
        got = await asyncio.wait_for(self.etcd.get_prefix(key), self.cfg.etcd_timeout)
        routes = []
        for kv in got:
            parsed = parse_route_key(kv.key.decode("utf-8", "replace")[len(prefix) + len(ROUTES):])
            if parsed is not None and parsed[0] == node:
                routes.append((*parsed, *parse_route_value(kv.value)))
        return routes

    async def client_node(self, cid):
        """The node where client `cid` last connected, as etcd has it now (None if no
        node registered it); raises what the read raised."""
        got = await asyncio.wait_for(self.etcd.get(f"{self.cluster.prefix}{CLIENTS}{cid}".encode()),
                                     self.cfg.etcd_timeout)
        return None if got is None else got.value.decode("utf-8", "replace")

    # --- what this node writes -----------------------------------------------------------

    def write(self, key, value):
        """Put `value` at `key` (None: delete it) with this loop turn's other writes."""
        self._pending[key] = value
        self._kick()

    def _register_client(self, cid):
        self._pending[f"{self.cluster.prefix}{CLIENTS}{cid}".encode()] = self.cluster.node.encode()
        self._pending_clients.add(cid)

    def client_connected(self, cid):
        self._register_client(cid)
        self._kick()

    def client_gone(self, cid):
        if self._owned.pop(cid, None) is not None or cid in self._pending_clients:
            self._pending[f"{self.cluster.prefix}{CLIENTS}{cid}".encode()] = None
            self._kick()

    def registering(self, cid):
        """Whether this node's registration of client `cid` is still to be written, or on
        its way to etcd."""
        return cid in self._pending_clients

    def disown(self, cid):
        """Client `cid`'s session went to another node, which registers the client next:
        its registration here is not this node's to delete any more."""
        self._owned.pop(cid, None)

    def _kick(self):
        if self._flushing is None and self.etcd_up and not self.stopping:
            self._flushing = self.cluster.loop.create_task(self._flush_soon())

    async def _flush_soon(self):
        try:
            await asyncio.sleep(0)  # the rest of this loop turn's changes go in the same request
            await self._flush_pending()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("cluster: writing to etcd failed (%s: %s); retried when etcd is back",
                        type(e).__name__, e)
        finally:
            self._flushing = None

    async def _flush_pending(self):
        """Write what changed, in transactions of at most _TXN_OPS keys."""
        etcd = self.etcd
        tx = etcd.transactions
        client_keys = f"{self.cluster.prefix}{CLIENTS}".encode()
        skip = len(client_keys)
        client_lease = self._client_lease()
        while self._pending:
            batch = []
            size = 0
            for key in list(self._pending)[:_TXN_OPS]:
                value = self._pending[key]
                size += len(key) + len(value or b"")
                if batch and size > _TXN_BYTES:
                    break
                batch.append((key, self._pending.pop(key)))
            ops = [tx.put(k, v, lease=client_lease if k.startswith(client_keys) else self.lease)
                   if v is not None else tx.delete(k) for k, v in batch]
            try:
                _, responses = await etcd.transaction(compare=[], success=ops, failure=[])
            except BaseException:
                for k, v in batch:  # a newer change to the same key wins
                    self._pending.setdefault(k, v)
                raise
            revision = _written_at(responses)
            self.written = max(self.written, revision)
            for k, v in batch:
                if k.startswith(client_keys):
                    cid = k[skip:].decode()
                    if self._pending.get(k, v) is not v:
                        continue  # changed again meanwhile: that write decides
                    self._pending_clients.discard(cid)
                    foreign = self._foreign.pop(cid, 0)
                    if v is None:
                        continue
                    self._owned[cid] = revision
                    if foreign > revision:
                        self._client_elsewhere(cid, foreign)

"""The partitions' control plane in etcd: this process's lease and registration, the
partition records it reads and watches, and the transactions it runs on them.

Keys, under `/wrenmq/<cluster name>/ha/` (apart from the brokers' own keys, which a
hosted broker registers under its partition's node name, node.py):

    nodes/<node>         {"addr": "host:port"}: a process taking part, on its lease; the
                         key's create revision is the process's incarnation
    partitions/<P>       replication_control.PartitionRecord, no lease: changed only by
                         transactions compared on its revision
    logs/<P>             the identity of partition P's commit log (what a replica's state
                         database says, so a broker started on any replica names the same
                         log to the other nodes), written with the first record
    status/<P>           the leader's figures for `wrenmq cluster status` (its HW, log end,
                         each replica's position), on the leader's lease

The rules the simulator found the I/O layer must keep are kept here: output is released
only while the lease holds (`lease_ok`: now < the send time of the last successful
grant or keepalive + the TTL), a view older than one already held is ignored, and a
transaction's outcome is reported to whoever asked only once its answer (or the
record's move) says what happened.
"""

import asyncio
import json
import logging
import time

from .. import ClusterError, etcd_failure, etcd_session
from .. import replication_control as RC

log = logging.getLogger("wrenmq.cluster.ha")

LOGS = "logs/"
STATUS = "status/"


def ha_prefix(cluster_name):
    return f"/wrenmq/{cluster_name}/ha/"


def _revision_of(responses):
    revision = 0
    for r in responses:
        if r.HasField("response_put"):
            revision = max(revision, r.response_put.header.revision)
    return revision


class Control:
    """This process's etcd session for the partitions.

    `records`: partition -> (PartitionRecord, mod revision); `live`: node -> create
    revision of its key (the nodes taking part now); `addresses`: node -> its link port's
    address; `logs`: partition -> log id; `status`: partition -> the leader's figures.
    `on_change()` is called (on the loop) whenever any of them changes, and
    `on_incarnation()` when this process registered anew (its lease ran out). Its etcd is
    a Session over every `[cluster] etcd` endpoint: when the member in use is lost, it
    goes on through the next one, its lease alive if that takes less than its TTL."""

    def __init__(self, cfg, node, advertise, on_change, on_incarnation):
        self.cfg = cfg
        self.node = node
        self.advertise = advertise
        self.prefix = ha_prefix(cfg.name)
        self.on_change = on_change
        self.on_incarnation = on_incarnation
        self.etcd = None
        self.lease = None
        self.incarnation = None
        self.valid_until = float("-inf")  # monotonic time until which the lease surely holds
        self.records = {}
        self.live = {}
        self.addresses = {}
        self.logs = {}
        self.status = {}
        self.revision = 0
        self.etcd_up = False
        self.stopping = False
        self._main = None

    # --- the session ------------------------------------------------------------------

    async def start(self):
        """Reach etcd, take a lease, register, read everything; ClusterError if that fails."""
        cfg = self.cfg
        session = etcd_session(cfg)
        try:
            await session.connect()
        except Exception as e:
            await session.close()
            raise ClusterError(f"cannot reach etcd at {', '.join(cfg.etcd)} ([cluster] etcd): "
                               f"{etcd_failure(cfg, e)}") from None
        self.etcd = session
        await self._register()
        await self._read_all()
        self._main = asyncio.get_running_loop().create_task(self._run())

    def lease_ok(self):
        """Whether this process may still speak for what it leads: registered, and its lease
        surely not run out (by this process's clock: etcd counts from a later moment)."""
        return self.incarnation is not None and time.monotonic() < self.valid_until

    async def _register(self):
        """A lease, then this node's key (waiting out an earlier process's, which holds the
        name until its lease runs out); its create revision is the incarnation."""
        cfg = self.cfg
        etcd = self.etcd
        sent = time.monotonic()
        self.lease = await etcd.lease(cfg.lease_ttl)
        self.valid_until = sent + cfg.lease_ttl
        key = RC.node_key(self.prefix, self.node).encode()
        value = json.dumps({"addr": self.advertise}).encode()
        tx = etcd.transactions
        deadline = time.monotonic() + cfg.lease_ttl + 2
        said = False
        while True:
            ok, responses = await etcd.transaction(compare=[tx.create(key) == 0],
                                                   success=[tx.put(key, value, lease=self.lease)], failure=[])
            if ok:
                break
            if time.monotonic() >= deadline:
                await self.lease.revoke()
                self.lease = None
                raise ClusterError(f"node name {self.node!r} is already taken in cluster {cfg.name!r} "
                                   f"(a live process holds {key.decode()})")
            if not said:
                log.info("cluster: %s is registered; waiting up to %d s for that registration to run out "
                         "(a restart after a crash)", key.decode(), cfg.lease_ttl)
                said = True
            await asyncio.sleep(0.25)
            await self._refresh()
        self.incarnation = _revision_of(responses)
        self.etcd_up = True
        log.info("cluster: partitions: node %s registered (incarnation %d)", self.node, self.incarnation)

    async def _refresh(self):
        sent = time.monotonic()
        ttl = await self.etcd.keep_alive(self.lease)
        if ttl <= 0:
            raise ConnectionError("lease expired")
        self.valid_until = max(self.valid_until, sent + ttl)

    async def _read_all(self):
        got = await asyncio.wait_for(self.etcd.get_prefix(self.prefix.encode()), self.cfg.etcd_timeout)
        records, live, addresses, logs, status = {}, {}, {}, {}, {}
        for kv in got:
            self._take(kv.key, kv.value, kv.mod_revision, kv.create_revision, records, live, addresses, logs,
                       status)
        # Keep the newer of what is held and what was read (a watch event may have come in between).
        for p, (rec, mod) in records.items():
            held = self.records.get(p)
            if held is None or held[1] < mod:
                self.records[p] = (rec, mod)
        for p in [p for p in self.records if p not in records and self.records[p][1] <= got.header.revision]:
            del self.records[p]
        self.live, self.addresses, self.logs, self.status = live, addresses, logs, status
        self.revision = got.header.revision
        self.on_change()

    def _take(self, key, value, mod, create, records, live, addresses, logs, status):
        rest = key.decode("utf-8", "replace")[len(self.prefix):]
        if rest.startswith(RC.PARTITIONS):
            try:
                records[rest[len(RC.PARTITIONS):]] = (RC.PartitionRecord.from_json(value), mod)
            except RC.RecordError as e:
                log.warning("cluster: ignoring partition record %s: %s", rest, e)
        elif rest.startswith(RC.NODES):
            name = rest[len(RC.NODES):]
            live[name] = create
            try:
                addresses[name] = json.loads(value)["addr"]
            except (ValueError, KeyError, TypeError):
                log.warning("cluster: ignoring node %s's malformed registration", name)
        elif rest.startswith(LOGS):
            logs[rest[len(LOGS):]] = value.decode("utf-8", "replace")
        elif rest.startswith(STATUS):
            try:
                status[rest[len(STATUS):]] = json.loads(value)
            except ValueError:
                pass

    async def _run(self):
        while not self.stopping:
            try:
                await self._watch_and_keep_alive()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.etcd_up = False
                log.warning("cluster: partitions: etcd session lost (%s: %s); rejoining", type(e).__name__, e)
            await self._rejoin()

    async def _rejoin(self):
        """Back to etcd through the next endpoint each attempt, with a backoff: `_resume`."""
        attempts = await self.etcd.recover(self._resume, lambda: self.stopping,
                                           "cluster: partitions: rejoining through etcd")
        if attempts:
            log.info("cluster: partitions: etcd session back through %s (after %d attempt(s))",
                     self.etcd.endpoint, attempts)

    async def _resume(self):
        """On the member just reached: keep the lease alive there at once (the switch may
        have taken most of its TTL) or, if it ran out, register anew (a new incarnation);
        then read everything again."""
        sent = time.monotonic()
        ttl = await self.etcd.keep_alive(self.lease) if self.lease is not None else 0
        if ttl > 0:
            self.valid_until = max(self.valid_until, sent + ttl)
        else:
            log.warning("cluster: partitions: this process's lease ran out; registering again")
            self.incarnation = None
            self.on_incarnation()
            await self._register()
            self.on_incarnation()
        await self._read_all()
        self.etcd_up = True

    async def _watch_and_keep_alive(self):
        watch = await self.etcd.watch_prefix(self.prefix.encode(), start_revision=self.revision + 1)
        keepalive = asyncio.get_running_loop().create_task(self._keep_alive())
        try:
            events = watch.__aiter__()
            while True:
                nxt = asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait((nxt, keepalive), return_when=asyncio.FIRST_COMPLETED)
                if keepalive in done:
                    nxt.cancel()
                    keepalive.result()
                    raise ConnectionError("keepalive stopped")
                ev = nxt.result()
                kv = ev.kv
                self.revision = max(self.revision, kv.mod_revision)
                self._event(kv, ev.kind == "PUT")
        finally:
            keepalive.cancel()
            try:
                await watch.cancel()
            except Exception:
                pass

    def _event(self, kv, put):
        rest = kv.key.decode("utf-8", "replace")[len(self.prefix):]
        if put:
            records, live, addresses, logs, status = {}, {}, {}, {}, {}
            self._take(kv.key, kv.value, kv.mod_revision, kv.create_revision, records, live, addresses, logs,
                       status)
            for p, (rec, mod) in records.items():
                held = self.records.get(p)
                if held is not None and held[1] >= mod:
                    continue  # older than the view held (a transaction's answer came first)
                self.records[p] = (rec, mod)
            self.live.update(live)
            self.addresses.update(addresses)
            self.logs.update(logs)
            self.status.update(status)
        elif rest.startswith(RC.PARTITIONS):
            self.records.pop(rest[len(RC.PARTITIONS):], None)
        elif rest.startswith(RC.NODES):
            name = rest[len(RC.NODES):]
            self.live.pop(name, None)
            self.addresses.pop(name, None)
            if name == self.node and not self.stopping:
                raise ConnectionError("etcd dropped this process's registration")
        elif rest.startswith(STATUS):
            self.status.pop(rest[len(STATUS):], None)
        self.on_change()

    async def _keep_alive(self):
        period = max(0.3, self.cfg.lease_ttl / 3)
        while True:
            await asyncio.sleep(period)
            await asyncio.wait_for(self._refresh(), self.cfg.etcd_timeout)

    async def stop(self):
        """Revoke the lease (the others see this process go at once) and close the client."""
        self.stopping = True
        if self._main is not None:
            self._main.cancel()
        if self.etcd is None:
            return
        try:
            if self.lease is not None:
                await asyncio.wait_for(self.lease.revoke(), self.cfg.etcd_timeout)
        except Exception as e:
            log.warning("cluster: partitions: could not revoke the lease on leaving (%s)", e)
        self.valid_until = float("-inf")
        await self.etcd.close()

    # --- reads and writes -----------------------------------------------------------------

    async def refresh(self):
        """Read everything again (a frame said there is a newer epoch than the view)."""
        try:
            await self._read_all()
        except Exception as e:
            log.warning("cluster: partitions: reading etcd failed (%s: %s)", type(e).__name__, e)

    async def transaction(self, txn, extra=()):
        """Run a replication_control.Txn (and put `extra` (key, value) pairs with it):
        (True, revision) if applied, (False, 0) if a compare failed. Raises what etcd
        raised (the caller cannot tell whether it applied: it sends it again)."""
        etcd = self.etcd
        tx = etcd.transactions
        compares = []
        for c in txn.compares:
            target = tx.mod(c.key.encode()) if c.target == "mod" else tx.create(c.key.encode())
            compares.append(target == c.value)
        puts = [tx.put(txn.key.encode(), txn.value)] + [tx.put(k.encode(), v) for k, v in extra]
        ok, responses = await asyncio.wait_for(etcd.transaction(compare=compares, success=puts, failure=[]),
                                               self.cfg.etcd_timeout)
        if not ok:
            return False, 0
        revision = _revision_of(responses)
        p = txn.key[len(self.prefix) + len(RC.PARTITIONS):]
        held = self.records.get(p)
        if held is None or held[1] < revision:
            self.records[p] = (txn.record, revision)
        return True, revision

    def log_key(self, partition):
        return f"{self.prefix}{LOGS}{partition}"

    async def put_status(self, partition, figures):
        """The leader's figures for `wrenmq cluster status`, on this process's lease."""
        if self.lease is None or not self.etcd_up:
            return
        try:
            await asyncio.wait_for(self.etcd.put(f"{self.prefix}{STATUS}{partition}".encode(),
                                                 json.dumps(figures).encode(), lease=self.lease),
                                   self.cfg.etcd_timeout)
        except Exception as e:
            log.debug("cluster: partitions: writing %s's status failed: %s", partition, e)

    async def read_log_id(self, partition):
        """Partition `partition`'s log id as etcd has it now (None if none)."""
        got = await asyncio.wait_for(self.etcd.get(self.log_key(partition).encode()), self.cfg.etcd_timeout)
        return None if got is None else got.value.decode("utf-8", "replace")

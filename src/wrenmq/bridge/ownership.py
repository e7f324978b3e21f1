"""In a cluster, which node runs each bridge's remote session: the holder of an etcd key.

A remote broker takes one connection per client id, and a subscription made by two
nodes would bring each message in twice; so the session (client id, subscriptions,
the "in" direction) runs on one node at a time. Each node takes a lease of its own
(TTL [cluster] lease_ttl) and tries to create /wrenmq/<cluster>/bridges/<name> under
it for every bridge it does not hold; the first to create a key holds that bridge
until its lease ends (the node stops, crashes, or loses etcd), when the key goes and
another node takes it at its next try (every lease_ttl / 3 seconds).

When the etcd member its session uses is lost, a node goes on to the next endpoint of
[cluster] etcd (cluster/etcd.py's Session) and refreshes its lease there: a lease that
lived keeps the node's bridges, one that ran out is replaced (and the bridges are taken
again like any others). Meanwhile the node keeps its bridges only as long as etcd cannot
have given them to another node: it lets go of them `_MARGIN` seconds before its lease
could run out (the lease outlives the last refresh it answered by its TTL).

Self-contained: its own lease and session (`cluster.etcd_session`), nothing of the
node's link or interest code.
"""

import asyncio
import logging
import time

from ..cluster import RETRY, etcd_failure, etcd_session

log = logging.getLogger("wrenmq.bridge")

_MARGIN = 1.0  # seconds before the lease could run out that a node cut off from etcd lets go of its bridges


def bridges_prefix(cluster_name):
    return f"/wrenmq/{cluster_name}/bridges/"


class Ownership:
    def __init__(self, cfg, node, bridges):
        self.cfg = cfg  # the [cluster] section
        self.node = node
        self.bridges = {b.name: b for b in bridges}
        self.prefix = bridges_prefix(cfg.name)
        self.held = set()
        self.etcd = etcd_session(cfg)
        self.lease = None
        self._task = None
        self._said = 0.0
        self._attempt = 0  # failed attempts in a row to reach etcd (the backoff's step)
        self._lease_until = None  # time.monotonic() by which the lease may have run out
        self._let_go_timer = None
        self._away = False  # the session failed and has not been back since

    def start(self):
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._let_go()
        lease, self.lease = self.lease, None
        try:
            if lease is not None:  # the keys go now: another node takes the bridges at once
                await asyncio.wait_for(lease.revoke(), self.cfg.etcd_timeout)
        except Exception as e:
            log.warning("bridges: could not revoke the lease on leaving (%s); other nodes take the "
                        "bridges when it runs out", e)
        await self.etcd.close()

    def _let_go(self):
        if self._let_go_timer is not None:
            self._let_go_timer.cancel()
            self._let_go_timer = None
        for name in self.held:
            self.bridges[name].set_owner(False)
        self.held.clear()

    def _refreshed(self, sent, ttl):
        """A keepalive sent at `sent` (time.monotonic()) was answered: the lease lives `ttl`
        seconds from then at least."""
        self._lease_until = sent + ttl
        self._attempt = 0
        if self._away:
            self._away = False
            log.info("bridges: etcd session back through %s%s", self.etcd.endpoint,
                     "; still holding " + ", ".join(sorted(self.held)) if self.held else "")
        if self._let_go_timer is not None:
            self._let_go_timer.cancel()
            self._let_go_timer = None

    def _lost(self, e):
        """The session failed: keep the bridges held until just before the lease could
        run out, unless it comes back first (`_refreshed`)."""
        self._away = True
        now = time.monotonic()
        if self.held or now - self._said >= 60:
            self._said = now
            log.warning("bridges: etcd session lost (%s); going on to the next etcd endpoint%s",
                        etcd_failure(self.cfg, e),
                        "; holding " + ", ".join(sorted(self.held)) + " while the lease lasts" if self.held else "")
        if self.held and self._let_go_timer is None:
            left = (self._lease_until or now) - _MARGIN - now
            self._let_go_timer = asyncio.get_running_loop().call_later(max(0.0, left), self._expired)

    def _expired(self):
        self._let_go_timer = None
        if self.held:
            log.warning("bridges: the lease may run out before etcd answers again; letting go of %s",
                        ", ".join(sorted(self.held)))
            self._let_go()

    async def _run(self):
        first = True
        while True:
            try:
                if first:
                    await self.etcd.connect()  # (the first endpoint that answers)
                else:
                    await self.etcd.reconnect()  # (the next endpoint)
                first = False
                await self._hold()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._lost(e)
            # While it holds bridges on a lease it cannot renew, the node tries the next
            # member at the first step's pace: an etcd election takes a second or more, and
            # a longer wait could let the lease's margin pass with a member already back.
            await asyncio.sleep(RETRY[0] if self.held else RETRY[min(self._attempt, len(RETRY) - 1)])
            self._attempt += 1

    async def _hold(self):
        cfg = self.cfg
        timeout = cfg.etcd_timeout
        etcd = self.etcd
        period = max(0.5, cfg.lease_ttl / 3)
        if self.lease is not None:  # (back through another member: did the lease live?)
            sent = time.monotonic()
            ttl = await asyncio.wait_for(etcd.keep_alive(self.lease), timeout)
            if ttl > 0:
                self._refreshed(sent, ttl)
            else:
                log.warning("bridges: the lease ran out while etcd did not answer; taking a new one")
                self._let_go()
                self.lease = None
        if self.lease is None:
            sent = time.monotonic()
            self.lease = await asyncio.wait_for(etcd.lease(cfg.lease_ttl), timeout)
            self._refreshed(sent, self.lease.ttl)
        lease = self.lease
        tx = etcd.transactions
        node = self.node.encode()
        while True:
            for name, bridge in self.bridges.items():
                key = (self.prefix + name).encode()
                if name in self.held:
                    got = await asyncio.wait_for(etcd.get(key), timeout)
                    if got is not None and got.value == node:
                        continue
                    self.held.discard(name)  # (deleted by hand: taken again below, or by another node)
                    bridge.set_owner(False)
                ok, _ = await asyncio.wait_for(etcd.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, node, lease=lease)], failure=[]), timeout)
                if not ok:
                    got = await asyncio.wait_for(etcd.get(key), timeout)
                    # (still on this lease: let go of while etcd did not answer, and kept by it)
                    ok = got is not None and got.value == node and got.lease == lease.id
                if ok:
                    self.held.add(name)
                    bridge.set_owner(True, self.node)
                else:
                    bridge.set_owner(False, got.value.decode("utf-8", "replace") if got is not None else "")
            await asyncio.sleep(period)
            sent = time.monotonic()
            ttl = await asyncio.wait_for(etcd.keep_alive(lease), timeout)
            if ttl <= 0:
                raise ConnectionError("the lease ran out")
            self._refreshed(sent, ttl)

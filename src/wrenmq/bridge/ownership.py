"""In a cluster, which node runs each bridge's remote session: the holder of an etcd key.

A remote broker takes one connection per client id, and a subscription made by two
nodes would bring each message in twice; so the session (client id, subscriptions,
the "in" direction) runs on one node at a time. Each node takes a lease of its own
(TTL [cluster] lease_ttl) and tries to create /wrenmq/<cluster>/bridges/<name> under
it for every bridge it does not hold; the first to create a key holds that bridge
until its lease ends (the node stops, crashes, or loses etcd), when the key goes and
another node takes it at its next try (every lease_ttl / 3 seconds).

A node that cannot refresh its lease lets go of its bridges at once, before etcd
could give them to another node: the lease outlives the last refresh by its TTL.

Self-contained: its own lease and the cluster's etcd client (`cluster.etcd_client`),
nothing of the node's link or interest code.
"""

import asyncio
import logging
import time

from ..cluster import etcd_client, etcd_failure

log = logging.getLogger("wrenmq.bridge")

_RETRY = 1.0  # seconds before reaching etcd again after a failure


def bridges_prefix(cluster_name):
    return f"/wrenmq/{cluster_name}/bridges/"


class Ownership:
    def __init__(self, cfg, node, bridges):
        self.cfg = cfg  # the [cluster] section
        self.node = node
        self.bridges = {b.name: b for b in bridges}
        self.prefix = bridges_prefix(cfg.name)
        self.held = set()
        self.etcd = None
        self.lease = None
        self._task = None
        self._said = 0.0

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
        etcd, lease = self.etcd, self.lease
        self.etcd = self.lease = None
        if etcd is not None:
            try:
                if lease is not None:  # the keys go now: another node takes the bridges at once
                    await asyncio.wait_for(lease.revoke(), self.cfg.etcd_timeout)
            except Exception as e:
                log.warning("bridges: could not revoke the lease on leaving (%s); other nodes take the "
                            "bridges when it runs out", e)
            await etcd.close()

    def _let_go(self):
        for name in self.held:
            self.bridges[name].set_owner(False)
        self.held.clear()

    async def _run(self):
        while True:
            try:
                await self._hold()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                now = time.monotonic()
                if self.held or now - self._said >= 60:
                    self._said = now
                    log.warning("bridges: etcd session lost (%s)%s; retrying", etcd_failure(self.cfg, e),
                                "; letting go of " + ", ".join(sorted(self.held)) if self.held else "")
            self._let_go()
            etcd, self.etcd, self.lease = self.etcd, None, None
            if etcd is not None:
                try:
                    await etcd.close()
                except Exception:
                    pass
            await asyncio.sleep(_RETRY)

    async def _connect(self):
        last = None
        for endpoint in self.cfg.etcd:
            client = etcd_client(self.cfg, endpoint)
            try:
                await asyncio.wait_for(client.connect(), self.cfg.etcd_timeout)
                return client
            except Exception as e:
                last = e
                await client.close()
        raise last or ConnectionError("no etcd endpoint")

    async def _hold(self):
        cfg = self.cfg
        timeout = cfg.etcd_timeout
        self.etcd = etcd = await self._connect()
        self.lease = lease = await asyncio.wait_for(etcd.lease(cfg.lease_ttl), timeout)
        tx = etcd.transactions
        period = max(0.5, cfg.lease_ttl / 3)
        while True:
            reply = await asyncio.wait_for(lease.refresh(), timeout)
            ttl = getattr(reply[0] if isinstance(reply, list) and reply else reply, "TTL", 1)
            if ttl <= 0:
                raise ConnectionError("the lease ran out")
            for name, bridge in self.bridges.items():
                key = (self.prefix + name).encode()
                if name in self.held:
                    got = await asyncio.wait_for(etcd.get(key), timeout)
                    if got is not None and got.value == self.node.encode():
                        continue
                    self.held.discard(name)  # (deleted by hand: taken again below, or by another node)
                    bridge.set_owner(False)
                ok, _ = await asyncio.wait_for(etcd.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, self.node.encode(), lease=lease)], failure=[]), timeout)
                if ok:
                    self.held.add(name)
                    bridge.set_owner(True, self.node)
                else:
                    got = await asyncio.wait_for(etcd.get(key), timeout)
                    bridge.set_owner(False, got.value.decode("utf-8", "replace") if got is not None else "")
            await asyncio.sleep(period)

"""The Broker core: owns the listeners, the router, the store and the lifecycle.

It knows the parts above it (auth, cluster, bridges, the admin listener) only through
what the assembly gives it (wrenmq/assemble.py): its first hook, more hooks
(`add_hook`), extensions (`add_extension`) and listener types (`listener_types`). A
program embeds the assembled broker, `wrenmq.Broker`:

    async with wrenmq.Broker(config) as broker:
        broker.publish("hello/world", b"hi")
        await broker.serve_forever()
"""

import asyncio
import collections
import gc
import logging
import os
import weakref
from time import monotonic

from ..mqtt import constants as C
from ..store.store import SEAL_DELAY
from .bans import Bans
from .listeners import LISTENER_TYPES, ListenerError, TLSReloadHook
from .hooks import HookChain
from .persistence import Persistence
from .router import Router
from .sys import SysTopics

THROTTLE_TICK = 0.005  # seconds between wake-ups of clients over their publish rate
DEADLINE_TICK = 0.25  # connect timeouts and keepalives are checked this often
FIRST_TIME_KEYS = 10_000  # keys Broker.first_time remembers per kind
log = logging.getLogger("wrenmq.broker")


def _tune_gc():
    """Collect cyclic garbage less often.

    Every message allocates a few short-lived objects that reference counting frees;
    the cycle collector's default gen-0 threshold (700 allocations) makes it walk the
    young heap thousands of times a second, and with the commit log holding recent
    messages that walk is long. Cycles are rare here, so trade a little memory for it.
    """
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 < 50_000:
        gc.set_threshold(50_000, max(gen1, 20), max(gen2, 100))


class Broker:
    """`auth` is the hook that goes first in the chain (the `[auth]` hook of auth/hook.py in
    an assembled broker: it asks the `authenticate` of the hooks behind it for users it does
    not know). The broker also asks it, for a client no hook had an opinion of, whether
    anonymous clients may connect on its listener (`anonymous_allowed(listener name)`),
    and a metrics listener with `users` checks them against its password file
    (`passwords`, `delay`)."""

    def __init__(self, config, auth):
        self.config = config
        self.extensions = []  # hooks.Extension: started and stopped with the broker (add_extension)
        self._log_readers = []  # on_log_growth callbacks
        self._log_told = 0  # the log's end they were last told of
        self.auth = auth
        self.hooks = HookChain([auth])
        self.router = Router(self.config, self.hooks)
        self.connections = set()
        # Accepted connections still in their TLS or WebSocket handshake (listeners/): they
        # count against max_connections with those above.
        self.handshakes = 0
        self.loop = None
        self._servers = []
        self.addresses = []  # (host, port) actually bound, per listener
        self._dirty = []
        self._flush_scheduled = False
        self._seal_scheduled = False
        self._throttled = []  # connections over their publish rate, woken by one tick
        self._yielded = []  # connections that used their read budget, resumed next turn
        self._throttle_handle = None
        self._arrivals = collections.deque()  # (connect deadline, weakref to connection)
        self._deadlines = {}  # tick number -> connections to check at that tick (watch())
        self._swept = int(monotonic() / DEADLINE_TICK)  # last tick number checked
        self._sweep_handle = None
        self._timer = None
        self._timer_at = None
        self.sys_topics = SysTopics(self)  # the $SYS figures (also read by metrics listeners)
        self._sys_handle = None
        self._tasks = set()
        self._stopped = None
        self.running = False
        # The store: opened by start() with [storage] mode = "disk", unless the caller gave
        # one opened already (a replicated partition's, cluster/ha/), which start() starts.
        self.store = None
        self.cluster = None  # with [cluster]: the node (cluster/), set by its extension once joined
        self.failed = None
        # Output held until the epoch that produced it is durable: [epoch id, [(conn, bytes)]].
        self._held = collections.deque()
        self._discarding = False  # stop(discard_held=True): held output is dropped, not waited for
        self._checkpoint_handle = None
        self._disk_handle = None
        self._accept = {}  # listener name -> connection_rate token bucket
        self._seen = {}  # kind -> keys Broker.first_time has seen
        # Client ids, user names and addresses refused at CONNECT (0x8A); saved under the data
        # directory with [storage] mode = "disk" (bans.py).
        self.bans = Bans()
        # [[listener]] type -> async opener(broker, cfg, index) returning a started listener
        # (listeners/__init__.py): the broker's own types, and those of layers above it that
        # the assembly adds (the admin listener: wrenmq.admin.install).
        self.listener_types = dict(LISTENER_TYPES)

    # --- lifecycle -----------------------------------------------------------

    async def start(self):
        self.loop = asyncio.get_running_loop()
        _tune_gc()
        self._stopped = asyncio.Event()
        early = [ext for ext in self.extensions if ext.before_listeners]
        # The timers of the sessions restored from disk (wills and expiries that fell due
        # while the broker was down) wait until the early extensions (the cluster) have
        # started: a session whose client came back on another node meanwhile ends then,
        # without its will (cluster/membership.py).
        self.router.timers.on_change = None if early else self._on_timer
        if self.config.storage.mode == "disk" or self.store is not None:
            self._open_store()
        joined = []  # (the cluster: no client publishes before its messages can reach the other nodes)
        try:
            for ext in early:
                await ext.start(self)
                joined.append(ext)
            await self.hooks.start(self)  # before the listeners: hooks see every client
        except BaseException:
            await self._stop_extensions(joined)
            self._close_store_of_failed_start()
            raise
        if early:
            self.router.timers.on_change = self._on_timer
            due = self.router.timers.next_deadline()
            if due is not None:
                self._on_timer(due)
        # One listener per [[listener]], opened by its type's opener (listeners/).
        try:
            for i, lst in enumerate(self.config.listener):
                opener = self.listener_types.get(lst.type)
                if opener is None:
                    raise ListenerError(f"listener[{i}].type: no listener of type \"{lst.type}\" in this "
                                        "broker (wrenmq serve and wrenmq.Broker have them all; a type of "
                                        "a layer above the broker is added to Broker.listener_types)")
                listener = await opener(self, lst, i)
                self._servers.append(listener)
                self.addresses.append(listener.address)
        except BaseException:
            for listener in self._servers:  # do not leave the ones already open listening
                listener.close()
            self._servers.clear()
            await self.hooks.stop()
            await self._stop_extensions(joined)
            self._close_store_of_failed_start()
            raise
        if self.store is not None:
            self.store.announce_listeners([lst.address for lst in self._servers if lst.mqtt_over_tcp])
        if any(lst.tls for lst in self.config.listener):
            self.hooks.add(TLSReloadHook(self))  # SIGHUP (hooks.reload) re-reads certificates
        self.running = True
        try:
            for ext in self.extensions:
                if not ext.before_listeners:
                    await ext.start(self)
        except BaseException:
            await self.stop()
            raise
        if self.config.sys.interval > 0:
            self._publish_sys()
        return self

    async def _stop_extensions(self, started):
        """Stop the extensions of `started` (in the order they started), the last first."""
        for ext in reversed(started):
            try:
                await ext.stop()
            except Exception:
                log.exception("stopping %s failed", type(ext).__name__)

    def _close_store_of_failed_start(self):
        """Close the store (and with it the data dir's lock, so a program that embeds the
        broker can start it again) and its timers, after start() failed."""
        if self.store is None:
            return
        for h in (self._checkpoint_handle, self._disk_handle):
            if h is not None:
                h.cancel()
        self.store.close()

    def _open_store(self):
        from ..store.store import Store

        self.bans.open(os.path.join(os.path.abspath(self.config.storage.data_dir), "bans.json"))
        store = self.store
        if store is None:
            store = Store(self.config, on_durable=self._on_durable, on_error=self._on_store_error)
        else:
            store.on_durable = self._on_durable
            store.on_error = self._on_store_error
        store.on_pending = self._schedule_flush
        self.store = store
        persist = Persistence(self.router, store)
        self.router.persist = persist
        self.router.topic_log = store.topic_log
        persist.restore()
        store.start(self.loop)
        log.info("storage: %s (node %s, fsync %s, log %s at offset %d)", store.data_dir, store.node_id,
                 store.fsync, "on" if self.config.log.enabled else "off (owed messages only)", store.next_offset)
        self._checkpoint_handle = self.loop.call_later(
            self.config.storage.checkpoint_interval_ms / 1000.0, self._checkpoint)
        if store.min_free:
            store.on_disk = self._on_disk
            self._watch_disk()

    def _watch_disk(self):
        """Once a second: space freed or taken by others moves [storage] min_free_bytes' alarm
        too (the writer has it looked at as it writes)."""
        self.store.watch_disk()
        self._disk_handle = self.loop.call_later(1.0, self._watch_disk)

    def _on_disk(self, low):
        """The data directory's free space crossed [storage] min_free_bytes."""
        store = self.store
        if low:
            log.warning("%s has %d bytes free, under [storage] min_free_bytes (%d): taking no new "
                        "messages (QoS 1/2 refused, QoS 0 delivered but not recorded) until %d are free",
                        store.data_dir, store.disk_free, store.min_free, store.resume_free)
        else:
            log.info("%s has %d bytes free again: taking messages", store.data_dir, store.disk_free)
        self.router.set_disk_low(low)

    async def stop(self, reason=C.SERVER_SHUTTING_DOWN, discard_held=False):
        """Stop accepting, tell 5.0 clients `reason` (0x8B, server shutting down), close
        everything. `discard_held`: the output held for the store is never sent (a replicated
        partition's leader that lost its leadership: what it held was not committed)."""
        if not self.running:
            return
        self.running = False
        for server in self._servers:
            server.close()
        if discard_held:
            self._discarding = True  # (holding() is False from now on: nothing waits for the store)
            self._held.clear()
            # The clients go now, not after the extensions stop (a cluster's leave can wait
            # etcd_timeout for an etcd it was cut from): from here on output is written
            # without the store, so a client still connected would be given what was never
            # committed (acknowledgements, PUBCOMPs, deliveries). Each connection drops what
            # is queued for it (what closing the others queued too) before its DISCONNECT.
            for conn in list(self.connections):
                conn.take_output()  # produced for records that are not committed: never sent
                conn.close(reason)
        # In the reverse of their start's order: the cluster, which joined before the
        # listeners opened, leaves last (the other nodes stop sending here at once).
        await self._stop_extensions([ext for ext in self.extensions if ext.before_listeners] +
                                    [ext for ext in self.extensions if not ext.before_listeners])
        for h in (self._sys_handle, self._timer, self._checkpoint_handle, self._sweep_handle, self._disk_handle):
            if h is not None:
                h.cancel()
        for conn in list(self.connections):
            conn.close(reason)
        self._flush()
        for _ in range(100):
            if not self.connections and not self._held:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        await self.hooks.stop()
        if self.store is not None:
            if self.failed is None:
                self.router.persist.checkpoint(everything=True)
            self.store.close()
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        if self._stopped is not None:
            self._stopped.set()
        log.info("broker stopped")

    def reload(self):
        """SIGHUP: every hook's on_reload (password and ACL files, TLS certificates...)."""
        self.hooks.reload()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    async def serve_forever(self):
        await self._stopped.wait()

    @property
    def port(self):
        """The port of the first listener (handy with port 0)."""
        return self.addresses[0][1]

    # --- services for connections and the router ------------------------------

    def mark_dirty(self, conn):
        """`conn` has bytes to write: flush them all once, at the end of this loop turn."""
        self._dirty.append(conn)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _schedule_flush(self):
        if not self._flush_scheduled and self.loop is not None:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def holding(self):
        """True while output must wait for the store (so closing must wait too)."""
        if self._discarding:
            return False
        store = self.store
        return bool(self._held) or (store is not None and store.must_hold)

    def _flush(self):
        """End of a loop turn: seal the store's epoch and write (or hold) every dirty connection."""
        self._flush_scheduled = False
        dirty = self._dirty
        self._dirty = []
        store = self.store
        if store is not None:
            if self._log_readers and store.next_offset != self._log_told:
                self._log_grew(store.next_offset)
            hold = store.must_hold
            eid = 0
            if store.pending:
                if store.seal_due:
                    eid = store.seal()
                elif not self._seal_scheduled:
                    # Nothing waits for this epoch: let a few turns share one hand-over.
                    self._seal_scheduled = True
                    self.loop.call_later(SEAL_DELAY, self._seal_later)
            if (hold or (self._held and dirty)) and not self._discarding:
                self._hold(eid or store.last_sealed, dirty)
                return
        for conn in dirty:
            conn.flush()

    def on_log_growth(self, callback):
        """Have `callback()` called at the end of each loop turn in which the commit log
        grew (readers that follow its end, like bridges; no call per record)."""
        self._log_readers.append(callback)
        if self.store is not None:
            self._log_told = self.store.next_offset

    def _log_grew(self, end):
        self._log_told = end
        for callback in self._log_readers:
            callback()

    def yield_turn(self, conn):
        """`conn` has read READ_TURN_BYTES: it reads again in the next loop turn.

        libuv reads a socket up to 32 times per wake-up while it stays full, so without
        this a few flooding publishers make one loop turn last half a second: timers
        (keepalive, the store's seal) fire late, the writer thread's reports wait, and
        every message of the turn stays in memory until it ends.
        """
        self._yielded.append(conn)
        if len(self._yielded) == 1:
            self.loop.call_soon(self._resume_yielded)

    def _resume_yielded(self):
        if not self._yielded:
            return
        store = self.store
        if store is not None and store.behind and store.wait_drained(self._resume_yielded):
            # The log writer is behind (a slow disk, or a flood on a busy machine): these
            # readers wait for it, so the records it has yet to write stay bounded.
            store.reader_waits += 1
            return
        conns = self._yielded
        self._yielded = []
        for conn in conns:
            conn.resume_turn()

    def throttle(self, conn):
        """`conn` is over its publish rate: give it its tokens' worth again at the next tick.

        One broker-wide tick every THROTTLE_TICK for all throttled clients, not a timer
        each: their input is decoded in one loop turn and leaves in one write per
        subscriber, so a flood of throttled clients costs a few wake-ups a tick.
        """
        self._throttled.append(conn)
        if self._throttle_handle is None:
            self._throttle_handle = self.loop.call_later(THROTTLE_TICK, self._throttle_tick)

    def _throttle_tick(self):
        self._throttle_handle = None
        conns = self._throttled
        self._throttled = []
        for conn in conns:
            if not conn.closing:
                conn.throttle_tick()

    def expect_connect(self, conn):
        """A new connection: have `conn.deadline(now)` called once its connect timeout is up.

        Every connection gets the same timeout, so arrivals wait in one FIFO (weakly
        held, nothing to cancel): a connect costs an append, not a loop timer. A client
        still connected then, with no keepalive check of its own yet, moves to `watch`.
        """
        self._arrivals.append((monotonic() + self.config.limits.connect_timeout, weakref.ref(conn)))
        if self._sweep_handle is None and self.loop is not None:
            self._sweep_handle = self.loop.call_later(DEADLINE_TICK, self._sweep)

    def watch(self, conn, at):
        """Call `conn.deadline(now)` within DEADLINE_TICK after monotonic time `at`.

        Keepalives share one coarse wheel instead of a loop timer per connection:
        idle clients only need checking a few times a second. Returns the tick to give
        `unwatch`.
        """
        tick = max(int(at / DEADLINE_TICK) + 1, self._swept + 1)
        due = self._deadlines.get(tick)
        if due is None:
            due = self._deadlines[tick] = set()
        due.add(conn)
        if self._sweep_handle is None and self.loop is not None:
            self._sweep_handle = self.loop.call_later(DEADLINE_TICK, self._sweep)
        return tick

    def unwatch(self, conn, tick):
        due = self._deadlines.get(tick)
        if due is not None:
            due.discard(conn)

    def _sweep(self):
        now = monotonic()
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= now:
            conn = arrivals.popleft()[1]()
            if conn is not None and not conn.watched:
                conn.deadline(now)
        last = int(now / DEADLINE_TICK)
        first = self._swept + 1
        self._swept = last
        deadlines = self._deadlines
        # After a quiet spell (no sweep running) the span can be long: walk the ticks
        # that have entries instead.
        ticks = range(first, last + 1) if last - first <= len(deadlines) else \
            sorted(t for t in deadlines if t <= last)
        for tick in ticks:
            due = deadlines.pop(tick, None)
            if due:
                for conn in due:
                    conn.deadline(now)
        if deadlines or arrivals:
            self._sweep_handle = self.loop.call_later(DEADLINE_TICK, self._sweep)
        else:
            self._sweep_handle = None

    def _seal_later(self):
        self._seal_scheduled = False
        store = self.store
        if store is None or not store.pending:
            return
        if store.seal_due:
            # Since the timer was set, the epoch got something output may have to wait
            # for (a PUBREC queued in this very loop turn, say): only _flush seals such an
            # epoch, because only it holds that output back. Sealing it here would
            # let _flush see an empty epoch and send the PUBREC before the commit.
            self._schedule_flush()
        else:
            store.seal()

    def _hold(self, eid, conns):
        group = []
        for conn in conns:
            data = conn.take_output()
            if data:
                group.append((conn, data))
            if conn.close_pending:
                conn.close_pending = False
                group.append((conn, None))
        if self._held and self._held[-1][0] == eid:
            self._held[-1][1].extend(group)
        else:
            self._held.append([eid, group])
        self.store.loop_holding = True

    def _on_durable(self, eid):
        """The store made epochs up to `eid` durable: release what they were holding."""
        held = self._held
        while held and held[0][0] <= eid:
            _, group = held.popleft()
            for conn, data in group:
                conn.write_now(data)
        if not held:
            self.store.loop_holding = False

    def _on_store_error(self, exc):
        """The disk failed us: nothing held may be sent (it was never made durable). Stop."""
        self.failed = exc
        self._held.clear()
        log.critical("stopping: the store can no longer make messages durable (%s)", exc)
        if self.running:
            self.spawn(self.stop())

    def _checkpoint(self):
        self._checkpoint_handle = None
        if not self.running or self.failed is not None:
            return
        try:
            self.router.persist.checkpoint()
        except Exception:
            log.exception("checkpoint failed")
        self._checkpoint_handle = self.loop.call_later(
            self.config.storage.checkpoint_interval_ms / 1000.0, self._checkpoint)

    def admit(self, listener_name):
        """One more connection on this listener within [limits] connection_rate?"""
        rate = self.config.limits.connection_rate
        now = self.loop.time()
        bucket = self._accept.get(listener_name)
        if bucket is None:
            bucket = self._accept[listener_name] = [rate, now]
        tokens = min(rate, bucket[0] + (now - bucket[1]) * rate)
        bucket[1] = now
        if tokens < 1:
            bucket[0] = tokens
            return False
        bucket[0] = tokens - 1
        return True

    def first_time(self, kind, key):
        """True the first time `key` (a client id, say) comes for `kind`: for log lines
        given once per client. Past FIRST_TIME_KEYS keys of a kind they are all forgotten
        (and may be logged again), so what clients send cannot grow it without bound."""
        seen = self._seen.get(kind)
        if seen is None:
            seen = self._seen[kind] = set()
        elif key in seen:
            return False
        elif len(seen) >= FIRST_TIME_KEYS:
            seen.clear()
        seen.add(key)
        return True

    def refused(self, conn, why):
        """Count a connection refused before CONNECT; log at most one line per second."""
        n = self.router.stats.refuse("refused_connections")
        if n:
            log.warning("refusing connections (%s): %d so far, latest from %s on %s", why,
                        n, conn.address, conn.listener_name,
                        extra={"event": "connection.refused", "address": conn.address,
                               "listener": conn.listener_name, "reason": why})

    def spawn(self, coro):
        """Run a coroutine for one connection (authentication); kept so it can be cancelled."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_timer(self, deadline):
        if self.loop is None:
            return
        if self._timer_at is not None and self._timer_at <= deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = self.loop.call_later(max(0.0, deadline - self.router.clock()), self._run_timers)

    def _run_timers(self):
        self._timer = None
        self._timer_at = None
        nxt = self.router.tick()
        if nxt is not None:
            self._on_timer(nxt)

    def _publish_sys(self):
        try:
            self.sys_topics.publish()
        except Exception:
            log.exception("publishing $SYS failed")
        self._sys_handle = self.loop.call_later(self.config.sys.interval, self._publish_sys)

    def listener_connections(self):
        """Open network connections per MQTT listener name (a CONNECT not yet read counts)."""
        counts = {lst.cfg.label: 0 for lst in self._servers if lst.serves_mqtt}
        for conn in self.connections:
            name = conn.listener_name
            counts[name] = counts.get(name, 0) + 1
        return counts

    def extra_sys_values(self):
        """More $SYS values from parts that plug in (commit log, cluster, bridges)."""
        values = {}
        for ext in self.extensions:
            values.update(ext.sys_values())
        values.update(self.hooks.sys_values())
        store = self.store
        if store is None:
            return values
        values.update({
            "$SYS/broker/log/end_offset": store.next_offset,
            "$SYS/broker/log/start_offset": store.start_offset,
            "$SYS/broker/log/appended": store.appended,
            "$SYS/broker/log/bytes_appended": store.bytes_appended,
            "$SYS/broker/log/retention/lost": store.lost_to_retention,
            "$SYS/broker/log/unwritten_bytes": store.unwritten_bytes,
            "$SYS/broker/log/writer_waits": store.reader_waits,
            "$SYS/broker/log/syncs": store.syncs,
            "$SYS/broker/log/sealed_syncs": store.sealed_syncs,
            "$SYS/broker/log/batches": store.batches,
            "$SYS/broker/log/writer_wakes": store.wakes,
        })
        if store.min_free:
            values["$SYS/broker/store/disk_free_bytes"] = store.disk_free
            values["$SYS/broker/store/disk_low"] = int(store.disk_low)
        if store.log is not None:
            values["$SYS/broker/log/segments"] = len(store.log.segments)
            values["$SYS/broker/log/truncated_bytes"] = store.log.truncated_bytes
        return values

    # --- embedding API ---------------------------------------------------------

    def publish(self, topic, payload=b"", qos=0, retain=False, properties=None, client=None):
        """Publish a message as the broker itself, or on behalf of `client` (a ClientInfo:
        its client id goes into the log; no ACL is asked); True if a subscriber matched."""
        if isinstance(payload, str):
            payload = payload.encode()
        return self.router.publish_internal(topic, payload, qos, retain, properties, client)

    def add_hook(self, hook):
        """Put `hook` (a hooks.Hook) in the chain, behind the ones already there; the
        assembly adds them before `start()`."""
        self.hooks.add(hook)

    def add_extension(self, extension):
        """Have `extension` (a hooks.Extension) started and stopped with the broker, in the
        order they are added (those with `before_listeners` before the others)."""
        self.extensions.append(extension)

    def reload_tls(self):
        """Re-read every TLS listener's certificate, key and CA (new handshakes use them;
        open connections are untouched). A listener whose files fail to load keeps its
        previous ones and logs why. True if all reloaded."""
        ok = True
        for listener in self._servers:
            ok = listener.reload_tls() and ok
        return ok

"""The Broker: owns the listeners, the router and the lifecycle; embeddable.

    async with Broker(config) as broker:
        broker.publish("hello/world", b"hi")
        await broker.serve_forever()
"""

import asyncio
import logging
import socket

from ..config import Config
from ..mqtt import constants as C
from .connection import Connection
from .hooks import HookChain
from .router import Router
from .sys import SysTopics

log = logging.getLogger("wrenmq.broker")


class Broker:
    def __init__(self, config=None, hooks=()):
        self.config = config if config is not None else Config()
        self.hooks = HookChain(hooks)
        self.router = Router(self.config, self.hooks)
        self.connections = set()
        self.loop = None
        self._servers = []
        self.addresses = []  # (host, port) actually bound, per listener
        self._dirty = []
        self._flush_scheduled = False
        self._timer = None
        self._timer_at = None
        self._sys = SysTopics(self)
        self._sys_handle = None
        self._tasks = set()
        self._stopped = None
        self.running = False

    # --- lifecycle -----------------------------------------------------------

    async def start(self):
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self.router.on_timer = self._on_timer
        for lst in self.config.listener:
            server = await self.loop.create_server(
                lambda lst=lst: Connection(self, lst), lst.bind, lst.port, backlog=4096,
                reuse_address=True)
            self._servers.append(server)
            sock = server.sockets[0]
            addr = sock.getsockname()
            self.addresses.append((addr[0], addr[1]))
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                log.info("listening on %s:%d", addr[0], addr[1])
        self.running = True
        if self.config.sys.interval > 0:
            self._publish_sys()
        return self

    async def stop(self):
        """Stop accepting, tell 5.0 clients 0x8B (server shutting down), close everything."""
        if not self.running:
            return
        self.running = False
        for server in self._servers:
            server.close()
        if self._sys_handle is not None:
            self._sys_handle.cancel()
        if self._timer is not None:
            self._timer.cancel()
        for conn in list(self.connections):
            conn.close(C.SERVER_SHUTTING_DOWN)
        self._flush()
        for _ in range(50):
            if not self.connections:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        if self._stopped is not None:
            self._stopped.set()
        log.info("broker stopped")

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

    def _flush(self):
        self._flush_scheduled = False
        dirty = self._dirty
        if not dirty:
            return
        self._dirty = []
        for conn in dirty:
            conn.flush()

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
            self._sys.publish()
        except Exception:
            log.exception("publishing $SYS failed")
        self._sys_handle = self.loop.call_later(self.config.sys.interval, self._publish_sys)

    def extra_sys_values(self):
        """More $SYS values from parts that plug in (commit log, cluster)."""
        return {}

    # --- embedding API ---------------------------------------------------------

    def publish(self, topic, payload=b"", qos=0, retain=False, properties=None):
        """Publish a message as the broker itself; True if a subscriber matched."""
        if isinstance(payload, str):
            payload = payload.encode()
        return self.router.publish_internal(topic, payload, qos, retain, properties)

    def add_hook(self, hook):
        self.hooks.add(hook)

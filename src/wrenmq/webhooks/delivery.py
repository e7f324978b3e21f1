"""One webhook endpoint: a bounded queue of events, and the task that POSTs them.

Events arrive as tuples (`put`, called from hook notifications on the broker's paths:
an append and a counter). The endpoint's task waits for `batch_delay` or a full batch,
turns up to `batch_size` events into one JSON array, POSTs it, and on a failure (a
status other than 2xx, a failed connection, a timeout) waits `retry_delay`, doubled
each time up to 30 s, and sends the same batch again, `retries` times; then the batch
is given up and its events counted as failed. While it retries, new events queue up to
`max_queued` events and `max_queued_bytes` of payloads; past either they are dropped
and counted. Order is kept: a batch is sent again before anything newer.
"""

import asyncio
import base64
import collections
import json
import logging
import time

from ..net.http_client import client_session

log = logging.getLogger("wrenmq.webhooks")

MAX_BACKOFF = 30.0
STOP_GRACE = 2.0  # seconds the broker's stop gives queued events to go out


class Endpoint:
    def __init__(self, cfg):
        self.cfg = cfg
        self.name = cfg.name
        self.queue = collections.deque()
        self.queued_bytes = 0
        self.sent = 0  # events the receiver took
        self.dropped = 0  # events refused because the queue was full
        self.failed = 0  # events given up after their retries
        self.failed_requests = 0  # POSTs that failed (each retry counts)
        self.session = None
        self.task = None
        self._wake = None
        self._stopping = False
        self._last_log = 0.0

    # --- on the broker's paths ----------------------------------------------------

    def put(self, event, size=0):
        cfg = self.cfg
        if len(self.queue) >= cfg.max_queued or self.queued_bytes + size > cfg.max_queued_bytes:
            self.dropped += 1
            return
        self.queue.append((event, size))
        self.queued_bytes += size
        wake = self._wake
        if wake is not None and not wake.is_set():
            wake.set()

    # --- the task ---------------------------------------------------------------------

    def start(self):
        cfg = self.cfg
        self.session = client_session(f"webhook {self.name}", cfg.timeout,
                                      {"Content-Type": "application/json", **cfg.headers}, limit=4)
        self._wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.task), STOP_GRACE)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            self.task.cancel()
        if self.queue:
            log.info("webhook %s: %d events not sent at stop", self.name, len(self.queue))
        if self.session is not None:
            await self.session.close()

    async def _run(self):
        cfg = self.cfg
        while True:
            if not self.queue:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self.queue) < cfg.batch_size and cfg.batch_delay and not self._stopping:
                await asyncio.sleep(cfg.batch_delay)
            batch = []
            size = 0
            q = self.queue
            while q and len(batch) < cfg.batch_size:
                event, n = q.popleft()
                batch.append(event)
                size += n
            try:
                body = json.dumps([render(e, cfg.payload) for e in batch], ensure_ascii=False).encode()
            except Exception:
                log.exception("webhook %s: could not make JSON of %d events", self.name, len(batch))
                self.failed += len(batch)
                self.queued_bytes -= size
                continue
            await self._deliver(batch, body)
            self.queued_bytes -= size

    async def _deliver(self, batch, body):
        cfg = self.cfg
        delay = cfg.retry_delay
        for attempt in range(cfg.retries + 1):
            why = await self._post(body)
            if why is None:
                self.sent += len(batch)
                return
            self.failed_requests += 1
            if attempt == cfg.retries or (self._stopping and attempt):
                break
            self._log(f"{why}; sending {len(batch)} events again in {delay:g} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)
        self.failed += len(batch)
        self._log(f"{why}; gave up {len(batch)} events after {cfg.retries} retries", force=True)

    async def _post(self, body):
        """None if the receiver took the batch, else why not."""
        try:
            async with self.session.post(self.cfg.url, data=body) as resp:
                await resp.read()
                if 200 <= resp.status < 300:
                    return None
                return f"HTTP {resp.status}"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    def _log(self, msg, force=False):
        now = time.monotonic()
        if force or now - self._last_log >= 1.0:
            self._last_log = now
            log.warning("webhook %s (%s): %s", self.name, self.cfg.url, msg,
                        extra={"event": "webhook.failed", "webhook": self.name})

    def sys_values(self):
        p = f"$SYS/broker/webhooks/{self.name}/"
        return {p + "sent": self.sent, p + "dropped": self.dropped, p + "failed": self.failed,
                p + "failed requests": self.failed_requests, p + "queued": len(self.queue)}


def _payload(data, how):
    if how == "base64":
        return base64.b64encode(data).decode("ascii")
    return data.decode("utf-8", "replace")


def render(event, payload_how):
    """The JSON object of one queued event (made in the endpoint's task, not on the
    path that raised the event). Field names follow EMQX's webhook plugin."""
    kind = event[0]
    ts = int(event[1] * 1000)
    if kind == "client.connected":
        _, _, cid, user, addr, listener, version, keepalive = event
        return {"action": "client_connected", "clientid": cid, "username": user,
                "ipaddress": addr.rpartition(":")[0] or addr, "peername": addr, "listener": listener,
                "proto_ver": version, "keepalive": keepalive, "connected_at": ts}
    if kind == "client.disconnected":
        _, _, cid, user, addr, reason = event
        return {"action": "client_disconnected", "clientid": cid, "username": user,
                "ipaddress": addr.rpartition(":")[0] or addr, "peername": addr, "reason": reason,
                "disconnected_at": ts}
    if kind == "session.subscribed":
        _, _, cid, user, topic, qos = event
        return {"action": "session_subscribed", "clientid": cid, "username": user, "topic": topic,
                "opts": {"qos": qos}, "ts": ts}
    if kind == "session.unsubscribed":
        _, _, cid, user, topic = event
        return {"action": "session_unsubscribed", "clientid": cid, "username": user, "topic": topic,
                "ts": ts}
    _, _, msg, cid, user, extra = event  # cid: the publisher's, or for a drop the receiver's
    out = {"action": "message_publish" if kind == "message.publish" else "message_dropped",
           "from_client_id": msg.client_id, "from_username": user, "topic": msg.topic,
           "qos": msg.qos, "retain": bool(msg.retain), "ts": ts}
    if payload_how != "none":
        out["payload"] = _payload(msg.payload, payload_how)
        out["payload_encoding"] = payload_how
    if kind == "message.dropped":
        out["to_client_id"] = cid
        out["reason"] = extra
    return out

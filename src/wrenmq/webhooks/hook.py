"""The Hook that turns broker events into webhook events for every [[webhook]].

Each notification checks which endpoints want the event (decided once, at start: a
tuple per kind) and appends a tuple to their queues. For messages (`on_publish`, which
returns the message unchanged, and `on_message_dropped`) a topic filter check comes
first; `$` topics are never sent. Only the kinds some endpoint wants are implemented
as hook methods of the instance's class, so an endpoint that wants client events only
adds nothing to the message path (HookChain skips hook points nobody implements).
"""

import time

from ..broker.hooks import Hook
from ..mqtt.topics import topic_matches
from .delivery import Endpoint

_OVERHEAD = 200  # bytes an event costs besides its payload, about (its tuple, the JSON later)


def _wants(filters):
    if tuple(filters) == ("#",):
        return lambda topic: True
    return lambda topic: any(topic_matches(f, topic) for f in filters)


class Webhooks(Hook):
    _METHODS = {"client.connected": "on_connect", "client.disconnected": "on_disconnect",
                "session.subscribed": "on_subscribe", "session.unsubscribed": "on_unsubscribe",
                "message.publish": "on_publish", "message.dropped": "on_message_dropped"}

    def __new__(cls, configs):
        # A subclass with only the notifications some endpoint wants: HookChain leaves the
        # others at None, so e.g. messages pay nothing for client-event webhooks.
        wanted = {m for c in configs for e in c.events for m in [cls._METHODS[e]]}
        methods = {name: getattr(_Notifications, name) for name in wanted}
        sub = type("Webhooks", (cls,), methods)
        return super().__new__(sub)

    def __init__(self, configs):
        self.endpoints = [Endpoint(c) for c in configs]
        by = {e: tuple(ep for ep in self.endpoints if e in ep.cfg.events) for e in self._METHODS}
        self._connected = by["client.connected"]
        self._disconnected = by["client.disconnected"]
        self._subscribed = by["session.subscribed"]
        self._unsubscribed = by["session.unsubscribed"]
        self._published = tuple((ep, _wants(ep.cfg.topics)) for ep in by["message.publish"])
        self._dropped = tuple((ep, _wants(ep.cfg.topics)) for ep in by["message.dropped"])

    async def start(self, broker):
        for ep in self.endpoints:
            ep.start()

    async def stop(self):
        for ep in self.endpoints:
            await ep.stop()

    def sys_values(self):
        values = {}
        totals = dict.fromkeys(("sent", "dropped", "failed", "failed requests", "queued"), 0)
        for ep in self.endpoints:
            for topic, value in ep.sys_values().items():
                values[topic] = value
                totals[topic.rpartition("/")[2]] += value
        for key, value in totals.items():
            values[f"$SYS/broker/webhooks/{key}"] = value
        return values


class _Notifications:
    """The hook methods Webhooks' subclass takes (those some endpoint wants)."""

    def on_connect(self, client):
        event = ("client.connected", time.time(), client.client_id, client.username, client.address,
                 client.listener, client.version, getattr(client, "keepalive", None))
        for ep in self._connected:
            ep.put(event)

    def on_disconnect(self, client, reason):
        event = ("client.disconnected", time.time(), client.client_id, client.username, client.address,
                 reason)
        for ep in self._disconnected:
            ep.put(event)

    def on_subscribe(self, client, topic_filter, qos):
        event = ("session.subscribed", time.time(), client.client_id, client.username, topic_filter, qos)
        for ep in self._subscribed:
            ep.put(event)

    def on_unsubscribe(self, client, topic_filter):
        event = ("session.unsubscribed", time.time(), client.client_id, client.username, topic_filter)
        for ep in self._unsubscribed:
            ep.put(event)

    def on_publish(self, client, message):
        topic = message.topic
        if client is not None and topic[:1] != "$":
            event = None
            for ep, wants in self._published:
                if wants(topic):
                    if event is None:
                        event = ("message.publish", time.time(), message, client.client_id,
                                 client.username, None)
                    ep.put(event, len(message.payload) + _OVERHEAD)
        return message

    def on_message_dropped(self, client, message, why):
        topic = message.topic
        if topic[:1] == "$":
            return
        event = None
        for ep, wants in self._dropped:
            if wants(topic):
                if event is None:
                    origin = message.origin
                    event = ("message.dropped", time.time(), message, client.client_id,
                             getattr(origin, "username", None), why)
                ep.put(event, len(message.payload) + _OVERHEAD)

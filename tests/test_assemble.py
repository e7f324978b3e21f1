"""The assembly (wrenmq/assemble.py): what `wrenmq.Broker` puts together around the core.

The broker core (broker/) knows the parts above it only through what it is given; a
program that embeds `wrenmq.Broker` gets them as `wrenmq serve` does.
"""

import asyncio
import json
import urllib.request

import pytest

from conftest import free_port
from wrenmq import Broker, Hook
from wrenmq.auth.hook import build_auth_hook
from wrenmq.broker import broker as core
from wrenmq.broker.hooks import Extension
from wrenmq.config import load
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Connect
from wrenmq.net import ListenerError


class Noted(Hook):
    """A hook that notes the clients it was asked about."""

    def __init__(self):
        self.asked = []

    def authenticate(self, client, connect):
        self.asked.append(client.client_id)
        return None


class Recorded(Extension):
    """An extension that records when it starts and stops, and whether the listeners
    were open then."""

    def __init__(self, log, name, before_listeners=False):
        self.log = log
        self.name = name
        self.before_listeners = before_listeners

    async def start(self, broker):
        self.log.append((self.name, "start", bool(broker.addresses)))

    async def stop(self):
        self.log.append((self.name, "stop"))


def test_an_embedded_broker_serves_the_admin_listener(make_broker):
    """`wrenmq.Broker` has the admin listener's type, as `wrenmq serve` has."""
    port = free_port()
    make_broker(f'[[listener]]\ntype = "admin"\nbind = "127.0.0.1"\nport = {port}\nanonymous = "read"\n')
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        assert r.status == 200
        assert json.load(r) == {"status": "ok"}


def test_the_core_names_a_listener_type_it_was_not_given():
    """The core broker opens only the types it has (its own, and those added to
    `listener_types`), and says which type it lacks, before any listener is open."""
    cfg = load(text=f'[[listener]]\nbind = "127.0.0.1"\nport = 0\n'
                    f'[[listener]]\ntype = "admin"\nbind = "127.0.0.1"\nport = {free_port()}\n'
                    'anonymous = "read"\n[storage]\nmode = "memory"\n')
    broker = core.Broker(cfg, build_auth_hook(cfg))

    async def start():
        with pytest.raises(ListenerError, match='listener\\[1\\].type: no listener of type "admin"'):
            await broker.start()
        return broker.addresses, broker.running

    assert "admin" not in broker.listener_types and "mqtt" in broker.listener_types
    addresses, running = asyncio.run(start())
    assert not running
    assert len(addresses) == 1  # the MQTT listener had opened, and was closed again


def test_hooks_go_behind_the_auth_hook(make_broker, raw_client):
    """The [auth] hook is first; a program's hooks are asked after it, in order."""
    first, second = Noted(), Noted()
    b = make_broker('[auth]\nallow_anonymous = true\n', hooks=[first, second])
    chain = b.broker.hooks.hooks
    assert chain[0] is b.broker.auth
    assert chain.index(first) < chain.index(second)
    c = raw_client(b.port)
    c.send(Connect("someone", C.MQTT311, True, 60))
    assert c.recv().reason_code == 0
    assert first.asked == second.asked == ["someone"]


def test_extensions_start_around_the_listeners_and_stop_in_reverse():
    """An extension with before_listeners starts before the listeners open and stops after
    the others (the cluster's place); the rest start once they are open."""
    log = []
    cfg = load(text='[[listener]]\nbind = "127.0.0.1"\nport = 0\n[storage]\nmode = "memory"\n')
    late = Recorded(log, "late")
    early = Recorded(log, "early", before_listeners=True)

    async def run():
        broker = Broker(cfg, extensions=[late, early])
        await broker.start()
        await broker.stop()

    asyncio.run(run())
    assert log == [("early", "start", False), ("late", "start", True), ("late", "stop"), ("early", "stop")]

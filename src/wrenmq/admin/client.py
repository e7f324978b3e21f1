"""A small asyncio MQTT client on the broker's own codec, for `wrenmq bench` and `wrenmq top`.

It speaks 3.1.1 or 5.0 to any broker (wrenmq, Mosquitto): connect, subscribe, publish at
QoS 0, 1 or 2 with a window of unacknowledged messages, and receive (acknowledging QoS
1 and 2 as the protocol asks). Received messages go to `on_message(topic, payload)`; a
lost connection ends `closed` (a future) with the reason.
"""

import asyncio

from ..mqtt import constants as C
from ..mqtt.codec import Decoder, MQTTError, encode
from ..mqtt.packets import (Connect, Disconnect, Pingreq, Puback, Pubcomp, Publish, Pubrec, Pubrel,
                            Subscribe, SubscribeTopic)


class ClientError(Exception):
    pass


class MqttClient(asyncio.Protocol):
    def __init__(self, client_id, version=C.MQTT311, on_message=None, window=100):
        self.client_id = client_id
        self.version = version
        self.on_message = on_message
        self.decoder = Decoder(version)
        self.transport = None
        self.loop = asyncio.get_running_loop()
        self.closed = self.loop.create_future()
        self._waiting = {}  # packet type -> future of the next one (CONNACK, SUBACK)
        self._next_pid = 0
        self._unacked = {}  # packet id -> QoS of our PUBLISHes not yet acknowledged
        self._room = asyncio.Event()  # set while fewer than `window` are unacknowledged
        self._room.set()
        self.window = window
        self._writable = asyncio.Event()
        self._writable.set()
        self.acked = 0  # our QoS 1/2 PUBLISHes acknowledged
        self._ping = None

    # --- connection ----------------------------------------------------------------

    @classmethod
    async def connect(cls, host, port, client_id, version=C.MQTT311, username=None, password=None,
                      keepalive=60, clean=True, on_message=None, window=100, timeout=10.0, ssl=None):
        loop = asyncio.get_running_loop()
        _, client = await asyncio.wait_for(
            loop.create_connection(lambda: cls(client_id, version, on_message, window), host, port, ssl=ssl),
            timeout)
        connack = client._expect(C.CONNACK)
        client._send(Connect(client_id, version, clean, keepalive, None, username,
                             password.encode() if isinstance(password, str) else password))
        pkt = await asyncio.wait_for(connack, timeout)
        if pkt.reason_code:
            client.transport.close()
            raise ClientError(f"{client_id}: CONNACK refused it: "
                              f"{C.REASON_NAMES.get(pkt.reason_code, hex(pkt.reason_code)) if version == C.MQTT5 else pkt.reason_code}")
        if keepalive:
            client._ping = loop.create_task(client._pinger(keepalive / 2))
        return client

    async def _pinger(self, every):
        while not self.closed.done():
            await asyncio.sleep(every)
            self._send(Pingreq())

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        if self._ping is not None:
            self._ping.cancel()
        if not self.closed.done():
            self.closed.set_result(exc)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ClientError(f"{self.client_id}: connection closed"))
        self._room.set()
        self._writable.set()

    def pause_writing(self):
        self._writable.clear()

    def resume_writing(self):
        self._writable.set()

    def _send(self, pkt):
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode(pkt, self.version))

    def _expect(self, kind):
        fut = self._waiting[kind] = self.loop.create_future()
        return fut

    def close(self):
        if self.transport is not None and not self.transport.is_closing():
            self._send(Disconnect())
            self.transport.close()

    # --- requests --------------------------------------------------------------------

    def _pid(self):
        for _ in range(65535):
            self._next_pid = self._next_pid % 65535 + 1
            if self._next_pid not in self._unacked:
                return self._next_pid
        raise ClientError("no free packet id")

    async def subscribe(self, filters, qos=0, timeout=10.0):
        suback = self._expect(C.SUBACK)
        self._send(Subscribe(self._pid(), [SubscribeTopic(f, qos) for f in filters]))
        pkt = await asyncio.wait_for(suback, timeout)
        bad = [f for f, rc in zip(filters, pkt.reason_codes) if rc >= 0x80]
        if bad:
            raise ClientError(f"{self.client_id}: subscription refused: {', '.join(bad)}")
        return pkt.reason_codes

    async def publish(self, topic, payload, qos=0, retain=False):
        """Send one PUBLISH; for QoS 1/2, first wait while `window` are unacknowledged."""
        if self.closed.done():
            raise ClientError(f"{self.client_id}: connection closed")
        if not self._writable.is_set():
            await self._writable.wait()
        pid = None
        if qos:
            while len(self._unacked) >= self.window:
                self._room.clear()
                await self._room.wait()
                if self.closed.done():
                    raise ClientError(f"{self.client_id}: connection closed")
            pid = self._pid()
            self._unacked[pid] = qos
        self._send(Publish(topic, payload, qos, retain, False, pid))

    async def drained(self, timeout):
        """Wait until every QoS 1/2 PUBLISH sent is acknowledged (or the timeout passes)."""
        deadline = self.loop.time() + timeout
        while self._unacked and self.loop.time() < deadline and not self.closed.done():
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), max(0.01, deadline - self.loop.time()))
            except asyncio.TimeoutError:
                break
        return not self._unacked

    # --- what arrives ------------------------------------------------------------------

    def data_received(self, data):
        try:
            packets = self.decoder.feed(data)
        except MQTTError as e:
            if not self.closed.done():
                self.closed.set_result(ClientError(f"{self.client_id}: bad data from the broker: {e}"))
            self.transport.abort()
            return
        for pkt in packets:
            t = pkt.TYPE
            if t == C.PUBLISH:
                if pkt.qos == 1:
                    self._send(Puback(pkt.packet_id))
                elif pkt.qos == 2:
                    self._send(Pubrec(pkt.packet_id))
                if self.on_message is not None:
                    self.on_message(pkt.topic, pkt.payload)
            elif t == C.PUBACK or t == C.PUBCOMP:
                if self._unacked.pop(pkt.packet_id, None) is not None:
                    self.acked += 1
                    self._room.set()
            elif t == C.PUBREC:
                self._send(Pubrel(pkt.packet_id))
            elif t == C.PUBREL:
                self._send(Pubcomp(pkt.packet_id))
            elif t == C.DISCONNECT:
                if not self.closed.done():
                    self.closed.set_result(ClientError(
                        f"{self.client_id}: the broker disconnected it "
                        f"({C.REASON_NAMES.get(pkt.reason_code, hex(pkt.reason_code))})"))
            else:
                fut = self._waiting.pop(t, None)
                if fut is not None and not fut.done():
                    fut.set_result(pkt)

"""Frames to other nodes held until the high watermark passes what they follow.

The broker holds what a loop turn produced for its clients until the store says the
turn's epoch is durable; with a replicated store that is when the high watermark has
passed it (replicated.py). A frame this node sends another node in that turn (a message
forwarded to its subscribers, a retained change, a session handed over, a route) must
wait the same way: a message seen on another node and then lost with this node's
uncommitted tail would be delivered there and never acknowledged here, and its
publisher's QoS 2 resend (to the node that takes the partition over, which never had
the message) would be delivered a second time.

`CommitGate` keeps, per peer, the frames written in order behind the epoch they follow
(`write`), and writes them once the store's `durable_id` (the last epoch released at the
HW) reaches it (`released`, called by the store's on_durable). A frame of a record the
HW has passed already (a replay of committed records) follows with epoch 0: it waits
only behind what was held before it. Without replication (`[cluster] replicas = 1`) no
gate exists and links write as before.
"""

import asyncio
import collections


class CommitGate:
    def __init__(self, store):
        self.store = store
        self.held = {}  # peer name -> deque of [epoch id, link, [frames], bytes, [callbacks] or None]
        self.held_bytes = {}  # peer name -> bytes held
        inner = store.on_durable

        def on_durable(eid):
            inner(eid)
            self.released()

        store.on_durable = on_durable

    def now(self):
        """The epoch that what is produced now belongs to: the one being filled, or if it
        is empty, the last one sealed."""
        store = self.store
        return store.epoch_id if store.pending else store.last_sealed

    def write(self, peer, link, frames, eid=None):
        """Write `frames` (a list of bytes) on `link` (peer's link) once epoch `eid` (None:
        `now()`) is committed, after whatever is held for the peer."""
        if eid is None:
            eid = self.now()
        name = peer.name
        queue = self.held.get(name)
        if not queue and self.store.durable_id >= eid:
            t = link.transport
            if len(frames) == 1:
                t.write(frames[0])
            else:
                t.writelines(frames)
            return
        if queue is None:
            queue = self.held[name] = collections.deque()
        n = sum(map(len, frames))
        if queue and queue[-1][0] == eid and queue[-1][1] is link and queue[-1][4] is None:
            queue[-1][2].extend(frames)
            queue[-1][3] += n
        else:
            queue.append([eid, link, list(frames), n, None])
        self.held_bytes[name] = self.held_bytes.get(name, 0) + n

    def after_held(self, peer, callback):
        """Call `callback` once what is held for `peer` now has been written (at once if
        nothing is held), or its link went meanwhile; never if the gate is discarded."""
        queue = self.held.get(peer.name)
        if not queue:
            callback()
            return
        last = queue[-1]
        if last[4] is None:
            last[4] = []
        last[4].append(callback)

    def pending(self, peer):
        """Bytes held for `peer` (they count against its link_buffer)."""
        return self.held_bytes.get(peer.name, 0)

    def released(self):
        """The store released epochs up to its `durable_id`: write what waited for them."""
        if not self.held:
            return
        durable = self.store.durable_id
        for name, queue in list(self.held.items()):
            freed = 0
            while queue and queue[0][0] <= durable:
                _, link, frames, n, callbacks = queue.popleft()
                freed += n
                t = link.transport
                if t is not None and not t.is_closing():
                    t.writelines(frames)
                # (else the link went: what the log records is replayed on the next one)
                if callbacks is not None:
                    for callback in callbacks:
                        callback()
            if freed:
                left = self.held_bytes[name] - freed
                if queue:
                    self.held_bytes[name] = left
                else:
                    del self.held[name]
                    del self.held_bytes[name]

    async def drained(self, timeout):
        """Until nothing is held (the HW passed it all) or `timeout` seconds: a broker that
        stops cleanly writes what it held before its links close."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.held and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def discard(self):
        """The leadership is over: what is held was never committed and is never sent."""
        self.held.clear()
        self.held_bytes.clear()

    def forget(self, peer):
        """The peer left: nothing held for it is sent (what waited for it goes on)."""
        queue = self.held.pop(peer.name, None)
        self.held_bytes.pop(peer.name, None)
        for entry in queue or ():
            for callback in entry[4] or ():
                callback()

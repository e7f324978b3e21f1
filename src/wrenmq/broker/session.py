"""Session state: what the broker keeps for one client id across connections.

Pure data plus the small amount of bookkeeping that belongs to it (packet id
allocation, the outgoing window). The router drives it; no I/O happens here.
"""


NEVER = 0xFFFFFFFF  # session expiry interval meaning "does not expire"
_NO_IDS = frozenset()


class Subscription:
    """One subscription of one session; `group` is the share name for $share filters."""

    __slots__ = ("filter", "qos", "no_local", "retain_as_published", "retain_handling",
                 "sub_id", "group", "session", "since", "created")

    def __init__(self, filter, qos, no_local=False, retain_as_published=False, retain_handling=0,
                 sub_id=None, group=None, session=None):
        self.filter = filter
        self.qos = qos
        self.no_local = no_local
        self.retain_as_published = retain_as_published
        self.retain_handling = retain_handling
        self.sub_id = sub_id
        self.group = group
        self.session = session
        self.since = 0  # log offset when subscribed: earlier messages are not for it
        # Wall clock when a client made it here (0: restored or handed over, older than
        # anything): a message another node replays from its log is not for it if older.
        self.created = 0.0

    @property
    def full_filter(self):
        return f"$share/{self.group}/{self.filter}" if self.group else self.filter


# A queue entry's own cost in bytes (the Outgoing and its slot in the deque), what
# `[limits] queue_memory` counts per entry besides the message it holds (Message.memory).
QUEUE_ENTRY_COST = 128


class Outgoing:
    """A QoS 1/2 message sent (or about to be sent) to the session's client."""

    __slots__ = ("msg", "qos", "retain", "sub_ids", "packet_id", "released", "group", "tracked",
                 "size", "maybe_sent")

    def __init__(self, msg, qos, retain, sub_ids=(), group=None, tracked=True):
        self.msg = msg
        self.qos = qos
        self.retain = retain
        self.sub_ids = sub_ids
        self.packet_id = 0
        # QoS 2: PUBREC received, PUBREL sent; the client owns the message now.
        self.released = False
        # The SharedGroup it was chosen by, so it can go to another member if unacknowledged.
        self.group = group
        # Delivered in log order by a subscription of this session (not retained-on-subscribe,
        # not shared): the session's log cursor must not pass it until it is acknowledged.
        self.tracked = tracked and group is None
        # What it counts against its session's bounds (`max_queued_bytes`,
        # `max_inflight_bytes`): payload and topic, as if the message were its own. The
        # broker-wide `queue_memory` counts a shared message once (Queues.push).
        self.size = len(msg.payload) + len(msg.topic) + 64
        # May have reached the client before a restart: send it with DUP set.
        self.maybe_sent = False


class RetainedMatch:
    """The retained messages one SUBSCRIBE matched for one subscription, not sent yet.

    They stand in the session's queue after the messages queued before the SUBSCRIBE:
    they go once `until` entries have left the queue (Session.dequeued), and whatever is
    routed to the session meanwhile waits behind them. `walk` finds them in the retained
    tree a few at a time (RetainedTrie.walk, started when their turn comes, skipping what
    was retained after version `since`: the subscription was sent it live); `held` is what
    the walk holds (references to nodes), `counted` what the router counts of it in
    queue_memory; `waiting` a message taken from the walk that the client's window or
    socket had no room for yet."""

    __slots__ = ("sub", "until", "since", "walk", "held", "counted", "waiting")

    def __init__(self, sub, until, since):
        self.sub = sub
        self.until = until
        self.since = since
        self.walk = None
        self.held = 0
        self.counted = 0
        self.waiting = None


class Session:
    __slots__ = (
        "client_id", "client_b", "version", "v5", "conn", "subscriptions", "expiry_interval",
        "expires_at", "will", "will_delay", "will_at", "inflight", "queue", "incoming_qos2", "next_pid",
        "send_quota", "max_packet_out", "alias_in", "alias_out", "alias_out_max",
        "topic_alias_in_max", "receive_max_in", "username", "address", "connected_at",
        "dropped", "generation", "request_problem_info", "listener", "stored", "resume_from",
        "skip_offsets", "restored_qos2", "match_cache", "cursor_saved", "resend",
        "queued_bytes", "inflight_bytes", "replay_dup_below", "will_held", "retained_due", "retained_at",
        "dequeued",
    )

    def __init__(self, client_id):
        self.client_id = client_id
        self.client_b = client_id.encode()  # (the log records it with every message)
        self.version = 4
        self.v5 = False
        self.conn = None  # the Connection while the client is online
        self.subscriptions = {}  # full filter -> Subscription
        self.expiry_interval = 0  # seconds after disconnect; NEVER = keep forever
        self.expires_at = None  # monotonic deadline while offline
        self.will = None  # Message to publish if the connection fails
        self.will_delay = 0  # will delay interval (s) from CONNECT
        self.will_at = None  # monotonic deadline of a delayed will
        self.will_held = 0  # what the router counts for it in held_will_bytes while will_at is set
        self.inflight = {}  # packet id -> Outgoing, in send order
        # Containers most sessions never use start as shared empty ones (a deque costs
        # 600 bytes, a set 200): the router swaps in a real one on first use.
        self.queue = ()  # Outgoing waiting for a window slot or for the client (a deque)
        self.resend = ()  # packet ids in `inflight` still to be resent after a reconnect
        self.queued_bytes = 0  # sizes of the Outgoing in `queue`
        self.dequeued = 0  # entries taken from the front of `queue` so far (RetainedMatch.until)
        # The retained messages its SUBSCRIBEs matched, still to send while the client is
        # connected: full filter -> RetainedMatch, in the order of the SUBSCRIBEs (None
        # when there are none); and the deadline of the timer that sends the next loop
        # turn's share of them (one share a turn, however many acknowledgements or
        # SUBSCRIBEs ask for more), None when none is set.
        self.retained_due = None
        self.retained_at = None
        self.inflight_bytes = 0  # sizes of the Outgoing in `inflight`
        self.replay_dup_below = 0  # log offsets below this, read back after a restart, get DUP
        self.incoming_qos2 = _NO_IDS  # packet ids PUBRECed, waiting for PUBREL (a set)
        self.next_pid = 1
        # Per-connection limits, reset on every CONNECT.
        self.send_quota = 65535
        self.max_packet_out = 0  # 0: no limit announced by the client
        self.alias_in = None  # inbound topic aliases (dict), per connection
        self.alias_out = None  # outbound topic aliases (dict) when the client allows them
        self.alias_out_max = 0
        self.topic_alias_in_max = 0
        self.receive_max_in = 65535
        self.username = None
        self.address = None
        self.connected_at = 0.0
        self.dropped = 0
        self.generation = 0  # bumped on every attach; stale timers compare it
        self.request_problem_info = True
        self.listener = None
        # Persistence (only with [storage] mode = "disk"):
        self.stored = False  # has a row in the state database
        self.resume_from = None  # log offset to catch up from (messages not in memory)
        self.skip_offsets = None  # log offsets handled by restored QoS 2 state
        self.restored_qos2 = _NO_IDS  # inbound QoS 2 ids known before a restart (a set)
        self.match_cache = None  # topic -> matching subscriptions, for catch-up
        self.cursor_saved = None

    @property
    def online(self):
        return self.conn is not None

    def add_incoming_qos2(self, pid):
        if not self.incoming_qos2:
            self.incoming_qos2 = set()
        self.incoming_qos2.add(pid)

    def release_incoming_qos2(self, pid):
        """Forget an inbound QoS 2 id (PUBREL); True if it was known."""
        known = False
        if pid in self.incoming_qos2:
            self.incoming_qos2.discard(pid)
            known = True
        if pid in self.restored_qos2:
            self.restored_qos2.discard(pid)
            known = True
        return known

    def add_restored_qos2(self, pid):
        if not self.restored_qos2:
            self.restored_qos2 = set()
        self.restored_qos2.add(pid)

    def take_inflight(self, pid):
        """Remove and return the Outgoing with packet id `pid` (None if unknown)."""
        out = self.inflight.pop(pid, None)
        if out is not None:
            self.inflight_bytes -= out.size
        return out

    def allocate_pid(self):
        """Next free packet identifier for an outgoing QoS > 0 PUBLISH."""
        pid = self.next_pid
        inflight = self.inflight
        for _ in range(65535):
            if pid not in inflight:
                break
            pid = pid + 1 if pid < 65535 else 1
        else:
            raise RuntimeError("no free packet identifier")
        self.next_pid = pid + 1 if pid < 65535 else 1
        return pid

    def __repr__(self):
        return f"Session({self.client_id!r}, online={self.online}, subs={len(self.subscriptions)})"

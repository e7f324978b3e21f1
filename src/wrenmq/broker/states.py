"""A client connection's states as data: what the client may send in each, and how the
state moves on.

    NEW --CONNECT--> AUTH --CONNACK sent--> OPEN
     \\               \\                      \\
      `---------------`----------------------`--close--> CLOSED

NEW: nothing but a CONNECT may come first. AUTH: the CONNECT is being authenticated
(a hook, an enhanced authentication exchange, a session handed over by another node);
what the client sends meanwhile waits undecoded, except during an enhanced
authentication exchange, when only AUTH and DISCONNECT may come. OPEN: the session is
the client's; a second CONNECT, or a packet only a server sends, is a protocol error.

`check` is the one place a packet type is checked against the state; for OPEN, where
every packet of the client comes, `dispatch_table` turns the same table into one list
lookup per packet.
"""

from ..mqtt import constants as C
from ..mqtt.codec import MQTTError

NEW, AUTH, OPEN, CLOSED = range(4)
NAMES = ("NEW", "AUTH", "OPEN", "CLOSED")

# What a client may send in each state (packet types).
ALLOWED = {
    NEW: frozenset({C.CONNECT}),
    AUTH: frozenset({C.AUTH, C.DISCONNECT}),
    OPEN: frozenset({C.PUBLISH, C.PUBACK, C.PUBREC, C.PUBREL, C.PUBCOMP, C.SUBSCRIBE, C.UNSUBSCRIBE,
                     C.PINGREQ, C.DISCONNECT, C.AUTH}),
    CLOSED: frozenset(),
}

# What moves the state: a CONNECT decoded, the CONNACK that accepts it sent, the
# connection closed (from any state, once or more).
CONNECT_RECEIVED, ACCEPTED, CLOSE = "CONNECT received", "accepted", "closed"
TRANSITIONS = {
    NEW: {CONNECT_RECEIVED: AUTH, CLOSE: CLOSED},
    AUTH: {ACCEPTED: OPEN, CLOSE: CLOSED},
    OPEN: {CLOSE: CLOSED},
    CLOSED: {CLOSE: CLOSED},
}


def advance(state, event):
    """The state `event` leads to from `state`; a move the table does not have is a bug
    in the broker, not the client's doing (RuntimeError)."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise RuntimeError(f"connection state {NAMES[state]}: no move on {event!r}") from None


def check(state, ptype):
    """Raise MQTTError (protocol error) unless a client may send a packet of type
    `ptype` in `state`."""
    if ptype not in ALLOWED[state]:
        raise MQTTError(C.PROTOCOL_ERROR, f"{C.PACKET_NAMES.get(ptype, ptype)} from a client in state "
                                          f"{NAMES[state]}")


def unexpected(session, pkt):
    """What `dispatch_table` gives the packet types a client may not send in OPEN."""
    check(OPEN, pkt.TYPE)


def dispatch_table(handlers):
    """The handler of each packet type (a list of 16) for an OPEN connection: `handlers`
    (packet type -> handler(session, packet)) for what a client may send, None for what
    the connection handles itself (AUTH), `unexpected` for the rest."""
    table = [unexpected] * 16
    for ptype in ALLOWED[OPEN]:
        table[ptype] = handlers.get(ptype)
    missing = ALLOWED[OPEN] - set(handlers) - {C.AUTH}
    if missing:
        raise ValueError(f"no handler for {sorted(C.PACKET_NAMES[t] for t in missing)}")
    return table

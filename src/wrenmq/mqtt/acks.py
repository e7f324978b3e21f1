"""The acknowledgements sent for every message, as bytes, without a packet object.

PUBACK, PUBREC, PUBREL and PUBCOMP are the packet id and, from a 5.0 peer, a reason code
that is left out when it is 0 (success) and no properties go with it: four bytes or
five. The broker sends one or two per QoS 1/2 message, so they are packed in one C call
each (`struct`); the general encoder (`codec.encode` of a Puback, ...) is for the ones
with properties. PINGRESP, PINGREQ and the CONNACK of an accepted 3.1.1 connection
never vary: they are constants.
"""

from struct import Struct

_pack_ack = Struct("!BBH").pack
_pack_ack_reason = Struct("!BBHB").pack

PINGREQ = b"\xc0\x00"
PINGRESP = b"\xd0\x00"
# A 3.1.1 CONNACK accepting the connection, by session present (0, 1).
CONNACK_311_ACCEPTED = (b"\x20\x02\x00\x00", b"\x20\x02\x01\x00")


def puback(packet_id, reason=0, v5=False):
    """PUBACK for `packet_id`; `reason` goes only to a 5.0 peer (`v5`), and only if not 0."""
    if reason and v5:
        return _pack_ack_reason(0x40, 3, packet_id, reason)
    return _pack_ack(0x40, 2, packet_id)


def pubrec(packet_id, reason=0, v5=False):
    """PUBREC for `packet_id` (as `puback`)."""
    if reason and v5:
        return _pack_ack_reason(0x50, 3, packet_id, reason)
    return _pack_ack(0x50, 2, packet_id)


def pubrel(packet_id, reason=0, v5=False):
    """PUBREL for `packet_id` (as `puback`; its fixed header's flags are 0010)."""
    if reason and v5:
        return _pack_ack_reason(0x62, 3, packet_id, reason)
    return _pack_ack(0x62, 2, packet_id)


def pubcomp(packet_id, reason=0, v5=False):
    """PUBCOMP for `packet_id` (as `puback`)."""
    if reason and v5:
        return _pack_ack_reason(0x70, 3, packet_id, reason)
    return _pack_ack(0x70, 2, packet_id)

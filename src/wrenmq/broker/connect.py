"""What the broker grants a CONNECT, from the packet and the configuration alone.

`ConnectTerms.terms` checks what the client asks for against [limits] and [broker]
(client id, keepalive, session expiry) and says what it gets, and what the CONNACK must
tell it; `apply_client_limits` puts what the client says of itself (receive maximum,
maximum packet size, topic aliases) on its session; `connack` encodes the answer. The
router does the rest (the session, a takeover). Nothing here keeps state between
connects but the encoded CONNACKs most of them get.
"""

import os

from ..mqtt import constants as C
from ..mqtt.acks import CONNACK_311_ACCEPTED
from ..mqtt.codec import ConnectRefused, encode
from ..mqtt.packets import Connack
from .session import NEVER


class ConnectTerms:
    """The broker's side of every CONNECT."""

    __slots__ = ("limits", "broker", "_connack_v5")

    def __init__(self, config):
        self.limits = config.limits
        self.broker = config.broker
        # The two 5.0 CONNACKs most connects get (only the broker's own properties), by
        # session present (0, 1).
        self._connack_v5 = tuple(encode(Connack(present, 0, self.connack_properties()), C.MQTT5)
                                 for present in (False, True))

    def terms(self, pkt):
        """(client id, keepalive, session expiry interval, CONNACK properties) for `pkt`:
        what it asked for within what is allowed; the properties tell a 5.0 client what it
        got instead (an assigned client id, the server's keepalive, a shorter expiry).
        Raises ConnectRefused (the reason for the CONNACK) when it cannot be accepted."""
        limits = self.limits
        v5 = pkt.version == C.MQTT5
        cid = pkt.client_id
        props = {}
        if limits.max_client_id_length and len(cid) > limits.max_client_id_length // 4 and \
                len(cid.encode()) > limits.max_client_id_length:
            raise ConnectRefused(C.CLIENT_IDENTIFIER_NOT_VALID, "client id too long", pkt.version)
        if not cid:
            if not v5 and not pkt.clean_start:
                raise ConnectRefused(C.CLIENT_IDENTIFIER_NOT_VALID, "empty client id without clean session",
                                     pkt.version)
            cid = "wrenmq-" + os.urandom(9).hex()
            if v5:
                props["assigned_client_identifier"] = cid
        keepalive = pkt.keepalive
        if limits.max_keepalive < 65535 and (keepalive == 0 or keepalive > limits.max_keepalive):
            if not v5:
                # 3.1.1 has no way to tell the client another keepalive.
                raise ConnectRefused(C.CLIENT_IDENTIFIER_NOT_VALID, "keepalive over max_keepalive",
                                     pkt.version)
            keepalive = limits.max_keepalive
            props["server_keep_alive"] = keepalive
        if v5:
            expiry = pkt.properties.get("session_expiry_interval", 0) if pkt.properties else 0
        else:
            expiry = 0 if pkt.clean_start else NEVER
        if expiry > limits.max_session_expiry:
            expiry = limits.max_session_expiry
            if v5:
                props["session_expiry_interval"] = expiry
        return cid, keepalive, expiry, props

    def apply_client_limits(self, session, pkt):
        """What the client's CONNECT says it takes (receive maximum, maximum packet size,
        topic aliases) and what the broker lets it send, on its session for this
        connection."""
        limits = self.limits
        session.alias_in = None
        session.alias_out = None
        session.receive_max_in = limits.receive_maximum
        session.topic_alias_in_max = limits.topic_alias_maximum if pkt.version == C.MQTT5 else 0
        cprops = pkt.properties
        if cprops:
            session.send_quota = min(cprops.get("receive_maximum", 65535), limits.max_inflight)
            session.max_packet_out = cprops.get("maximum_packet_size", 0)
            session.alias_out_max = cprops.get("topic_alias_maximum", 0)
            if session.alias_out_max:
                session.alias_out = {}
            session.request_problem_info = bool(cprops.get("request_problem_information", 1))
        else:  # 3.1.1 has none of these properties, and many 5.0 clients send none
            session.send_quota = min(65535, limits.max_inflight)
            session.max_packet_out = 0
            session.alias_out_max = 0
            session.request_problem_info = True

    def connack(self, version, present, props, auth_props=None):
        """The CONNACK accepting a connection: `props` from `terms`, `auth_props` from an
        enhanced authentication."""
        if version != C.MQTT5:
            return CONNACK_311_ACCEPTED[present]
        if not props and not auth_props:
            return self._connack_v5[present]
        props.update(self.connack_properties())
        if auth_props:
            props.update(auth_props)
        return encode(Connack(present, 0, props), C.MQTT5)

    def connack_properties(self):
        """What a 5.0 CONNACK tells every client of the broker's limits and features."""
        limits = self.limits
        b = self.broker
        props = {
            "receive_maximum": limits.receive_maximum,
            "topic_alias_maximum": limits.topic_alias_maximum,
            "maximum_packet_size": limits.max_packet_size,
        }
        if b.maximum_qos < 2:
            props["maximum_qos"] = b.maximum_qos
        if not b.retain_available:
            props["retain_available"] = 0
        if not b.wildcard_subscriptions:
            props["wildcard_subscription_available"] = 0
        if not b.subscription_identifiers:
            props["subscription_identifier_available"] = 0
        if not b.shared_subscriptions:
            props["shared_subscription_available"] = 0
        return props

"""MQTT wire constants: packet types, protocol levels, reason codes and properties.

Plain integers (not enums) because they sit on the hot path; `REASON_NAMES`
and `PACKET_NAMES` give the readable names for logs and errors.
"""

# Protocol levels as carried in CONNECT.
MQTT31 = 3  # protocol name "MQIsdp"
MQTT311 = 4
MQTT5 = 5

# Packet types (upper nibble of the fixed header).
CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14
AUTH = 15

PACKET_NAMES = {
    CONNECT: "CONNECT", CONNACK: "CONNACK", PUBLISH: "PUBLISH", PUBACK: "PUBACK",
    PUBREC: "PUBREC", PUBREL: "PUBREL", PUBCOMP: "PUBCOMP", SUBSCRIBE: "SUBSCRIBE",
    SUBACK: "SUBACK", UNSUBSCRIBE: "UNSUBSCRIBE", UNSUBACK: "UNSUBACK", PINGREQ: "PINGREQ",
    PINGRESP: "PINGRESP", DISCONNECT: "DISCONNECT", AUTH: "AUTH",
}

MAX_REMAINING_LENGTH = 268_435_455
MAX_PACKET_ID = 65535

# --- Reason codes (MQTT 5.0 section 2.4) ---------------------------------
SUCCESS = 0x00
NORMAL_DISCONNECTION = 0x00
GRANTED_QOS_0 = 0x00
GRANTED_QOS_1 = 0x01
GRANTED_QOS_2 = 0x02
DISCONNECT_WITH_WILL = 0x04
NO_MATCHING_SUBSCRIBERS = 0x10
NO_SUBSCRIPTION_EXISTED = 0x11
CONTINUE_AUTHENTICATION = 0x18
REAUTHENTICATE = 0x19
UNSPECIFIED_ERROR = 0x80
MALFORMED_PACKET = 0x81
PROTOCOL_ERROR = 0x82
IMPLEMENTATION_SPECIFIC_ERROR = 0x83
UNSUPPORTED_PROTOCOL_VERSION = 0x84
CLIENT_IDENTIFIER_NOT_VALID = 0x85
BAD_USER_NAME_OR_PASSWORD = 0x86
NOT_AUTHORIZED = 0x87
SERVER_UNAVAILABLE = 0x88
SERVER_BUSY = 0x89
BANNED = 0x8A
SERVER_SHUTTING_DOWN = 0x8B
BAD_AUTHENTICATION_METHOD = 0x8C
KEEP_ALIVE_TIMEOUT = 0x8D
SESSION_TAKEN_OVER = 0x8E
TOPIC_FILTER_INVALID = 0x8F
TOPIC_NAME_INVALID = 0x90
PACKET_IDENTIFIER_IN_USE = 0x91
PACKET_IDENTIFIER_NOT_FOUND = 0x92
RECEIVE_MAXIMUM_EXCEEDED = 0x93
TOPIC_ALIAS_INVALID = 0x94
PACKET_TOO_LARGE = 0x95
MESSAGE_RATE_TOO_HIGH = 0x96
QUOTA_EXCEEDED = 0x97
ADMINISTRATIVE_ACTION = 0x98
PAYLOAD_FORMAT_INVALID = 0x99
RETAIN_NOT_SUPPORTED = 0x9A
QOS_NOT_SUPPORTED = 0x9B
USE_ANOTHER_SERVER = 0x9C
SERVER_MOVED = 0x9D
SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
CONNECTION_RATE_EXCEEDED = 0x9F
MAXIMUM_CONNECT_TIME = 0xA0
SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2

REASON_NAMES = {
    0x00: "Success", 0x01: "Granted QoS 1", 0x02: "Granted QoS 2",
    0x04: "Disconnect with Will Message", 0x10: "No matching subscribers",
    0x11: "No subscription existed", 0x18: "Continue authentication", 0x19: "Re-authenticate",
    0x80: "Unspecified error", 0x81: "Malformed Packet", 0x82: "Protocol Error",
    0x83: "Implementation specific error", 0x84: "Unsupported Protocol Version",
    0x85: "Client Identifier not valid", 0x86: "Bad User Name or Password",
    0x87: "Not authorized", 0x88: "Server unavailable", 0x89: "Server busy", 0x8A: "Banned",
    0x8B: "Server shutting down", 0x8C: "Bad authentication method",
    0x8D: "Keep Alive timeout", 0x8E: "Session taken over", 0x8F: "Topic Filter invalid",
    0x90: "Topic Name invalid", 0x91: "Packet Identifier in use",
    0x92: "Packet Identifier not found", 0x93: "Receive Maximum exceeded",
    0x94: "Topic Alias invalid", 0x95: "Packet too large", 0x96: "Message rate too high",
    0x97: "Quota exceeded", 0x98: "Administrative action", 0x99: "Payload format invalid",
    0x9A: "Retain not supported", 0x9B: "QoS not supported", 0x9C: "Use another server",
    0x9D: "Server moved", 0x9E: "Shared Subscriptions not supported",
    0x9F: "Connection rate exceeded", 0xA0: "Maximum connect time",
    0xA1: "Subscription Identifiers not supported",
    0xA2: "Wildcard Subscriptions not supported",
}

# Reason codes each 5.0 packet may carry (anything else is a malformed packet).
VALID_REASONS = {
    CONNACK: frozenset({0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A,
                        0x8C, 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}),
    PUBACK: frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    PUBREC: frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    PUBREL: frozenset({0x00, 0x92}),
    PUBCOMP: frozenset({0x00, 0x92}),
    SUBACK: frozenset({0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}),
    UNSUBACK: frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91}),
    DISCONNECT: frozenset({0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F,
                           0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D,
                           0x9E, 0x9F, 0xA0, 0xA1, 0xA2}),
    AUTH: frozenset({0x00, 0x18, 0x19}),
}

# MQTT 3.1.1 CONNACK return codes.
CONNACK_ACCEPTED = 0
CONNACK_REFUSED_PROTOCOL_VERSION = 1
CONNACK_REFUSED_IDENTIFIER_REJECTED = 2
CONNACK_REFUSED_SERVER_UNAVAILABLE = 3
CONNACK_REFUSED_BAD_USERNAME_PASSWORD = 4
CONNACK_REFUSED_NOT_AUTHORIZED = 5

# How a 5.0 CONNACK reason maps onto a 3.1.1 return code.
V5_TO_V311_CONNACK = {
    0x00: 0, 0x84: 1, 0x85: 2, 0x88: 3, 0x89: 3, 0x8B: 3, 0x97: 3, 0x86: 4, 0x87: 5, 0x8A: 5, 0x8C: 5,
}

# --- Properties (MQTT 5.0 section 2.2.2.2) --------------------------------
# Value kinds.
BYTE, TWO, FOUR, VARINT, STRING, BINARY, PAIR = range(7)

PROPERTIES = {
    # id: (name, kind, packets that may carry it; WILL is the will properties in CONNECT)
    0x01: ("payload_format_indicator", BYTE, "PW"),
    0x02: ("message_expiry_interval", FOUR, "PW"),
    0x03: ("content_type", STRING, "PW"),
    0x08: ("response_topic", STRING, "PW"),
    0x09: ("correlation_data", BINARY, "PW"),
    0x0B: ("subscription_identifier", VARINT, "PS"),
    0x11: ("session_expiry_interval", FOUR, "CKD"),
    0x12: ("assigned_client_identifier", STRING, "K"),
    0x13: ("server_keep_alive", TWO, "K"),
    0x15: ("authentication_method", STRING, "CKA"),
    0x16: ("authentication_data", BINARY, "CKA"),
    0x17: ("request_problem_information", BYTE, "C"),
    0x18: ("will_delay_interval", FOUR, "W"),
    0x19: ("request_response_information", BYTE, "C"),
    0x1A: ("response_information", STRING, "K"),
    0x1C: ("server_reference", STRING, "KD"),
    0x1F: ("reason_string", STRING, "KRTDA"),
    0x21: ("receive_maximum", TWO, "CK"),
    0x22: ("topic_alias_maximum", TWO, "CK"),
    0x23: ("topic_alias", TWO, "P"),
    0x24: ("maximum_qos", BYTE, "K"),
    0x25: ("retain_available", BYTE, "K"),
    0x26: ("user_property", PAIR, "CKPRSTUDAW"),
    0x27: ("maximum_packet_size", FOUR, "CK"),
    0x28: ("wildcard_subscription_available", BYTE, "K"),
    0x29: ("subscription_identifier_available", BYTE, "K"),
    0x2A: ("shared_subscription_available", BYTE, "K"),
}
# The letters above: C CONNECT, K CONNACK, P PUBLISH, W will properties, R PUBACK/PUBREC/
# PUBREL/PUBCOMP, S SUBSCRIBE, T SUBACK/UNSUBACK, U UNSUBSCRIBE, D DISCONNECT, A AUTH.
PACKET_LETTER = {
    CONNECT: "C", CONNACK: "K", PUBLISH: "P", PUBACK: "R", PUBREC: "R", PUBREL: "R",
    PUBCOMP: "R", SUBSCRIBE: "S", SUBACK: "T", UNSUBSCRIBE: "U", UNSUBACK: "T",
    DISCONNECT: "D", AUTH: "A",
}

PROPERTY_IDS = {name: pid for pid, (name, _kind, _where) in PROPERTIES.items()}
USER_PROPERTY = 0x26
SUBSCRIPTION_IDENTIFIER = 0x0B

"""The OpenAPI 3.1 description of the admin API, served at /api/v1/openapi.json.

Built from the routes themselves (every served path and method appears, with its summary
and whether it needs a caller who may write), plus what the routes cannot say: query
parameters, request bodies and the shapes of the answers, declared here once.
"""

import re

from .. import __version__

_PAGING = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
    {"name": "cursor", "in": "query", "description": "The `next` of the previous page.", "schema": {"type": "string"}},
]


def _q(name, description, kind="string"):
    return {"name": name, "in": "query", "description": description, "schema": {"type": kind}}


QUERY = {
    ("GET", "/api/v1/clients"): _PAGING + [
        _q("prefix", "Only client ids that start with this."),
        _q("user", "Only clients of this user name."),
        _q("address", "Only addresses that start with this (e.g. `10.1.`)."),
        _q("connected", "true: connected clients only; false: offline sessions only.", "boolean"),
    ],
    ("DELETE", "/api/v1/clients/{client_id}"): [
        _q("session", "true: end the session too (its will is published).", "boolean"),
    ],
    ("GET", "/api/v1/subscriptions"): _PAGING + [
        _q("client_id", "Only this client's."),
        _q("filter", "Only filters that start with this (`$share/` ones included)."),
    ],
    ("GET", "/api/v1/retained"): _PAGING + [
        _q("filter", "MQTT topic filter the topics match (default `#`; `$SYS/#` for the broker's own)."),
    ],
    ("GET", "/api/v1/log/partitions"): [
        _q("local", "true: this node's partitions only (not the cluster's).", "boolean"),
    ],
    ("GET", "/api/v1/log/partitions/{partition}/offset"): [
        {**_q("timestamp", "Microseconds since the epoch.", "integer"), "required": True},
    ],
    ("GET", "/api/v1/log/partitions/{partition}/records"): [
        {**_q("start", "First offset.", "integer"), "required": True},
        {**_q("end", "End offset, exclusive; at most the partition's durable end (else 416).", "integer"),
         "required": True},
        _q("topics", "MQTT topic filters, comma separated or a JSON list: only records that match."),
        _q("rows", "Rows per Arrow batch at most (default and maximum 131072).", "integer"),
        _q("compression", "Arrow IPC buffer compression: none (default), lz4 or zstd."),
    ],
}

_CLIENT = {
    "type": "object",
    "properties": {
        "client_id": {"type": "string"}, "connected": {"type": "boolean"}, "node": {"type": "string"},
        "address": {"type": ["string", "null"]}, "listener": {"type": ["string", "null"]},
        "protocol": {"type": "string", "enum": ["3.1", "3.1.1", "5.0"]},
        "username": {"type": ["string", "null"]}, "keepalive": {"type": ["integer", "null"]},
        "connected_at": {"type": ["number", "null"], "description": "Seconds since the epoch."},
        "session_expiry_interval": {"type": "integer"},
        "expires_at": {"type": ["number", "null"]},
        "subscriptions": {"description": "A count in lists; the list of them for one client.",
                          "oneOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/components/schemas/Subscription"}}]},
        "inflight": {"type": "integer"}, "queued": {"type": "integer"}, "queued_bytes": {"type": "integer"},
        "behind_in_log": {"type": "boolean", "description": "More waits for it in the commit log than in memory."},
        "dropped": {"type": "integer"},
        "packets_in": {"type": ["integer", "null"]}, "bytes_in": {"type": ["integer", "null"]},
        "bytes_out": {"type": ["integer", "null"]},
        "will": {"type": ["object", "null"]},
    },
}
_SUBSCRIPTION = {
    "type": "object",
    "properties": {
        "client_id": {"type": "string"}, "filter": {"type": "string"}, "topic_filter": {"type": "string"},
        "share": {"type": ["string", "null"]}, "qos": {"type": "integer"}, "no_local": {"type": "boolean"},
        "retain_as_published": {"type": "boolean"}, "retain_handling": {"type": "integer"},
        "subscription_identifier": {"type": ["integer", "null"]},
    },
}
_RETAINED = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"}, "qos": {"type": "integer"}, "client_id": {"type": ["string", "null"]},
        "timestamp": {"type": ["number", "null"]}, "size": {"type": "integer"},
        "payload": {"type": "string", "description": "When the payload is UTF-8."},
        "payload_base64": {"type": "string", "description": "When it is not."},
        "truncated": {"type": "boolean"}, "properties": {"type": "object"},
    },
}
_BAN = {
    "type": "object",
    "required": ["kind", "value"],
    "properties": {
        "kind": {"type": "string", "enum": ["client_id", "username", "address"]},
        "value": {"type": "string", "description": "address: an IP address or a CIDR network."},
        "until": {"type": ["number", "null"], "description": "Seconds since the epoch; null: until lifted."},
        "duration": {"type": "number", "description": "In a POST: seconds from now (instead of until)."},
        "reason": {"type": "string"},
        "created": {"type": "number"},
    },
}
_PUBLISH = {
    "type": "object",
    "required": ["topic"],
    "properties": {
        "topic": {"type": "string"},
        "payload": {"type": "string", "description": "Text (sent as UTF-8)."},
        "payload_base64": {"type": "string", "description": "Binary payload (instead of payload)."},
        "qos": {"type": "integer", "enum": [0, 1, 2], "default": 0},
        "retain": {"type": "boolean", "default": False},
        "properties": {
            "type": "object",
            "properties": {
                "payload_format_indicator": {"type": "integer", "enum": [0, 1]},
                "message_expiry_interval": {"type": "integer"},
                "content_type": {"type": "string"},
                "response_topic": {"type": "string"},
                "correlation_data": {"type": "string"},
                "correlation_data_base64": {"type": "string"},
                "user_properties": {"description": "[[name, value], ...] or {name: value}"},
            },
        },
    },
}


def _page_of(ref):
    return {"type": "object", "properties": {
        "items": {"type": "array", "items": {"$ref": f"#/components/schemas/{ref}"}},
        "total": {"type": "integer"}, "next": {"type": ["string", "null"]}}}


_SERVER = {
    "type": "object",
    "properties": {
        "node": {"type": "string"}, "admin": {"type": "string", "description": "Its admin listener's URL."},
        "start_offset": {"type": "integer"},
        "end_offset": {"type": "integer", "description": "The durable end: nothing past it is served."},
        "first_timestamp_us": {"type": ["integer", "null"]}, "last_timestamp_us": {"type": ["integer", "null"]},
        "role": {"type": "string", "enum": ["leader", "in_sync", "replica"],
                 "description": "The partition's leader, an in-sync replica, or another copy (listed in that order)."},
    },
}
_PARTITIONS = {"type": "object", "properties": {
    "node": {"type": "string"},
    "partitions": {"type": "array", "items": {"type": "object", "properties": {
        "partition": {"type": "string"}, "start_offset": {"type": "integer"}, "end_offset": {"type": "integer"},
        "servers": {"type": "array", "items": _SERVER}}}},
    "unreachable": {"type": "object", "additionalProperties": {"type": "string"}}}}
CONTENT = {  # answers that are not JSON
    ("GET", "/api/v1/log/partitions/{partition}/records"): "application/vnd.apache.arrow.stream",
}

RESPONSES = {
    ("GET", "/api/v1/log/partitions"): _PARTITIONS,
    ("GET", "/api/v1/clients"): _page_of("Client"),
    ("GET", "/api/v1/clients/{client_id}"): {"$ref": "#/components/schemas/Client"},
    ("GET", "/api/v1/subscriptions"): _page_of("Subscription"),
    ("GET", "/api/v1/retained"): _page_of("Retained"),
    ("GET", "/api/v1/retained/{topic}"): {"$ref": "#/components/schemas/Retained"},
    ("GET", "/api/v1/banned"): _page_of("Ban"),
}
BODIES = {
    ("POST", "/api/v1/publish"): "Publish",
    ("POST", "/api/v1/banned"): "Ban",
}


def document(routes):
    paths = {}
    for route in routes.routes:
        template = re.sub(r"\{(\w+):path\}", r"{\1}", route.template)
        key = (route.method, template)
        op = {"summary": route.summary, "operationId": f"{route.method.lower()}_{_slug(template)}",
              "responses": {"200": {"description": "OK"}}}
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"},
                   "description": "Percent-encoded ('/' as %2F where it is part of a client id)."}
                  for n in re.findall(r"\{(\w+)\}", template)]
        params += QUERY.get(key, [])
        if params:
            op["parameters"] = params
        schema = RESPONSES.get(key)
        if schema is not None:
            op["responses"]["200"]["content"] = {"application/json": {"schema": schema}}
        if key in CONTENT:
            op["responses"]["200"]["content"] = {CONTENT[key]: {}}
        body = BODIES.get(key)
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body}"}}}}
        if route.method == "DELETE":
            op["responses"] = {"204": {"description": "Done"}, "404": {"description": "Not found"}}
            if template.startswith("/api/v1/clients/"):
                op["responses"] = {"200": {"description": "Disconnected"}, "404": {"description": "Not found"},
                                   "409": {"description": "Not connected (and session not asked)"}}
        if route.public:
            op["security"] = []
        if route.write:
            op["description"] = "Needs a caller who may write (`users`, or a write token)."
        op["responses"].setdefault("401", {"description": "No or wrong credentials"})
        if route.write:
            op["responses"]["403"] = {"description": "The caller may read only"}
        paths.setdefault(template, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "wrenmq admin API", "version": __version__,
                 "description": "See and steer a running wrenmq broker (docs/ADMIN.md)."},
        "servers": [{"url": "/"}],
        "security": [{"basic": []}, {"bearer": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"basic": {"type": "http", "scheme": "basic"},
                                "bearer": {"type": "http", "scheme": "bearer",
                                           "description": "A token made by `wrenmq admin token add`."}},
            "schemas": {"Client": _CLIENT, "Subscription": _SUBSCRIPTION, "Retained": _RETAINED,
                        "Ban": _BAN, "Publish": _PUBLISH},
        },
    }


def _slug(template):
    return re.sub(r"[^a-z0-9]+", "_", template.lower().replace("/api/v1/", "")).strip("_") or "root"

"""An example hook package that `wrenmq serve` loads from its configuration
(examples/hooks.toml):

    [[hook]]
    module = "acme_hooks:Gatekeeper"
    path = "hooks"                   # this folder, relative to the config file
    [hook.options]
    refused_prefixes = ["test-"]
    site = "plant-7"
    wrap_topics = ["sensors/#"]

`Gatekeeper` refuses clients whose id starts with one of `refused_prefixes` (CONNACK
0x87 not authorized, 3.1.1: 5) and wraps the payload of messages on `wrap_topics` in
JSON that names the site they came through:

    mosquitto_pub -t sensors/t1 -m 21.5   ->   subscribers get {"site": "plant-7", "value": "21.5"}

Every key of [hook.options] arrives as a keyword argument; an unknown one (a typo)
stops the broker at start with an error naming the hook.
"""

import json

from wrenmq.broker.hooks import Hook
from wrenmq.broker.message import Message
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.topics import topic_matches


class Gatekeeper(Hook):
    def __init__(self, refused_prefixes=(), site="", wrap_topics=()):
        self.refused = tuple(refused_prefixes)
        self.site = site
        self.filters = tuple(wrap_topics)

    def authenticate(self, client, connect):
        if self.refused and client.client_id.startswith(self.refused):
            return C.NOT_AUTHORIZED
        return None  # no opinion: the password file, other hooks or the policy decide

    def on_publish(self, client, message):
        # Called once per accepted message, on the publishing path: keep it cheap.
        if client is None or not any(topic_matches(f, message.topic) for f in self.filters):
            return message
        body = json.dumps({"site": self.site, "value": message.payload.decode("utf-8", "replace")})
        return Message(message.topic, body.encode(), message.qos, message.retain, message.properties,
                       message.expiry, message.client_id, message.origin, timestamp=message.timestamp)

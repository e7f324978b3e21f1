"""A custom authentication and authorization hook, with wrenmq embedded in your program.

Each service logs in with its name as user name and a token as password, and may only
publish and subscribe under its own topic prefix. The table comes from an environment
variable (in real life: a secrets store, a database, an HTTP call):

    WRENMQ_TOKENS="sensors=t0k3n-1:sensors,alerts=t0k3n-2:alerts" \\
        python examples/custom_auth_hook.py --port 1884

    mosquitto_pub -p 1884 -u sensors -P t0k3n-1 -t sensors/kitchen -m 21.5    # accepted
    mosquitto_pub -p 1884 -u sensors -P t0k3n-1 -t alerts/fire -m x           # dropped (3.1.1)
    mosquitto_pub -p 1884 -u sensors -P wrong -t sensors/kitchen -m 1         # refused

How the pieces fit (see src/wrenmq/broker/hooks.py and docs/SECURITY.md):

- `Broker(config, hooks=[...])` puts the `[auth]` hook (password file, ACL file, anonymous
  policy) first and yours behind it. For a user name the password file does not know, the
  `[auth]` hook asks your `authenticate`; if you answer None, its policy decides.
- `authenticate` returns True (accept), False (bad user name or password: 0x86, 3.1.1: 4),
  an MQTT 5 reason code such as 0x87 (not authorized, 3.1.1: 5), or None (no opinion).
  It may be `async` (call a remote service); a slow answer never holds other clients.
- `authorize_publish` / `authorize_subscribe` / `authorize_deliver` run for every packet or
  message: keep them plain functions and cheap. Return False to refuse, None to let the
  next hook (and finally the broker) decide.
"""

import argparse
import asyncio
import hmac
import os
import signal
import sys

from wrenmq import Broker
from wrenmq.broker.hooks import Hook
from wrenmq.config import load
from wrenmq.mqtt.topics import parse_shared


class TokenAuth(Hook):
    """Service name -> (token, topic prefix the service owns)."""

    def __init__(self, table):
        self.table = table

    @classmethod
    def from_env(cls, var="WRENMQ_TOKENS"):
        table = {}
        for item in filter(None, os.environ.get(var, "").split(",")):
            name, _, rest = item.partition("=")
            token, _, topics = rest.partition(":")
            table[name.strip()] = (token.strip().encode(), topics.strip() or name.strip())
        return cls(table)

    def authenticate(self, client, connect):
        entry = self.table.get(connect.username)
        if entry is None:
            return None  # not one of ours: the [auth] settings decide
        if connect.password is None:
            return False
        return hmac.compare_digest(connect.password, entry[0])

    def _inside(self, client, topic):
        """None (no objection) if `topic` (a name or a filter) lies under the service's
        prefix, False if it does not; None for clients that are not services."""
        entry = self.table.get(client.username)
        if entry is None:
            return None
        prefix = entry[1]
        return None if topic == prefix or topic.startswith(prefix + "/") else False

    def authorize_publish(self, client, topic, qos, retain):
        return self._inside(client, topic)

    def authorize_subscribe(self, client, topic_filter, qos):
        _, flt = parse_shared(topic_filter)  # $share/<group>/<filter>: check the filter
        return self._inside(client, flt)

    def reload_from_env(self):
        self.table = TokenAuth.from_env().table

    def on_reload(self):  # SIGHUP, when run under `wrenmq serve`-like signal handling
        self.reload_from_env()


CONFIG = """
[[listener]]
bind = "{bind}"
port = {port}

[auth]
allow_anonymous = false   # only services with a token (or users in a password file)

[storage]
mode = "memory"

[sys]
interval = 0
"""


async def main(argv=None):
    p = argparse.ArgumentParser(description="wrenmq embedded with a token auth hook")
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1884)
    args = p.parse_args(argv)

    config = load(text=CONFIG.format(bind=args.bind, port=args.port))
    hook = TokenAuth.from_env()
    if not hook.table:
        print("warning: WRENMQ_TOKENS is empty: nobody can log in", file=sys.stderr)
    async with Broker(config, hooks=[hook]) as broker:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(broker.stop()))
        loop.add_signal_handler(signal.SIGHUP, broker.hooks.reload)
        print(f"wrenmq with token auth on {args.bind}:{broker.port} "
              f"({len(hook.table)} service(s))", flush=True)
        await broker.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

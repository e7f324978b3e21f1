"""Hooks: the extension points of the broker (auth, ACL, storage, transforms).

Subclass `Hook` and override only what you need; the broker calls a method
only if at least one registered hook overrides it, so unused hooks cost
nothing on the publish path. Every method receives the client: its `Session`,
or a `ClientInfo` before the session exists (`on_publish`: None for the broker's own
messages) (both have `client_id`,
`username`, `address`, `version`, `listener`; do not modify them).

Answers: `authenticate` and the `authorize_*` methods return True (allow),
False (deny) or None (no opinion: ask the next hook). When no hook has an
opinion the broker's configured default applies. `authenticate` and
`enhanced_auth` may be coroutines; everything else is called on the hot path
and must be plain functions.

A hook that needs the event loop (a task, an HTTP client) does it in `start`, which
the broker awaits before its listeners open; one that raises there stops the start.
`stop` is awaited when the broker stops. `sys_values` adds figures to `$SYS` (and to
the metrics listener's, for the topics metrics.py names).
"""

import inspect
import logging


_PLAIN_ANSWERS = frozenset({bool, int, type(None)})


def awaitable(r):
    """`inspect.isawaitable` without its ABC check for the plain answers hooks give."""
    return r.__class__ not in _PLAIN_ANSWERS and inspect.isawaitable(r)


class HookError(Exception):
    """A hook could not be loaded or started; the message names it."""


def hook_name(hook):
    cls = type(hook)
    return f"{cls.__module__}:{cls.__qualname__}"


class ClientInfo:
    """Who is connecting, for `authenticate` (a `Session` has the same attributes)."""

    __slots__ = ("client_id", "username", "address", "version", "listener")
    cert_identity = None  # the CN a TLS listener took as user name (CertClientInfo)

    def __init__(self, client_id, username, address, version, listener):
        self.client_id = client_id
        self.username = username
        self.address = address
        self.version = version
        self.listener = listener

    def __repr__(self):
        return f"ClientInfo({self.client_id!r}, username={self.username!r}, address={self.address!r})"


class Hook:
    #: Authentication methods (MQTT 5 enhanced auth) this hook answers for.
    auth_methods = frozenset()

    def authenticate(self, client, connect):
        """CONNECT arrived: True accept, False bad credentials, an int = 5.0 reason code."""
        return None

    def enhanced_auth(self, client, method, data, step):
        """One step of an MQTT 5 AUTH exchange.

        Return (reason, data): reason 0x00 success, 0x18 continue (data goes to the
        client in an AUTH packet), anything else refuses with that reason code.
        """
        return (0x8C, None)

    def authorize_publish(self, client, topic, qos, retain):
        return None

    def authorize_subscribe(self, client, topic_filter, qos):
        return None

    def authorize_deliver(self, client, message):
        """A message is about to be delivered to `client` (retained, queued or live)."""
        return None

    def on_publish(self, client, message):
        """Transform an accepted message: return it (possibly changed), or None to drop it.

        Called once per message, on the node that accepted it: for clients' PUBLISHes
        and wills (`client`: the publisher's session), and for the broker's own
        messages, its `$SYS` topics and `Broker.publish` (`client` is None then)."""
        return message

    def on_connect(self, client):
        pass

    def on_disconnect(self, client, reason):
        pass

    def on_subscribe(self, client, topic_filter, qos):
        """A subscription was granted (`qos`: the QoS granted; the SUBACK is on its way)."""

    def on_unsubscribe(self, client, topic_filter):
        """A subscription the client held was removed by its UNSUBSCRIBE."""

    def on_message_dropped(self, client, message, why):
        """A message for `client` was not delivered: "congested" (QoS 0 to a client not
        reading), "queue_full", "too_large" (over the client's maximum packet size)."""

    async def start(self, broker):
        """The broker is starting (its loop runs, its listeners are not open yet)."""

    async def stop(self):
        """The broker is stopping: end tasks, close clients."""

    def sys_values(self):
        """Figures for `$SYS`: {topic: value}."""
        return {}

    def on_session_expired(self, client_id):
        pass

    def on_reload(self):
        """Re-read files (SIGHUP); raise to keep the previous state."""


class Extension:
    """A part that runs beside the broker and is no hook (the cluster, bridges to other
    brokers).

    The assembly adds them (`Broker.add_extension`): `start` runs once the listeners are
    open, `stop` first when the broker stops (while the store still takes writes); with
    `before_listeners`, `start` runs before the listeners open (a failure stops the start)
    and `stop` after the others'. `sys_values` adds to $SYS, `metrics` to the metrics
    listener, as (name, type, help, [(labels dict, value), ...]) per metric."""

    before_listeners = False

    async def start(self, broker):
        pass

    async def stop(self):
        pass

    def sys_values(self):
        return {}

    def metrics(self):
        return ()


def _overrides(hook, name):
    return getattr(type(hook), name, None) is not getattr(Hook, name)


class HookChain:
    """The registered hooks, with one dispatcher per hook point.

    Each `authorize_*`/`on_publish` attribute is None when no hook implements it,
    so the router tests `if hooks.authorize_publish is not None` and pays nothing otherwise.
    """

    def __init__(self, hooks=()):
        self.hooks = []
        for h in hooks:
            self.add(h, rebuild=False)
        self._rebuild()

    def add(self, hook, rebuild=True):
        self.hooks.append(hook)
        if rebuild:
            self._rebuild()

    def _rebuild(self):
        def chain(name):
            return [getattr(h, name) for h in self.hooks if _overrides(h, name)]

        self._auth = chain("authenticate")
        self.auth_async = any(inspect.iscoroutinefunction(f) for f in self._auth)
        self.auth_methods = {}
        for h in self.hooks:
            for m in h.auth_methods:
                self.auth_methods.setdefault(m, h)
        self.authorize_publish = self._decider(chain("authorize_publish"))
        self.authorize_subscribe = self._decider(chain("authorize_subscribe"))
        self.authorize_deliver = self._decider(chain("authorize_deliver"))
        transforms = chain("on_publish")
        if not transforms:
            self.on_publish = None
        elif len(transforms) == 1:
            self.on_publish = transforms[0]
        else:
            def on_publish(client, message, _t=transforms):
                for f in _t:
                    message = f(client, message)
                    if message is None:
                        return None
                return message
            self.on_publish = on_publish
        self.on_subscribe = self._fanout(chain("on_subscribe"))
        self.on_unsubscribe = self._fanout(chain("on_unsubscribe"))
        self.on_message_dropped = self._fanout(chain("on_message_dropped"))
        self._on_connect = chain("on_connect")
        self._on_disconnect = chain("on_disconnect")
        self._on_expired = chain("on_session_expired")
        self._on_reload = chain("on_reload")

    @staticmethod
    def _decider(funcs):
        if not funcs:
            return None
        if len(funcs) == 1:
            return funcs[0]

        def decide(*args):
            for f in funcs:
                r = f(*args)
                if r is not None:
                    return r
            return None
        return decide

    @staticmethod
    def _fanout(funcs):
        """One callable for notifications every hook gets; None when no hook wants them."""
        if not funcs:
            return None
        if len(funcs) == 1:
            return funcs[0]

        def notify(*args):
            for f in funcs:
                f(*args)
        return notify

    async def start(self, broker):
        for h in list(self.hooks):
            if _overrides(h, "start"):
                try:
                    await h.start(broker)
                except HookError:
                    raise
                except Exception as e:
                    raise HookError(f"hook {hook_name(h)} failed to start: {e!r}") from e

    async def stop(self):
        for h in reversed(self.hooks):
            if _overrides(h, "stop"):
                try:
                    await h.stop()
                except Exception:
                    logging.getLogger("wrenmq.hooks").exception("stopping %s failed", type(h).__name__)

    def sys_values(self):
        values = {}
        for h in self.hooks:
            if _overrides(h, "sys_values"):
                values.update(h.sys_values())
        return values

    def authenticate(self, client, connect):
        """First opinion of the chain (sync hooks only); None if nobody answered."""
        for f in self._auth:
            r = f(client, connect)
            if r is not None:
                return r
        return None

    async def authenticate_async(self, client, connect):
        for f in self._auth:
            r = f(client, connect)
            if awaitable(r):
                r = await r
            if r is not None:
                return r
        return None

    def on_connect(self, client):
        for f in self._on_connect:
            f(client)

    def on_disconnect(self, client, reason):
        for f in self._on_disconnect:
            f(client, reason)

    def on_session_expired(self, client_id):
        for f in self._on_expired:
            f(client_id)

    def reload(self):
        """Every hook's on_reload (SIGHUP). One that raises keeps its previous state (as
        the contract says) and is logged; it does not stop the others (TLS certificates,
        other files) from reloading."""
        for f in self._on_reload:
            try:
                f()
            except Exception:
                logging.getLogger("wrenmq.hooks").exception("reload failed in %s", f.__qualname__)

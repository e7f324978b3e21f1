"""wrenmq: an MQTT 3.1.1 and 5.0 broker with a durable commit log."""

__version__ = "0.1.0"

from . import _compiled

_compiled.install()


def __getattr__(name):
    # `from wrenmq import Broker, Hook` without importing the broker on `import wrenmq`.
    # Broker is the assembled one (assemble.py): with its [auth] hook, cluster, bridges.
    if name == "Broker":
        from .assemble import Broker
        return Broker
    if name in ("Hook", "ClientInfo", "Extension"):
        from .broker import hooks
        return getattr(hooks, name)
    raise AttributeError(name)

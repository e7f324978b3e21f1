"""wrenmq: an MQTT 3.1.1 and 5.0 broker with a durable commit log."""

__version__ = "0.1.0"

from . import _compiled

_compiled.install()


def __getattr__(name):
    # `from wrenmq import Broker, Hook` without importing the broker on `import wrenmq`.
    if name in ("Broker", "Hook", "ClientInfo"):
        from . import broker
        return getattr(broker, name)
    raise AttributeError(name)

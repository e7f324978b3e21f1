"""The broker: topics, sessions, the router, connections, listeners and the Broker core.

A program embeds the assembled broker, `wrenmq.Broker` (wrenmq/assemble.py), which is
this package's `Broker` with its [auth] hook, cluster, bridges and admin listener."""

from .broker import Broker
from .hooks import ClientInfo, Extension, Hook

__all__ = ["Broker", "Hook", "ClientInfo", "Extension"]

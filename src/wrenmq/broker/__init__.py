"""The broker: topics, sessions, the router, connections and the Broker object."""

from .broker import Broker
from .hooks import ClientInfo, Extension, Hook

__all__ = ["Broker", "Hook", "ClientInfo", "Extension"]

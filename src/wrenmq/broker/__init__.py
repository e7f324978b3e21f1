"""The broker: topics, sessions, the router, connections and the Broker object."""

from .broker import Broker
from .hooks import ClientInfo, Hook

__all__ = ["Broker", "Hook", "ClientInfo"]

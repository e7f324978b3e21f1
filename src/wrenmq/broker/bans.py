"""Banned clients: refused at CONNECT (reason 0x8A, 3.1.1: 5) by client id, user name or address.

Operators ban through the admin API (`/api/v1/banned`); the broker checks a CONNECT
against the bans before it asks anyone to authenticate it (`Connection._authenticate`), so
a banned client costs no password hashing. With no bans the check is one length test.

A ban names one `kind` and its `value`:

- `client_id`: that client id exactly;
- `username`: that user name exactly (a TLS listener's certificate CN included, once it
  is taken as the user name);
- `address`: an IP address, or a network in CIDR form (`10.0.0.0/8`), matched against
  the address the connection comes from.

A ban may end (`until`, seconds since the epoch); ended bans are dropped as they are met.
With `[storage] mode = "disk"` the bans live in `<data_dir>/bans.json`, written whole
(a temporary file, fsynced, renamed over the old one, the directory fsynced), so a crash
leaves the old list or the new one, never a mix; a file that cannot be read stops the
broker at start rather than forget who is banned.
"""

import ipaddress
import json
import logging
import os
import tempfile
import threading
import time

log = logging.getLogger("wrenmq.bans")

KINDS = ("client_id", "username", "address")
MAX_BANS = 100_000  # an operator's list, not a firewall: bounded so a script gone wrong cannot fill memory
MAX_VALUE = 65535


class BanError(ValueError):
    """A ban that cannot be made (unknown kind, bad address, too many), or a bans file that
    cannot be read; the message says which."""


class BansFileError(OSError):
    """The bans file cannot be read: the broker does not start (it would forget who is banned)."""


class Ban:
    __slots__ = ("kind", "value", "until", "reason", "created", "network")

    def __init__(self, kind, value, until=None, reason="", created=None):
        self.kind = kind
        self.value = value
        self.until = until
        self.reason = reason
        self.created = created if created is not None else time.time()
        self.network = None  # address bans: the ip_network `value` names
        if kind == "address":
            try:
                self.network = ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise BanError(f"address: expected an IP address or a CIDR network, got {value!r}") from None

    def ended(self, now):
        return self.until is not None and now >= self.until

    def as_dict(self):
        return {"kind": self.kind, "value": self.value, "until": self.until, "reason": self.reason,
                "created": self.created}


def _host(address):
    """The IP address of a connection's `address` ("ip:port", IPv6 too), or None."""
    host = address.rpartition(":")[0] if ":" in address else address
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class Bans:
    """The bans in force, looked up per CONNECT; see the module docstring."""

    def __init__(self, path=None, clock=time.time):
        self.path = path
        self.clock = clock
        self.entries = {}  # (kind, value) -> Ban
        self._exact = {"client_id": set(), "username": set(), "address": set()}
        self._networks = []  # address bans of more than one address
        self.refused = 0  # CONNECTs refused because of a ban
        self._write_lock = threading.Lock()
        self._version = 0  # bumped by every change: a slow write never overwrites a newer one
        self._written = 0

    def __len__(self):
        return len(self.entries)

    # --- in memory ------------------------------------------------------------

    def add(self, kind, value, until=None, reason=""):
        """Ban `value` of `kind` until `until` (None: until removed); replaces a ban of the
        same kind and value. Returns the Ban."""
        if kind not in KINDS:
            raise BanError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(value, str) or not value or len(value) > MAX_VALUE:
            raise BanError("value: expected a non-empty string")
        if until is not None and (not isinstance(until, (int, float)) or isinstance(until, bool)):
            raise BanError("until: expected seconds since the epoch")
        ban = Ban(kind, value, until, str(reason or "")[:1024])
        if ban.network is not None:
            ban.value = value = str(ban.network) if ban.network.num_addresses > 1 else \
                str(ban.network.network_address)
        key = (kind, value)
        if key not in self.entries and len(self.entries) >= MAX_BANS:
            raise BanError(f"{MAX_BANS} bans held: remove some first")
        self._drop(key)
        self._put(ban)
        self._version += 1
        return ban

    def remove(self, kind, value):
        """Lift a ban; False if there was none."""
        ban = self._drop((kind, value))
        if ban is None and kind == "address":
            try:  # the same network written another way (10.0.0.1/8 for 10.0.0.0/8)
                net = ipaddress.ip_network(value, strict=False)
                ban = self._drop((kind, str(net) if net.num_addresses > 1 else str(net.network_address)))
            except ValueError:
                pass
        if ban is None:
            return False
        self._version += 1
        return True

    def _put(self, ban):
        self.entries[(ban.kind, ban.value)] = ban
        if ban.network is not None and ban.network.num_addresses > 1:
            self._networks.append(ban)
        else:
            self._exact[ban.kind].add(ban.value)

    def _drop(self, key):
        ban = self.entries.pop(key, None)
        if ban is None:
            return None
        if ban in self._networks:
            self._networks.remove(ban)
        else:
            self._exact[ban.kind].discard(ban.value)
        return ban

    def list(self):
        """The bans in force (ended ones are dropped first)."""
        self._expire()
        return list(self.entries.values())

    def _expire(self):
        now = self.clock()
        ended = [key for key, ban in self.entries.items() if ban.ended(now)]
        for key in ended:
            self._drop(key)
        if ended:
            self._version += 1
        return ended

    def match(self, client_id, username, address):
        """The ban that refuses a CONNECT of `client_id` from `username` at `address`, or None."""
        found = None
        exact = self._exact
        if client_id in exact["client_id"]:
            found = self.entries[("client_id", client_id)]
        elif username is not None and username in exact["username"]:
            found = self.entries[("username", username)]
        else:
            host = _host(address) if exact["address"] or self._networks else None
            if host is not None:
                text = str(host)
                if text in exact["address"]:
                    found = self.entries[("address", text)]
                else:
                    for ban in self._networks:
                        if host.version == ban.network.version and host in ban.network:
                            found = ban
                            break
        if found is not None and found.ended(self.clock()):
            self._drop((found.kind, found.value))
            self._version += 1
            return self.match(client_id, username, address)
        return found

    # --- on disk --------------------------------------------------------------

    def open(self, path):
        """Read the bans saved at `path` (none if it does not exist yet); BansFileError if the
        file cannot be used."""
        self.path = path
        try:
            with open(path, "rb") as fh:
                data = json.loads(fh.read())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise BansFileError(f"{path}: cannot read the bans ({e}); fix or remove the file") from None
        if not isinstance(data, dict) or not isinstance(data.get("bans"), list):
            raise BansFileError(f"{path}: not a bans file (expected {{\"bans\": [...]}})")
        now = self.clock()
        for i, item in enumerate(data["bans"]):
            try:
                ban = Ban(item["kind"], item["value"], item.get("until"), item.get("reason", ""),
                          item.get("created"))
                if ban.kind not in KINDS:
                    raise BanError(f"unknown kind {ban.kind!r}")
            except (KeyError, TypeError, BanError) as e:
                raise BansFileError(f"{path}: ban {i} cannot be used ({e}); fix or remove the file") from None
            if not ban.ended(now):
                self._put(ban)
        if self.entries:
            log.info("%d ban(s) in force, from %s", len(self.entries), path)

    def dump(self):
        """(version, bytes) of the bans as they are now, for `write` (take it on the loop)."""
        self._expire()
        body = json.dumps({"bans": [b.as_dict() for b in self.entries.values()]}, indent=1)
        return self._version, body.encode()

    def write(self, snapshot):
        """Write a `dump()` to the bans file atomically (blocking: run it in a thread). A
        snapshot older than one written already is skipped. No-op without a path."""
        version, data = snapshot
        if self.path is None:
            return
        with self._write_lock:
            if version < self._written:
                return
            directory = os.path.dirname(self.path) or "."
            fd, tmp = tempfile.mkstemp(prefix=".bans-", dir=directory)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._written = version

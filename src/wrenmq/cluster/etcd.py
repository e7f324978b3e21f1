"""The etcd client of a node: aetcd's, over plain gRPC or, with [cluster] etcd_tls, over TLS,
and `Session`, one such client at a time over every endpoint of [cluster] etcd.

aetcd 1.0's `Client.connect` always opens a plaintext channel. `TLSClient` is the same
client; its `connect` opens the channel with TLS credentials (the CA that signs etcd's
certificate, and this node's certificate when etcd asks for one, `--client-cert-auth`).
It builds the same stubs and watcher as aetcd's own `connect`, which is why pyproject
pins aetcd below 1.1.
"""

import asyncio
import logging
import re
import time

import aetcd
import grpc
from aetcd import leases, rpc, watcher
from aetcd.client import Transactions, _handle_errors

from . import RETRY

log = logging.getLogger("wrenmq.cluster")

_PEM_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----.+?-----END [A-Z ]*PRIVATE KEY-----", re.S)
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


class EtcdTLSError(ValueError):
    """A file of the etcd TLS settings cannot be used (named in the message)."""


def _read(key, path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise EtcdTLSError(f"[cluster] {key}: cannot read {path}: {e.strerror}") from None


def credentials(cfg):
    """gRPC TLS credentials from a [cluster] section's etcd_cafile, etcd_certfile and
    etcd_keyfile, read now (a client made after the files change uses the new ones)."""
    root = _read("etcd_cafile", cfg.etcd_cafile) if cfg.etcd_cafile else None
    if root is not None and not _PEM_CERT.search(root):
        raise EtcdTLSError(f"[cluster] etcd_cafile: no PEM certificate in {cfg.etcd_cafile}")
    key = chain = None
    if cfg.etcd_certfile:
        pem = _read("etcd_certfile", cfg.etcd_certfile)
        chain = b"\n".join(m.group(0) for m in _PEM_CERT.finditer(pem))
        if not chain:
            raise EtcdTLSError(f"[cluster] etcd_certfile: no PEM certificate in {cfg.etcd_certfile}")
        key_key = "etcd_keyfile" if cfg.etcd_keyfile else "etcd_certfile"  # (the key in the certificate's file)
        key_path = getattr(cfg, key_key)
        m = _PEM_KEY.search(_read(key_key, key_path) if cfg.etcd_keyfile else pem)
        if m is None:
            raise EtcdTLSError(f"[cluster] {key_key}: no PEM private key in {key_path}")
        key = m.group(0)
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)


class TLSClient(aetcd.Client):
    """aetcd's client whose channel is TLS (`credentials`: grpc.ChannelCredentials)."""

    def __init__(self, credentials, **kw):
        super().__init__(**kw)
        self._credentials = credentials

    @_handle_errors
    async def connect(self):
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                              options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def client(cfg, host, port):
    """An unconnected client of the etcd at host:port, for a [cluster] section."""
    kw = dict(host=host, port=port, timeout=cfg.etcd_timeout, connect_wait_timeout=max(1, int(cfg.etcd_timeout)),
              username=cfg.etcd_username or None, password=cfg.etcd_password or None)
    if cfg.etcd_tls:
        return TLSClient(credentials(cfg), **kw)
    return aetcd.Client(**kw)


class Session:
    """One etcd client at a time, over every endpoint of a [cluster] section's `etcd`.

    An etcd of three members stays up when one of them goes, but aetcd's client talks to
    one member (one host and port) and fails with it. A Session knows the endpoint list:
    `connect` reaches the first member that answers, `reconnect` replaces the client with
    one of the next member (round robin: the member that went is tried again last), and
    `recover` does that with a backoff until its owner is back on its feet.

    Calls (`get`, `put`, `transaction`, `watch_prefix`, ... aetcd's client's) go to the
    client of the moment; one that fails is not tried again on another member (a
    transaction may have been applied): its owner sees the failure and recovers. A lease
    is the etcd cluster's, not a member's: `lease()` gives one whose refresh and revoke go
    through the session, so it lives on across a change of member, as do the keys on it.
    """

    def __init__(self, cfg, make_client):
        self.cfg = cfg
        self.endpoints = list(cfg.etcd)
        self.transactions = Transactions()  # (builds compares and operations: no member needed)
        self._make_client = make_client  # endpoint -> an unconnected aetcd client
        self._client = None
        self.endpoint = None  # "host:port" of the member in use; None while there is none
        self.switches = 0  # times the session went on to another member than the one it had
        self._had = None  # the endpoint of the last member in use
        self._last = None  # the endpoint tried last: reconnect goes on from the one after it

    @property
    def client(self):
        """The aetcd client of the member in use; ConnectionError while there is none."""
        if self._client is None:
            raise ConnectionError("no etcd member reached")
        return self._client

    def __getattr__(self, name):
        # (only reached for names the session does not have: aetcd's calls)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.client, name)

    async def connect(self):
        """Reach the first endpoint, in the order given, whose member answers; raises the
        last failure if none does."""
        await self._drop()
        last = None
        for endpoint in self.endpoints:
            try:
                await self._use(endpoint)
                return
            except Exception as e:
                last = e
        raise last

    async def reconnect(self):
        """Drop the client in use and reach the endpoint after the one tried last; raises
        what that member's failure was (the next call goes on from the one after it)."""
        await self._drop()
        i = self.endpoints.index(self._last) + 1 if self._last in self.endpoints else 0
        await self._use(self.endpoints[i % len(self.endpoints)])

    async def recover(self, resume, stopping=lambda: False, what="reaching etcd again"):
        """Reconnect (`RETRY`'s backoff, the next member each time) until `resume()`, the
        owner's own steps back (its lease checked, what it reads read again), goes through
        on the member reached; the number of attempts it took (0 if `stopping()` first). A
        failure is logged once a minute, as "<what> failed ...". """
        attempt = 0
        said = 0.0
        while not stopping():
            await asyncio.sleep(RETRY[min(attempt, len(RETRY) - 1)])
            attempt += 1
            try:
                await self.reconnect()
                await resume()
                return attempt
            except asyncio.CancelledError:
                raise
            except Exception as e:
                now = time.monotonic()
                if now - said >= 60:
                    said = now
                    log.warning("%s failed (etcd %s: %s: %s); retrying through the next endpoint",
                                what, self._last, type(e).__name__, e)
        return 0

    async def lease(self, ttl, lease_id=None):
        """A new lease of `ttl` seconds, kept through the session (see the class)."""
        got = await self.client.lease(ttl, lease_id)
        return leases.Lease(lease_id=got.id, ttl=got.ttl, etcd_client=self)

    async def keep_alive(self, lease):
        """Refresh `lease` once: its TTL from now, as etcd says; 0 or less if it is gone."""
        reply = await self.client.refresh_lease(lease.id)
        if isinstance(reply, list):
            reply = reply[0] if reply else None
        if reply is None:
            raise ConnectionError(f"etcd {self.endpoint} did not answer the lease's keepalive")
        return reply.TTL

    async def close(self):
        await self._drop()

    async def _use(self, endpoint):
        """Make the client of `endpoint` the one in use once its member answers and knows
        a leader (a member cut off from the others answers, but cannot serve)."""
        self._last = endpoint
        client = self._make_client(endpoint)
        try:
            status = await asyncio.wait_for(client.status(), 2 * self.cfg.etcd_timeout)
            if status.leader is None:
                raise ConnectionError(f"etcd member {endpoint} has no leader")
        except BaseException:
            await _close_quietly(client, self.cfg.etcd_timeout)
            raise
        if self._had is not None and self._had != endpoint:
            self.switches += 1
        self._client = client
        self.endpoint = self._had = endpoint

    async def _drop(self):
        client, self._client, self.endpoint = self._client, None, None
        if client is not None:
            await _close_quietly(client, self.cfg.etcd_timeout)


async def _close_quietly(client, timeout):
    """Close an aetcd client, whatever state its member is in (gone: nothing to say)."""
    try:
        await asyncio.wait_for(client.close(), timeout)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.debug("closing an etcd client: %s", e)

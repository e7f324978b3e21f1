"""The etcd client of a node: aetcd's, over plain gRPC or, with [cluster] etcd_tls, over TLS.

aetcd 1.0's `Client.connect` always opens a plaintext channel. `TLSClient` is the same
client; its `connect` opens the channel with TLS credentials (the CA that signs etcd's
certificate, and this node's certificate when etcd asks for one, `--client-cert-auth`).
It builds the same stubs and watcher as aetcd's own `connect`, which is why pyproject
pins aetcd below 1.1.
"""

import asyncio
import re

import aetcd
import grpc
from aetcd import rpc, watcher
from aetcd.client import _handle_errors

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

"""What MQTT over TLS adds to a connection: the client certificate.

On a TLS listener with a CA (`cafile`), connections are `CertConnection`s: hooks see the
verified certificate (`CertClientInfo.peercert`), and with `use_identity_as_username` its
CN is the client's user name. The handshake itself is `net.tls`'s.
"""

import logging

from ...mqtt import constants as C
from ...net.tls import cert_common_name
from ..connection import Connection
from ..hooks import ClientInfo

log = logging.getLogger("wrenmq.listeners")


class CertClientInfo(ClientInfo):
    """`ClientInfo` on TLS listeners with a CA: hooks also see the client certificate.

    `peercert` is the verified certificate as `ssl.SSLSocket.getpeercert()` returns it
    (None without one); `cert_identity` is its CN when the listener has
    `use_identity_as_username`, else None. With it, the user name is the CN and the
    CONNECT's password is dropped: the verified certificate is the credential (as in
    Mosquitto), so a password check should not apply to such a client.
    """

    __slots__ = ("peercert", "cert_identity")

    def __init__(self, client_id, username, address, version, listener, peercert, cert_identity):
        super().__init__(client_id, username, address, version, listener)
        self.peercert = peercert
        self.cert_identity = cert_identity


class CertConnection(Connection):
    """A Connection on a TLS listener that verifies client certificates."""

    __slots__ = ("cert_identity",)

    def __init__(self, broker, listener, name=None, sniff=False):
        super().__init__(broker, listener, name, sniff)
        self.cert_identity = None

    def _peercert(self):
        t = self.transport
        return t.get_extra_info("peercert") if t is not None else None

    def _client_info(self, pkt):
        return CertClientInfo(pkt.client_id, pkt.username, self.address, pkt.version,
                              self.listener_name, self._peercert(), self.cert_identity)

    def _authenticate(self, pkt):
        if self.listener.use_identity_as_username:
            cn = cert_common_name(self._peercert())
            if cn is None:
                log.info("refusing %s: its client certificate has no CN to use as user name", self.address)
                self.refuse(pkt.version, C.NOT_AUTHORIZED)
                return
            self.cert_identity = cn
            pkt.username = cn
            pkt.password = None
        super()._authenticate(pkt)

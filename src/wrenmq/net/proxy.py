"""The PROXY protocol header (HAProxy's spec, versions 1 and 2), sans-IO.

A load balancer that terminates nothing but TCP (HAProxy, AWS NLB, nginx stream,
Envoy) starts each connection it opens to the broker with one header that says
whose connection it is. `ProxyHeaderReader.feed(bytes)` takes what the socket gave:

- None: the header is not complete yet (feed more);
- (ProxyHeader, rest): the header, and the bytes after it (the client's own: MQTT,
  or a TLS ClientHello);
- ProxyError: not a PROXY header, or a malformed one. The listener closes the
  connection: with `proxy_protocol = true` the header is required, since a client
  that can skip it could claim any address.

Bounded: a v1 header is at most 107 bytes, a v2 one 16 + 65,535; bytes past those
bounds without a complete header are an error, so a peer cannot make the reader
hold more. No asyncio, no sockets: tests feed it bytes.
"""

import ipaddress
import struct

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V1_PREFIX = b"PROXY "
V1_MAX = 107  # "PROXY TCP6 " + two full IPv6 addresses + two ports + CRLF
V2_HEADER = 16

# v2 address families (high nibble) and transports (low nibble) of byte 14.
_AF_UNSPEC, _AF_INET, _AF_INET6, _AF_UNIX = 0x0, 0x1, 0x2, 0x3
_ADDRESS_BYTES = {_AF_INET: 12, _AF_INET6: 36, _AF_UNIX: 216}


class ProxyError(ValueError):
    """Not a PROXY protocol header, or a malformed one (the message says which)."""


class ProxyHeader:
    """What the proxy said. `source`/`destination` are (host, port), or None when the
    proxy gave no addresses (v1 UNKNOWN, v2 LOCAL or UNSPEC: its own health check)."""

    __slots__ = ("version", "source", "destination")

    def __init__(self, version, source=None, destination=None):
        self.version = version
        self.source = source
        self.destination = destination

    def __repr__(self):
        return f"ProxyHeader(v{self.version}, {self.source} -> {self.destination})"


class ProxyHeaderReader:
    def __init__(self):
        self._buf = b""

    def feed(self, data):
        buf = self._buf + data if self._buf else bytes(data)
        n = len(buf)
        # Decide the version as soon as the first bytes allow: a client that sends
        # MQTT (or TLS) straight away is refused at its first packet.
        if buf[:min(n, 12)] == V2_SIGNATURE[:min(n, 12)]:
            if n < V2_HEADER:
                self._buf = buf
                return None
            return self._v2(buf)
        if buf[:min(n, 6)] == V1_PREFIX[:min(n, 6)]:
            end = buf.find(b"\r\n", 0, V1_MAX)
            if end < 0:
                if n >= V1_MAX:
                    raise ProxyError("v1 header without CRLF in its first 107 bytes")
                self._buf = buf
                return None
            self._buf = b""
            return _parse_v1(buf[:end]), buf[end + 2:]
        raise ProxyError(f"no PROXY protocol header (the connection starts with {buf[:8]!r})")

    def _v2(self, buf):
        ver_cmd, fam, length = buf[12], buf[13], struct.unpack_from("!H", buf, 14)[0]
        if ver_cmd >> 4 != 2:
            raise ProxyError(f"v2 header with version {ver_cmd >> 4}")
        command = ver_cmd & 0x0F
        if command > 1:
            raise ProxyError(f"v2 header with unknown command {command}")
        end = V2_HEADER + length
        if len(buf) < end:
            self._buf = buf
            return None
        self._buf = b""
        body = buf[V2_HEADER:end]
        rest = buf[end:]
        if command == 0:  # LOCAL: the proxy's own connection (a health check)
            return ProxyHeader(2), rest
        family, transport = fam >> 4, fam & 0x0F
        if family == _AF_UNSPEC:
            return ProxyHeader(2), rest
        need = _ADDRESS_BYTES.get(family)
        if need is None or transport not in (1, 2):
            raise ProxyError(f"v2 header with unknown address family/transport 0x{fam:02x}")
        if len(body) < need:
            raise ProxyError(f"v2 header of {len(body)} address bytes, {need} needed for its family")
        if family == _AF_INET:
            src, dst = ipaddress.IPv4Address(body[0:4]), ipaddress.IPv4Address(body[4:8])
            sport, dport = struct.unpack_from("!HH", body, 8)
        elif family == _AF_INET6:
            src, dst = ipaddress.IPv6Address(body[0:16]), ipaddress.IPv6Address(body[16:32])
            sport, dport = struct.unpack_from("!HH", body, 32)
        else:  # AF_UNIX: paths, no ports (the client is local to the proxy)
            spath = body[:108].split(b"\0", 1)[0].decode("utf-8", "replace")
            dpath = body[108:216].split(b"\0", 1)[0].decode("utf-8", "replace")
            return ProxyHeader(2, (f"unix:{spath}", 0), (f"unix:{dpath}", 0)), rest
        return ProxyHeader(2, (str(src), sport), (str(dst), dport)), rest


def _parse_v1(line):
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise ProxyError("v1 header that is not ASCII") from None
    parts = text.split(" ")
    if len(parts) >= 2 and parts[1] == "UNKNOWN":
        return ProxyHeader(1)  # the proxy does not know (or will not say): its own address stands
    if len(parts) != 6 or parts[1] not in ("TCP4", "TCP6"):
        raise ProxyError(f"malformed v1 header {text[:107]!r}")
    _, proto, src, dst, sport, dport = parts
    try:
        s = ipaddress.ip_address(src)
        d = ipaddress.ip_address(dst)
    except ValueError:
        raise ProxyError(f"v1 header with an invalid address: {text[:107]!r}") from None
    if (s.version, d.version) != ((4, 4) if proto == "TCP4" else (6, 6)):
        raise ProxyError(f"v1 header whose addresses are not {proto}: {text[:107]!r}")
    ports = []
    for p in (sport, dport):
        # Decimal without leading zeros, 0-65535 (the spec's words).
        if not p.isdigit() or (len(p) > 1 and p[0] == "0") or int(p) > 65535:
            raise ProxyError(f"v1 header with an invalid port: {text[:107]!r}")
        ports.append(int(p))
    return ProxyHeader(1, (str(s), ports[0]), (str(d), ports[1]))


def encode_v1(source, destination):
    """A v1 header (for tests and tools): source/destination are (host, port)."""
    proto = "TCP6" if ipaddress.ip_address(source[0]).version == 6 else "TCP4"
    return f"PROXY {proto} {source[0]} {destination[0]} {source[1]} {destination[1]}\r\n".encode()


def encode_v2(source=None, destination=None, tlvs=b""):
    """A v2 header (for tests and tools); without addresses a LOCAL one."""
    if source is None:
        return V2_SIGNATURE + bytes([0x20, 0x00]) + struct.pack("!H", len(tlvs)) + tlvs
    s, d = ipaddress.ip_address(source[0]), ipaddress.ip_address(destination[0])
    fam = 0x11 if s.version == 4 else 0x21
    body = s.packed + d.packed + struct.pack("!HH", source[1], destination[1]) + tlvs
    return V2_SIGNATURE + bytes([0x21, fam]) + struct.pack("!H", len(body)) + body

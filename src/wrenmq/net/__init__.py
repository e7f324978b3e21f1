"""What sits between a socket and a protocol, below the broker and shared by its users.

- `front.py`: protocols that stand in front of a listener's own one for a while (`Front`),
  and `PlainSniffer`, which closes a plain port's TLS client with a clear log line;
- `tls.py`: server `SSLContext`s from a listener's files, and `TLSAcceptor`, which runs an
  accepted socket's TLS handshake itself so its failure is logged with its reason: the
  MQTT, metrics and admin listeners and the cluster's link port use it (`accept_tls`,
  `TLSPort`);
- `websocket.py`: one `websockets` connection as the asyncio Transport a protocol expects;
- `proxy.py`: the PROXY protocol header (sans-IO), and `proxied.py`, which reads it in
  front of a listener's protocol (`proxy_protocol = true`);
- `http_client.py`: the aiohttp sessions the HTTP features use.

Nothing here knows MQTT, the broker or its configuration beyond the few attributes each
function names.
"""


class ListenerError(OSError):
    """A listener cannot start (bad certificate, socket path in use, ...)."""

"""HTTP from the event loop ([auth.http], [auth.jwt] jwks_url, [[webhook]]): aiohttp.

aiohttp is the asyncio HTTP client: connection pooling with keep-alive, a C parser,
per-request timeouts, TLS through the standard ssl module, and it runs on uvloop. It
is an extra (`pip install 'wrenmq[http]'`), imported only when one of those sections
is configured.
"""


def aiohttp_module(what):
    """The aiohttp module, or RuntimeError saying how to install it."""
    try:
        import aiohttp
    except ImportError:
        raise RuntimeError(f"{what} needs aiohttp: pip install 'wrenmq[http]'") from None
    return aiohttp


def client_session(what, timeout, headers=None, limit=64):
    """An aiohttp.ClientSession for `what` (call it on the running loop). `limit`: connections
    open to the service at most; more requests wait for one."""
    aiohttp = aiohttp_module(what)
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout),
        headers=headers or None,
        connector=aiohttp.TCPConnector(limit=limit),
        raise_for_status=False,
    )

"""`[auth.jwt]`: a password that is a JSON Web Token is the credential (PyJWT).

A CONNECT whose password looks like a JWT (three base64url parts, the first starting
"eyJ") and whose user name the password file does not know is verified here:

- the signature, by `secret` (HS256/384/512), the PEM `public_key` (RS*, PS*, ES*,
  EdDSA) or the key of a JSON Web Key Set at `jwks_url` that the token's `kid` names
  (fetched at start, every `jwks_refresh` seconds, and at most every 10 s sooner when
  a token names a kid the set does not have: a provider rotating its keys);
- `exp` (required unless `require_exp = false`), `nbf`, and `aud` / `iss` when set,
  with `leeway` seconds of clock skew.

A valid token accepts the client (its user name becomes the `username_claim` claim's
value when that is set), its `acl_claim` gives its publish/subscribe rules (rules.py,
EMQX's formats) and its `exp` the moment its connection is closed (grants.py). An
invalid one (signature, expiry, audience...) refuses it: 0x86 (3.1.1: 4), logged with
why. A password that is not a JWT is left to the next source (HTTP auth, hooks).

Verifying a token is CPU work on the event loop (an RS256 check is about 50 us, ES256
about 100 us), done once per CONNECT.
"""

import asyncio
import logging
import time

from .grants import Grant, GrantingSource
from .rules import RulesError, parse_rules

log = logging.getLogger("wrenmq.auth")

_HMAC = ["HS256", "HS384", "HS512"]
_PUBLIC = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
_JWKS_MIN_INTERVAL = 10.0  # seconds between fetches a token with an unknown kid may cause
MAX_TOKEN = 16384  # bytes: a longer password is not taken for a token


def _jwt_module():
    try:
        import jwt
    except ImportError:
        raise RuntimeError("[auth.jwt] needs PyJWT: pip install 'wrenmq[jwt]'") from None
    return jwt


def looks_like_jwt(password):
    return (password is not None and len(password) <= MAX_TOKEN and password[:3] == b"eyJ"
            and password.count(b".") == 2)


class JwtAuth(GrantingSource):
    source = "JWT"

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.jwt = _jwt_module()
        self.key = None
        self.jwks = {}  # kid -> PyJWK
        self.session = None
        self._refresher = None
        self._jwks_fetched = 0.0
        self._jwks_lock = None
        self.refused = 0
        if cfg.secret:
            self.key = cfg.secret
            self.algorithms = cfg.algorithms or _HMAC
        else:
            self.algorithms = cfg.algorithms or _PUBLIC
            if cfg.public_key:
                with open(cfg.public_key, "rb") as f:
                    self.key = f.read()

    async def start(self, broker):
        await super().start(broker)
        if self.cfg.jwks_url:
            from ..net.http_client import client_session
            self.session = client_session("[auth.jwt] jwks_url", 10.0, limit=2)
            self._jwks_lock = asyncio.Lock()
            if not await self._fetch_jwks():
                log.error("JWT: no keys from %s yet: JWT logins are refused until it answers",
                          self.cfg.jwks_url)
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_jwks())

    async def stop(self):
        if self._refresher is not None:
            self._refresher.cancel()
        if self.session is not None:
            await self.session.close()

    def sys_values(self):
        return {"$SYS/broker/auth/jwt/refused": self.refused, "$SYS/broker/auth/jwt/expired": self.expired}

    async def _refresh_jwks(self):
        while True:
            await asyncio.sleep(self.cfg.jwks_refresh)
            await self._fetch_jwks()

    async def _fetch_jwks(self):
        """Fetch the key set; True if it was read (the old keys stay otherwise)."""
        async with self._jwks_lock:
            self._jwks_fetched = time.monotonic()
            try:
                async with self.session.get(self.cfg.jwks_url) as resp:
                    if resp.status != 200:
                        raise ValueError(f"HTTP {resp.status}")
                    data = await resp.json(content_type=None)
                keys = {}
                for k in self.jwt.PyJWKSet.from_dict(data).keys:
                    keys[k.key_id] = k
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("JWT: cannot read the key set at %s: %s (keeping the %d keys known)",
                            self.cfg.jwks_url, e, len(self.jwks))
                return False
            self.jwks = keys
            log.info("JWT: %d key(s) from %s", len(keys), self.cfg.jwks_url)
            return True

    async def _key_for(self, token):
        if not self.cfg.jwks_url:
            return self.key
        kid = self.jwt.get_unverified_header(token).get("kid")
        key = self.jwks.get(kid)
        if key is None and time.monotonic() - self._jwks_fetched >= _JWKS_MIN_INTERVAL:
            await self._fetch_jwks()  # a key the provider added since the last fetch
            key = self.jwks.get(kid)
        if key is None:
            raise self.jwt.InvalidKeyError(f"no key with kid {kid!r} in the key set")
        return key

    async def authenticate(self, client, connect):
        password = connect.password
        if not looks_like_jwt(password):
            return None
        jwt = self.jwt
        cfg = self.cfg
        token = password.decode("ascii", "replace")
        try:
            key = await self._key_for(token)
            claims = jwt.decode(
                token, key, algorithms=self.algorithms, audience=cfg.audience or None,
                issuer=cfg.issuer or None, leeway=cfg.leeway,
                options={"require": ["exp"] if cfg.require_exp else [], "verify_aud": bool(cfg.audience)})
            rules = parse_rules(claims.get(cfg.acl_claim)) if cfg.acl_claim else None
        except (jwt.PyJWTError, RulesError) as e:
            return self._refuse(client, f"{type(e).__name__}: {e}")
        if cfg.username_claim:
            name = claims.get(cfg.username_claim)
            if not isinstance(name, str) or not name:
                return self._refuse(client, f"no {cfg.username_claim!r} claim for the user name")
            connect.username = name
            client.username = name
        exp = claims.get("exp")
        self.accepted(client, Grant(rules, float(exp) if isinstance(exp, (int, float)) else None))
        return True

    def _refuse(self, client, why):
        self.refused += 1
        log.info("JWT login of client %s from %s refused: %s", client.client_id, client.address, why,
                 extra={"event": "auth.failed", "client_id": client.client_id, "address": client.address,
                        "listener": client.listener, "reason": f"JWT: {why}"})
        return False

"""[auth.jwt]: JWTs made with real keys (HS256, RS256, ES256; a public key file and a JWKS
URL served by the test), verified by the broker (auth/jwt.py); paho clients log in with
the token as password."""

import json
import time

import pytest

from auth_services import JwksService
from conftest import paho_client, subscribe
from wrenmq.broker.hooks import Hook
from wrenmq.mqtt import constants as C

jwt = pytest.importorskip("jwt")
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, rsa  # noqa: E402

SECRET = "a-shared-secret-of-at-least-32-bytes!!"


@pytest.fixture(scope="module")
def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key():
    return ec.generate_private_key(ec.SECP256R1())


def pem(public_key, path):
    path.write_bytes(public_key.public_bytes(serialization.Encoding.PEM,
                                             serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(path)


def token(key, alg, lifetime=300, kid=None, **claims):
    now = int(time.time())
    body = {"iat": now, **claims}
    if lifetime is not None:
        body["exp"] = now + lifetime
    return jwt.encode(body, key, algorithm=alg, headers={"kid": kid} if kid else None)


class Users(Hook):
    """Records the user name each client's session got."""

    def __init__(self):
        self.names = {}

    def on_connect(self, client):
        self.names[client.client_id] = client.username


def jwt_broker(make_broker, jwt_section, hooks=()):
    return make_broker(f"""
[auth]
allow_anonymous = false
[auth.jwt]
{jwt_section}
[sys]
interval = 0
""", hooks=hooks)


def login(port, password, user="device", client_id=None, version=5):
    c = paho_client(port, client_id=client_id, username=user, password=password, version=version)
    return c


def rc(c):
    return int(c.connack[0].value)


def done(c):
    c.disconnect()
    c.loop_stop()


def test_hs256_valid_wrong_signature_expired_and_not_a_token(make_broker):
    users = Users()
    b = jwt_broker(make_broker, f'secret = "{SECRET}"\nusername_claim = "sub"', hooks=[users])
    ok = login(b.port, token(SECRET, "HS256", sub="sensor-17"), client_id="c-ok")
    assert rc(ok) == 0
    assert users.names["c-ok"] == "sensor-17"  # the claim, not the CONNECT's "device"
    done(ok)
    assert rc(login(b.port, token("another-secret-of-at-least-32-bytes!", "HS256", sub="x"))) == \
        C.BAD_USER_NAME_OR_PASSWORD
    assert rc(login(b.port, token(SECRET, "HS256", lifetime=-60, sub="x"))) == C.BAD_USER_NAME_OR_PASSWORD
    assert rc(login(b.port, token(SECRET, "HS256", lifetime=None, sub="x"))) == C.BAD_USER_NAME_OR_PASSWORD
    assert rc(login(b.port, token(SECRET, "HS256"))) == C.BAD_USER_NAME_OR_PASSWORD  # no sub claim
    # Not a JWT: left to the next source, here the policy (no anonymous, no password file).
    assert rc(login(b.port, "plain-password")) == C.NOT_AUTHORIZED
    assert b.call(b.broker.sys_topics.snapshot)["$SYS/broker/auth/jwt/refused"] == 4


def test_rs256_with_a_public_key_file(make_broker, rsa_key, tmp_path):
    b = jwt_broker(make_broker, f'public_key = "{pem(rsa_key.public_key(), tmp_path / "rsa.pem")}"')
    c = login(b.port, token(rsa_key, "RS256"))
    assert rc(c) == 0
    done(c)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert rc(login(b.port, token(other, "RS256"))) == C.BAD_USER_NAME_OR_PASSWORD
    # An HS256 token "signed" with the public key's PEM as secret (algorithm confusion):
    # only the public-key algorithms are accepted with public_key.
    import base64
    import hashlib
    import hmac

    def b64(data):
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps({"exp": int(time.time()) + 60}).encode())
    sig = b64(hmac.new((tmp_path / "rsa.pem").read_bytes(), head + b"." + body, hashlib.sha256).digest())
    assert rc(login(b.port, (head + b"." + body + b"." + sig).decode())) == C.BAD_USER_NAME_OR_PASSWORD


def test_es256_from_a_jwks_url_and_key_rotation(make_broker, ec_key):
    first = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key()))
    first["kid"] = "key-1"
    svc = JwksService([first])
    try:
        b = jwt_broker(make_broker, f'jwks_url = "{svc.url}/jwks.json"\njwks_refresh = 1')
        c = login(b.port, token(ec_key, "ES256", kid="key-1"))
        assert rc(c) == 0
        done(c)
        new_key = ec.generate_private_key(ec.SECP256R1())
        assert rc(login(b.port, token(new_key, "ES256", kid="key-2"))) == C.BAD_USER_NAME_OR_PASSWORD
        second = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(new_key.public_key()))
        second["kid"] = "key-2"
        svc.keys.append(second)  # the provider rotates: the broker fetches the set again
        deadline = time.monotonic() + 10
        while True:
            c = login(b.port, token(new_key, "ES256", kid="key-2"))
            if rc(c) == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert rc(c) == 0
        done(c)
        assert svc.fetches >= 2
    finally:
        svc.stop()


def test_acl_claims_both_formats(make_broker):
    b = jwt_broker(make_broker, f'secret = "{SECRET}"')
    rules = [{"permission": "allow", "action": "publish", "topic": "up/${clientid}"},
             {"permission": "allow", "action": "subscribe", "topic": "down/${clientid}/#"},
             {"permission": "deny", "action": "all", "topic": "#"}]
    c = login(b.port, token(SECRET, "HS256", acl=rules), client_id="d1")
    assert rc(c) == 0
    assert subscribe(c, "down/d1/#", 1)[0] == 1
    assert subscribe(c, "down/d2/#", 1)[0] == C.NOT_AUTHORIZED
    c.publish("up/d1", b"ok", qos=1).wait_for_publish(5)
    c.publish("up/d2", b"no", qos=1).wait_for_publish(5)
    assert b.call(lambda: b.broker.router.stats.denied_publish) == 1
    done(c)
    # The older whitelist format, with %c: what is not listed is refused.
    old = login(b.port, token(SECRET, "HS256", acl={"pub": ["up/%c"], "sub": ["down/%c"]}), client_id="d3")
    assert rc(old) == 0
    assert subscribe(old, "down/d3", 0)[0] == 0
    assert subscribe(old, "other", 0)[0] == C.NOT_AUTHORIZED
    done(old)
    # Rules that cannot be read refuse the login rather than grant something unclear.
    assert rc(login(b.port, token(SECRET, "HS256", acl=[{"permission": "maybe"}]))) == \
        C.BAD_USER_NAME_OR_PASSWORD


def test_the_connection_closes_when_the_token_expires(make_broker):
    b = jwt_broker(make_broker, f'secret = "{SECRET}"')
    c = login(b.port, token(SECRET, "HS256", lifetime=2))
    assert rc(c) == 0
    started = time.monotonic()
    assert c.disconnected_event.wait(8)
    assert 1.0 < time.monotonic() - started < 6
    assert int(c.disconnect_reason.value) == C.NOT_AUTHORIZED
    assert b.call(b.broker.sys_topics.snapshot)["$SYS/broker/auth/jwt/expired"] == 1


def test_audience_and_issuer(make_broker):
    b = jwt_broker(make_broker, f'secret = "{SECRET}"\naudience = "mqtt"\nissuer = "https://id.example"')
    good = login(b.port, token(SECRET, "HS256", aud="mqtt", iss="https://id.example"))
    assert rc(good) == 0
    done(good)
    assert rc(login(b.port, token(SECRET, "HS256", aud="web", iss="https://id.example"))) == \
        C.BAD_USER_NAME_OR_PASSWORD
    assert rc(login(b.port, token(SECRET, "HS256", aud="mqtt", iss="https://evil.example"))) == \
        C.BAD_USER_NAME_OR_PASSWORD

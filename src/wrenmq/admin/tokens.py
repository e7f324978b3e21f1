"""API tokens of admin listeners: made by `wrenmq admin token add`, kept as hashes in a file.

A token is `<name>.<secret>`: the name its owner chose (letters, digits, `-` and `_`) and
32 random bytes in URL-safe base64. It is shown once, when made; the file keeps only its
SHA-256, one line per token:

    <name>:<scope>:<sha256 of the whole token, hex>

`scope` is `write` (everything the API offers) or `read` (GET only). A request sends it as
`Authorization: Bearer <token>`. The listener finds the entry by the name and compares
the hashes with `hmac.compare_digest` (a name it does not know is compared against a
dummy hash, so both take the same time). 256 random bits need no slow hash: nobody can
guess them, and a stolen file gives no token.

The file is re-read when its size or modification time changes, so a token added or
revoked applies to the next request without a reload.
"""

import base64
import hashlib
import hmac
import os
import re
import secrets
import tempfile

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SCOPES = ("read", "write")
_DUMMY = hashlib.sha256(b"no such token").hexdigest()


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file and line."""


def new_token(name):
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return f"{name}.{secret}"


def token_hash(token):
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def read_tokens(path):
    """{name: (scope, hash)} of a token file; TokenFileError if a line is malformed."""
    out = {}
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return out
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(f"{path}: cannot read it: {e}") from None
    for n, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        parts = s.split(":")
        if len(parts) != 3 or not NAME.match(parts[0]) or parts[1] not in SCOPES or \
                not re.fullmatch(r"[0-9a-f]{64}", parts[2]):
            raise TokenFileError(f"{path}:{n}: expected <name>:<read|write>:<sha256 hex> "
                                 "(a file written by `wrenmq admin token`)")
        out[parts[0]] = (parts[1], parts[2])
    return out


def write_tokens(path, tokens):
    """Replace the file with `tokens` ({name: (scope, hash)}), atomically, mode 0600."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tokens-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("# wrenmq admin API tokens: name:scope:sha256 (written by `wrenmq admin token`)\n")
            for name, (scope, digest) in sorted(tokens.items()):
                fh.write(f"{name}:{scope}:{digest}\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class TokenFile:
    """The tokens of one listener's `token_file`, re-read when the file changes."""

    def __init__(self, path):
        self.path = path
        self.tokens = {}
        self._seen = None
        self.refresh()

    def refresh(self):
        """Re-read the file if it changed. A file that became unusable keeps the tokens
        read before (and raises, for the caller to log)."""
        try:
            st = os.stat(self.path)
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            seen = None
        if seen == self._seen:
            return False
        tokens = read_tokens(self.path) if seen is not None else {}
        self.tokens = tokens
        self._seen = seen
        return True

    def check(self, token):
        """The scope of a valid token ("read" or "write"), else None; constant time in the
        token's secret."""
        name, dot, _ = token.partition(".")
        entry = self.tokens.get(name) if dot else None
        digest = token_hash(token)
        if entry is None:
            hmac.compare_digest(digest, _DUMMY)
            return None
        return entry[0] if hmac.compare_digest(digest, entry[1]) else None

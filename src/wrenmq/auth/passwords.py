"""Mosquitto password files: read `$6$` and `$7$` entries, write `$7$` ones.

One entry per line, `user:hash`, where hash is one of

    $6$<salt>$<digest>                 salted SHA-512: SHA512(password + salt)
    $7$<iterations>$<salt>$<digest>    PBKDF2-HMAC-SHA512(password, salt, iterations), 64 bytes

salt and digest in standard base64 (the digest is 64 bytes). This is what
Mosquitto 1.5+ (`$6$`) and 2.x (`$7$`, 101 iterations, 12-byte salt) write with
`mosquitto_passwd`; `wrenmq passwd` writes `$7$` entries the same way.

Reading is stricter than Mosquitto, which logs and drops a malformed entry:
here any malformed line is an error naming the file and the line, so a broken
file never silently changes who can log in (and a reload keeps the old file).
Lines starting with `#` and blank lines are ignored.
"""

import base64
import binascii
import hashlib
import hmac
import os
import stat
import tempfile

DEFAULT_ITERATIONS = 101  # mosquitto_passwd's default for $7$
SALT_BYTES = 12
DIGEST_BYTES = 64
MAX_LEN = 65535


class PasswordFileError(ValueError):
    """A password file that cannot be used; the message names the file (and line)."""


class Entry:
    """One user's hash, parsed; `verify(password)` is CPU work (run it off the event loop)."""

    __slots__ = ("kind", "iterations", "salt", "digest")

    def __init__(self, kind, iterations, salt, digest):
        self.kind = kind  # 6 or 7
        self.iterations = iterations
        self.salt = salt
        self.digest = digest

    def verify(self, password):
        if password is None:
            return False
        if isinstance(password, str):
            password = password.encode()
        if self.kind == 6:
            got = hashlib.sha512(password + self.salt).digest()
        else:
            got = hashlib.pbkdf2_hmac("sha512", password, self.salt, self.iterations, DIGEST_BYTES)
        return hmac.compare_digest(got, self.digest)


def _b64(text):
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def parse_hash(text):
    """`$6$...` or `$7$...` -> Entry; raise ValueError with a short reason."""
    parts = text.split("$")
    # "$7$101$salt$hash".split("$") == ["", "7", "101", "salt", "hash"]
    if len(parts) < 2 or parts[0] != "":
        raise ValueError("not a $6$ or $7$ hash (plain-text passwords are not accepted)")
    kind = parts[1]
    if kind == "6":
        if len(parts) != 4:
            raise ValueError("a $6$ hash is $6$<salt>$<hash>")
        iterations = 0
        salt_s, digest_s = parts[2], parts[3]
    elif kind == "7":
        if len(parts) != 5:
            raise ValueError("a $7$ hash is $7$<iterations>$<salt>$<hash>")
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise ValueError(f"bad iteration count {parts[2]!r}")
        iterations = int(parts[2])
        salt_s, digest_s = parts[3], parts[4]
    else:
        raise ValueError(f"unknown hash type ${kind}$ (only $6$ and $7$ are supported)")
    salt = _b64(salt_s)
    if not salt:
        raise ValueError("salt is not valid base64")
    digest = _b64(digest_s)
    if digest is None or len(digest) != DIGEST_BYTES:
        raise ValueError(f"hash is not {DIGEST_BYTES} bytes of base64")
    return Entry(int(kind), iterations, salt, digest)


def hash_password(password, iterations=DEFAULT_ITERATIONS, salt=None):
    """The `$7$` string mosquitto_passwd writes for `password` (str or bytes)."""
    if isinstance(password, str):
        password = password.encode()
    if salt is None:
        salt = os.urandom(SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password, salt, iterations, DIGEST_BYTES)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _split_line(line):
    """'user:hash' -> (user, hash), both trimmed like Mosquitto does; None for a non-entry."""
    s = line.strip()
    if not s or s.startswith("#"):
        return None
    user, sep, rest = line.partition(":")
    return user.strip(" \t\r\n"), sep, rest.strip(" \t\r\n")


class PasswordFile:
    """A parsed password file: `users` maps user name -> Entry."""

    def __init__(self, path, users):
        self.path = path
        self.users = users

    def __len__(self):
        return len(self.users)

    def get(self, username):
        return self.users.get(username)

    @classmethod
    def load(cls, path):
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as e:
            raise PasswordFileError(f"{path}: cannot read password file: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise PasswordFileError(f"{path}:{line}: not valid UTF-8") from None
        return cls.parse(text, path)

    @classmethod
    def parse(cls, text, path="<string>"):
        users = {}
        for n, line in enumerate(text.splitlines(), 1):
            parts = _split_line(line)
            if parts is None:
                continue
            user, sep, rest = parts
            if not sep:
                raise PasswordFileError(f"{path}:{n}: expected user:hash")
            if not user:
                raise PasswordFileError(f"{path}:{n}: empty user name")
            if user in users:
                raise PasswordFileError(f"{path}:{n}: user {user!r} appears twice")
            try:
                users[user] = parse_hash(rest)
            except ValueError as e:
                raise PasswordFileError(f"{path}:{n}: user {user!r}: {e}") from None
        return cls(path, users)


# --- editing (wrenmq passwd) -------------------------------------------------------

def check_username(username):
    """mosquitto_passwd's rules; return an error message or None."""
    if len(username) > MAX_LEN:
        return "Username must be less than 65536 characters long."
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in username):
        return "Username must not contain control characters."
    if ":" in username:
        return "Username must not contain the ':' character."
    if not username.strip(" \t"):
        return "Username must not be empty."
    return None


def read_lines(path):
    """The file's lines (without newlines), checked the way mosquitto_passwd checks them."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for n, line in enumerate(lines, 1):
        parts = _split_line(line)
        if parts is not None and (not parts[1] or not parts[0] or not parts[2]):
            raise PasswordFileError(f"Corrupt password file at line {n}.")
    return lines


def set_password(lines, username, password, iterations=DEFAULT_ITERATIONS):
    """Replace the user's entry in place (or append one); return (lines, updated?)."""
    entry = f"{username}:{hash_password(password, iterations)}"
    out = []
    found = False
    for line in lines:
        parts = _split_line(line)
        if parts is not None and parts[0] == username:
            if not found:
                out.append(entry)
                found = True
            continue  # a duplicate of the user: drop it
        out.append(line)
    if not found:
        out.append(entry)
    return out, found


def delete_user(lines, username):
    """Remove the user's entries; return (lines, found?)."""
    out = [line for line in lines if (_split_line(line) or (None,))[0] != username]
    return out, len(out) != len(lines)


def write_lines(path, lines, create=False):
    """Write atomically (temporary file + rename). A new file is private (0600); an
    existing one keeps its permissions (and owner, when we may set it)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    mode, owner = 0o600, None
    try:
        st = os.stat(path)
        if not create or stat.S_ISREG(st.st_mode):
            mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=".wrenmq-passwd-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        if owner is not None and hasattr(os, "chown"):
            try:
                os.chown(tmp, *owner)
            except OSError:
                pass
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise

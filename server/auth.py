"""Who is asking. One story for every path to the engine (the API and the chat page alike):

- API keys and logins are named, and read from files or the environment, never from the command
  line (where `ps` shows them). Passwords are stored as scrypt hashes: `python -m server.auth
  add-user FILE NAME` writes one.
- With keys but no logins, the chat page asks for a login too: the key's name and the key.
- With neither, each browser is a visitor known by a server-issued, HttpOnly, signed cookie whose key
  never leaves the server.
- Operators are the names given to `--admin`, logins or keys alike.
"""
from __future__ import annotations

import argparse
import getpass
import hashlib
import hmac
import os
import secrets
import sys
from dataclasses import dataclass, field

DEFAULT_KEY_NAME = "api"
VISITOR_COOKIE = "pagedchat_visitor"
_SCRYPT = dict(n=2 ** 14, r=8, p=1, dklen=32)


# ---- passwords ----------------------------------------------------------------------------
def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, **_SCRYPT)
    return f"scrypt${salt.hex()}${digest.hex()}"


def verify_password(password: str, stored: str) -> bool:
    scheme, salt, digest = (stored.split("$") + ["", ""])[:3]
    if scheme != "scrypt":
        return False
    try:
        got = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), **_SCRYPT)
        return hmac.compare_digest(got, bytes.fromhex(digest))
    except ValueError:
        return False


# ---- reading the secrets ------------------------------------------------------------------
def _lines(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        return [(n, line.strip()) for n, line in enumerate(f, 1) if line.strip() and not line.startswith("#")]


def read_api_keys(path: str | None, env_key: str | None = None) -> dict[str, str]:
    """key -> name. The file holds `NAME:KEY` lines (a bare `KEY` is named "api"); `env_key` (the
    environment's PAGEDCHAT_API_KEY, engine.config.knobs) adds one key named "api"."""
    keys: dict[str, str] = {}
    if env_key:
        keys[env_key] = DEFAULT_KEY_NAME
    for n, line in _lines(path) if path else []:
        name, sep, key = line.rpartition(":")
        if len(key) < 8:
            raise ValueError(f"{path}:{n}: an API key must be at least 8 characters")
        keys[key] = name if sep and name else DEFAULT_KEY_NAME
    return keys


def read_users(path: str | None) -> dict[str, str]:
    """name -> scrypt hash, from `NAME:scrypt$...` lines (written by `python -m server.auth add-user`)."""
    users: dict[str, str] = {}
    for n, line in _lines(path) if path else []:
        name, sep, stored = line.partition(":")
        if not sep or not name or not stored.startswith("scrypt$"):
            raise ValueError(f"{path}:{n}: expected NAME:scrypt$... (make it with "
                             f"`python -m server.auth add-user {path} NAME`); plain passwords are not accepted")
        users[name] = stored
    return users


def read_secret(path: str | None) -> str | None:
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


@dataclass(frozen=True)
class Credentials:
    keys: dict[str, str] = field(default_factory=dict)  # API key -> its name
    users: dict[str, str] = field(default_factory=dict)  # login name -> password hash
    operators: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.operators) - set(self.users) - set(self.keys.values())
        if unknown:
            raise ValueError(f"--admin names a login (--auth-file) or an API key's name; "
                             f"not among them: {', '.join(sorted(unknown))}")

    @property
    def required(self) -> bool:
        """Whether anything at all asks for a key or login."""
        return bool(self.keys or self.users)

    def key_name(self, authorization: str | None) -> str | None:
        """The name of the key in an `Authorization: Bearer KEY` header, if it is one of ours."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        for known, name in self.keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return name
        return None

    def check_login(self, name: str, password: str) -> bool:
        """The chat page's login: a user's password, or a key given with its name."""
        if name in self.users:
            return verify_password(password, self.users[name])
        return self.key_name(f"Bearer {password}") == name


# ---- the anonymous visitor's cookie --------------------------------------------------------
class VisitorCookie:
    """`id.signature`; the signature is an HMAC of the id under a key kept on the server."""

    def __init__(self, secret: str) -> None:
        self._key = hashlib.sha256(f"pagedchat-visitor:{secret}".encode()).digest()

    def _sign(self, visitor: str) -> str:
        return hmac.new(self._key, visitor.encode(), hashlib.sha256).hexdigest()

    def issue(self) -> str:
        visitor = secrets.token_hex(16)
        return f"{visitor}.{self._sign(visitor)}"

    def visitor(self, value: str | None) -> str | None:
        """The id in a cookie value, or None unless the signature is ours."""
        visitor, _, signature = (value or "").partition(".")
        if visitor and hmac.compare_digest(signature, self._sign(visitor)):
            return visitor
        return None


# ---- python -m server.auth add-user FILE NAME ------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.auth", description="manage the login file (--auth-file)")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add-user", help="add or replace a login; the password is read from the terminal or stdin")
    add.add_argument("file")
    add.add_argument("name")
    args = p.parse_args(argv)
    if ":" in args.name or not args.name.strip():
        p.error("a login name cannot be empty or contain ':'")
    password = getpass.getpass(f"password for {args.name}: ") if sys.stdin.isatty() else sys.stdin.readline()
    password = password.rstrip("\n")
    if len(password) < 8:
        p.error("the password must be at least 8 characters")
    users = read_users(args.file) if os.path.exists(args.file) else {}
    users[args.name] = hash_password(password)
    fd = os.open(args.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(f"{name}:{stored}\n" for name, stored in users.items())
    print(f"{args.name} saved in {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Who may talk to whom: the shared token and its handshake MAC, protected mode, and TLS
contexts.

Both sides use these, so the rules are written once:

- A token is at least `MIN_TOKEN_BYTES` bytes, comes from a file (`--token-file`, readable
  by its owner only) or the `EGGROLL_TOKEN` environment variable, never from a command line
  (every local user can read another's argv). Known placeholders are refused.
- Without a token the coordinator runs in protected mode: it serves loopback peers only,
  like Redis with no password.
- Without TLS the HMAC handshake proves the worker holds the token, but nothing is
  encrypted and the coordinator is not authenticated: a trusted network is assumed. With TLS
  (standard library `ssl`) the worker checks the coordinator's certificate against its CA,
  and with a client CA on the coordinator, the coordinator checks the worker's (mutual TLS).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import ssl
import stat
from pathlib import Path

__all__ = [
    "CREDENTIAL_PREFIX",
    "MIN_TOKEN_BYTES",
    "TOKEN_ENV",
    "TokenError",
    "auth_mac",
    "check_token",
    "client_tls_context",
    "is_loopback",
    "load_token",
    "new_token",
    "server_tls_context",
    "verify_mac",
    "worker_credential",
]

MIN_TOKEN_BYTES = 16
TOKEN_ENV = "EGGROLL_TOKEN"
_PLACEHOLDERS = {b"change-me", b"changeme", b"secret", b"password", b"token"}
_MAX_TOKEN_FILE_BYTES = 4096


class TokenError(ValueError):
    """A token that cannot be used; the message says what to do."""


def new_token() -> str:
    """A fresh 256-bit token, as 64 hex characters."""
    return secrets.token_hex(32)


def check_token(token: bytes, source: str) -> bytes:
    """`token` if it is long enough and no placeholder; TokenError naming `source` if not."""
    if token.strip().lower() in _PLACEHOLDERS:
        raise TokenError(f"the token from {source} is a placeholder: {_HOW}")
    if len(token) < MIN_TOKEN_BYTES:
        raise TokenError(
            f"the token from {source} is {len(token)} bytes; at least {MIN_TOKEN_BYTES} "
            f"are needed: {_HOW}"
        )
    return token


_HOW = "make one with `eggroll-coordinator --new-token` (or `openssl rand -hex 32`)"


def auth_mac(token: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the challenge nonce, keyed with the shared token."""
    return hmac.new(token, nonce, hashlib.sha256).digest()


def verify_mac(token: bytes, nonce: bytes, mac: bytes) -> bool:
    """Constant-time check of an AUTH mac against the expected one."""
    return hmac.compare_digest(auth_mac(token, nonce), mac)


CREDENTIAL_PREFIX = "worker:"  # the machine a worker credential stands for: worker:NAME
_CREDENTIAL_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def worker_credential(token: bytes, name: str) -> bytes | None:
    """The credential the operator hands the worker enrolled as `name` instead of the run's
    token: HMAC-SHA256(token, "worker:" + name) in hex, used as that worker's token. It
    proves the name (the coordinator derives it again from the HELLO's worker name) and not
    the token, which it does not reveal. None for a name that cannot be enrolled (not 1 to
    64 letters, digits, `.`, `_`, `-`) or without a token (protected mode)."""
    if not token or not _CREDENTIAL_NAME.fullmatch(name):
        return None
    message = (CREDENTIAL_PREFIX + name).encode()
    return hmac.new(token, message, hashlib.sha256).hexdigest().encode()


def load_token(token_file: str | Path | None, environ: dict[str, str] | None = None) -> bytes:
    """The run's token from `token_file`, else from $EGGROLL_TOKEN, else b"" (none).

    The file holds the token on its first line; it must not be readable by group or others.
    """
    environ = os.environ if environ is None else environ
    if token_file is not None:
        path = Path(token_file)
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read(_MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise TokenError(f"cannot read --token-file {path}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TokenError(
                f"--token-file {path} is readable by others (mode {stat.S_IMODE(mode):04o}): "
                f"run `chmod 600 {path}`"
            )
        if len(data) > _MAX_TOKEN_FILE_BYTES:
            raise TokenError(f"--token-file {path} is over {_MAX_TOKEN_FILE_BYTES} bytes")
        lines = data.splitlines()
        return check_token(lines[0].strip() if lines else b"", f"--token-file {path}")
    value = environ.get(TOKEN_ENV, "")
    if value == "":
        return b""
    return check_token(value.strip().encode("utf-8"), f"${TOKEN_ENV}")


def is_loopback(host: str) -> bool:
    """Whether a peer address is on this machine's loopback (127.0.0.0/8, ::1)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def server_tls_context(
    cert: str | Path, key: str | Path, client_ca: str | Path | None = None
) -> ssl.SSLContext:
    """TLS for the coordinator; with `client_ca`, workers must present a certificate it
    signed (mutual TLS)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        ctx.load_verify_locations(str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


MAX_CN_CHARS = 64  # X.509's bound on a common name
IDENTITY_PREFIXES = ("cn:", "cert:")  # a certificate identity, never an address
_PLAIN_CN = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_CN_CHARS}}}")


def certificate_identity(cert: dict | None) -> str | None:
    """The machine a verified client certificate (`ssl.SSLSocket.getpeercert()`) stands
    for: `cn:NAME`, its subject's one common name where that is plain (letters, digits,
    `.`, `_`, `-`; no look-alikes, nothing to confuse a log), else `cert:HEX` of its issuer
    and serial number, which the CA signed (a hash of the certificate's bytes would not
    do: an ECDSA signature has two valid forms). None without either. Certificates that
    share a common name stand for one machine."""
    if not cert:
        return None
    names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    if len(names) == 1 and _PLAIN_CN.fullmatch(names[0]):
        return f"cn:{names[0]}"
    serial, issuer = cert.get("serialNumber"), cert.get("issuer")
    if not serial or not issuer:
        return None
    return "cert:" + hashlib.sha256(repr((issuer, serial)).encode()).hexdigest()[:32]


def client_tls_context(
    ca: str | Path, cert: str | Path | None = None, key: str | Path | None = None
) -> ssl.SSLContext:
    """TLS for a worker: the coordinator's certificate must chain to `ca` and name the host
    dialled; `cert`/`key` are the worker's own for mutual TLS."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        ctx.load_cert_chain(str(cert), None if key is None else str(key))
    return ctx

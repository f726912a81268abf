"""Tokens, protected mode and TLS contexts: the rules both sides share."""

from __future__ import annotations

import hashlib
import hmac
import ssl
from pathlib import Path

import pytest

from eggroll_dist.protocol.messages import Auth
from eggroll_dist.protocol.security import (
    MIN_TOKEN_BYTES,
    TokenError,
    auth_mac,
    certificate_identity,
    client_tls_context,
    is_loopback,
    load_token,
    new_token,
    server_tls_context,
    verify_mac,
)


def _token_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_token_from_file_then_environment_then_none(tmp_path: Path) -> None:
    token = new_token()
    assert len(token) == 64 and token != new_token()
    path = _token_file(tmp_path, token + "\n")
    assert load_token(path, {"EGGROLL_TOKEN": "ignored-when-a-file-is-given"}) == token.encode()
    assert load_token(None, {"EGGROLL_TOKEN": token}) == token.encode()
    assert load_token(None, {}) == b""


def test_bad_tokens_are_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match=f"at least {MIN_TOKEN_BYTES}.*--new-token"):
        load_token(None, {"EGGROLL_TOKEN": "hunter2"})
    with pytest.raises(TokenError, match="placeholder"):
        load_token(None, {"EGGROLL_TOKEN": "change-me"})
    with pytest.raises(TokenError, match="chmod 600"):
        load_token(_token_file(tmp_path, new_token(), 0o644), {})
    with pytest.raises(TokenError, match="cannot read --token-file"):
        load_token(tmp_path / "missing", {})
    with pytest.raises(TokenError, match="0 bytes"):
        load_token(_token_file(tmp_path, ""), {})


def test_loopback_peers() -> None:
    for host in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("10.0.0.5", "192.168.1.2", "::ffff:10.0.0.1", "2001:db8::1", "", "localhost"):
        assert not is_loopback(host), host


def test_tls_contexts_load_certificates(tls_certs: dict[str, dict[str, Path]]) -> None:
    certs = tls_certs["ca"]
    server = server_tls_context(certs["srv.pem"], certs["srv.key"], certs["ca.pem"])
    assert server.verify_mode is ssl.CERT_REQUIRED  # mutual TLS with a client CA
    assert server_tls_context(certs["srv.pem"], certs["srv.key"]).verify_mode is ssl.CERT_NONE
    client = client_tls_context(certs["ca.pem"], certs["cli.pem"], certs["cli.key"])
    assert client.verify_mode is ssl.CERT_REQUIRED and client.check_hostname
    with pytest.raises(ssl.SSLError):
        server_tls_context(certs["srv.pem"], certs["cli.key"])  # key of another certificate


def test_a_certificate_stands_for_its_plain_common_name_else_its_serial() -> None:
    issuer = ((("commonName", "eggroll-ca"),),)

    def cert(*names: str, serial: str = "0A1B") -> dict:
        subject = tuple((("commonName", n),) for n in names)
        return {"subject": subject, "issuer": issuer, "serialNumber": serial}

    assert certificate_identity(cert("node-7.rack_2")) == "cn:node-7.rack_2"
    # No common name, several, an overlong, unprintable, look-alike or spaced one: the
    # issuer and serial number, which the CA signed (the same certificate, the same).
    odd = [cert(), cert("a", "b"), cert("x" * 65), cert("a\nb"), cert("nоde"), cert("a b")]
    named = {certificate_identity(c) for c in odd}
    assert len(named) == 1 and next(iter(named)).startswith("cert:")
    assert certificate_identity(cert(serial="0A1C")) not in named | {None}
    assert certificate_identity(None) is None and certificate_identity({}) is None
    assert certificate_identity({"subject": ()}) is None


def test_auth_mac() -> None:
    token, nonce = b"secret-token", bytes(range(32))
    mac = auth_mac(token, nonce)
    assert mac == hmac.new(token, nonce, hashlib.sha256).digest()
    assert len(mac) == 32
    assert verify_mac(token, nonce, mac)
    assert not verify_mac(b"other-token", nonce, mac)
    assert not verify_mac(token, bytes(32), mac)
    assert not verify_mac(token, nonce, mac[:-1] + bytes([mac[-1] ^ 1]))
    Auth(mac)  # fits the AUTH field

"""Tokens, protected mode and TLS contexts: the rules both sides share."""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path

import pytest

from eggroll_dist.protocol.security import (
    MIN_TOKEN_BYTES,
    TokenError,
    certificate_identity,
    client_tls_context,
    is_loopback,
    load_token,
    new_token,
    server_tls_context,
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


def test_a_certificate_stands_for_its_common_name_else_its_digest(
    tls_certs: dict[str, dict[str, Path]],
) -> None:
    der = ssl.PEM_cert_to_DER_cert(tls_certs["ca"]["cli.pem"].read_text())
    digest = f"sha256:{hashlib.sha256(der).hexdigest()}"

    def subject(*names: str) -> dict:
        return {"subject": tuple((("commonName", n),) for n in names)}

    assert certificate_identity(subject("node7"), der) == "cn:node7"
    # No common name, several, an overlong or unprintable one: the certificate itself.
    for cert in (subject(), subject("a", "b"), subject("x" * 65), subject("a\nb")):
        assert certificate_identity(cert, der) == digest
    assert certificate_identity(None, None) is None

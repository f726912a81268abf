"""Nothing the network sends can crash the coordinator or lose committed data."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
from pathlib import Path

import pytest
from helpers import TINY_RUN, command, start_coordinator, start_worker

from eggroll_dist.protocol import (
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Connection,
    Error,
    ErrorCode,
    Hello,
    Role,
    auth_mac,
    decode_message,
    encode_frame,
)

TOKEN = "input-tests-token-0123456789"


def _talk(port: int, data: bytes) -> Error | None:
    """Send raw bytes; return the ERROR the coordinator answers with (None if none)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    if len(received) < 16:
        return None
    (length,) = struct.unpack(">I", received[8:12])
    msg = decode_message(received[5], received[16 : 16 + length])
    return msg if isinstance(msg, Error) else None


def _handshake_with_token(port: int, token: bytes) -> Error | None:
    conn = Connection(Role.WORKER)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(conn.send(Hello(PROTOCOL_VERSION, "intruder", "numpy", "cpu", bytes(32))))
        while True:
            data = sock.recv(65536)
            if not data:
                return None
            conn.receive_data(data)
            while (msg := conn.next_event()) is not None:
                if isinstance(msg, Challenge):
                    sock.sendall(conn.send(Auth(auth_mac(token, msg.nonce))))
                elif isinstance(msg, Error):
                    return msg


def test_garbage_and_wrong_tokens_are_refused_and_the_run_goes_on(
    spawn, words_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EGGROLL_TOKEN", TOKEN)  # inherited by every process started here
    config = tmp_path / "run.toml"
    config.write_text(TINY_RUN)
    coord, port = start_coordinator(spawn, tmp_path / "run", config, "--max-steps", "3")

    bad_magic = b"JOBS" + bytes(12)
    assert _talk(port, bad_magic).code == ErrorCode.BAD_MAGIC
    header = b"EGGR\x02\x01\x00\x00" + struct.pack(">I", 1 << 30) + bytes(4)
    assert _talk(port, header).code == ErrorCode.FRAME_TOO_LARGE  # never buffers 1 GiB
    bad_crc = bytearray(encode_frame(1, b"\x01" + bytes(40)))
    bad_crc[12] ^= 0xFF
    assert _talk(port, bytes(bad_crc)).code == ErrorCode.BAD_CRC
    assert _talk(port, encode_frame(99, b"")).code == ErrorCode.UNKNOWN_TYPE
    assert _talk(port, encode_frame(5, struct.pack(">QQQI", 0, 0, 0, 1))).code == (
        ErrorCode.ILLEGAL_STATE  # a JOB_REQUEST before the handshake
    )
    assert _talk(port, encode_frame(1, b"\x01\x00")).code == ErrorCode.MALFORMED
    assert _handshake_with_token(port, b"guess").code == ErrorCode.AUTH_FAILED
    wrong = subprocess.run(
        [
            command("eggroll-worker"),
            f"127.0.0.1:{port}",
            "--data-dir",
            str(words_data),
            "--log-format",
            "json",
        ],
        env={**os.environ, "EGGROLL_TOKEN": "a-wrong-guess-of-the-token"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 2 and "token" in wrong.stderr and "Traceback" not in wrong.stderr

    # The coordinator is still serving: a worker with the right token trains to the end.
    start_worker(spawn, port, words_data)
    assert coord.wait(120) == 0
    assert coord.count(lambda e: e.get("event") == "step") == 3

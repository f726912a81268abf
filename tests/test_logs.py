"""Event lines: key=value text on a terminal, JSON lines otherwise."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

CODE = (
    "import sys, structlog\n"
    "from eggroll_dist.shared.logs import configure_logging\n"
    "configure_logging(sys.argv[1])\n"
    "structlog.get_logger().info('step', step=3, loss_bits=4.5, worker='w 1')\n"
)


def _line(log_format: str, tty: bool) -> str:
    env = {**os.environ, "NO_COLOR": "1"}
    if not tty:
        done = subprocess.run(
            [sys.executable, "-c", CODE, log_format],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        return done.stderr.strip()
    main, sub = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-c", CODE, log_format], stderr=sub, env=env)
        os.close(sub)
        out = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(60) == 0
    finally:
        os.close(main)
    return out.decode().strip()


@pytest.mark.parametrize(("log_format", "tty"), [("auto", True), ("text", False)])
def test_text_is_key_value(log_format: str, tty: bool) -> None:
    line = _line(log_format, tty)
    assert "step" in line and "step=3" in line and "loss_bits=4.5" in line
    assert "worker='w 1'" in line and not line.startswith("{")


@pytest.mark.parametrize(("log_format", "tty"), [("auto", False), ("json", True)])
def test_json_otherwise(log_format: str, tty: bool) -> None:
    event = json.loads(_line(log_format, tty))
    assert event["event"] == "step" and event["step"] == 3 and event["worker"] == "w 1"


def test_a_json_line_reads_as_text_on_a_terminal() -> None:
    from eggroll_dist.shared.logs import readable

    line = (
        '{"reason": "cannot connect", "attempt": 2, "event": "reconnecting", '
        '"level": "warning", "timestamp": "t"}'
    )
    assert readable(line) == "warning: reconnecting reason='cannot connect' attempt=2"
    assert readable('{"step": 3, "event": "step", "level": "info"}') == "step step=3"
    assert readable("not json at all") == "not json at all"
    assert readable('{"event": "x", "text": "\\u001b[2J"}') == "x text=\\x1b[2J"

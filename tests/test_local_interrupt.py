"""eggroll-local on a run far too long: an ETA in days and a warning; and Ctrl-C, which
stops at once and says which steps are kept."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import SMALL_RUN, command


def test_a_huge_run_is_warned_of_and_ctrl_c_keeps_its_steps(
    words_data: Path, tmp_path: Path
) -> None:
    config = tmp_path / "small.toml"
    config.write_text(SMALL_RUN)
    save = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *(command("eggroll-local"), "--config", str(config), "--steps", "1000000000"),
            *("--save-dir", str(save), "--data-dir", str(words_data), "--metrics-port", "0"),
            *("--snapshot-every", "0", "--sample-every", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _check(proc, save)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _check(proc: subprocess.Popen, save: Path) -> None:
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(("warning: at this pace", "step      4/")):
            break
    text = "".join(lines)
    assert "warning: at this pace the 1,000,000,000 steps take " in text, text
    assert "is --steps what you meant?" in text
    eta = re.search(r"step +2/1000000000 .* ETA (\S+)\n", text)
    assert eta is not None and re.fullmatch(r"[0-9,]+d[0-9]{2}h", eta[1]), text
    # A terminal's Ctrl-C goes to the whole foreground process group.
    interrupted = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    seconds = time.monotonic() - interrupted
    text += out
    assert proc.returncode == 130, text
    assert seconds < 5, (seconds, text)
    assert "chunks in" not in out and "worker left" not in out, out
    (kept,) = [ln for ln in out.splitlines() if ln.startswith("stopped at step")]
    steps = int(kept.split()[3].rstrip(";"))
    assert steps >= 2 and kept.endswith(f"steps 1..{steps} are kept in {save}: run again to resume")


def test_a_workers_long_catch_up_is_shown_not_silent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker replaying the fitness log (or downloading a snapshot) before it trains says
    so on eggroll-local's console, not only in its log file."""
    import sys

    from eggroll_dist.worker.local import _copy_output

    lines = [
        '{"done": 40, "of": 226, "event": "catching up", "level": "info"}',
        '{"step": 3, "event": "job skipped", "level": "info"}',
    ]
    code = "import sys; sys.stdout.write(sys.argv[1])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "\n".join(lines) + "\n"], stdout=subprocess.PIPE, text=True
    )
    _copy_output(proc, tmp_path / "w.log", "local-0").join(30)
    proc.wait(30)
    shown = capsys.readouterr().out.splitlines()
    assert shown == ["local-0: catching up done=40 of=226"], shown
    assert (tmp_path / "w.log").read_text().splitlines() == lines

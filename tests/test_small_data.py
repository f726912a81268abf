"""Data too small for a run: eggroll-data prepare warns and says what is enough;
eggroll-train and eggroll-local refuse it in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eggroll_dist.shared.config import preset
from eggroll_dist.shared.window import data_too_short, step_tokens
from eggroll_dist.worker.data.build import size_warnings


def _exe(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture
def short_data(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    (tmp_path / "a.txt").write_text("hello world, a short text.\n")
    (tmp_path / "b.txt").write_text("another short one.\n")
    done = _run(_exe("eggroll-data"), "prepare", "a.txt", "b.txt", "--out", "d", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return tmp_path / "d", done


def test_prepare_warns_about_data_too_small_for_the_presets(short_data) -> None:
    _, done = short_data
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2  # tiny and egg-paper
    assert "tiny preset" in warnings[0] and "need at least 33 in each" in warnings[0]


@pytest.mark.parametrize("command", ["eggroll-train", "eggroll-local"])
def test_a_run_on_data_shorter_than_a_window_is_one_line(
    short_data, tmp_path: Path, command: str
) -> None:
    data_dir, _ = short_data
    extra = ["--save-dir", tmp_path / "run", "--metrics-port", "0"] * (command == "eggroll-local")
    done = _run(_exe(command), "--data-dir", data_dir, "--steps", "2", *extra, cwd=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "train split has 28 tokens" in lines[0] and "prepare more text" in lines[0]


def test_size_warnings_say_what_is_enough() -> None:
    tiny = preset("tiny")
    enough = step_tokens(tiny)
    assert data_too_short(tiny, tiny.es.seq_len + 1, tiny.es.seq_len + 1) is None
    warnings = size_warnings(enough - 1, 10_000, 256)
    assert any(f"at least {enough:,} bytes" in w and "tiny" in w for w in warnings)
    assert not any("tiny" in w for w in size_warnings(enough, 10_000, 256))
    former = step_tokens(preset("former-tiny"))  # a BPE vocabulary of 2048: its presets only
    assert [w for w in size_warnings(former - 1, 10_000, 2048) if "former-tiny" in w]
    assert not [w for w in size_warnings(former - 1, 10_000, 2048) if "the tiny preset" in w]

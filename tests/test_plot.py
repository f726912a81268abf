"""eggroll-inspect SAVE_DIR --plot FILE: the curve the save directory records (history.log),
drawn as a PNG against the data's baselines; without matplotlib, one line saying what to
install."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import TRAIN_RUN, command

from eggroll_dist.coordinator.curve import read_curve
from eggroll_dist.coordinator.inspect import main as inspect_main
from eggroll_dist.coordinator.plot import DPI, HEIGHT, INSTALL, WIDTH, draw
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.save_dir import read_history

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header (its first chunk, IHDR)."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


@pytest.fixture(scope="module")
def trained(words_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save directory of six eggroll-train steps, validated at steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("plot")
    config, save_dir = tmp / "train.toml", tmp / "run"
    config.write_text(TRAIN_RUN)
    done = subprocess.run(
        [
            *(command("eggroll-train"), "--data-dir", str(words_data), "--config", str(config)),
            *("--save-dir", str(save_dir), "--log-format", "json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return save_dir


def test_the_plot_holds_the_recorded_curve(trained: Path, words_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    png = tmp_path / "curve.png"
    done = subprocess.run(
        [command("eggroll-inspect"), str(trained), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"plot of 6 steps, 2 held-out scores in {png}"
    assert png_size(png) == (int(WIDTH * DPI), int(HEIGHT * DPI))
    assert png.stat().st_size > 10_000  # lines and text, not an empty canvas
    # What the figure holds, read back from matplotlib, is what history.log recorded.
    drawn = draw(read_curve(trained), tmp_path / "again.png", "again")
    records = read_history(trained / "history.log")
    steps = [r for r in records if r["event"] == "step"]
    valid = [r for r in records if r["event"] == "validation"]
    assert drawn["train loss"] == ([r["step"] for r in steps], [r["loss_bits"] for r in steps])
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert drawn["held-out"] == ([3, 6], [r["valid_bits"] for r in valid])
    assert drawn["held-out, long streams"] == ([3, 6], [r["stream_bits"] for r in valid])
    baselines = load_data_dir(words_data).meta.baselines
    for name, label in (("unigram", "unigram"), ("bigram", "bigram"), ("gzip9", "gzip -9")):
        value = baselines[name]
        assert drawn[f"{label} {value:.3f}"] == ([0, 6], [value, value])
    assert len(drawn) == 6


def test_without_matplotlib_the_plot_fails_at_once_in_one_line(
    monkeypatch: pytest.MonkeyPatch, trained: Path, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    png = tmp_path / "curve.png"
    done = CliRunner().invoke(inspect_main, [str(trained), "--plot", str(png)])
    assert done.exit_code == 2
    assert done.output.strip().splitlines() == [
        f"Error: --plot needs the matplotlib package: {INSTALL}"
    ]
    assert not png.exists()


def test_a_save_dir_without_a_curve_has_nothing_to_plot(trained: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("run.json", "fitness.log"):
        (bare / name).write_bytes((trained / name).read_bytes())
    done = CliRunner().invoke(inspect_main, [str(bare), "--plot", str(tmp_path / "x.png")])
    assert done.exit_code == 1
    assert "nothing to plot" in done.output and len(done.output.strip().splitlines()) == 1

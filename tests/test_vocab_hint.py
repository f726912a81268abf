"""A preset whose vocabulary the data does not have: one line that names the command that
makes suitable data, before anything is started or written."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import command

from eggroll_dist.worker.data.cli import main as data_main


@pytest.mark.parametrize("name", ["eggroll-train", "eggroll-local"])
def test_former_tiny_on_byte_data_says_what_to_run(
    name: str, words_data: Path, tmp_path: Path
) -> None:
    save = tmp_path / "run"
    done = subprocess.run(
        [
            *(command(name), "--preset", "former-tiny"),
            *("--data-dir", str(words_data), "--save-dir", str(save)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"{words_data} holds bytes (256 tokens), the model reads a 2,048-token" in line
    make = "eggroll-data prepare --builtin --tokenizer bpe --vocab-size 2048 --out data/bpe-2048"
    assert f"`{make}`" in line and line.endswith("then pass --data-dir data/bpe-2048")
    assert not save.exists()  # nothing was started
    # The command it names is one eggroll-data takes.
    prepare = data_main.commands["prepare"]
    ctx = prepare.make_context("prepare", shlex.split(make)[2:])
    assert ctx.params["builtin"] and ctx.params["vocab_size"] == 2048

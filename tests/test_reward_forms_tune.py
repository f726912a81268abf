"""eggroll-tune's --reward in every form, on a tiny GPT-2 built here: a lambda, a bare file
and a weighted combination (--reward NAME:WEIGHT, repeated) train and print the config a
coordinator runs; a bad combination is one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import command
from hf_models import save_model

from eggroll_dist.shared.config import load_config
from eggroll_dist.shared.pinned import pin

LAMBDA = "lambda text: text.count('e') / max(1, len(text))"
RUN = (
    "--prompts", "prompts.txt", "--population", "8", "--rank", "2", "--sigma", "0.05",
    "--completion-tokens", "4", "--prompts-per-step", "2", "--valid-tokens", "64",
    "--threads", "1", "--validate-every", "0",
)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tune-rewards")
    save_model(root / "model", "gpt2")
    prompts = "the quick\na bird\nevery good\nthe lazy\nfox\nhand\ntwo in\neggs are\nbush\n"
    (root / "prompts.txt").write_text(prompts)
    (root / "bare.py").write_text("def score(text):\n    return len(text) / 100\n")
    return root


def tune(folder: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command("eggroll-tune"), "model", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
    )


def test_every_form_prints_the_config_a_coordinator_runs(folder: Path) -> None:
    pair = ("--reward", f"{LAMBDA}:0.5", "--reward", "bare.py:0.5")
    pair += ("--reward", "builtin:brackets:1")
    for rewards, want in (
        (("--reward", LAMBDA), "reward = "),
        (("--reward", "bare.py"), 'reward = "bare.py"'),
        (pair, f'rewards = ["{LAMBDA}:0.5", "bare.py:0.5", "builtin:brackets:1"]'),
    ):
        printed = tune(folder, *rewards, *RUN, "--print-config")
        assert printed.returncode == 0 and want in printed.stdout, printed.stderr
    (folder / "run.toml").write_text(printed.stdout)
    cfg = pin(load_config(folder / "run.toml"), folder)
    assert cfg.fitness.rewards[0] == f"{LAMBDA}:0.5" and len(cfg.fitness.rewards_sha256) == 1


def test_a_weighted_lambda_and_bare_file_train(folder: Path, words_data: Path) -> None:
    done = tune(
        folder, "--reward", f"{LAMBDA}:2", "--reward", "bare.py:0.5", *RUN, "--steps", "2",
        "--data-dir", words_data, "--save-dir", "run",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    saved = (folder / "run" / "run.json").read_text()
    assert "bare.py:0.5" in saved and "rewards_sha256" in saved


def test_perplexity_is_not_combined(folder: Path) -> None:
    done = tune(folder, "--reward", "perplexity", "--reward", "builtin:letter_e:1", *RUN[2:])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, lines
    assert "--reward perplexity is not combined with other rewards" in lines[0]

"""The Python API runs what the commands run, to the same digests; it takes a reward as a
function, a lambda or a file and prompts as a list; its records come as a callback or an
iterator; and a run that needs workers refuses a function in one line."""

from __future__ import annotations

import json
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import TRAIN_RUN, command

from eggroll_dist.shared.config import load_config
from eggroll_dist.shared.fitness_log import FitnessLog
from eggroll_dist.worker.api import Result, RunError, Trainer, Tuner, function_digest

SMALL = tomllib.loads(TRAIN_RUN)  # steps = 6, validation every 3


def _cli_digest(*args: str | Path, cwd: Path) -> str:
    summary = cwd / "cli-summary.json"
    done = subprocess.run(
        [command(str(args[0])), *map(str, args[1:]), "--summary-json", str(summary)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(summary.read_text())["replica_digest"]


def test_a_trainer_reaches_eggroll_trains_digest_and_reports_every_record(
    words_data: Path, tmp_path: Path
) -> None:
    config = tmp_path / "small.toml"
    config.write_text(TRAIN_RUN)
    heard: list[dict] = []
    run = Trainer(SMALL, data_dir=words_data, save_dir=tmp_path / "api", sample_every=2).run(
        on_record=heard.append
    )
    cli = _cli_digest("eggroll-train", "--config", config, "--data-dir", words_data, cwd=tmp_path)
    assert run.digest == cli and run.steps == 6
    assert heard == run.records and [r["step"] for r in run.records if r["event"] == "step"] == [
        1, 2, 3, 4, 5, 6,
    ]  # fmt: skip
    assert len(run.scores) == 6 and all(np.isfinite(run.scores))
    assert run.held_out is not None and run.held_out["step"] == 6
    assert [r["step"] for r in run.records if r["event"] == "sample"] == [2, 4, 6]
    assert run.summary is not None and run.summary["replica_digest"] == run.digest
    assert FitnessLog.open(tmp_path / "api" / "fitness.log").steps == 6
    # The same object from a TOML file, and a preset name, build the same config.
    assert Trainer(config, data_dir=words_data).config.digest() == run.config.digest()
    assert Trainer(preset="tiny").config.digest() == Trainer({"preset": "tiny"}).config.digest()


def test_leaving_the_iterator_stops_the_run_and_keeps_its_steps(
    words_data: Path, tmp_path: Path
) -> None:
    trainer = Trainer(SMALL, data_dir=words_data, steps=1000, save_dir=tmp_path / "run")
    steps = []
    for record in trainer.records():
        if record["event"] == "step":
            steps.append(record["step"])
            if len(steps) == 2:
                break
    kept = FitnessLog.open(tmp_path / "run" / "fitness.log").steps
    assert steps == [1, 2] and 2 <= kept < 1000
    again = Trainer(SMALL, data_dir=words_data, steps=kept + 1, save_dir=tmp_path / "run").run()
    assert again.steps == kept + 1  # the same run continues


def letter_e(text: str) -> float:
    return text.lower().count("e") / len(text) if text else 0.0


EASY = {  # a run whose letter-e reward rises within 30 steps (tests/test_reward.py's)
    "model": {"n_layer": 1, "d_model": 32},
    "es": {
        "population": 128, "chunk_size": 64, "seq_len": 16, "sigma_shift": 2,
        "noise": "gaussian",
    },
    "fitness": {"prompts_per_step": 4, "completion_tokens": 12, "held_out_prompts": 16},
    "update": {"rule": "momentum", "momentum_shift": 2},
    "validation": {"every_steps": 0, "max_tokens": 320},
}  # fmt: skip


def test_a_reward_given_as_a_function_moves_and_stays_in_this_process(
    words_data: Path, tmp_path: Path
) -> None:
    trainer = Trainer(EASY, data_dir=words_data, steps=30, reward=letter_e, prompts="data")
    assert trainer.config.fitness.reward == "python:letter_e"
    assert trainer.config.fitness.reward_sha256 == function_digest(letter_e)
    run = trainer.run()
    first, last = np.mean(run.scores[:3]), np.mean(run.scores[-3:])
    assert last > 4 * first and last > 0.1, run.scores
    # A named reward gives a config for workers; a function or a lambda's text does not.
    with pytest.raises(RunError, match="a run with workers needs a reward file"):
        trainer.coordinator_config(tmp_path / "run.toml")
    text = "lambda text: text.lower().count('e') / len(text) if text else 0.0"
    inline = Trainer(EASY, data_dir=words_data, reward=text, prompts="data")
    with pytest.raises(RunError, match="a run with workers needs a reward file"):
        inline.coordinator_config(tmp_path / "run.toml")
    spec = Trainer(EASY, data_dir=words_data, reward="builtin:letter_e", prompts="data")
    written = spec.coordinator_config(tmp_path / "run.toml")
    assert load_config(written).digest() == spec.config.digest()
    # A function's code pins it: another function is another config.
    other = Trainer(EASY, data_dir=words_data, reward=lambda t: 0.0, prompts="data")
    assert other.config.digest() != trainer.config.digest()


def test_prompts_as_a_list_are_pinned_by_their_content(
    monkeypatch: pytest.MonkeyPatch, words_data: Path, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompts = ["the eggs", "a line\nwith a newline", "back\\slash", *(f"p{i}" for i in range(9))]
    a = Trainer(EASY, data_dir=words_data, reward="builtin:letter_e", prompts=prompts)
    b = Trainer(EASY, data_dir=words_data, reward="builtin:letter_e", prompts=list(prompts))
    assert a.config.digest() == b.config.digest()
    path = Path(a.config.fitness.prompts)
    assert path.is_relative_to(tmp_path / "cache" / "eggroll-distributed" / "prompts")
    assert path.read_text().splitlines()[1:3] == ["a line\\nwith a newline", "back\\\\slash"]
    c = Trainer(EASY, data_dir=words_data, reward="builtin:letter_e", prompts=prompts[:-1])
    assert c.config.digest() != a.config.digest()
    with pytest.raises(RunError, match="workers read goal files only under their --goal-dir"):
        a.coordinator_config(tmp_path / "run.toml")  # a list's file lies in the cache
    with pytest.raises(RunError, match="a reward needs prompts"):
        Trainer(EASY, data_dir=words_data, reward="builtin:letter_e")


def test_refusals_are_one_line(words_data: Path, tmp_path: Path) -> None:
    with pytest.raises(RunError, match="must be even"):
        Trainer({"es": {"population": 7}})
    with pytest.raises(RunError, match="does not exist"):
        Trainer(SMALL, data_dir=tmp_path / "none").run()
    result = Result(Trainer(SMALL).config, None, [], None, None)  # type: ignore[arg-type]
    with pytest.raises(RunError, match="give the run a save_dir"):
        result.export(tmp_path / "out")


torch = pytest.importorskip("torch")


def test_a_tuner_reaches_eggroll_tunes_digest(
    monkeypatch: pytest.MonkeyPatch, words_data: Path, tmp_path: Path
) -> None:
    from hf_models import save_model

    save_model(tmp_path / "model", "gpt2", initializer_range=0.3)
    prompts = ["the quick", "a bird", "every good", "the lazy", "fox", "hand", "two in", "eggs"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    flags = {"population": 8, "rank": 2, "sigma": 0.05, "lr": 2.0, "completion_tokens": 4}
    flags |= {"prompts_per_step": 2, "valid_tokens": 64, "threads": 1}
    cli = _cli_digest(
        "eggroll-tune", "model", "--reward", "builtin:letter_e", "--prompts", "prompts.txt",
        "--steps", "2", "--data-dir", words_data,
        *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items()),
        cwd=tmp_path,
    )  # fmt: skip
    monkeypatch.chdir(tmp_path)  # the model and prompts paths are the command's, from here
    common = {"data_dir": words_data, **flags}
    run = Tuner("model", "builtin:letter_e", "prompts.txt", steps=2, **common).run()
    assert run.digest == cli and len(run.scores) == 2
    by_function = Tuner("model", letter_e, prompts, steps=1, **common).run()
    assert by_function.steps == 1 and by_function.config.fitness.reward == "python:letter_e"


def test_a_functions_pin_is_the_same_in_every_process_and_follows_its_values() -> None:
    """Sets are hashed in an order of their own in each process: the pin must not be."""
    import functools
    import sys

    code = (
        "from eggroll_dist.worker.api import function_digest\n"
        "def score(text):\n    return float(text[:1] in {'a', 'e', 'i', 'o', 'u', 'y'})\n"
        "print(function_digest(score))\n"
    )
    pins = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2, 3, 4)
    }
    assert len(pins) == 1 and len(pins.pop().strip()) == 64

    def scaled(k: float) -> Callable[[str], float]:
        return lambda text: k * len(text)

    assert function_digest(scaled(1.0)) != function_digest(scaled(2.0))  # closed-over values
    with pytest.raises(RunError, match="must be a Python function"):
        function_digest(functools.partial(letter_e))


def test_a_score_with_an_optional_parameter_is_the_one_text_form(tmp_path: Path) -> None:
    from eggroll_dist.worker.reward import _batched

    def score(text: str, scale: float = 1.0) -> float:
        return scale * len(text)

    def batched(prompts: list, completions: list, **fields: list) -> list:
        return [0.0] * len(completions)

    assert not _batched(score) and _batched(batched) and not _batched(letter_e)

"""Rewards as other ES fine-tuners write them: an inline lambda, a bare file (its `score`,
else its `reward`) and a weighted combination each move a small model, each is pinned (a
lambda by its text in the config, a file part by its bytes), a combination is the same
float on every machine and over a coordinator, and bad forms are refused in one line."""

from __future__ import annotations

import dataclasses
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import command, digest_at

from eggroll_dist.shared.config import (
    ConfigError,
    ESConfig,
    FitnessConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
    ValidationConfig,
    load_config,
)
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.objectives import objective_of
from eggroll_dist.shared.pinned import GoalError, check_files, pin
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.objective import make_objective
from eggroll_dist.worker.reward import RewardError, RewardRunner
from eggroll_dist.worker.train import train

E_SHARE = "lambda text: text.lower().count('e') / len(text) if text else 0.0"
# A bare file: no ':function', so its `score` is used (its `reward` only lacking a score).
BARE = "def score(text):\n    return text.count('e') / max(1, len(text))\n"
BATCHED = "def reward(prompts, completions, **fields):\n    return [len(c) for c in completions]\n"


def fitness(**reward: object) -> FitnessConfig:
    return FitnessConfig(
        objective="reward",
        prompts="data",
        prompts_per_step=4,
        completion_tokens=12,
        held_out_prompts=16,
        **reward,  # type: ignore[arg-type]
    )


def moving_config(**reward: object) -> RunConfig:
    """test_reward.py's run that moves letter_e within 30 steps, with another reward."""
    return RunConfig(
        model=ModelConfig(n_layer=1, d_model=32),
        es=ESConfig(population=128, chunk_size=64, seq_len=16, sigma_shift=2, noise="gaussian"),
        fitness=fitness(**reward),
        update=UpdateConfig(rule="momentum", momentum_shift=2),
        validation=ValidationConfig(every_steps=0, max_tokens=320),
    )


@pytest.mark.parametrize(
    "reward",
    [
        {"reward": E_SHARE},
        {"reward": "bare.py"},
        {"rewards": ("builtin:letter_e:0.25", "bare.py:score:0.75")},
    ],
    ids=["lambda", "bare-file", "weighted-pair"],
)
def test_each_form_moves_its_reward(words_data: Path, tmp_path: Path, reward: dict) -> None:
    (tmp_path / "bare.py").write_text(BARE)
    cfg = pin(moving_config(**reward), tmp_path)
    dataset = load_data_dir(words_data)
    backend = NumpyBackend(dataset, ReplicaState.initial(cfg), threads=1)
    objective = make_objective(cfg, dataset, tmp_path)
    try:
        result = train(cfg, backend, 30, objective=objective)
    finally:
        objective.close()
    rewards = result.scores["reward"]
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > 3 * first and last > 0.1, rewards


def test_a_bare_file_takes_score_else_reward(tmp_path: Path) -> None:
    (tmp_path / "both.py").write_text(BARE + BATCHED)
    (tmp_path / "batched.py").write_text(BATCHED)
    (tmp_path / "neither.py").write_text("def other(text):\n    return 1.0\n")
    for name, want in (("both.py", [1.0, 0.0]), ("batched.py", [2.0, 3.0])):
        runner = RewardRunner(name, tmp_path, 10)
        try:
            assert runner.score(["p", "q"], ["ee", "abc"], {}) == want
        finally:
            runner.close()
    runner = RewardRunner("neither.py", tmp_path, 10)
    with pytest.raises(RewardError) as refused:
        runner.start()
    message = str(refused.value)
    assert "neither a score nor a reward function" in message and "\n" not in message


def test_a_batched_lambda_gets_the_fields(tmp_path: Path) -> None:
    spec = (
        "lambda prompts, completions, **fields: "
        "[float(c == a) for c, a in zip(completions, fields['answer'])]"
    )
    runner = RewardRunner.of(RunConfig(fitness=fitness(reward=spec)), tmp_path, 10)
    try:
        assert runner.score(["1+1=", "2+2="], ["2", "5"], {"answer": ["2", "4"]}) == [1.0, 0.0]
    finally:
        runner.close()


def test_a_combination_is_the_fsum_of_its_weighted_parts(tmp_path: Path) -> None:
    """Parts in config order, each weight times its reward, summed exactly (fsum): a
    lambda, a batched bare file and a built-in together."""
    (tmp_path / "batched.py").write_text(BATCHED)
    parts = ("lambda text: 5e5:1", "batched.py:2e-11", "builtin:letter_e:2e-11")
    cfg = pin(RunConfig(fitness=fitness(rewards=parts)), tmp_path)
    runner = RewardRunner.of(cfg, tmp_path, 10)
    try:
        got = runner.score(["p", "q"], ["e", "abcd"], {})
    finally:
        runner.close()
    assert got == [500000.00000000006, math.fsum([5e5, 8e-11, 0.0])]
    assert 5e5 + 2e-11 + 2e-11 == 5e5  # what a running sum would have made of it


def test_each_part_is_pinned(tmp_path: Path) -> None:
    """Every file part of a combination is pinned by its bytes (in config order, in
    fitness.rewards_sha256), a lambda by its text: a changed part changes the digest and a
    worker's copy that differs is refused, naming its file."""
    (tmp_path / "a.py").write_text(BARE)
    (tmp_path / "b.py").write_text(BATCHED)
    parts = ("a.py:0.5", "builtin:brackets:0.25", "b.py:reward:-0.001")
    cfg = pin(RunConfig(fitness=fitness(rewards=parts)), tmp_path)
    assert [g.path for g in objective_of(cfg).files(cfg)] == ["a.py", "b.py"]
    assert len(cfg.fitness.rewards_sha256) == 2 and cfg.fitness.reward_sha256 == ""
    check_files(cfg, tmp_path)
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir()
    (elsewhere / "a.py").write_text(BARE)
    (elsewhere / "b.py").write_text(BATCHED.replace("len(c)", "-len(c)"))
    with pytest.raises(GoalError, match=r"reward file .*b\.py .* is not the run's"):
        check_files(cfg, elsewhere)
    assert pin(cfg, elsewhere).digest() != cfg.digest()
    # The runner checks each part's bytes again as it reads them.
    runner = RewardRunner.of(cfg, elsewhere, 10)
    with pytest.raises(RewardError, match=r"b\.py changed after the run pinned it"):
        runner.start()
    # A lambda is pinned by its text, which the config's canonical bytes hold.
    one = RunConfig(fitness=fitness(reward=E_SHARE))
    other = RunConfig(fitness=fitness(reward=E_SHARE.replace("'e'", "'a'")))
    assert E_SHARE.encode() in one.canonical_bytes() and one.digest() != other.digest()
    assert objective_of(one).files(one) == []


def test_a_single_reward_keeps_its_config_bytes() -> None:
    """fitness.rewards is a later setting: a config without it has the bytes it had."""
    cfg = RunConfig(fitness=fitness(reward="builtin:letter_e"))
    assert b"rewards" not in cfg.canonical_bytes()
    again = dataclasses.replace(cfg.fitness, rewards=(), rewards_sha256=())
    assert cfg.replace(fitness=again).canonical_bytes() == cfg.canonical_bytes()


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"reward": "lambda text 1.0"}, "does not parse"),
        ({"reward": "lambda: 1.0"}, "must take one text (lambda text: ...) or a batch"),
        ({"reward": "lambda a, b: 1.0"}, "must take one text"),
        ({"reward": "lambda text: 1.0; 2"}, "does not parse"),
        ({"rewards": ("builtin:letter_e:0", "a.py:1")}, "a number other than 0"),
        ({"rewards": ("builtin:letter_e:inf", "a.py:1")}, "a number other than 0"),
        ({"rewards": ("builtin:letter_e:nan", "a.py:1")}, "a number other than 0"),
        ({"rewards": ("builtin:letter_e", "a.py:1")}, "must end in ':WEIGHT'"),
        ({"rewards": ("lambda text: 0.5", "a.py:1")}, "a lambda part ends in ':WEIGHT' too"),
        ({"rewards": ("a.py:1", "a.py:2")}, "names 'a.py' twice"),
        ({"rewards": ("a.py:1",)}, "two or more rewards"),
        ({"rewards": ("a.py:1", "b.txt:1")}, "must be 'file.py:function', 'file.py'"),
        ({"reward": "a.py", "rewards": ("a.py:1", "b.py:1")}, "set one of them"),
    ],
)
def test_bad_reward_forms_are_refused_in_one_line(reward: dict, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        RunConfig(fitness=fitness(**reward))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def run_cli(*args: str | Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command(str(args[0])), *map(str, args[1:])],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def combined_config(tmp: Path, rewards: str) -> Path:
    """A small reward run whose fitness.rewards is the TOML array `rewards`."""
    path = tmp / "run.toml"
    path.write_text(
        "steps = 2\n[model]\nn_layer = 1\nd_model = 32\n"
        '[es]\npopulation = 32\nchunk_size = 8\nseq_len = 16\nsigma_shift = 3\nnoise = "gaussian"\n'
        '[fitness]\nobjective = "reward"\nprompts = "data"\nprompts_per_step = 4\n'
        f"completion_tokens = 12\nheld_out_prompts = 8\nrewards = {rewards}\n"
        "[validation]\nevery_steps = 2\nmax_tokens = 320\n"
    )
    return path


def test_a_combination_over_workers_matches_one_process(words_data: Path, tmp_path: Path) -> None:
    """A TOML combination of a bare file, a file's function and a built-in: two workers over
    the coordinator (reading the files under their --goal-dir) reach eggroll-train's digest."""
    (tmp_path / "bare.py").write_text(BARE)
    (tmp_path / "a.py").write_text(
        "def share(text):\n    return text.count('a') / max(1, len(text))\n"
    )
    config = combined_config(
        tmp_path,
        """[
    "bare.py:0.5",
    "a.py:share:0.3",
    "builtin:brackets:0.2",
]""",
    )
    cfg = pin(load_config(config), tmp_path)
    assert len(cfg.fitness.rewards) == 3 and len(cfg.fitness.rewards_sha256) == 2
    common = ("--data-dir", words_data, "--config", config)
    one = run_cli("eggroll-train", *common, "--save-dir", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    local = ("--workers", "2", "--metrics-port", "0", "--save-dir", tmp_path / "two")
    two = run_cli("eggroll-local", *common, *local)
    assert two.returncode == 0, two.stderr + two.stdout
    assert digest_at(tmp_path / "two", 2) == digest_at(tmp_path / "one", 2)


def test_a_bad_combination_stops_eggroll_train_in_one_line(
    words_data: Path, tmp_path: Path
) -> None:
    config = combined_config(tmp_path, '["builtin:letter_e:0.5", "builtin:letter_e:0"]')
    done = run_cli("eggroll-train", "--data-dir", words_data, "--config", config, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "must end in ':WEIGHT', a number other than 0" in lines[0], lines


def test_the_reward_process_does_not_see_the_runs_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from eggroll_dist.worker.reward import RewardRunner

    monkeypatch.setenv("EGGROLL_TOKEN", "s3cret")
    monkeypatch.setenv("EGGROLL_TOKEN_FILE", "/etc/eggroll/token")
    monkeypatch.setenv("EGGROLL_OTHER", "kept")
    spec = (
        "lambda text: float(__import__('os').environ.get('EGGROLL_TOKEN') is not None)"
        " + 2 * float('EGGROLL_TOKEN_FILE' in __import__('os').environ)"
        " + 4 * float(__import__('os').environ.get('EGGROLL_OTHER') == 'kept')"
    )
    runner = RewardRunner(spec, tmp_path)
    try:
        assert runner.score(["p"], ["c"], {}) == [4.0]
    finally:
        runner.close()


def test_a_worker_runs_no_reward_code_a_coordinator_sends(tmp_path: Path) -> None:
    """A lambda (alone or as a part) is code in the config: fine for eggroll-train and
    eggroll-tune, refused by a worker, whatever its --goal-dir holds."""
    for fitness in (
        {"reward": "lambda text: 0.0"},
        {"rewards": ("builtin:letter_e:0.5", "lambda text: 1.0:0.5")},
    ):
        cfg = RunConfig(
            fitness=FitnessConfig(objective="reward", prompts="data", **fitness)  # type: ignore[arg-type]
        )
        for goal_dir in (None, tmp_path):
            with pytest.raises(GoalError, match="never code a coordinator sends"):
                check_files(cfg, goal_dir)

"""An architecture, an update rule or an objective is a module plus one registry line: with
only that line added, configs accept the name and replicas build, update and checkpoint it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from eggroll_dist.shared import egg
from eggroll_dist.shared.config import (
    ConfigError,
    ESConfig,
    FitnessConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
)
from eggroll_dist.shared.model import ARCHS
from eggroll_dist.shared.perturb import StateSpec
from eggroll_dist.shared.replica import ReplicaState, decode_checkpoint, encode_checkpoint, replay
from eggroll_dist.shared.rules import RULES, ztest


def _config(arch: str = "egg", rule: str = "ztest") -> RunConfig:
    return RunConfig(
        model=ModelConfig(arch=arch, vocab_size=32, n_layer=1, d_model=8),
        es=ESConfig(population=8, chunk_size=4, seq_len=4),
        update=UpdateConfig(rule=rule, alpha=1.0),
    )


def _fitness(cfg: RunConfig, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(-1, 2, size=cfg.pairs).astype(np.int8) for _ in range(steps)]


def test_unknown_names_are_refused_with_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="'egg', 'former' or 'hf'"):
        _config(arch="mamba")
    with pytest.raises(ConfigError, match="'ztest', 'momentum' or 'adamw'"):
        _config(rule="lion")


def test_a_registered_architecture_trains_like_any_other(monkeypatch: pytest.MonkeyPatch) -> None:
    # The EGG model's module under a second name: the registry line is all that differs.
    twin = SimpleNamespace(
        FAMILY=egg.FAMILY,
        EXACT=egg.EXACT,
        OWN_TOKENIZER=egg.OWN_TOKENIZER,
        specs=egg.specs,
        check=egg.check,
        MODEL=egg.EggModel,
        GENERATOR=egg.EggGenerator,
    )
    monkeypatch.setitem(ARCHS, "twin", twin)
    base, cfg = _config(), _config(arch="twin")
    fitness = _fitness(cfg, 3)
    a = replay(ReplicaState.initial(base), fitness)
    b = replay(ReplicaState.initial(cfg), fitness)
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert a.digest() != b.digest()  # the config (and so its digest) names the architecture


def test_a_registered_rule_keeps_state_in_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    def state_specs(cfg: RunConfig, specs: tuple) -> tuple[StateSpec, ...]:
        return (StateSpec("steps_seen", (1,), np.int32),)

    def update(cfg, step, specs, params, state, z):  # ztest's moves, and a step counter
        new, _ = ztest.update(cfg, step, specs, params, state, z)
        return new, {"steps_seen": state["steps_seen"] + 1}

    monkeypatch.setitem(RULES, "counting", SimpleNamespace(state_specs=state_specs, update=update))
    cfg, base = _config(rule="counting"), _config()
    fitness = _fitness(cfg, 4)
    state = replay(ReplicaState.initial(cfg), fitness)
    plain = replay(ReplicaState.initial(base), fitness)
    assert state.opt["steps_seen"].tolist() == [4]
    assert all(np.array_equal(state.params[k], plain.params[k]) for k in plain.params)
    again = decode_checkpoint(encode_checkpoint(state))
    assert again.digest() == state.digest()
    assert again.opt["steps_seen"].tolist() == [4]


def test_a_registered_objective_pins_its_file_and_trains(
    monkeypatch: pytest.MonkeyPatch, words_data: Path, tmp_path: Path
) -> None:
    """A third objective (here: a score read off the next-token losses, with a labels file
    of its own) is one module and one line in OBJECTIVES, plus its runner in the worker's
    MAKERS: configs accept it, pin its file, refuse a changed copy, and a run reports its
    score under its own name."""
    from eggroll_dist.shared.data import load_data_dir
    from eggroll_dist.shared.objectives import OBJECTIVES, GoalFile, next_token
    from eggroll_dist.shared.pinned import GoalError, check_files, pin
    from eggroll_dist.worker import objective as runners
    from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
    from eggroll_dist.worker.train import train

    accuracy = SimpleNamespace(
        SCORE="accuracy",
        WINDOWS=True,
        check=lambda cfg: None if cfg.fitness.prompts else "objective 'accuracy' needs a file",
        files=lambda cfg: [
            GoalFile(
                "fitness.prompts_sha256", cfg.fitness.prompts, cfg.fitness.prompts_sha256, "labels"
            )
        ],
        inline_code=next_token.inline_code,
        member_tokens=next_token.member_tokens,
        mean_score=lambda cfg, total: -total / 16 / cfg.es.population,
        loss_range=next_token.loss_range,
    )

    base = dataclasses.replace(_config(), model=ModelConfig(vocab_size=256, n_layer=1, d_model=8))

    def config(**fitness: str) -> RunConfig:
        return dataclasses.replace(base, fitness=FitnessConfig(objective="accuracy", **fitness))

    with pytest.raises(ConfigError, match="'next_token' or 'reward'"):
        config()
    monkeypatch.setitem(OBJECTIVES, "accuracy", accuracy)
    monkeypatch.setitem(runners.MAKERS, "accuracy", runners.MAKERS["next_token"])
    with pytest.raises(ConfigError, match="needs a file"):
        config()
    cfg = config(prompts="labels.txt")
    (tmp_path / "labels.txt").write_text("a 1\nb 0\n")
    pinned = pin(cfg, tmp_path)
    assert len(pinned.fitness.prompts_sha256) == 64 and pinned.digest() != cfg.digest()
    check_files(pinned, tmp_path)
    (tmp_path / "labels.txt").write_text("a 0\nb 1\n")
    with pytest.raises(GoalError, match=r"labels .*labels\.txt .* is not the run's"):
        check_files(pinned, tmp_path)

    dataset = load_data_dir(words_data)
    runner = runners.make_objective(pinned, dataset, tmp_path)
    ours = train(pinned, NumpyBackend(dataset, ReplicaState.initial(pinned)), 2, objective=runner)
    plain = train(base, NumpyBackend(dataset, ReplicaState.initial(base)), 2)
    assert list(ours.scores) == ["accuracy"] and len(ours.scores["accuracy"]) == 2
    losses = plain.scores["loss_bits"]  # the same members, so the same integer losses
    seq_len = pinned.es.seq_len
    assert ours.scores["accuracy"] == pytest.approx([-x * seq_len for x in losses])
    assert ours.fitness == plain.fitness

"""An architecture or an update rule is a module plus one registry line: with only that
line added, configs accept the name and replicas build, update and checkpoint it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from eggroll_dist.shared import egg
from eggroll_dist.shared.config import ConfigError, ESConfig, ModelConfig, RunConfig, UpdateConfig
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
        specs=egg.specs, check=egg.check, MODEL=egg.EggModel, GENERATOR=egg.EggGenerator
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

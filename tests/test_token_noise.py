"""Token noise (es.token_noise_rows): only the token rows (and head bias elements) with ids
below K get noise, in the forward pass and in Z alike, so only they move (under ztest and
momentum; AdamW's weight decay moves every matrix row); K = vocab_size is exactly no
scaling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog.testing

from eggroll_dist.shared.config import (
    ConfigError,
    ESConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
    ValidationConfig,
    validate,
)
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.perturb import TOKEN_TENSORS, noise_scales, pair_noise, token_row_factors
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.shared.update import apply_update, initial_opt_state
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.train import train

VOCAB, ROWS = 40, 12


ARCHS = ["egg", "former", "former+bias"]  # the last: the former with a zipf head bias


def _cfg(arch: str, rows: int, rule: str = "ztest", adaptive: bool = False) -> RunConfig:
    arch, _, bias = arch.partition("+")
    return RunConfig(
        model=ModelConfig(
            arch=arch,
            vocab_size=VOCAB,
            n_layer=1,
            d_model=8,
            head_bias="zipf" if bias else "none",
        ),
        es=ESConfig(
            population=64,
            chunk_size=32,
            seq_len=4,
            noise="gaussian",
            token_noise_rows=rows,
            adaptive_noise=adaptive,
        ),
        update=UpdateConfig(rule=rule, alpha=0.5),
    )


def test_factors_are_full_below_the_rows_and_zero_above() -> None:
    factors = token_row_factors(6, 2)
    assert factors.tolist() == [64, 64, 0, 0, 0, 0]
    assert not factors.flags.writeable
    assert token_row_factors(3, 3).tolist() == [64, 64, 64]


@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_token_rows_below_k_get_noise(arch: str) -> None:
    cfg, plain = _cfg(arch, ROWS), _cfg(arch, 0)
    pairs = np.arange(32)
    scaled = pair_noise(
        cfg,
        param_specs(cfg.model),
        3,
        pairs,
        noise_scales(cfg, param_specs(cfg.model), initial_opt_state(cfg)),
    )
    full = pair_noise(
        plain,
        param_specs(plain.model),
        3,
        pairs,
        noise_scales(plain, param_specs(plain.model), initial_opt_state(plain)),
    )
    token_tensors = [s.name for s in param_specs(cfg.model) if s.name in TOKEN_TENSORS]
    expected = {"egg": ["emb", "head"], "former": ["emb"], "former+bias": ["emb", "head_bias"]}
    assert token_tensors == expected[arch]
    for name, values in [*scaled.a.items(), *scaled.u.items()]:
        whole = full.a[name] if name in full.a else full.u[name]
        if name in TOKEN_TENSORS:
            assert np.array_equal(values[:, :ROWS], whole[:, :ROWS])
            assert not values[:, ROWS:].any() and whole[:, ROWS:].any()
        else:
            assert np.array_equal(values, whole)
    for name, b in scaled.b.items():
        assert np.array_equal(b, full.b[name])


@pytest.mark.parametrize("rule", ["ztest", "momentum"])
@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_rows_with_noise_move(arch: str, rule: str) -> None:
    cfg = _cfg(arch, ROWS, rule)
    params, opt = init_params(cfg.model), initial_opt_state(cfg)
    start = {name: params[name].copy() for name in TOKEN_TENSORS if name in params}
    rng = np.random.default_rng(1)
    for step in range(6):
        fitness = rng.integers(-1, 2, size=cfg.pairs).astype(np.int8)
        updated = apply_update(cfg, step, params, opt, fitness)
        params, opt = updated.params, updated.opt
    for name, before in start.items():
        assert np.array_equal(params[name][ROWS:], before[ROWS:])
        assert not np.array_equal(params[name][:ROWS], before[:ROWS])


@pytest.mark.parametrize("arch", ["egg", "former+bias"])
def test_token_noise_multiplies_into_the_overlays(arch: str) -> None:
    cfg = _cfg(arch, ROWS, adaptive=True)
    opt = initial_opt_state(cfg)
    overlay = np.arange(VOCAB, dtype=np.int8) * 3 - 20  # some below 0, some above 64
    opt["overlay.rows.emb"] = overlay
    scales = noise_scales(cfg, param_specs(cfg.model), opt)
    factors = token_row_factors(VOCAB, ROWS)
    expected = (np.clip(overlay.astype(np.int32), 0, 64) * factors) >> 6
    assert np.array_equal(scales.rows["emb"], expected)
    other, name = (scales.rows, "head") if arch == "egg" else (scales.elements, "head_bias")
    assert np.array_equal(other[name], factors)  # overlays at their start: 64


def test_all_rows_is_exactly_no_token_noise(words_data: Path) -> None:
    """K = vocab_size scales every value by 64/64: the same fitness and weights as K = 0."""
    runs = []
    for rows in (0, 256, 100):
        cfg = RunConfig(
            model=ModelConfig(
                arch="former", vocab_size=256, n_layer=1, d_model=8, head_bias="zipf"
            ),
            es=ESConfig(population=32, chunk_size=16, seq_len=6, token_noise_rows=rows),
            update=UpdateConfig(rule="momentum", alpha=0.5),
            validation=ValidationConfig(every_steps=0, max_tokens=400),
        )
        runs.append(
            train(cfg, NumpyBackend(load_data_dir(words_data), ReplicaState.initial(cfg)), 3)
        )
    none, every, some = runs
    assert none.fitness == every.fitness
    for name, w in none.state.params.items():
        assert np.array_equal(w, every.state.params[name])
    assert some.fitness[0] != none.fitness[0]  # the forward pass uses the token noise
    start = init_params(some.state.config.model)
    for name in ("emb", "head_bias"):
        assert np.array_equal(some.state.params[name][100:], start[name][100:])


@pytest.mark.parametrize("rows", [-1, VOCAB + 1])
def test_rows_outside_the_vocabulary_are_refused(rows: int) -> None:
    with pytest.raises(ConfigError, match=r"es\.token_noise_rows"):
        validate(_cfg("egg", rows))


@pytest.mark.parametrize(
    "model,es,setting",
    [
        ({}, {"token_noise_rows": 8}, "es.token_noise_rows"),
        ({"head_bias": "zipf"}, {}, "model.head_bias = 'zipf'"),
        ({"head_bias": "zero"}, {}, None),
    ],
)
def test_settings_for_ranked_ids_warn_on_unranked_data(
    words_data: Path, model: dict, es: dict, setting: str | None
) -> None:
    dataset = load_data_dir(words_data)
    assert not dataset.meta.ids_by_frequency  # bytes keep their own numbering
    cfg = RunConfig(
        model=ModelConfig(arch="former", vocab_size=256, n_layer=1, d_model=8, **model),
        es=ESConfig(population=8, chunk_size=8, seq_len=4, **es),
    )
    with structlog.testing.capture_logs() as events:
        NumpyBackend(dataset, ReplicaState.initial(cfg))
    warnings = [e["event"] for e in events if e["log_level"] == "warning"]
    if setting is None:
        assert not warnings
    else:
        assert len(warnings) == 1 and warnings[0].startswith(setting)
        assert "not ranked by frequency" in warnings[0]

"""Adaptive noise: the overlays' rule, the scaled noise in the forward pass and in Z alike,
and the overlays as replica state (digest, checkpoints, replay)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.protocol.ternary import unpack_ternary
from eggroll_dist.shared.config import (
    ESConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
    ValidationConfig,
)
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.egg import EggModel
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.perturb import (
    member_noise,
    noise_scales,
    pair_noise,
    scale_noise,
    update_overlays,
)
from eggroll_dist.shared.replica import (
    ReplicaState,
    decode_checkpoint,
    encode_checkpoint,
    replay,
)
from eggroll_dist.shared.update import accumulate_z, apply_update, initial_opt_state, state_specs
from eggroll_dist.shared.window import pair_windows
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.train import train


def _cfg(rule: str = "ztest", noise: str = "uniform", population: int = 40) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=16, n_layer=1, d_model=8),
        es=ESConfig(
            population=population,
            chunk_size=population // 2,
            seq_len=4,
            noise=noise,
            adaptive_noise=True,
        ),
        update=UpdateConfig(rule=rule, alpha=1.0),
    )


def _random_overlays(cfg: RunConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    opt = initial_opt_state(cfg)
    for name, ov in opt.items():
        if name.startswith("overlay."):
            opt[name] = rng.integers(-127, 128, ov.shape).astype(np.int8)
    return opt


def test_overlays_are_state_after_the_rule_state() -> None:
    cfg = _cfg("momentum")
    names = [s.name for s in state_specs(cfg)]
    n_params = len(param_specs(cfg.model))
    assert all(n.startswith("momentum.") for n in names[:n_params])
    assert names[n_params : n_params + 2] == ["overlay.rows.emb", "overlay.cols.emb"]
    assert "overlay.layers.0.ln1" in names
    opt = initial_opt_state(cfg)
    assert opt["overlay.rows.emb"].shape == (16,) and opt["overlay.cols.emb"].shape == (8,)
    assert opt["overlay.rows.layers.0.w1"].shape == (32,)
    assert opt["overlay.cols.layers.0.w1"].shape == (8,)
    assert all((v == 64).all() and v.dtype == np.int8 for k, v in opt.items() if "overlay" in k)
    off = cfg.replace(es=ESConfig(population=40, chunk_size=20, seq_len=4))
    assert not any("overlay" in s.name for s in state_specs(off))
    assert noise_scales(off, param_specs(off.model), {}) is None


def test_scale_noise_by_hand_and_symmetric() -> None:
    v = np.array([-15, -7, -1, 0, 1, 7, 15], dtype=np.int8)
    f = np.array([64, 64, 32, 0, 32, 10, 1], dtype=np.int32)
    # sign(v) * ((|v| * f) >> 6)
    assert scale_noise(v, f).tolist() == [-15, -7, 0, 0, 0, 1, 0]
    assert scale_noise(-v, f).tolist() == (-scale_noise(v, f)).tolist()
    u = np.array([[3025, -3025, -50, 50]], dtype=np.int16)
    assert scale_noise(u, np.array([63, 63, 33, 33])).tolist() == [[2977, -2977, -25, 25]]
    assert scale_noise(u, np.full(4, 64)).tolist() == u.tolist()


def test_overlay_rule_per_row_column_and_element_by_hand() -> None:
    cfg = _cfg()
    old = init_params(cfg.model)
    new = {k: v.copy() for k, v in old.items()}
    new["layers.0.wf"][2, 5] += 1  # row 2, column 5 of an (8, 8) matrix
    new["layers.0.ln1"][3] -= 1
    new["emb"][7, 0] += 1  # token 7, feature 0
    opt = initial_opt_state(cfg)
    opt["overlay.rows.layers.0.wf"][:] = [125, 126, 127, -127, -126, 0, 1, 64]
    opt["overlay.cols.layers.0.wf"][:] = [125, 126, 127, -127, -126, 0, 1, 64]
    opt["overlay.layers.0.ln1"][:] = [125, 126, 127, -127, -126, 0, 1, 64]
    out = update_overlays(param_specs(cfg.model), old, new, opt)
    assert out["overlay.rows.layers.0.wf"].tolist() == [124, 125, 127, -127, -127, -1, 0, 63]
    assert out["overlay.cols.layers.0.wf"].tolist() == [124, 125, 126, -127, -127, 5, 0, 63]
    assert out["overlay.layers.0.ln1"].tolist() == [124, 125, 126, -122, -127, -1, 0, 63]
    rows, cols = out["overlay.rows.emb"], out["overlay.cols.emb"]
    assert rows[7] == 69 and (np.delete(rows, 7) == 63).all()
    assert cols[0] == 69 and (cols[1:] == 63).all()
    untouched = out["overlay.rows.head"]
    assert (untouched == 63).all() and untouched.dtype == np.int8


@pytest.mark.parametrize("noise", ["uniform", "gaussian"])
def test_z_gemm_equals_the_explicit_sum_of_the_scaled_noise(noise: str) -> None:
    cfg = _cfg(noise=noise)
    opt = _random_overlays(cfg, 1)
    fitness = np.random.default_rng(2).integers(-1, 2, cfg.pairs).astype(np.int8)
    z = accumulate_z(cfg, 4, fitness, noise_scales(cfg, param_specs(cfg.model), opt))
    raw = pair_noise(cfg, param_specs(cfg.model), 4, np.arange(cfg.pairs))

    def scaled(v: int, ov: int) -> int:  # sign(v) * ((|v| * clip(ov, 0, 64)) >> 6)
        f = min(max(ov, 0), 64)
        return (1 if v > 0 else -1 if v < 0 else 0) * ((abs(v) * f) >> 6)

    for spec in param_specs(cfg.model):
        n = spec.name
        want = np.zeros(spec.shape, dtype=np.int64)
        for k in range(cfg.pairs):
            if spec.kind == "matrix":
                rows, cols = opt[f"overlay.rows.{n}"], opt[f"overlay.cols.{n}"]
                a = [scaled(int(x), int(o)) for x, o in zip(raw.a[n][k], rows, strict=True)]
                b = [scaled(int(x), int(o)) for x, o in zip(raw.b[n][k], cols, strict=True)]
                want += int(fitness[k]) * np.outer(a, b)
            else:
                ov = opt[f"overlay.{n}"]
                want += int(fitness[k]) * np.array(
                    [scaled(int(x), int(o)) for x, o in zip(raw.u[n][k], ov, strict=True)]
                )
        assert np.array_equal(z[n], want), n
    assert not np.array_equal(z["head"], accumulate_z(cfg, 4, fitness)["head"])


def test_members_of_a_pair_stay_mirror_images() -> None:
    cfg = _cfg()
    opt = _random_overlays(cfg, 3)
    params = init_params(cfg.model)
    pn = pair_noise(
        cfg, param_specs(cfg.model), 0, np.arange(5), noise_scales(cfg, param_specs(cfg.model), opt)
    )
    mn = member_noise(pn, params, cfg.es.sigma_shift)
    for n, a in mn.a.items():
        assert np.array_equal(a[1::2], -a[0::2]) and np.array_equal(mn.b[n][1::2], mn.b[n][0::2])
    for n, u in pn.u.items():
        scaled_down = np.abs(u) <= np.abs(
            pair_noise(cfg, param_specs(cfg.model), 0, np.arange(5)).u[n]
        )
        assert scaled_down.all()


def _backend(cfg: RunConfig, data_dir: Path, opt: dict[str, np.ndarray]) -> NumpyBackend:
    state = ReplicaState(cfg, 0, init_params(cfg.model), opt)
    return NumpyBackend(load_data_dir(data_dir), state)


def test_the_forward_pass_uses_the_scaled_noise(words_data: Path) -> None:
    cfg = _cfg(population=8).replace(model=ModelConfig(vocab_size=256, n_layer=1, d_model=8))
    opt = _random_overlays(cfg, 4)
    backend = _backend(cfg, words_data, opt)
    got = backend.evaluate_chunk(0, 0, 8)
    # by hand: the same model with explicitly scaled member noise
    pairs = np.arange(4)
    params = backend.state.params
    mn = member_noise(
        pair_noise(
            cfg, param_specs(cfg.model), 0, pairs, noise_scales(cfg, param_specs(cfg.model), opt)
        ),
        params,
        4,
    )
    tokens = np.repeat(pair_windows(cfg, backend.dataset.train, 0, pairs), 2, axis=0)
    loss, _ = EggModel(cfg, params).forward(tokens, mn)
    assert got.loss_sum == int(loss.sum())
    # every overlay <= 0: no noise at all, so both members of a pair score the same
    silent = {k: np.full_like(v, -5) for k, v in opt.items()}
    quiet = _backend(cfg, words_data, silent).evaluate_chunk(0, 0, 8)
    assert not quiet.fitness.any()
    unperturbed, _ = EggModel(cfg, params).forward(tokens)
    assert quiet.loss_sum == int(unperturbed.sum())


def test_full_overlays_change_nothing_on_the_first_step() -> None:
    """All overlays start at 64 (factor 1): step 0 moves the weights as without them."""
    for rule in ("ztest", "momentum", "adamw"):
        cfg = _cfg(rule)
        off = cfg.replace(es=ESConfig(population=40, chunk_size=20, seq_len=4))
        fitness = np.random.default_rng(6).integers(-1, 2, cfg.pairs).astype(np.int8)
        params = init_params(cfg.model)
        a = apply_update(cfg, 0, params, initial_opt_state(cfg), fitness)
        b = apply_update(off, 0, params, initial_opt_state(off), fitness)
        assert a.changed == b.changed and (a.changed > 0 or rule == "adamw")  # lr < 1
        assert all(np.array_equal(a.params[k], b.params[k]) for k in params)
        assert all(np.array_equal(a.opt[k], v) for k, v in b.opt.items())


@pytest.mark.parametrize("rule", ["ztest", "momentum", "adamw"])
def test_replay_checkpoint_and_digest_carry_the_overlays(rule: str) -> None:
    cfg = _cfg(rule, population=8)
    rng = np.random.default_rng(7)
    fitness = [rng.integers(-1, 2, cfg.pairs).astype(np.int8) for _ in range(12)]
    whole = replay(ReplicaState.initial(cfg), fitness)
    assert any((v != 64).any() for k, v in whole.opt.items() if k.startswith("overlay."))
    half = decode_checkpoint(encode_checkpoint(replay(ReplicaState.initial(cfg), fitness[:5])))
    part = replay(half, fitness[5:])
    assert part.digest() == whole.digest()
    loaded = decode_checkpoint(encode_checkpoint(whole))
    assert loaded.digest() == whole.digest()
    assert all(np.array_equal(loaded.opt[k], v) for k, v in whole.opt.items())
    opt = {k: v.copy() for k, v in whole.opt.items()}
    opt["overlay.layers.0.bf"][0] += 1
    assert ReplicaState(cfg, whole.step, whole.params, opt).digest() != whole.digest()


@pytest.mark.parametrize(
    "settings",
    [
        {"update": UpdateConfig(rule="adamw")},
        {"es_adaptive": True},
        {"update": UpdateConfig(rule="adamw"), "es_adaptive": True},
    ],
    ids=["adamw", "adaptive", "adamw-adaptive"],
)
def test_a_short_training_run_is_deterministic(words_data: Path, settings: dict) -> None:
    cfg = RunConfig(
        model=ModelConfig(n_layer=1, d_model=16),
        es=ESConfig(
            population=32,
            chunk_size=8,
            seq_len=8,
            adaptive_noise=settings.get("es_adaptive", False),
        ),
        update=settings.get("update", UpdateConfig()),
        validation=ValidationConfig(every_steps=0, max_tokens=400),
        steps=4,
    )
    dataset = load_data_dir(words_data)
    a = train(cfg, NumpyBackend(dataset, ReplicaState.initial(cfg)), 4)
    b = train(cfg, NumpyBackend(dataset, ReplicaState.initial(cfg), batch_members=6), 4)
    assert a.state.digest() == b.state.digest() and a.fitness == b.fitness
    assert a.state.opt and a.state.digest() != ReplicaState.initial(cfg).digest()
    logged = [unpack_ternary(p, cfg.pairs) for p in a.fitness]
    assert replay(ReplicaState.initial(cfg), logged).digest() == a.state.digest()

"""The counter-based noise: an independent scalar implementation of the spec, and golden
vectors that pin every bit (the CUDA port must reproduce them)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from eggroll_dist.shared import noise as nz

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _fmix32(x: int) -> int:
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _spec_noise(run_seed: int, step: int, pair: int, tensor_id: int, index: int, kind: str) -> int:
    """DESIGN: noise(run_seed, step, pair, tensor_id, index), written from the docstring."""
    h = 0x6E6F697365
    for w in (run_seed, step, pair, tensor_id):
        h = _mix64(h ^ _mix64((w + 0x9E3779B97F4A7C15) & M64))
    bits = _fmix32((h & M32) ^ _fmix32(index ^ (h >> 32)))
    if kind == "uniform":
        m = (bits >> 1) & 15
        return m if bits & 1 else -m
    d = sum((bits >> (8 * i)) & 0xFF for i in range(4)) - 510
    mag = (abs(d) * 7) >> 6
    return -mag if d < 0 else mag


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_vectorised_noise_matches_scalar_spec(kind: str) -> None:
    rng = np.random.default_rng(1)
    for _ in range(40):
        run_seed = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))
        step, tensor_id = int(rng.integers(0, 10**6)), int(rng.integers(0, 200))
        pairs = rng.integers(0, 2**20, size=3)
        start = int(rng.integers(0, 5000))
        block = nz.noise_block(run_seed, step, pairs, tensor_id, start, 7, kind)
        for r, pair in enumerate(pairs):
            for c in range(7):
                want = _spec_noise(run_seed, step, int(pair), tensor_id, start + c, kind)
                assert block[r, c] == want


def test_golden_vectors() -> None:
    # Pinned outputs: a change here breaks every stored run and the CUDA port.
    assert [nz.noise(0, 0, 0, 0, i) for i in range(12)] == GOLDEN_UNIFORM
    assert [nz.noise(42, 7, 1234, 5, i, "gaussian") for i in range(12)] == GOLDEN_GAUSSIAN
    assert nz.hash_key(nz.DOMAIN_NOISE, 1, 2, 3, 4) == GOLDEN_KEY
    assert nz.window_offsets(3, 9, np.arange(5), 1000).tolist() == GOLDEN_WINDOWS
    assert nz.init_values(0, 1, 8).tolist() == GOLDEN_INIT


GOLDEN_UNIFORM = [-4, 8, 4, -15, -1, -10, 9, 5, 2, 5, -3, 10]
GOLDEN_GAUSSIAN = [16, -17, -3, -1, 7, 25, 10, 13, 0, -1, 7, 5]
GOLDEN_KEY = 0xBD4C7A4ED3DBC1A4
GOLDEN_WINDOWS = [294, 508, 668, 935, 422]
GOLDEN_INIT = [0, -15, 0, -7, 20, -12, -32, -3]


def test_keys_are_combined_not_added() -> None:
    # d-eggs' additive seeds made (pair p, tensor t+1) equal (pair p+1, tensor t).
    a = nz.noise_block(0, 0, np.array([5]), 7, 0, 64, "uniform")
    b = nz.noise_block(0, 0, np.array([6]), 6, 0, 64, "uniform")
    assert not np.array_equal(a, b)
    # Shifting step into pair, or pair into tensor, gives unrelated vectors.
    c = nz.noise_block(0, 1, np.array([5]), 6, 0, 64, "uniform")
    d = nz.noise_block(0, 0, np.array([6]), 6, 0, 64, "uniform")
    assert not np.array_equal(c, d)
    assert np.count_nonzero(a == b) < 20  # about 64 * P(equal) ~ 3, not a shifted copy


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_distribution_moments(kind: str) -> None:
    v = nz.noise_block(9, 1, np.arange(256), 3, 0, 4096, kind).astype(np.float64)
    assert abs(v.mean()) < 0.1
    assert v.max() <= nz.max_abs(kind) and v.min() >= -nz.max_abs(kind)
    assert abs((v * v).mean() - float(nz.second_moment(kind))) < 0.02 * float(
        nz.second_moment(kind)
    )


def test_uniform_distribution_is_exact() -> None:
    assert nz.second_moment("uniform") == Fraction(155, 2)
    v = nz.noise_block(1, 2, np.arange(64), 0, 0, 4096, "uniform")
    counts = np.bincount(np.abs(v).ravel(), minlength=16)
    assert len(counts) == 16 and counts.min() > 0.8 * v.size / 16


def test_gaussian_is_bell_shaped_with_std_16() -> None:
    assert 15 < float(nz.second_moment("gaussian")) ** 0.5 < 17.5
    v = nz.noise_block(1, 2, np.arange(64), 0, 0, 4096, "gaussian")
    assert np.mean(np.abs(v) <= 16) > 0.6  # ~68% within one std for a normal


def test_unknown_kind_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown noise kind"):
        nz.noise(0, 0, 0, 0, 0, "cauchy")

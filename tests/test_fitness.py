"""Ternary fitness from pair losses, with the optional d-eggs chunk filters."""

from __future__ import annotations

import numpy as np

from eggroll_dist.shared.config import FitnessConfig, preset
from eggroll_dist.shared.fitness import chunk_loss_range, pair_fitness
from eggroll_dist.shared.loss import token_loss


def test_sign_of_loss_difference() -> None:
    loss = np.array([10, 20, 30, 5, 7, 7])  # pairs: + better, - better, tie
    assert pair_fitness(loss, FitnessConfig()).tolist() == [1, -1, 0]


def test_chunk_mean_filter_adds_integer_bias() -> None:
    # diffs (minus - plus): 100, 100, -50 -> mean 50 -> bias floor(50 ** 1.2) = 109
    loss = np.array([0, 100, 0, 100, 50, 0])
    cfg = FitnessConfig(chunk_mean_filter=True)
    assert int(50**1.2) == 109
    assert pair_fitness(loss, cfg).tolist() == [1, 1, 1]


def test_adaptive_threshold_zeroes_small_differences() -> None:
    # |diffs| 100, 100, 5, 3 -> mean 52 -> threshold 5.2: the 5 and the 3 become 0
    loss = np.array([0, 100, 100, 0, 0, 5, 3, 0])
    cfg = FitnessConfig(adaptive_threshold=True)
    assert pair_fitness(loss, cfg).tolist() == [1, -1, 0, 0]


def test_filters_are_deterministic_integers() -> None:
    rng = np.random.default_rng(0)
    loss = rng.integers(0, 10**7, size=4096)
    cfg = FitnessConfig(chunk_mean_filter=True, adaptive_threshold=True)
    a, b = pair_fitness(loss, cfg), pair_fitness(loss.copy(), cfg)
    assert a.dtype == np.int8 and a.tobytes() == b.tobytes()
    assert set(np.unique(a).tolist()) <= {-1, 0, 1}


def test_chunk_loss_range_bounds_every_possible_token_loss() -> None:
    cfg = preset("tiny")
    lo, hi = chunk_loss_range(cfg)
    tokens = cfg.es.chunk_size * cfg.es.seq_len
    assert lo % tokens == 0 and hi % tokens == 0
    rng = np.random.default_rng(0)
    logits = rng.integers(-127, 128, size=(4000, 256)).astype(np.int32)
    logits[:1000] = np.where(rng.random((1000, 256)) < 0.5, -127, 127)  # extremes too
    targets = rng.integers(0, 256, size=4000)
    loss = token_loss(logits, targets)
    assert lo // tokens <= loss.min() and loss.max() <= hi // tokens
    # The bounds are tight: a row at each extreme reaches them.
    assert hi // tokens == int(token_loss(np.array([[-128] + [127] * 255]), np.array([0]))[0])

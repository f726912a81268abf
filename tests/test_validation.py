"""Held-out validation: windows from a zero state and long streams with the recurrent state
carried, over the same target tokens, in bits per token and per byte of the text."""

from __future__ import annotations

import math
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, ValidationConfig
from eggroll_dist.shared.egg import EggModel
from eggroll_dist.shared.logs import HELD_OUT_FIELDS, held_out_text
from eggroll_dist.shared.loss import token_loss, true_bits
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.shared.window import (
    VALIDATION_STREAMS,
    validation_streams,
    validation_targets,
    validation_windows,
)
from eggroll_dist.worker.backend import HeldOut, Validation
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend

CFG = RunConfig(
    model=ModelConfig(vocab_size=16, n_layer=2, d_model=8, init_seed=3),
    es=ESConfig(population=8, chunk_size=8, seq_len=6),
    validation=ValidationConfig(max_tokens=0),  # all of valid.bin
)
BYTES = [bytes([i]) for i in range(16)]
# Multi-byte pieces, and a separator (token 0) that decodes to nothing.
PIECES = [b""] + [b"ab"[: 1 + i % 2] * (1 + i % 3) for i in range(1, 16)]


def held_out_data(pieces: list[bytes] = BYTES, size: int = 400) -> SimpleNamespace:
    rng = np.random.default_rng(5)
    valid = rng.integers(1, 16, size=size).astype(np.uint8)
    valid[::29] = 0  # documents start: the model resets its state there
    return SimpleNamespace(train=valid, valid=valid, decoding=pieces)


def backend(data: SimpleNamespace, cfg: RunConfig = CFG) -> NumpyBackend:
    return NumpyBackend(data, ReplicaState.initial(cfg))


def hand_streams(cfg: RunConfig, valid: np.ndarray, count: int) -> tuple[int, float, int]:
    """(integer loss, bits, tokens) of `count` streams, each read alone by `model.step`; the
    bits summed exactly, as validation sums them."""
    model = EggModel(cfg, ReplicaState.initial(cfg).params)
    targets = validation_targets(cfg, valid)
    q, r = divmod(targets, count)  # the first r streams are one token longer
    bounds = np.cumsum([0] + [q + 1] * r + [q] * (count - r))
    loss, bits, tokens = 0, [], 0
    for lo, hi in pairwise(bounds):
        state = model.initial_state(1)
        for t in range(lo, hi):
            logits = model.step(state, valid[t : t + 1])
            loss += int(token_loss(logits, valid[t + 1 : t + 2])[0])
            bits.append(float(true_bits(logits, valid[t + 1 : t + 2])[0]))
            tokens += 1
    return loss, math.fsum(bits), tokens


def test_streams_cut_the_windows_span_into_contiguous_pieces() -> None:
    valid = held_out_data().valid
    windows = validation_windows(CFG, valid)
    tokens, lengths = validation_streams(CFG, valid)
    assert len(tokens) == VALIDATION_STREAMS == 16
    assert lengths.sum() == windows[:, 1:].size == validation_targets(CFG, valid) == 396
    assert list(lengths) == sorted(lengths, reverse=True) and lengths[0] - lengths[-1] <= 1
    # Read in order, the streams predict exactly the windows' targets, each token once.
    predicted = np.concatenate([row[1 : n + 1] for row, n in zip(tokens, lengths, strict=True)])
    assert predicted.tobytes() == windows[:, 1:].reshape(-1).tobytes()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    assert tokens[:, 0].tobytes() == valid[starts].tobytes()
    # A span shorter than the stream count gets one stream per target token.
    short = CFG.replace(validation=ValidationConfig(max_tokens=6))
    few, few_lengths = validation_streams(short, valid)
    assert list(few_lengths) == [1] * 6 and few.shape == (6, 2)


def test_stream_metric_equals_a_hand_loop_over_model_step() -> None:
    data = held_out_data()
    got = backend(data).validate().streams
    assert got is not None
    loss, bits, tokens = hand_streams(CFG, data.valid, VALIDATION_STREAMS)
    assert got.tokens == tokens == 396
    assert got.loss_16 == loss / tokens
    assert got.bits_per_token == bits / tokens  # exact sums: equal to the last bit


def test_stream_metric_carries_the_state() -> None:
    v = backend(held_out_data()).validate()
    assert v.streams is not None
    assert (v.streams.tokens, v.streams.text_bytes) == (v.windows.tokens, v.windows.text_bytes)
    assert v.streams.loss_16 != v.windows.loss_16  # the carried state changes predictions


def test_streams_one_window_long_equal_the_window_metric() -> None:
    data = held_out_data()
    rows = len(validation_windows(CFG, data.valid))
    v = backend(data).validate(streams=rows)
    assert v.streams == v.windows  # same tokens, bytes, loss and bits, bit for bit


def test_validation_is_deterministic_and_independent_of_batching() -> None:
    data = held_out_data(PIECES)
    a = backend(data).validate()
    assert a == backend(data).validate() == backend(data).validate(rows_per_batch=7)


def test_bits_per_byte_on_multi_byte_pieces() -> None:
    data = held_out_data(PIECES)
    v = backend(data).validate()
    assert v.streams is not None
    targets = validation_windows(CFG, data.valid)[:, 1:].reshape(-1)
    size = sum(len(PIECES[t]) for t in targets)
    assert size > len(targets)  # more bytes than tokens: fewer bits per byte
    for metric in (v.windows, v.streams):
        assert metric.text_bytes == size
        total_bits = metric.bits_per_token * metric.tokens
        assert metric.bits_per_byte == pytest.approx(total_bits / size, rel=1e-15)
        assert metric.bits_per_byte < metric.bits_per_token
    _, bits, _ = hand_streams(CFG, data.valid, VALIDATION_STREAMS)
    assert v.streams.bits_per_byte == pytest.approx(bits / size, rel=1e-15)


def test_bits_per_byte_of_the_byte_vocabulary_is_bits_per_token() -> None:
    v = backend(held_out_data(BYTES)).validate()
    assert v.streams is not None
    for metric in (v.windows, v.streams):
        assert metric.text_bytes == metric.tokens
        assert metric.bits_per_byte == metric.bits_per_token


def test_a_model_without_streams_reports_none_for_them() -> None:
    v = Validation(HeldOut(100, 0, 70.0, 4.5), None)
    report = v.report()
    assert report["bits_per_token"] == 4.5 and report["bits_per_byte"] is None
    assert report["stream_tokens"] == 0
    assert report["stream_bits_per_token"] is report["stream_bits_per_byte"] is None
    fields = v.log_fields()
    assert tuple(fields) == HELD_OUT_FIELDS
    assert fields == {k: None for k in HELD_OUT_FIELDS} | {"valid_bits": 4.5}
    assert held_out_text(fields) == "4.500 bits/token"
    both = Validation(HeldOut(100, 150, 70.0, 4.5), HeldOut(100, 150, 68.0, 4.25))
    assert held_out_text(both.log_fields()) == (
        "4.500 bits/token, 3.000 bits/byte; long streams 4.250 bits/token, 2.833 bits/byte"
    )

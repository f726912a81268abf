"""Sampling: the exact table, each filter on hand-made distributions, determinism, the
EGG model's per-token step against its forward pass, prompts, and text display."""

from __future__ import annotations

import numpy as np
import pytest

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.egg import EggGenerator, EggModel
from eggroll_dist.shared.loss import token_loss
from eggroll_dist.shared.model import init_params
from eggroll_dist.shared.sample import (
    TOP_WEIGHT,
    SampleError,
    SampleSettings,
    exp_table,
    fit_prompt,
    generate,
    milli_text,
    next_token,
    parse_milli,
    penalized,
    token_weights,
)
from eggroll_dist.shared.vocab import Detokenizer, VocabError, decode, encode, escape

PLAIN = SampleSettings(temperature=1000, min_p=0, top_k=0, presence_penalty=0)
CFG = RunConfig(
    model=ModelConfig(vocab_size=256, n_layer=2, d_model=16, init_seed=5),
    es=ESConfig(population=8, chunk_size=8, seq_len=10),
)


def _no_counts(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


# --- the exact exp table ------------------------------------------------------------------


def test_exp_table_is_floor_of_two_to_minus_i_over_256() -> None:
    table = exp_table()
    # Golden values: any port must build the same table.
    assert [int(table[i]) for i in (0, 1, 128, 255)] == [
        1 << 30,
        1070838486,
        759250124,
        538326516,
    ]
    exact = 2.0 ** (30 - np.arange(256) / 256)
    assert np.all(table <= exact) and np.all(exact - table < 1)
    assert np.all(np.diff(table) < 0)


def test_settings_parse_exactly_and_reject_bad_values() -> None:
    assert parse_milli("0.6", "t") == 600 and parse_milli("0.08", "m") == 80
    assert parse_milli("2", "t") == 2000 and parse_milli(".5", "t") == 500
    assert parse_milli("0.1250", "t") == 125 and milli_text(80) == "0.08"
    for bad in ("", ".", "-1", "0.0001", "1e3", "abc", "٣"):
        with pytest.raises(SampleError):
            parse_milli(bad, "x")
    with pytest.raises(SampleError, match="min_p"):
        SampleSettings(min_p=1001)
    assert SampleSettings() == SampleSettings(600, 80, 0, 200, 0)  # the documented defaults


# --- each filter on a hand-made distribution ---------------------------------------------


def test_temperature_one_weights_follow_the_base_two_logits() -> None:
    logits = np.array([40, 24, 8, 40 - 160, 39])  # 1/16 bit: 0, -1, -2, -10 bits, -1/16
    w = token_weights(logits, _no_counts(5), PLAIN)
    ideal = TOP_WEIGHT * 2.0 ** ((logits - 40) / 16)
    assert np.all(np.abs(w - ideal) < 1)
    assert w[0] == TOP_WEIGHT and w[1] == TOP_WEIGHT // 2 and w[3] == TOP_WEIGHT >> 10


def test_temperature_scales_the_log_odds() -> None:
    logits = np.array([0, -16, -32, -48])
    cold = token_weights(logits, _no_counts(4), SampleSettings(500, 0, 0, 0, 0))
    hot = token_weights(logits, _no_counts(4), SampleSettings(2000, 0, 0, 0, 0))
    assert list(cold) == [TOP_WEIGHT >> k for k in (0, 2, 4, 6)]  # 2**(l / (16 * 0.5))
    assert np.all(np.abs(hot - TOP_WEIGHT * 2.0 ** (logits / 32)) < 1)


def test_temperature_zero_is_greedy_whatever_the_seed() -> None:
    logits = np.array([3, 9, 1, 9, -5])
    greedy = SampleSettings(temperature=0, presence_penalty=0)
    picks = {
        next_token(logits, _no_counts(5), greedy, seed, 0, p)
        for seed in range(20)
        for p in range(5)
    }
    assert picks == {1}  # the largest logit; a tie goes to the smaller id
    # The penalties still apply before the argmax.
    counts = np.array([0, 1, 0, 0, 0])
    assert next_token(logits, counts, SampleSettings(0, 0, 0, 200, 0), 0, 0, 0) == 3


def test_min_p_drops_exactly_the_tokens_below_min_p_times_p_max() -> None:
    # Relative probabilities 1, 1/2, 1/4, 1/8, 2**-3.5 = 0.088, 1/16, 1/32, and ties.
    logits = np.array([0, -16, -32, -48, -56, -64, -80, 0, -56])
    settings = SampleSettings(temperature=1000, min_p=80, presence_penalty=0)
    w = token_weights(logits, _no_counts(len(logits)), settings)
    plain = token_weights(logits, _no_counts(len(logits)), PLAIN)
    p = plain / plain.sum()
    kept = set(np.flatnonzero(w).tolist())
    assert kept == set(np.flatnonzero(p >= 0.08 * p.max()).tolist()) == {0, 1, 2, 3, 4, 7, 8}
    assert np.array_equal(w[w > 0], plain[w > 0])  # the survivors keep their weights
    # Dropped tokens are never drawn; kept ones are.
    drawn = {next_token(logits, _no_counts(9), settings, 7, 0, p) for p in range(3000)}
    assert drawn == kept
    # min-p 1 keeps only the most likely tokens (both of the tie).
    top = token_weights(logits, _no_counts(9), SampleSettings(1000, 1000, 0, 0, 0))
    assert set(np.flatnonzero(top).tolist()) == {0, 7}


def test_min_p_applies_after_temperature() -> None:
    logits = np.array([0, -64])  # p ratio 1/16 at temperature 1: dropped by min-p 0.08
    assert token_weights(logits, _no_counts(2), SampleSettings(1000, 80, 0, 0, 0))[1] == 0
    # At temperature 2 the ratio is 1/4: kept.
    assert token_weights(logits, _no_counts(2), SampleSettings(2000, 80, 0, 0, 0))[1] > 0


def test_top_k_keeps_the_k_largest_logits_ties_by_id() -> None:
    logits = np.array([5, 9, 7, 9, 1])
    w = token_weights(logits, _no_counts(5), SampleSettings(1000, 0, 2, 0, 0))
    assert set(np.flatnonzero(w).tolist()) == {1, 3}
    w = token_weights(logits, _no_counts(5), SampleSettings(1000, 0, 3, 0, 0))
    assert set(np.flatnonzero(w).tolist()) == {1, 2, 3}
    w = token_weights(logits, _no_counts(5), SampleSettings(1000, 0, 1, 0, 0))
    assert set(np.flatnonzero(w).tolist()) == {1}


def test_presence_penalty_applies_once_per_distinct_token() -> None:
    logits = np.array([10, 10, 10, 10])
    counts = np.array([0, 1, 2, 7])
    presence = SampleSettings(1000, 0, 0, 250, 0)
    big = penalized(logits, counts, presence)
    # 0.25 bit = 4000 in 1/16000 bit, once, however often the token occurred.
    assert list(big) == [10_000, 6_000, 6_000, 6_000]
    w = token_weights(logits, counts, presence)
    assert w[1] == w[2] == w[3] < w[0]


def test_frequency_penalty_applies_per_occurrence() -> None:
    logits = np.array([10, 10, 10, 10])
    counts = np.array([0, 1, 2, 7])
    frequency = SampleSettings(1000, 0, 0, 0, 250)
    assert list(penalized(logits, counts, frequency)) == [10_000, 6_000, 2_000, -18_000]
    w = token_weights(logits, counts, frequency)
    assert w[0] > w[1] > w[2] > w[3]
    assert w[1] == exp_table()[64] and w[2] == exp_table()[128]  # 1/4 bit per occurrence


def test_draws_follow_the_weights() -> None:
    logits = np.array([0, -16, -32, -8])
    w = token_weights(logits, _no_counts(4), PLAIN)
    n = 20_000
    drawn = np.bincount(
        [next_token(logits, _no_counts(4), PLAIN, 3, 0, p) for p in range(n)], minlength=4
    )
    expected = n * w / w.sum()
    assert np.all(np.abs(drawn - expected) < 5 * np.sqrt(expected))


def test_golden_draws() -> None:
    """Pins the whole specification: the hash, the table, the arithmetic."""
    logits = np.arange(-40, 24, 4)  # 16 tokens
    counts = np.zeros(16, dtype=np.int64)
    counts[[3, 15]] = [1, 2]
    picks = [next_token(logits, counts, SampleSettings(), 12345, 2, p) for p in range(12)]
    assert picks == GOLDEN_PICKS


GOLDEN_PICKS = [14, 12, 11, 11, 14, 10, 15, 8, 14, 13, 13, 15]


# --- the EGG model one token at a time ----------------------------------------------------


def test_stepping_token_by_token_gives_the_forward_logits() -> None:
    params = init_params(CFG.model)
    rng = np.random.default_rng(1)
    rows = rng.integers(1, 256, size=(4, 9))
    rows[:, 0] = 0  # a document start, where generation starts
    rows[2, 5] = 0  # and a document boundary inside a window
    model = EggModel(CFG, params)
    window = model.window_logits(rows)
    loss, _ = model.forward(rows)
    per_token = [token_loss(window[:, t], rows[:, t + 1]) for t in range(8)]
    assert np.array_equal(np.sum(per_token, axis=0), loss)  # forward is the same step
    gen = EggGenerator(CFG, params)
    for r in range(4):
        state, logits = gen.start()
        stepped = [logits]
        for tok in rows[r, 1:8]:
            state, logits = gen.step(state, int(tok))
            stepped.append(logits)
        assert np.array_equal(np.stack(stepped), window[r])


def test_same_inputs_same_tokens_twice_and_seeds_differ() -> None:
    gen = EggGenerator(CFG, init_params(CFG.model))
    prompt = list(b"the eggs")
    a = list(generate(gen, prompt, 30, SampleSettings(), seed=4))
    b = list(generate(EggGenerator(CFG, init_params(CFG.model)), prompt, 30, SampleSettings(), 4))
    assert a == b and len(a) == 30 and all(0 <= t < 256 for t in a)
    assert list(generate(gen, prompt, 30, SampleSettings(), seed=5)) != a
    assert list(generate(gen, prompt, 30, SampleSettings(), seed=4, sample=1)) != a
    # Streaming is lazy: a prefix of the stream is the same tokens.
    assert list(generate(gen, prompt, 10, SampleSettings(), seed=4)) == a[:10]


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens() -> None:
    gen = EggGenerator(CFG, init_params(CFG.model))
    assert gen.context == CFG.es.seq_len == 10
    long_prompt = list(b"an int8 model that writes very long prompts " * 20)
    assert fit_prompt(long_prompt, gen.context, 256) == long_prompt[-10:]
    settings = SampleSettings(frequency_penalty=100)
    full = list(generate(gen, long_prompt, 20, settings, seed=1))
    assert full == list(generate(gen, long_prompt[-10:], 20, settings, seed=1))
    assert len(full) == 20  # generating past the context is fine: no position table


def test_an_empty_prompt_starts_a_document() -> None:
    gen = EggGenerator(CFG, init_params(CFG.model))
    out = list(generate(gen, [], 25, SampleSettings(), seed=2))
    assert len(out) == 25 and out == list(generate(gen, [], 25, SampleSettings(), seed=2))
    # Without penalties, the empty prompt and the separator alone give the same state.
    free = SampleSettings(presence_penalty=0)
    assert list(generate(gen, [], 25, free, 2)) == list(generate(gen, [0], 25, free, 2))
    assert list(generate(gen, [], 0, free, 2)) == []


def test_prompt_tokens_outside_the_vocabulary_are_refused() -> None:
    gen = EggGenerator(CFG, init_params(CFG.model))
    with pytest.raises(SampleError, match="prompt token 1 is 256"):
        list(generate(gen, [5, 256], 3, SampleSettings(), 0))
    with pytest.raises(SampleError, match="tokens=70000"):
        list(generate(gen, [5], 70_000, SampleSettings(), 0))


# --- text in and out ---------------------------------------------------------------------


def test_encode_is_identity_for_bytes_and_longest_match_otherwise() -> None:
    byte_pieces = [bytes([i]) for i in range(256)]
    assert encode("é\x00a".encode(), byte_pieces) == [0xC3, 0xA9, 0, 0x61]
    pieces = [b"\x00", b"a", b"b", b"ab", b"abc", b" ", b"c"]
    assert encode(b"abcab c", pieces) == [4, 3, 5, 6]
    assert encode(b"", pieces) == []
    with pytest.raises(VocabError, match=r"prompt byte 3 \(0xc3\) is outside the vocabulary"):
        encode("abcé".encode(), pieces)
    with pytest.raises(VocabError, match="0x00"):  # the separator is not text
        encode(b"a\x00", pieces)


def test_detokenizer_joins_utf8_split_over_tokens() -> None:
    pieces = [bytes([i]) for i in range(256)]
    d = Detokenizer(pieces)
    assert d.feed(0xC3) == "" and d.feed(0xA9) == "é"
    assert d.feed(0xFF) == "\ufffd" and d.feed(0x41) == "A"
    assert decode([0xE2, 0x82], pieces) == "\ufffd"  # an unfinished character at the end
    assert Detokenizer(pieces[:10]).feed(300) == "<300>"


def test_escape_removes_every_terminal_control_character() -> None:
    text = "ok\x1b[31mred\x07\r\nnext\tcol\x85\x9b2J\x7f\u2028\\n"
    shown = escape(text)
    assert shown == "ok\\x1b[31mred\\x07\\x0d\nnext\tcol\\x85\\x9b2J\\x7f\\u2028\\n"
    one_line = escape(text, keep_newlines=False)
    assert "\n" not in one_line and "\t" not in one_line
    assert one_line.startswith("ok\\x1b[31mred\\x07\\x0d\u21b5next\\x09col")
    controls = [chr(c) for c in [*range(32), *range(127, 160)]]
    assert not any(c in escape("".join(controls), keep_newlines=False) for c in controls)

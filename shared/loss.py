"""The integer loss every architecture scores with: -log2 p(target) in 1/16 bit, from int8
logits that are base-2 log-odds in 1/16 bit, through two exact tables (no libm).

    token_loss = LOG2(sum_v EXP2[l_v + 128]) - 64 - (l_target + 128)
    EXP2[i]    = floor(16 * 2**(i/16))                 i in 0..255, exactly (integer bisection)
    LOG2(s)    = floor(16 * log2(s))                   exact for positive s < 2**53

`true_bits` is the exact float64 softmax loss of the same logits, for reporting only: no
replica ever depends on it. Both follow from a row's 256 logit counts (`logit_histogram`),
which is what a device returns for held-out scores. The CuPy backend loads the same two
tables onto the device.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .matmul import frozen

ZIPF_TOP = 64  # the commonest token's starting head bias: 4 bits, leaving headroom below 127


@cache
def exp2_table() -> np.ndarray:
    """EXP2[i] = floor(16 * 2**(i/16)) = floor(2**(4 + i/16)) for i in 0..255, exactly."""
    table = []
    for i in range(256):
        # Largest c with c**16 <= 2**(64 + i), by integer bisection (no float rounding).
        lo, hi = 1, 1 << 21
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if mid**16 <= 1 << (64 + i) else (lo, mid - 1)
        table.append(lo)
    return frozen(table, np.int32)  # <= 2**20: 2048 of them fit int32


@cache
def log2_thresholds() -> np.ndarray:
    """TH[j] = ceil(2**31 * 2**(j/16)) for j = 1..15: the mantissa steps of 16*log2."""
    th = []
    for j in range(1, 16):
        lo, hi = 1 << 31, 1 << 32
        while lo < hi:  # smallest c with c**16 >= 2**(31*16 + j)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if mid**16 >= 1 << (31 * 16 + j) else (mid + 1, hi)
        th.append(lo)
    return frozen(th, np.int64)


def floor_log2_16(s: np.ndarray) -> np.ndarray:
    """floor(16 * log2(s)) for positive int64 s < 2**53, exactly (replaces a 1 GiB table)."""
    _, exp = np.frexp(s.astype(np.float64))  # s = mant * 2**exp with mant in [0.5, 1): exact
    e = exp.astype(np.int64) - 1  # floor(log2 s)
    left = np.maximum(31 - e, 0)
    right = np.maximum(e - 31, 0)
    mant = (s << left) >> right  # s scaled to [2**31, 2**32); truncation keeps floor exact
    return 16 * e + np.searchsorted(log2_thresholds(), mant, side="right")


def token_loss(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log2 p(target) in 1/16 bit per row: LOG2(sum EXP2[l + 128]) - 64 - (l[target] + 128)."""
    shifted = logits + 128
    total = exp2_table().take(shifted).sum(axis=1, dtype=np.int64)
    target = shifted[np.arange(len(targets)), targets]
    return floor_log2_16(total) - 64 - target


def true_bits(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The exact -log2 softmax of logits/16 (base 2), in float64: reporting only."""
    target = logits[np.arange(len(targets)), targets]
    return histogram_bits(logit_histogram(logits), target)


# A row's losses depend on its logits only through how many take each value (and the
# target's): a device returns these 256 counts per row instead of the row, and both losses
# follow from them here, the same on every backend.


def logit_histogram(logits: np.ndarray) -> np.ndarray:
    """Counts (rows, 256) int64: [r, l + 128] = how many logits of row r equal l."""
    rows = len(logits)
    flat = (logits.astype(np.int64) + 128) + 256 * np.arange(rows, dtype=np.int64)[:, None]
    return np.bincount(flat.reshape(-1), minlength=256 * rows).reshape(rows, 256)


def histogram_loss(hist: np.ndarray, target: np.ndarray) -> np.ndarray:
    """token_loss from each row's logit counts and target logit: exact integers."""
    total = hist.astype(np.int64) @ exp2_table().astype(np.int64)
    return floor_log2_16(total) - 64 - (target.astype(np.int64) + 128)


def histogram_bits(hist: np.ndarray, target: np.ndarray) -> np.ndarray:
    """true_bits from each row's logit counts and target logit: top + log2(sum over values
    of count * 2**((l - top) / 16)) - target / 16, with top the row's largest logit / 16.
    A fixed-length sum per row, so the value is the same for any batch and vocabulary order."""
    values = np.arange(256, dtype=np.int64) - 128
    top = np.where(hist > 0, values, -256).max(axis=1)
    scaled = np.exp2((values[None, :] - top[:, None]) / 16.0)
    total = (hist * scaled).sum(axis=1)
    return (top + 16.0 * np.log2(total) - target) / 16.0


@cache
def zipf_bias(vocab_size: int) -> np.ndarray:
    """The "zipf" start of a logit bias, in the logits' 1/16 bits: id v >= 1 gets
    clip(64 - floor(16 * log2(v)), -127, 127), so that p(v) ~ 1/v (Zipf's law, when id 1 is
    the commonest token); id 0, the document separator wherever it ranks, gets the rarest
    id's value (a separator is far rarer than the commonest tokens)."""
    ids = np.maximum(np.arange(vocab_size, dtype=np.int64), 1)
    ids[0] = vocab_size - 1
    return frozen(np.clip(ZIPF_TOP - floor_log2_16(ids), -127, 127), np.int8)

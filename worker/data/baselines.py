"""Held-out baselines of a data set: unigram, bigram and gzip -9 on valid.bin.

`eggroll-data prepare` stores them in meta.json, in bits per token and in bits per byte of
the text valid.bin decodes to, so a run's held-out score has something to be read against
and a byte model, a BPE model and gzip compare on one scale. Nothing a replica computes
depends on them.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...shared.data import FORMAT_VERSION, DataMeta, decode_tokens, token_dtype, tokens_digest

__all__ = [
    "BASELINE_NAMES",
    "BIGRAM_LAMBDAS",
    "HeldOutScores",
    "baselines",
    "bigram_bits",
    "choose_bigram_lambda",
    "data_meta",
    "gzip_bits",
    "held_out_scores",
    "unigram_bits",
]

BASELINE_NAMES = ("unigram", "bigram", "gzip9")
# Interpolation weights tried for the bigram baseline (see bigram_bits).
BIGRAM_LAMBDAS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99)


# Tokens converted at a time: a large split is never copied whole into int64.
_BLOCK_TOKENS = 1 << 22


def token_counts(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """How often each id occurs (int64), converting a block of ids at a time."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), _BLOCK_TOKENS):
        block = np.asarray(tokens[start : start + _BLOCK_TOKENS], dtype=np.int64)
        counts += np.bincount(block, minlength=vocab_size)
    return counts


def _unigram_probs(train: np.ndarray, vocab_size: int) -> np.ndarray:
    # Add-one (Laplace) smoothing: every id has probability > 0, so held-out bits are finite.
    return (token_counts(train, vocab_size) + 1.0) / (len(train) + vocab_size)


def unigram_bits(train: np.ndarray, valid: np.ndarray, vocab_size: int) -> float:
    """Held-out cross-entropy (bits/token) on `valid` of an add-one unigram fitted on `train`."""
    p = _unigram_probs(train, vocab_size)
    return float(-np.log2(p[np.asarray(valid, dtype=np.int64)]).mean())


def _pair_codes(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """a * V + b for each adjacent pair: uint32 while V * V fits (half the memory of the
    sort in _pair_counts), else uint64, which fits for every V <= 2**32."""
    dtype = np.uint32 if vocab_size * vocab_size <= 1 << 32 else np.uint64
    t = np.asarray(tokens, dtype=dtype)
    codes = t[:-1] * dtype(vocab_size)
    codes += t[1:]
    return codes


def _pair_counts(train_codes: np.ndarray, codes: np.ndarray, vocab_size: int) -> np.ndarray:
    """How often each pair code in `codes` occurs in `train_codes` (which it may reorder)."""
    if vocab_size * vocab_size <= 1 << 24:  # byte vocabularies: one dense V*V table
        table = np.bincount(train_codes.astype(np.int64), minlength=vocab_size * vocab_size)
        return table[codes.astype(np.int64)]
    # Large vocabularies: sorted unique pairs instead of a V*V table. The codes are sorted
    # in place (np.unique would sort a copy of them).
    if train_codes.size == 0:
        return np.zeros(codes.shape, dtype=np.int64)
    train_codes.sort()
    first = np.empty(train_codes.size, dtype=bool)
    first[0] = True
    np.not_equal(train_codes[1:], train_codes[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    uniq = train_codes[starts]
    counts = np.diff(np.append(starts, train_codes.size))
    idx = np.minimum(np.searchsorted(uniq, codes), uniq.size - 1)
    return np.where(uniq[idx] == codes, counts[idx], 0)


def _bigram_terms(
    train: np.ndarray, valid: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per predicted valid token: (ML bigram prob or 0, whether its context was seen, unigram)."""
    uni = _unigram_probs(train, vocab_size)
    train_codes = _pair_codes(train, vocab_size)
    valid_codes = _pair_codes(valid, vocab_size)
    ctx = np.asarray(valid[:-1], dtype=np.int64)
    nxt = np.asarray(valid[1:], dtype=np.int64)
    # Context counts: how often each id is followed by anything in train.
    ctx_counts = token_counts(np.asarray(train[:-1]), vocab_size)
    pair_counts = _pair_counts(train_codes, valid_codes, vocab_size)
    c = ctx_counts[ctx]
    seen = c > 0
    ml = np.where(seen, pair_counts / np.maximum(c, 1), 0.0)
    return ml, seen, uni[nxt]


def bigram_bits(
    train: np.ndarray, valid: np.ndarray, vocab_size: int, lam: float | None = None
) -> float:
    """Held-out cross-entropy (bits/token) on `valid` of an interpolated bigram fitted on `train`.

    ``p(b | a) = lam * count(a, b) / count(a) + (1 - lam) * unigram(b)`` with the add-one
    unigram; a context never seen in train uses the unigram alone, and so does the first
    valid token (no context). Every probability is > 0, so the result is finite.

    With ``lam=None`` the weight is chosen from BIGRAM_LAMBDAS by fitting counts on the first
    90% of `train` and scoring the last 10% (train only; valid is never looked at), then the
    counts are refitted on all of `train`.
    """
    if lam is None:
        lam = choose_bigram_lambda(train, vocab_size)
    ml, seen, uni = _bigram_terms(train, valid, vocab_size)
    p = np.where(seen, lam * ml + (1.0 - lam) * uni, uni)
    first = _unigram_probs(train, vocab_size)[int(valid[0])]
    total = -np.log2(p).sum() - math.log2(first)
    return float(total / len(valid))


def choose_bigram_lambda(train: np.ndarray, vocab_size: int) -> float:
    """Interpolation weight from BIGRAM_LAMBDAS that scores best on a train-only held-out tail."""
    cut = len(train) * 9 // 10
    if cut < 2 or len(train) - cut < 2:
        return 0.9
    fit, held = train[:cut], train[cut:]
    ml, seen, uni = _bigram_terms(fit, held, vocab_size)
    best, best_bits = 0.9, math.inf
    for lam in BIGRAM_LAMBDAS:
        bits = -np.log2(np.where(seen, lam * ml + (1.0 - lam) * uni, uni)).sum()
        if bits < best_bits:
            best, best_bits = lam, bits
    return best


def gzip_bits(valid: np.ndarray, vocab_size: int) -> float:
    """Bits per token of ``gzip -9`` on the valid.bin bytes (mtime 0 for repeatability)."""
    data = np.ascontiguousarray(np.asarray(valid).astype(token_dtype(vocab_size), copy=False))
    return 8.0 * len(gzip.compress(data.tobytes(), compresslevel=9, mtime=0)) / len(valid)


def baselines(train: np.ndarray, valid: np.ndarray, vocab_size: int) -> dict[str, float]:
    """All baselines on `valid`, fitted on `train`, in bits per token (keys BASELINE_NAMES)."""
    return {
        "unigram": unigram_bits(train, valid, vocab_size),
        "bigram": bigram_bits(train, valid, vocab_size),
        "gzip9": gzip_bits(valid, vocab_size),
    }


@dataclass(frozen=True)
class HeldOutScores:
    """The baselines on valid.bin in both units; `valid_bytes` is the decoded text's size."""

    per_token: dict[str, float]
    per_byte: dict[str, float]
    valid_bytes: int


def held_out_scores(
    train: np.ndarray, valid: np.ndarray, decoding: Sequence[bytes]
) -> HeldOutScores:
    """All baselines on `valid`, fitted on `train`, in bits per token and bits per byte.

    gzip -9 compresses the text valid.bin decodes to (for the byte vocabulary: the
    valid.bin bytes themselves), so its bits per byte need no vocabulary; its bits per token
    are the same total over the token count. The model baselines' totals go the other way.
    """
    vocab_size = len(decoding)
    text = decode_tokens(valid, decoding)
    if not text:
        raise ValueError("valid.bin decodes to no text: bits per byte are undefined")
    gzip_total = 8.0 * len(gzip.compress(text, compresslevel=9, mtime=0))
    per_token = {
        "unigram": unigram_bits(train, valid, vocab_size),
        "bigram": bigram_bits(train, valid, vocab_size),
        "gzip9": gzip_total / len(valid),
    }
    # tokens / bytes is exactly 1.0 for the byte vocabulary: both units then coincide.
    ratio = len(valid) / len(text)
    per_byte = {
        "unigram": per_token["unigram"] * ratio,
        "bigram": per_token["bigram"] * ratio,
        "gzip9": gzip_total / len(text),
    }
    return HeldOutScores(per_token=per_token, per_byte=per_byte, valid_bytes=len(text))


def data_meta(
    train: np.ndarray,
    valid: np.ndarray,
    decoding: Sequence[bytes],
    source: str,
    documents: int,
    valid_documents: int,
) -> DataMeta:
    """meta.json of a split data set: its sizes, digest and baselines (rounded to 6 places)."""
    vocab = len(decoding)
    scores = held_out_scores(train, valid, decoding)
    return DataMeta(
        format_version=FORMAT_VERSION,
        vocab_size=vocab,
        train_tokens=len(train),
        valid_tokens=len(valid),
        sha256=tokens_digest(train, valid, vocab).hex(),
        source=source,
        documents=documents,
        valid_documents=valid_documents,
        baselines={k: round(v, 6) for k, v in scores.per_token.items()},
        baselines_per_byte={k: round(v, 6) for k, v in scores.per_byte.items()},
        valid_bytes=scores.valid_bytes,
        ids_by_frequency=ranked_by_frequency(train, vocab),
    )


def ranked_by_frequency(train: np.ndarray, vocab_size: int) -> bool:
    """Whether ids 1.. are in order of falling count in `train` (ties in any order)."""
    counts = token_counts(train, vocab_size)[1:]
    return bool(np.all(counts[1:] <= counts[:-1]))

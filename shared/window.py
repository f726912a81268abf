"""Which tokens each evaluation reads: a pure function of (config, step, pair), so every
backend scores the same windows by importing this module. Also the held-out prompts that
samples of the model's writing start from."""

from __future__ import annotations

import numpy as np

from .config import RunConfig
from .noise import window_offsets


def pair_windows(cfg: RunConfig, train: np.ndarray, step: int, pairs: np.ndarray) -> np.ndarray:
    """Each pair's seq_len + 1 tokens (P, T + 1), at a hashed offset into the train split."""
    span = len(train) - cfg.es.seq_len
    if span < 1:
        raise ValueError(f"train split has {len(train)} tokens; seq_len needs > {cfg.es.seq_len}")
    start = window_offsets(cfg.data.data_seed, step, pairs, span)
    return train[start[:, None] + np.arange(cfg.es.seq_len + 1)]


# The long-stream metric cuts the held-out span into this many contiguous streams: with the
# presets' max_tokens (32,768 and 102,400) each stream is 2,048 or 6,400 tokens long, read with
# the recurrent state carried, while the batch of streams still amortises each step.
VALIDATION_STREAMS = 16


def validation_targets(cfg: RunConfig, valid: np.ndarray) -> int:
    """How many held-out tokens validation predicts: whole windows of seq_len, at most
    `validation.max_tokens` tokens' worth (at least one window). Both held-out metrics
    predict the same tokens, valid[1 : targets + 1]."""
    t = cfg.es.seq_len
    rows = (len(valid) - 1) // t
    if cfg.validation.max_tokens:
        rows = min(rows, max(1, cfg.validation.max_tokens // t))
    if rows < 1:
        raise ValueError(f"valid split has {len(valid)} tokens; seq_len needs > {t}")
    return rows * t


def validation_windows(cfg: RunConfig, valid: np.ndarray) -> np.ndarray:
    """The held-out windows (rows, T + 1): seq_len + 1 tokens at stride seq_len from the start
    of valid.bin, at most `validation.max_tokens` tokens' worth of rows."""
    t = cfg.es.seq_len
    rows = validation_targets(cfg, valid) // t
    return valid[np.arange(rows)[:, None] * t + np.arange(t + 1)]


def validation_streams(
    cfg: RunConfig, valid: np.ndarray, streams: int = VALIDATION_STREAMS
) -> tuple[np.ndarray, np.ndarray]:
    """The span of the validation windows cut into `streams` contiguous streams (fewer if it
    has fewer tokens), so that they predict exactly the windows' target tokens.

    Returns (tokens (S, L + 1), lengths (S,)): stream i reads tokens[i, :lengths[i]] one by
    one and predicts tokens[i, 1 : lengths[i] + 1]. Lengths differ by at most one, longest
    first, so the streams still reading at any position are a prefix of the rows; a shorter
    stream's last column is padding (0) that is never read.
    """
    targets = validation_targets(cfg, valid)
    count = min(streams, targets)
    lengths = np.full(count, targets // count, dtype=np.int64)
    lengths[: targets % count] += 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    offset = np.arange(int(lengths[0]) + 1)
    inside = offset[None, :] <= lengths[:, None]
    index = np.where(inside, starts[:, None] + offset[None, :], 0)
    return np.where(inside, valid[index], 0).astype(valid.dtype), lengths


def held_out_prompt(valid: np.ndarray, index: int, length: int) -> list[int]:
    """The first `length` tokens of held-out document `index` (modulo their number), where
    token 0 separates documents; without separators, the window at `index * length`."""
    starts = np.flatnonzero(valid == 0) + 1
    starts = starts[starts < len(valid)]
    if len(starts) == 0:
        first = index * length % max(1, len(valid) - length)
        return [int(t) for t in valid[first : first + length]]
    first = int(starts[index % len(starts)])
    window = valid[first : first + length]
    end = np.flatnonzero(window == 0)
    return [int(t) for t in window[: end[0] if len(end) else length]]


def data_too_short(cfg: RunConfig, train_tokens: int, valid_tokens: int) -> str | None:
    """Why splits of these sizes cannot feed `cfg`'s windows (one line), or None."""
    need = cfg.es.seq_len + 1
    splits = (("train", train_tokens), ("valid", valid_tokens))
    short = [f"the {name} split has {n:,} tokens" for name, n in splits if n < need]
    if not short:
        return None
    return (
        f"{' and '.join(short)}; windows of seq_len {cfg.es.seq_len} need at least {need:,} "
        "in each: prepare more text"
    )


def step_tokens(cfg: RunConfig) -> int:
    """Tokens one step's windows read: a train split shorter than this is read over and over
    within every step, and the model learns it by heart."""
    return cfg.pairs * (cfg.es.seq_len + 1)

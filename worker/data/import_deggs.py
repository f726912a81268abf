"""`eggroll-data import`: turn a d-eggs data directory into an eggroll one.

A d-eggs directory holds ``input.bin`` (headerless token ids: uint8 for a 256-token
vocabulary, else little-endian uint32) and ``decoding.bin`` (u32 count, then per token u32
length + bytes). The vocabulary size is decoding.bin's count; every id is checked against it.

The held-out split is cut from the end of input.bin: the last ``valid_fraction`` of its
tokens, moved to the nearest document start when the ids hold separators (id 0, as
everywhere in eggroll), so that valid.bin begins a document. input.bin keeps the rest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...shared.atomic_file import write_atomic
from ...shared.data import (
    DECODING_FILE,
    INPUT_FILE,
    META_FILE,
    TOKENIZER_FILE,
    VALID_FILE,
    DataError,
    DataMeta,
    read_decoding,
    token_dtype,
    write_decoding,
    write_meta,
)
from .baselines import data_meta

__all__ = ["check_ids", "import_cut", "import_data_dir"]

_SCAN_TOKENS = 1 << 24  # ids checked per block, so a large input.bin is never copied whole


def check_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise DataError naming the first id >= vocab_size and where it is."""
    itemsize = tokens.dtype.itemsize
    for start in range(0, len(tokens), _SCAN_TOKENS):
        bad = np.flatnonzero(tokens[start : start + _SCAN_TOKENS] >= vocab_size)
        if bad.size:
            i = start + int(bad[0])
            raise DataError(
                f"{where}: token {i:,} (byte offset {i * itemsize:,}) is id {int(tokens[i]):,}, "
                f"not below the vocabulary size {vocab_size:,} that decoding.bin gives"
            )


def import_cut(tokens: np.ndarray, valid_fraction: float) -> int:
    """Index where valid.bin starts: the last `valid_fraction` of the tokens, moved to the
    nearest separator (id 0) after the first token when there is one."""
    n = len(tokens)
    if n < 2:
        raise DataError(f"input.bin has {n} token(s): at least 2 are needed to hold one out")
    target = n - min(n - 1, max(1, round(n * valid_fraction)))
    starts = [
        start + np.flatnonzero(tokens[start : start + _SCAN_TOKENS] == 0)
        for start in range(0, n, _SCAN_TOKENS)
    ]
    seps = np.concatenate(starts)
    seps = seps[seps > 0]
    if seps.size == 0:
        return target
    return int(seps[np.argmin(np.abs(seps - target))])


def _documents(tokens: np.ndarray) -> int:
    """Documents in a token run: its separators, plus one if it does not start with one."""
    seps = sum(
        int(np.count_nonzero(tokens[s : s + _SCAN_TOKENS] == 0))
        for s in range(0, len(tokens), _SCAN_TOKENS)
    )
    return seps + int(len(tokens) > 0 and tokens[0] != 0)


def import_data_dir(
    src: Path | str, out: Path | str | None, source: str, valid_fraction: float
) -> DataMeta:
    """Check `src`'s input.bin against its decoding.bin, cut the held-out split and write
    the eggroll data directory into `out` (default `src` itself, where input.bin then
    shrinks to the train part). meta.json is written last."""
    src = Path(src)
    root = Path(out) if out is not None else src
    if not src.is_dir():
        raise DataError(f"{src} is not a directory: give a d-eggs data directory")
    for name in (INPUT_FILE, DECODING_FILE):
        if not (src / name).is_file():
            raise DataError(f"{src} has no {name}: a d-eggs data directory holds both")
    if root.resolve() == src.resolve() and (src / VALID_FILE).exists():
        raise DataError(
            f"{src} already has {VALID_FILE}: it was imported before (its input.bin lost that "
            f"tail); give --out to import a d-eggs directory elsewhere"
        )
    pieces = read_decoding(src / DECODING_FILE)
    vocab = len(pieces)
    if vocab == 0:
        raise DataError(f"{src / DECODING_FILE} holds no tokens")
    dtype = token_dtype(vocab)
    path = src / INPUT_FILE
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise DataError(
            f"{path} has {size:,} bytes, not a non-zero multiple of {dtype.itemsize} (the id "
            f"size for {vocab:,} tokens in decoding.bin)"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    check_ids(tokens, vocab, str(path))
    cut = import_cut(tokens, valid_fraction)
    train, valid = tokens[:cut], tokens[cut:]
    documents = _documents(train) + _documents(valid)
    meta = data_meta(train, valid, pieces, source, documents, _documents(valid))
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / VALID_FILE, memoryview(np.ascontiguousarray(valid)).cast("B"))
    write_decoding(root / DECODING_FILE, pieces)
    # The map stays valid when input.bin is replaced under it (a new file, a rename).
    write_atomic(root / INPUT_FILE, memoryview(np.ascontiguousarray(train)).cast("B"))
    del tokens, train, valid
    if root.resolve() != src.resolve():
        (root / TOKENIZER_FILE).unlink(missing_ok=True)  # from an earlier build there
    write_meta(root / META_FILE, meta)
    return meta

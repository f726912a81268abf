"""`eggroll-data import`: turn a d-eggs data directory into an eggroll one.

A d-eggs directory holds ``input.bin`` (headerless token ids: uint8 for a 256-token
vocabulary, else little-endian uint32) and ``decoding.bin`` (u32 count, then per token u32
length + bytes). The vocabulary size is decoding.bin's count; every id is checked against it.

The held-out split is cut from the end of input.bin: the last ``valid_fraction`` of its
tokens, moved to the nearest document start when the ids hold separators (id 0, as
everywhere in eggroll), so that valid.bin begins a document. input.bin keeps the rest.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from ...shared.atomic_file import fsync_dir, naming, write_atomic
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
from ...shared.logs import os_error_text
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


def _replace_source_last(root: Path, train: memoryview, meta: DataMeta) -> None:
    """In place: write the train part beside input.bin, then meta.json, then rename it over
    input.bin, the one step that takes no room; up to it, the source is untouched. (With
    meta.json in and input.bin not yet cut, load_data_dir refuses the directory: its size
    disagrees with meta.json.) The map of input.bin stays valid across the rename."""
    target = root / INPUT_FILE
    tmp = root / f".{INPUT_FILE}.import.tmp"
    try:
        with naming(target):
            with open(tmp, "wb") as f:
                f.write(train)
                f.flush()
                os.fsync(f.fileno())
        write_meta(root / META_FILE, meta)
        with naming(target):
            os.replace(tmp, target)
            fsync_dir(root)
    finally:
        tmp.unlink(missing_ok=True)


def import_data_dir(
    src: Path | str, out: Path | str | None, source: str, valid_fraction: float
) -> DataMeta:
    """Check `src`'s input.bin against its decoding.bin, cut the held-out split and write
    the eggroll data directory into `out` (default `src` itself, where input.bin then
    shrinks to the train part). meta.json is written last.

    A failed write (a full disk, EIO) is DataError "cannot write PATH: ..." and leaves no
    directory that looks complete: into another directory, its data files are removed; in
    place, input.bin is the source, so its cut replaces it only after everything else is
    written, and until then a failure removes valid.bin and meta.json: the same import
    can simply be run again."""
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
    in_place = root.resolve() == src.resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / META_FILE).unlink(missing_ok=True)  # it must not vouch for new files
        write_atomic(root / VALID_FILE, memoryview(np.ascontiguousarray(valid)).cast("B"))
        write_decoding(root / DECODING_FILE, pieces)
        train_bytes = memoryview(np.ascontiguousarray(train)).cast("B")
        if in_place:
            _replace_source_last(root, train_bytes, meta)
        else:
            write_atomic(root / INPUT_FILE, train_bytes)
            (root / TOKENIZER_FILE).unlink(missing_ok=True)  # from an earlier build there
            write_meta(root / META_FILE, meta)
    except OSError as exc:
        if in_place:
            names = (META_FILE, VALID_FILE)  # input.bin and decoding.bin are the source
        else:
            names = (META_FILE, INPUT_FILE, VALID_FILE, DECODING_FILE, TOKENIZER_FILE)
        for name in names:
            with contextlib.suppress(OSError):
                (root / name).unlink(missing_ok=True)
        raise DataError(f"cannot write {exc.filename or root}: {os_error_text(exc)}") from None
    finally:
        del tokens, train, valid
    return meta

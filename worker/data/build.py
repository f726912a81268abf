"""Build a data directory from documents: the held-out split, the token files, the baselines.

Split. A document goes to valid.bin when ``int.from_bytes(blake2b(doc).digest()[:8],
"big") % 1000 < round(valid_fraction * 1000)``, where ``doc`` is its UTF-8 bytes: a pure
function of the text, so the split is identical on every run and machine. If that leaves
valid (or train) empty, the last train (first valid) document moves across.

Tokens. By default the vocabulary is bytes. With ``--tokenizer bpe`` a byte-level BPE is
trained on the train documents (see ``tokenizer.py``) and the ids are little-endian uint32;
a trained vocabulary is then numbered by frequency in the train split (id 1 the commonest
token; the separator stays 0), which es.token_noise_rows relies on. ``--tokenizer FILE.json``
reuses a tokenizer and its numbering. Either way documents and split are the same,
each document is id 0 followed by its ids, and the text is read twice in blocks (train,
then encode), never held whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ...shared.atomic_file import fsync_dir, naming, write_atomic
from ...shared.config import PRESETS
from ...shared.data import (
    BYTE_VOCAB_SIZE,
    DECODING_FILE,
    INPUT_FILE,
    META_FILE,
    TOKENIZER_FILE,
    VALID_FILE,
    DataError,
    DataMeta,
    byte_pieces,
    concat_documents,
    read_tokens,
    token_dtype,
    write_decoding,
    write_meta,
    write_tokens,
)
from ...shared.progress import Progress, duration_text
from ...shared.window import data_too_short, step_tokens
from .baselines import data_meta, token_counts
from .tokenizer import encode_documents, renumber, tokenizer_pieces, train_bpe

DEFAULT_VALID_FRACTION = 0.05
DEFAULT_BPE_VOCAB_SIZE = 8192

Echo = Callable[[str], None]


def counted(n: int, noun: str) -> str:
    """'1 document', '2,048 documents': a count with its noun, for progress lines."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


# --- split and build -----------------------------------------------------------------


def goes_to_valid(doc: bytes, valid_fraction: float) -> bool:
    """Whether a document belongs to valid.bin: a pure function of its bytes."""
    h = int.from_bytes(hashlib.blake2b(doc).digest()[:8], "big")
    return h % 1000 < round(valid_fraction * 1000)


def fix_split(flags: list[bool]) -> None:
    """Make both splits non-empty: `flags[i]` says whether document i goes to valid.bin.

    If no document hashed into valid, the last one moves there; if all did, the first
    moves to train. Fewer than two documents cannot be split.
    """
    if len(flags) < 2:
        raise DataError(
            f"the input has {counted(len(flags), 'document')}, at least 2 are needed to hold out "
            f"a validation split: give more text files (a file over 64 KiB is cut into "
            f"~16 KiB documents) or use --builtin"
        )
    if not any(flags):
        flags[-1] = True
    elif all(flags):
        flags[0] = False


def split_documents(
    docs: Sequence[bytes], valid_fraction: float = DEFAULT_VALID_FRACTION
) -> tuple[list[bytes], list[bytes]]:
    """(train, valid) documents, each in input order; both non-empty."""
    flags = [goes_to_valid(d, valid_fraction) for d in docs]
    fix_split(flags)
    train = [d for d, v in zip(docs, flags, strict=True) if not v]
    valid = [d for d, v in zip(docs, flags, strict=True) if v]
    return train, valid


def say_baselines(say: Echo, meta: DataMeta) -> None:
    """The baselines of meta.json, one line per unit (token, byte)."""
    for unit, scores in (("token", meta.baselines), ("byte", meta.baselines_per_byte)):
        say(
            f"baselines on valid (bits/{unit}): unigram {scores['unigram']:.4f}, "
            f"bigram {scores['bigram']:.4f}, gzip -9 {scores['gzip9']:.4f}"
        )


def prepare_data_dir(
    docs: Sequence[bytes],
    out: Path | str,
    source: str,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    echo: Echo | None = None,
) -> DataMeta:
    """Split `docs`, compute the baselines and write the four files into `out`.

    The old meta.json goes first and the new one is written last, so an interrupted run
    leaves a directory that load_data_dir rejects instead of one that looks complete; a
    failed write (OSError, naming its file) removes the data files (`discard_data_files`).
    """
    say = echo or (lambda _line: None)
    train_docs, valid_docs = split_documents(docs, valid_fraction)
    train = concat_documents(train_docs)
    valid = concat_documents(valid_docs)
    say(
        f"split: train {counted(len(train_docs), 'document')} / {len(train):,} tokens, "
        f"valid {counted(len(valid_docs), 'document')} / {len(valid):,} tokens"
    )
    meta = data_meta(train, valid, byte_pieces(), source, len(docs), len(valid_docs))
    say_baselines(say, meta)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    (root / META_FILE).unlink(missing_ok=True)  # an old meta.json must not vouch for new files
    try:
        write_tokens(root / INPUT_FILE, train, BYTE_VOCAB_SIZE)
        write_tokens(root / VALID_FILE, valid, BYTE_VOCAB_SIZE)
        write_decoding(root / DECODING_FILE, byte_pieces())
        (root / TOKENIZER_FILE).unlink(missing_ok=True)  # from an earlier tokenized build
        write_meta(root / META_FILE, meta)
    except OSError:
        discard_data_files(root)
        raise
    return meta


def discard_data_files(root: Path) -> None:
    """After a failed write (a full disk, EIO): remove the data files of `root`, meta.json
    first, so nothing there looks complete and the space they took is free for the retry.
    Their old versions go too: without the meta.json they went with, they are no data
    directory. A file that cannot be removed is left (the failed write is what to say)."""
    for name in (META_FILE, INPUT_FILE, VALID_FILE, DECODING_FILE, TOKENIZER_FILE):
        with contextlib.suppress(OSError):
            (root / name).unlink(missing_ok=True)


# --- a trained tokenizer -------------------------------------------------------------

DocSource = Callable[[], Iterator[bytes]]
ENCODE_BATCH_BYTES = 1 << 20


def _reading(say: Echo, what: str, total_bytes: int | None) -> Progress:
    """The progress of one pass over the text: a bar on a terminal, else a line per tenth
    of `total_bytes` (when known) or every few seconds."""
    return Progress(what, total_bytes, "B", say=lambda p: say(p.line()))


def _encode_pass(
    docs: DocSource,
    flags: Sequence[bool],
    tokenizer: Tokenizer,
    pieces: Sequence[bytes],
    root: Path,
    meter: Progress,
) -> None:
    """Encode `docs()` in batches, appending separator + ids to input.bin / valid.bin as
    `flags` says. The files are built under hidden names and renamed when complete; the old
    meta.json goes first, so the directory never looks complete in between."""
    dtype = token_dtype(len(pieces))
    partial = {name: root / f".{name}.partial" for name in (INPUT_FILE, VALID_FILE)}
    batch: list[tuple[bytes, bool]] = []
    try:
        with open(partial[INPUT_FILE], "wb") as train_f, open(partial[VALID_FILE], "wb") as valid_f:

            def flush() -> None:
                encoded = encode_documents(tokenizer, [d for d, _ in batch], pieces)
                for valid, f in ((False, train_f), (True, valid_f)):
                    ids = [
                        t
                        for (_, v), doc_ids in zip(batch, encoded, strict=True)
                        if v == valid
                        for t in (0, *doc_ids)
                    ]
                    if ids:
                        with naming(root / (VALID_FILE if valid else INPUT_FILE)):
                            f.write(np.asarray(ids, dtype).tobytes())
                meter.advance(sum(len(doc) for doc, _ in batch))
                batch.clear()

            size = 0
            for item in zip(docs(), flags, strict=True):
                batch.append(item)
                size += len(item[0])
                if size >= ENCODE_BATCH_BYTES:
                    flush()
                    size = 0
            flush()
            meter.finish()
            for name, f in ((INPUT_FILE, train_f), (VALID_FILE, valid_f)):
                with naming(root / name):
                    f.flush()
                    os.fsync(f.fileno())
        (root / META_FILE).unlink(missing_ok=True)
        for name, path in partial.items():
            os.replace(path, root / name)
    finally:
        for path in partial.values():
            path.unlink(missing_ok=True)


RANK_BLOCK_IDS = 1 << 24  # ids renumbered at once


def _rank_by_frequency(
    root: Path, tokenizer: Tokenizer, pieces: Sequence[bytes]
) -> tuple[Tokenizer, list[bytes]]:
    """Renumber a trained vocabulary so that ids 1.. go by falling count in input.bin (ties
    by the trainer's order; the separator stays 0), rewriting input.bin and valid.bin.
    Frequency-ranked ids let es.token_noise_rows leave rare tokens' rows without noise."""
    vocab = len(pieces)
    dtype = token_dtype(vocab)
    counts = token_counts(np.memmap(root / INPUT_FILE, dtype=dtype, mode="r"), vocab)
    order = np.concatenate([[0], 1 + np.argsort(-counts[1:], kind="stable")])
    new_id = np.empty(vocab, dtype=dtype)
    new_id[order] = np.arange(vocab)
    for name in (INPUT_FILE, VALID_FILE):
        partial = root / f".{name}.partial"
        try:
            ids = np.memmap(root / name, dtype=dtype, mode="r")
            with naming(root / name), open(partial, "wb") as f:
                for lo in range(0, len(ids), RANK_BLOCK_IDS):
                    f.write(new_id[ids[lo : lo + RANK_BLOCK_IDS]].tobytes())
                f.flush()
                os.fsync(f.fileno())
            del ids  # the mapping closes before the file is replaced
            os.replace(partial, root / name)
        finally:
            partial.unlink(missing_ok=True)
    return renumber(tokenizer, order.tolist()), [pieces[i] for i in order]


def prepare_tokenized_data_dir(
    docs: DocSource,
    out: Path | str,
    source: str,
    tokenizer: Tokenizer | None,
    vocab_size: int = DEFAULT_BPE_VOCAB_SIZE,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    echo: Echo | None = None,
    total_bytes: int | None = None,
) -> DataMeta:
    """Tokenize the documents `docs()` yields with `tokenizer` (or a byte-level BPE of
    `vocab_size` trained on the train documents) and write a data directory into `out`.

    Two passes over `docs()`, each one document at a time: the first trains (and fixes the
    split), the second encodes in batches and appends the ids to input.bin / valid.bin.
    The text is never held whole; the token files are read back for the baselines.
    Documents and split are those of the byte vocabulary; each document is id 0 (the
    separator) followed by its ids. Writes tokenizer.json beside the four files.
    `total_bytes`, the size of the text if known, lets progress say how far each pass is.
    """
    say = echo or (lambda _line: None)
    flags: list[bool] = []
    meter = _reading(say, "read", total_bytes)

    def train_texts() -> Iterator[str]:
        for doc in docs():
            flags.append(goes_to_valid(doc, valid_fraction))
            meter.advance(len(doc))
            if not flags[-1]:
                yield doc.decode("utf-8")
        meter.finish()
        if trained:  # what follows the reading takes a while on a large vocabulary
            say(f"merging pairs up to {vocab_size:,} tokens ...")

    trained = tokenizer is None
    if trained:
        say(f"training a byte-level BPE of {vocab_size:,} tokens on the train documents ...")
        tokenizer = train_bpe(train_texts(), vocab_size)
        say(
            f"trained {tokenizer.get_vocab_size(with_added_tokens=True):,} tokens "
            f"in {duration_text(meter.seconds())}"
        )
    else:
        for _ in train_texts():
            pass
    if not flags:
        raise DataError(f"no text found in {source}: the input files are empty")
    fix_split(flags)
    pieces = tokenizer_pieces(tokenizer)
    vocab = len(pieces)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    # A failed write in the encode pass leaves the old directory as it was; after it, the
    # old meta.json is gone and a failed write removes the data files (discard_data_files).
    _encode_pass(docs, flags, tokenizer, pieces, root, _reading(say, "encoded", meter.done))
    try:
        if trained:
            tokenizer, pieces = _rank_by_frequency(root, tokenizer, pieces)
            say("numbered the tokens by their frequency in the train split")
        with naming(root):
            fsync_dir(root)
        train = read_tokens(root / INPUT_FILE, vocab)
        valid = read_tokens(root / VALID_FILE, vocab)
        say(
            f"split: train {counted(flags.count(False), 'document')} / {len(train):,} tokens, "
            f"valid {counted(flags.count(True), 'document')} / {len(valid):,} tokens"
        )
        meta = data_meta(train, valid, pieces, source, len(flags), flags.count(True))
        say_baselines(say, meta)
        write_decoding(root / DECODING_FILE, pieces)
        write_atomic(root / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode("utf-8"))
        write_meta(root / META_FILE, meta)
    except OSError:
        discard_data_files(root)
        raise
    return meta


# --- what data a config needs --------------------------------------------------------


def vocabulary_mismatch(data_dir: Path | str, data_vocab: int, model_vocab: int) -> str | None:
    """Why a model of `model_vocab` tokens cannot train on `data_dir` (one line that names
    the command making suitable data), or None when the vocabularies agree."""
    if data_vocab == model_vocab:
        return None

    def kind(v: int) -> str:
        return "bytes (256 tokens)" if v == BYTE_VOCAB_SIZE else f"a {v:,}-token vocabulary"

    if model_vocab == BYTE_VOCAB_SIZE:
        out, flags = "data/bytes", ""
    else:
        out, flags = f"data/bpe-{model_vocab}", f" --tokenizer bpe --vocab-size {model_vocab}"
    return (
        f"{data_dir} holds {kind(data_vocab)}, the model reads {kind(model_vocab)}: make data "
        f"of its vocabulary with `eggroll-data prepare --builtin{flags} --out {out}` (or your "
        f"text files in place of --builtin), then pass --data-dir {out}"
    )


def size_warnings(train_tokens: int, valid_tokens: int, vocab_size: int) -> list[str]:
    """One line per preset of this vocabulary that these splits are too small for, saying
    what is enough."""
    lines = []
    for name, cfg in PRESETS.items():
        if cfg.model.vocab_size != vocab_size:
            continue
        short = data_too_short(cfg, train_tokens, valid_tokens)
        enough = step_tokens(cfg)
        if short is not None:
            lines.append(f"too little data for the {name} preset: {short}")
        elif train_tokens < enough:
            lines.append(
                f"the train split ({train_tokens:,} tokens) is smaller than what one step of "
                f"the {name} preset reads ({enough:,}): it would learn the text by heart; "
                f"give at least {enough:,} bytes of text for the byte vocabulary (that many "
                f"tokens for another), better a hundred times more"
            )
    return lines

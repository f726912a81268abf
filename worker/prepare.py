"""`eggroll-data`: build a data directory from text, import a d-eggs one, or inspect one.

    eggroll-data prepare notes.txt book.txt --out data/
    eggroll-data prepare --builtin --out data/
    eggroll-data prepare --builtin --tokenizer bpe --vocab-size 8192 --out data/bpe
    eggroll-data prepare more.txt --tokenizer data/bpe/tokenizer.json --out data/more
    eggroll-data import deggs-data/ --out data/deggs
    eggroll-data info data/

Documents. Each document becomes byte 0 (the document separator, as in nano-egg) followed
by the UTF-8 bytes of its text; NUL characters are removed from the text and ``\\r\\n`` is
read as ``\\n``. A text file is one document, unless it is larger than 64 KiB: then it is
cut on blank lines (``\\n\\n``) and the paragraphs are packed, in order, into documents of
at least 16 KiB (the last may be shorter). A paragraph larger than 64 KiB is cut the same
way on single newlines, and a line larger than that into pieces of 16 Ki characters.
Whitespace-only documents are dropped.

The built-in corpus (``--builtin``) exists on every machine with Python and needs no
download: the ``pydoc_data.topics`` texts (one document per topic, sorted by name), then
one document per standard-library module holding its module, class and function
docstrings, read by parsing the sources with ``ast`` (nothing is imported). It depends on
the Python build, so meta.json records the Python version in its source.

Tokens. By default the vocabulary is bytes. With ``--tokenizer bpe`` a byte-level BPE is
trained on the train documents (see ``tokenizer.py``) and the ids are little-endian uint32;
a trained vocabulary is then numbered by frequency in the train split (id 1 the commonest
token; the separator stays 0), which es.token_noise_rows relies on. ``--tokenizer FILE.json``
reuses a tokenizer and its numbering. Either way documents and split are the same,
each document is id 0 followed by its ids, and the text is read twice in blocks (train,
then encode), never held whole.

Split. A document goes to valid.bin when ``int.from_bytes(blake2b(doc).digest()[:8],
"big") % 1000 < round(valid_fraction * 1000)``, where ``doc`` is its UTF-8 bytes: a pure
function of the text, so the split is identical on every run and machine. If that leaves
valid (or train) empty, the last train (first valid) document moves across.
"""

from __future__ import annotations

import ast
import codecs
import hashlib
import os
import platform
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import click
import numpy as np
from tokenizers import Tokenizer

from ..shared.atomic_file import fsync_dir, write_atomic
from ..shared.cli import OneLineError, command
from ..shared.config import PRESETS
from ..shared.data import (
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
    load_data_dir,
    read_tokens,
    token_dtype,
    write_decoding,
    write_meta,
    write_tokens,
)
from ..shared.window import data_too_short, step_tokens
from .baselines import BASELINE_NAMES, data_meta, token_counts
from .import_deggs import import_data_dir
from .tokenizer import encode_documents, load_tokenizer, renumber, tokenizer_pieces, train_bpe

SPLIT_ABOVE_BYTES = 64 * 1024
DOC_TARGET_BYTES = 16 * 1024
BUILTIN_CAP_BYTES = 8 * 1024 * 1024
DEFAULT_VALID_FRACTION = 0.05
DEFAULT_BPE_VOCAB_SIZE = 8192
# Standard-library folders that hold tests, third-party code or no Python sources.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages", "lib-dynload"}
)

Echo = Callable[[str], None]


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


# --- documents from text files -------------------------------------------------------


def _clean(text: str) -> str:
    return text.replace("\x00", "").replace("\r\n", "\n")


def split_text(text: str) -> list[str]:
    """Documents of one file's text: itself, or ~16 KiB pieces when it is over 64 KiB."""
    if len(text.encode("utf-8")) <= SPLIT_ABOVE_BYTES:
        return [text]
    return _split(text, ("\n\n", "\n"))


def _split(text: str, separators: tuple[str, ...]) -> list[str]:
    if not separators:
        return [text[i : i + DOC_TARGET_BYTES] for i in range(0, len(text), DOC_TARGET_BYTES)]
    sep, finer = separators[0], separators[1:]
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for unit in text.split(sep):
        n = len(unit.encode("utf-8"))
        if n > SPLIT_ABOVE_BYTES:
            # Too big to pack: flush what we have and cut this unit on a finer separator.
            if current:
                docs.append(sep.join(current))
                current, size = [], 0
            docs.extend(_split(unit, finer))
            continue
        current.append(unit)
        size += n + len(sep)
        if size >= DOC_TARGET_BYTES:
            docs.append(sep.join(current))
            current, size = [], 0
    if current:
        docs.append(sep.join(current))
    return docs


def _check_input(path: Path) -> None:
    if not path.exists():
        raise DataError(f"input file {path} does not exist")
    if path.is_dir():
        raise DataError(f"input {path} is a directory: give the text files inside it")


def _not_utf8(path: Path, offset: int) -> DataError:
    return DataError(
        f"input file {path} is not UTF-8 text (bad byte at offset {offset}): "
        f"convert it first, e.g. `iconv -f latin1 -t utf-8`"
    )


def file_documents(path: Path | str) -> list[bytes]:
    """The documents of one UTF-8 text file (see the module docstring for the rule)."""
    path = Path(path)
    _check_input(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        # The offset counts from the start of the file, a byte order mark included.
        bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
        raise _not_utf8(path, bom + e.start) from None
    return [d.encode("utf-8") for d in split_text(_clean(text)) if d.strip()]


# The same documents, read in blocks: a file much larger than memory never is read whole.


class _Cutter:
    """The finest split of :func:`_split`: pieces of DOC_TARGET_BYTES characters."""

    def __init__(self) -> None:
        self.buf = ""

    def feed(self, text: str) -> Iterator[str]:
        buf = self.buf + text
        i = 0
        while len(buf) - i >= DOC_TARGET_BYTES:
            yield buf[i : i + DOC_TARGET_BYTES]
            i += DOC_TARGET_BYTES
        self.buf = buf[i:]

    def end(self) -> Iterator[str]:
        if self.buf:
            yield self.buf
        self.buf = ""


class _Packer:
    """One level of :func:`_split` over a text that arrives in pieces: units between `sep`
    packed into documents, a unit over SPLIT_ABOVE_BYTES streamed into the finer level."""

    def __init__(self, seps: tuple[str, ...]) -> None:
        self.sep, self.finer_seps = seps[0], seps[1:]
        self.current: list[str] = []  # packed units of the document being built
        self.size = 0
        self.unit: list[str] = []  # pieces of the unit being read (while it is small)
        self.unit_bytes = 0
        self.finer: _Packer | _Cutter | None = None  # while the unit is large
        self.tail = ""  # a trailing partial separator, held until the next piece

    def _make_finer(self) -> _Packer | _Cutter:
        return _Packer(self.finer_seps) if self.finer_seps else _Cutter()

    def feed(self, text: str) -> Iterator[str]:
        text = self.tail + text
        self.tail = ""
        pos = 0
        while (i := text.find(self.sep, pos)) >= 0:
            yield from self._add(text[pos:i])
            yield from self._end_unit()
            pos = i + len(self.sep)
        rest = text[pos:]
        # The next piece may complete a separator that starts at the end of this one.
        for k in range(len(self.sep) - 1, 0, -1):
            if rest.endswith(self.sep[:k]):
                rest, self.tail = rest[:-k], rest[-k:]
                break
        yield from self._add(rest)

    def end(self) -> Iterator[str]:
        yield from self._add(self.tail)
        self.tail = ""
        yield from self._end_unit()
        if self.current:
            yield self.sep.join(self.current)
        self.current, self.size = [], 0

    def _add(self, piece: str) -> Iterator[str]:
        if self.finer is not None:
            yield from self.finer.feed(piece)
            return
        self.unit.append(piece)
        self.unit_bytes += len(piece.encode("utf-8"))
        if self.unit_bytes > SPLIT_ABOVE_BYTES:
            # Too big to pack: flush what we have and cut this unit on a finer separator.
            if self.current:
                yield self.sep.join(self.current)
                self.current, self.size = [], 0
            self.finer = self._make_finer()
            unit, self.unit, self.unit_bytes = "".join(self.unit), [], 0
            yield from self.finer.feed(unit)

    def _end_unit(self) -> Iterator[str]:
        if self.finer is not None:
            yield from self.finer.end()
            self.finer = None
            return
        self.current.append("".join(self.unit))
        self.size += self.unit_bytes + len(self.sep)
        self.unit, self.unit_bytes = [], 0
        if self.size >= DOC_TARGET_BYTES:
            yield self.sep.join(self.current)
            self.current, self.size = [], 0


def _clean_blocks(path: Path, block_bytes: int) -> Iterator[str]:
    """The cleaned text of `path` (as _clean gives it), decoded block by block."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file handed to the decoder so far
    at_start = True  # a byte order mark is dropped only as the first character
    held = ""  # a trailing "\r" that may start a "\r\n" in the next block
    with open(path, "rb") as f:
        while True:
            block = f.read(block_bytes)
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise _not_utf8(path, offset - pending + e.start) from None
            offset += len(block)
            if at_start and text:
                text = text.removeprefix("\ufeff")
                at_start = False
            text = held + text.replace("\x00", "")
            held = ""
            if block and text.endswith("\r"):
                text, held = text[:-1], "\r"
            if text:
                yield text.replace("\r\n", "\n")
            if not block:
                return


def iter_file_documents(path: Path | str, block_bytes: int = 1 << 20) -> Iterator[bytes]:
    """:func:`file_documents`, one document at a time, reading `block_bytes` at a time."""
    path = Path(path)
    _check_input(path)
    blocks = _clean_blocks(path, block_bytes)
    head: list[str] = []  # the text while it may still be one whole document
    size = 0
    for text in blocks:
        head.append(text)
        size += len(text.encode("utf-8"))
        if size > SPLIT_ABOVE_BYTES:
            break
    else:
        whole = "".join(head)
        if whole.strip():
            yield whole.encode("utf-8")
        return
    packer = _Packer(("\n\n", "\n"))
    for text in head:
        for doc in packer.feed(text):
            if doc.strip():
                yield doc.encode("utf-8")
    del head
    for text in blocks:
        for doc in packer.feed(text):
            if doc.strip():
                yield doc.encode("utf-8")
    for doc in packer.end():
        if doc.strip():
            yield doc.encode("utf-8")


def _files_documents(paths: Sequence[Path]) -> Iterator[bytes]:
    for path in paths:
        yield from iter_file_documents(path)


# --- the built-in corpus -------------------------------------------------------------


def builtin_source() -> str:
    """meta.json source of the built-in corpus; it names the Python version it came from."""
    return f"builtin:python-{platform.python_version()}-docs"


def _topic_documents() -> list[bytes]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package pydoc_data separately
        return []
    docs = (_clean(topics[key]) for key in sorted(topics))
    return [d.encode("utf-8") for d in docs if d.strip()]


def _docstrings(node: ast.AST, prefix: str) -> Iterator[str]:
    """Class and function docstrings under `node`, in source order, with qualified names."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{child.name}"
            doc = ast.get_docstring(child, clean=True)
            if doc and doc.strip():
                kind = "class" if isinstance(child, ast.ClassDef) else "def"
                yield f"{kind} {name}\n{doc}"
            yield from _docstrings(child, f"{name}.")
        else:
            # Definitions nested in if/try blocks (platform variants) count too.
            yield from _docstrings(child, prefix)


def _module_document(path: Path, module: str) -> str | None:
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes
            tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return None  # unreadable or not Python 3: not part of the corpus
    parts = [module]
    doc = ast.get_docstring(tree, clean=True)
    if doc and doc.strip():
        parts.append(doc)
    parts.extend(_docstrings(tree, ""))
    return "\n\n".join(parts) if len(parts) > 1 else None


def stdlib_modules(stdlib_dir: Path | str | None = None) -> Iterator[tuple[Path, str]]:
    """(path, dotted module name) of every stdlib .py file, in sorted order, tests skipped."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's order; pruning skips tests and installed packages.
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        rel = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            parts = [*rel.parts, name[:-3]]
            if parts[-1] == "__init__":
                parts.pop()
            yield Path(dirpath) / name, ".".join(parts) or "__init__"


def builtin_documents(cap_bytes: int = BUILTIN_CAP_BYTES) -> list[bytes]:
    """The built-in corpus, at most `cap_bytes` of text: the first documents that fit."""
    docs = _topic_documents()
    for path, module in stdlib_modules():
        text = _module_document(path, module)
        if text is not None:
            docs.append(_clean(text).encode("utf-8"))
    kept: list[bytes] = []
    total = 0
    for doc in docs:
        total += 1 + len(doc)
        if total > cap_bytes:
            break
        kept.append(doc)
    return kept


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
            f"the input has {_count(len(flags), 'document')}, at least 2 are needed to hold out "
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


def _say_baselines(say: Echo, meta: DataMeta) -> None:
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

    meta.json is written last, so an interrupted run leaves a directory that
    load_data_dir rejects instead of one that looks complete.
    """
    say = echo or (lambda _line: None)
    train_docs, valid_docs = split_documents(docs, valid_fraction)
    train = concat_documents(train_docs)
    valid = concat_documents(valid_docs)
    say(
        f"split: train {_count(len(train_docs), 'document')} / {len(train):,} tokens, "
        f"valid {_count(len(valid_docs), 'document')} / {len(valid):,} tokens"
    )
    meta = data_meta(train, valid, byte_pieces(), source, len(docs), len(valid_docs))
    _say_baselines(say, meta)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    write_tokens(root / INPUT_FILE, train, BYTE_VOCAB_SIZE)
    write_tokens(root / VALID_FILE, valid, BYTE_VOCAB_SIZE)
    write_decoding(root / DECODING_FILE, byte_pieces())
    (root / TOKENIZER_FILE).unlink(missing_ok=True)  # from an earlier tokenized build
    write_meta(root / META_FILE, meta)
    return meta


# --- a trained tokenizer -------------------------------------------------------------

DocSource = Callable[[], Iterator[bytes]]
PROGRESS_EVERY_BYTES = 16 << 20
ENCODE_BATCH_BYTES = 1 << 20


class _Meter:
    """Progress lines while a pass over the text runs: one per PROGRESS_EVERY_BYTES."""

    def __init__(self, say: Echo, what: str) -> None:
        self.say, self.what = say, what
        self.docs = self.bytes = 0
        self.next = PROGRESS_EVERY_BYTES
        self.start = time.monotonic()

    def add(self, n: int) -> None:
        self.docs += 1
        self.bytes += n
        if self.bytes >= self.next:
            self.next += PROGRESS_EVERY_BYTES
            self.line()

    def line(self) -> None:
        self.say(
            f"{self.what} {self.bytes / 1e6:,.1f} MB of text ({_count(self.docs, 'document')}), "
            f"{time.monotonic() - self.start:.1f} s"
        )


def _encode_pass(
    docs: DocSource,
    flags: Sequence[bool],
    tokenizer: Tokenizer,
    pieces: Sequence[bytes],
    root: Path,
    meter: _Meter,
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
                        f.write(np.asarray(ids, dtype).tobytes())
                for doc, _ in batch:
                    meter.add(len(doc))
                batch.clear()

            size = 0
            for item in zip(docs(), flags, strict=True):
                batch.append(item)
                size += len(item[0])
                if size >= ENCODE_BATCH_BYTES:
                    flush()
                    size = 0
            flush()
            for f in (train_f, valid_f):
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
            with open(partial, "wb") as f:
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
) -> DataMeta:
    """Tokenize the documents `docs()` yields with `tokenizer` (or a byte-level BPE of
    `vocab_size` trained on the train documents) and write a data directory into `out`.

    Two passes over `docs()`, each one document at a time: the first trains (and fixes the
    split), the second encodes in batches and appends the ids to input.bin / valid.bin.
    The text is never held whole; the token files are read back for the baselines.
    Documents and split are those of the byte vocabulary; each document is id 0 (the
    separator) followed by its ids. Writes tokenizer.json beside the four files.
    """
    say = echo or (lambda _line: None)
    flags: list[bool] = []
    meter = _Meter(say, "read")

    def train_texts() -> Iterator[str]:
        for doc in docs():
            flags.append(goes_to_valid(doc, valid_fraction))
            meter.add(len(doc))
            if not flags[-1]:
                yield doc.decode("utf-8")

    trained = tokenizer is None
    if trained:
        say(f"training a byte-level BPE of {vocab_size:,} tokens on the train documents ...")
        tokenizer = train_bpe(train_texts(), vocab_size)
        meter.line()
        say(f"trained {tokenizer.get_vocab_size(with_added_tokens=True):,} tokens")
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
    _encode_pass(docs, flags, tokenizer, pieces, root, _Meter(say, "encoded"))
    if trained:
        tokenizer, pieces = _rank_by_frequency(root, tokenizer, pieces)
        say("numbered the tokens by their frequency in the train split")
    fsync_dir(root)
    train = read_tokens(root / INPUT_FILE, vocab)
    valid = read_tokens(root / VALID_FILE, vocab)
    say(
        f"split: train {_count(flags.count(False), 'document')} / {len(train):,} tokens, "
        f"valid {_count(flags.count(True), 'document')} / {len(valid):,} tokens"
    )
    meta = data_meta(train, valid, pieces, source, len(flags), flags.count(True))
    _say_baselines(say, meta)
    write_decoding(root / DECODING_FILE, pieces)
    write_atomic(root / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode("utf-8"))
    write_meta(root / META_FILE, meta)
    return meta


# --- CLI -----------------------------------------------------------------------------


def _progress(line: str) -> None:
    click.echo(line, err=True)


@command(group=True)
def main() -> None:
    """Build and inspect eggroll data directories (input.bin, valid.bin, decoding.bin,
    meta.json)."""


@main.command()
@click.argument("text_files", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Data directory to write (created if needed; its four files are replaced).",
)
@click.option(
    "--builtin",
    is_flag=True,
    help="Use the built-in corpus (Python's pydoc topics and stdlib docstrings).",
)
@click.option(
    "--valid-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
    default=DEFAULT_VALID_FRACTION,
    show_default=True,
    help="Share of documents held out in valid.bin (chosen by a hash of their text).",
)
@click.option(
    "--tokenizer",
    "tokenizer_arg",
    default=None,
    metavar="bpe|FILE.json",
    help="bpe: train a byte-level BPE on the train documents; FILE.json: use that "
    "tokenizer (id 0 a special token, byte-level pieces). Default: the byte vocabulary.",
)
@click.option(
    "--vocab-size",
    type=click.IntRange(min=1),
    default=None,
    help=f"Tokens of the trained BPE, separator and 256 bytes included "
    f"[default: {DEFAULT_BPE_VOCAB_SIZE}].",
)
def prepare(
    text_files: tuple[Path, ...],
    out: Path,
    builtin: bool,
    valid_fraction: float,
    tokenizer_arg: str | None,
    vocab_size: int | None,
) -> None:
    """Tokenize TEXT_FILES (UTF-8) or the built-in corpus into --out: as bytes, or with a
    BPE tokenizer (--tokenizer)."""
    if builtin and text_files:
        raise OneLineError("give text files or --builtin, not both")
    if not builtin and not text_files:
        raise OneLineError(
            "nothing to prepare: give text files, or --builtin for the built-in corpus"
        )
    if vocab_size is not None and tokenizer_arg != "bpe":
        raise OneLineError("--vocab-size sets the size of a trained BPE: add --tokenizer bpe")
    start = time.monotonic()
    try:
        if builtin:
            source = builtin_source()
            _progress(f"gathering the built-in corpus ({source}) ...")
            builtin_docs = builtin_documents()
        if tokenizer_arg is not None:
            tokenizer = None if tokenizer_arg == "bpe" else load_tokenizer(tokenizer_arg)
            if builtin:
                docs: DocSource = builtin_docs.__iter__
            else:
                source = ", ".join(p.name for p in text_files)
                docs = partial(_files_documents, text_files)
            meta = prepare_tokenized_data_dir(
                docs,
                out,
                source,
                tokenizer,
                vocab_size or DEFAULT_BPE_VOCAB_SIZE,
                valid_fraction,
                echo=_progress,
            )
        else:
            if builtin:
                all_docs = builtin_docs
            else:
                source = ", ".join(p.name for p in text_files)
                all_docs = [d for p in text_files for d in file_documents(p)]
            if not all_docs:
                raise DataError(f"no text found in {source}: the input files are empty")
            total = sum(len(d) for d in all_docs)
            _progress(f"gathered {_count(len(all_docs), 'document')}, {total:,} bytes of text")
            meta = prepare_data_dir(all_docs, out, source, valid_fraction, echo=_progress)
    except DataError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        where = e.filename or out
        raise click.ClickException(f"cannot use {where}: {e.strerror or e}") from None
    _summary(out, meta, time.monotonic() - start)


def _summary(out: Path, meta: DataMeta, elapsed: float) -> None:
    """The one stdout line of prepare and import, then the size warnings on stderr."""
    b, bb = meta.baselines, meta.baselines_per_byte
    click.echo(
        f"wrote {out}: {meta.train_tokens:,} train + {meta.valid_tokens:,} valid tokens "
        f"(vocab {meta.vocab_size:,}), sha256 {meta.sha256[:16]}, unigram {b['unigram']:.3f} / "
        f"bigram {b['bigram']:.3f} / gzip9 {b['gzip9']:.3f} bits/token = "
        f"{bb['unigram']:.3f} / {bb['bigram']:.3f} / {bb['gzip9']:.3f} bits/byte, "
        f"{elapsed:.1f} s"
    )
    for warning in size_warnings(meta.train_tokens, meta.valid_tokens, meta.vocab_size):
        click.echo(f"warning: {warning}", err=True)


@main.command("import")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out",
    default=None,
    type=click.Path(path_type=Path, file_okay=False),
    help="Data directory to write [default: DIRECTORY itself; its input.bin then keeps only "
    "the train part].",
)
@click.option(
    "--valid-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
    default=DEFAULT_VALID_FRACTION,
    show_default=True,
    help="Share of the tokens held out in valid.bin, cut from the end of input.bin.",
)
def import_(directory: Path, out: Path | None, valid_fraction: float) -> None:
    """Make a d-eggs data directory (input.bin + decoding.bin) an eggroll one: check the ids,
    cut valid.bin from the end of input.bin, write meta.json with the baselines."""
    start = time.monotonic()
    try:
        meta = import_data_dir(directory, out, f"import:{directory.name}", valid_fraction)
    except DataError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        where = e.filename or directory
        raise click.ClickException(f"cannot use {where}: {e.strerror or e}") from None
    _say_baselines(_progress, meta)
    _summary(out or directory, meta, time.monotonic() - start)


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


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Check the sha256 of input.bin + valid.bin against meta.json.",
)
def info(directory: Path, verify: bool) -> None:
    """Print the meta.json of a data directory, after checking its files."""
    try:
        data = load_data_dir(directory, verify=verify)
    except DataError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot read {e.filename or directory}: {e.strerror}") from None
    m = data.meta
    rows = [
        ("directory", str(directory)),
        ("source", m.source),
        ("format", str(m.format_version)),
        ("vocab size", str(m.vocab_size)),
        ("train tokens", f"{m.train_tokens:,}"),
        ("valid tokens", f"{m.valid_tokens:,}"),
        ("documents", f"{m.documents:,} ({m.valid_documents:,} in valid)"),
        ("ids by frequency", "yes" if m.ids_by_frequency else "no"),
        ("sha256", m.sha256 + (" (verified)" if verify else " (not checked)")),
    ]
    # Known baselines first, in their usual order, then any a newer writer added.
    names = [n for n in BASELINE_NAMES if n in m.baselines]
    names += sorted(set(m.baselines) - set(BASELINE_NAMES))
    rows += [(f"{name} bits/token", f"{m.baselines[name]:.4f}") for name in names]
    if m.valid_bytes:
        rows.append(("valid bytes", f"{m.valid_bytes:,}"))
    rows += [
        (f"{name} bits/byte", f"{m.baselines_per_byte[name]:.4f}")
        for name in names
        if name in m.baselines_per_byte
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()

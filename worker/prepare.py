"""`eggroll-data`: build a byte-vocabulary data directory from text, or inspect one.

    eggroll-data prepare notes.txt book.txt --out data/
    eggroll-data prepare --builtin --out data/
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

Split. A document goes to valid.bin when ``int.from_bytes(blake2b(doc).digest()[:8],
"big") % 1000 < round(valid_fraction * 1000)``, where ``doc`` is its UTF-8 bytes: a pure
function of the text, so the split is identical on every run and machine. If that leaves
valid (or train) empty, the last train (first valid) document moves across.
"""

from __future__ import annotations

import ast
import hashlib
import os
import platform
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import click

from ..shared.cli import OneLineError, command
from ..shared.config import PRESETS
from ..shared.data import (
    BYTE_VOCAB_SIZE,
    DECODING_FILE,
    FORMAT_VERSION,
    INPUT_FILE,
    META_FILE,
    VALID_FILE,
    DataError,
    DataMeta,
    byte_pieces,
    concat_documents,
    load_data_dir,
    tokens_digest,
    write_decoding,
    write_meta,
    write_tokens,
)
from ..shared.window import data_too_short, step_tokens
from .baselines import BASELINE_NAMES, baselines

SPLIT_ABOVE_BYTES = 64 * 1024
DOC_TARGET_BYTES = 16 * 1024
BUILTIN_CAP_BYTES = 8 * 1024 * 1024
DEFAULT_VALID_FRACTION = 0.05
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


def file_documents(path: Path | str) -> list[bytes]:
    """The documents of one UTF-8 text file (see the module docstring for the rule)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"input file {path} does not exist")
    if path.is_dir():
        raise DataError(f"input {path} is a directory: give the text files inside it")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"input file {path} is not UTF-8 text (bad byte at offset {e.start}): "
            f"convert it first, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    return [d.encode("utf-8") for d in split_text(_clean(text)) if d.strip()]


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


def split_documents(
    docs: Sequence[bytes], valid_fraction: float = DEFAULT_VALID_FRACTION
) -> tuple[list[bytes], list[bytes]]:
    """(train, valid) documents, each in input order; both non-empty."""
    if len(docs) < 2:
        raise DataError(
            f"the input has {_count(len(docs), 'document')}, at least 2 are needed to hold out a "
            f"validation split: give more text files (a file over 64 KiB is cut into "
            f"~16 KiB documents) or use --builtin"
        )
    train = [d for d in docs if not goes_to_valid(d, valid_fraction)]
    valid = [d for d in docs if goes_to_valid(d, valid_fraction)]
    if not valid:
        valid.append(train.pop())
    elif not train:
        train.append(valid.pop(0))
    return train, valid


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
    scores = {k: round(v, 6) for k, v in baselines(train, valid, BYTE_VOCAB_SIZE).items()}
    say(
        f"baselines on valid (bits/token): unigram {scores['unigram']:.4f}, "
        f"bigram {scores['bigram']:.4f}, gzip -9 {scores['gzip9']:.4f}"
    )
    meta = DataMeta(
        format_version=FORMAT_VERSION,
        vocab_size=BYTE_VOCAB_SIZE,
        train_tokens=len(train),
        valid_tokens=len(valid),
        sha256=tokens_digest(train, valid, BYTE_VOCAB_SIZE).hex(),
        source=source,
        documents=len(docs),
        valid_documents=len(valid_docs),
        baselines=scores,
    )
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    write_tokens(root / INPUT_FILE, train, BYTE_VOCAB_SIZE)
    write_tokens(root / VALID_FILE, valid, BYTE_VOCAB_SIZE)
    write_decoding(root / DECODING_FILE, byte_pieces())
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
def prepare(text_files: tuple[Path, ...], out: Path, builtin: bool, valid_fraction: float) -> None:
    """Tokenize TEXT_FILES (UTF-8) or the built-in corpus as bytes into --out."""
    if builtin and text_files:
        raise OneLineError("give text files or --builtin, not both")
    if not builtin and not text_files:
        raise OneLineError(
            "nothing to prepare: give text files, or --builtin for the built-in corpus"
        )
    start = time.monotonic()
    try:
        if builtin:
            source = builtin_source()
            _progress(f"gathering the built-in corpus ({source}) ...")
            docs = builtin_documents()
        else:
            source = ", ".join(p.name for p in text_files)
            docs = [d for p in text_files for d in file_documents(p)]
        if not docs:
            raise DataError(f"no text found in {source}: the input files are empty")
        total = sum(len(d) for d in docs)
        _progress(f"gathered {_count(len(docs), 'document')}, {total:,} bytes of text")
        meta = prepare_data_dir(docs, out, source, valid_fraction, echo=_progress)
    except DataError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        where = e.filename or out
        raise click.ClickException(f"cannot use {where}: {e.strerror or e}") from None
    elapsed = time.monotonic() - start
    b = meta.baselines
    click.echo(
        f"wrote {out}: {meta.train_tokens:,} train + {meta.valid_tokens:,} valid tokens, "
        f"sha256 {meta.sha256[:16]}, unigram {b['unigram']:.3f} / bigram {b['bigram']:.3f} / "
        f"gzip9 {b['gzip9']:.3f} bits/token, {elapsed:.1f} s"
    )
    for warning in size_warnings(meta.train_tokens, meta.valid_tokens):
        click.echo(f"warning: {warning}", err=True)


def size_warnings(train_tokens: int, valid_tokens: int) -> list[str]:
    """One line per preset these splits are too small for, saying what is enough."""
    lines = []
    for name, cfg in PRESETS.items():
        short = data_too_short(cfg, train_tokens, valid_tokens)
        enough = step_tokens(cfg)
        if short is not None:
            lines.append(f"too little data for the {name} preset: {short}")
        elif train_tokens < enough:
            lines.append(
                f"the train split ({train_tokens:,} tokens) is smaller than what one step of "
                f"the {name} preset reads ({enough:,}): it would learn the text by heart; "
                f"give at least {enough:,} bytes of text, better a hundred times more"
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
        ("sha256", m.sha256 + (" (verified)" if verify else " (not checked)")),
    ]
    # Known baselines first, in their usual order, then any a newer writer added.
    names = [n for n in BASELINE_NAMES if n in m.baselines]
    names += sorted(set(m.baselines) - set(BASELINE_NAMES))
    rows += [(f"{name} bits/token", f"{m.baselines[name]:.4f}") for name in names]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()

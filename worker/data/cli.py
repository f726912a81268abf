"""`eggroll-data`: build a data directory from text, import a d-eggs one, or inspect one.

    eggroll-data prepare notes.txt book.txt --out data/
    eggroll-data prepare minipile.jsonl.gz --text-field text --out data/minipile
    eggroll-data prepare --builtin --out data/
    eggroll-data prepare --builtin --tokenizer bpe --vocab-size 8192 --out data/bpe
    eggroll-data prepare more.txt --tokenizer data/bpe/tokenizer.json --out data/more
    eggroll-data import deggs-data/ --out data/deggs
    eggroll-data info data/

How text becomes documents is in ``documents.py``, the built-in corpus in ``builtin.py``,
the split, the tokens and the files in ``build.py``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import click

from ...shared.cli import F, OneLineError, cannot_write, command
from ...shared.data import DataError, DataMeta, load_data_dir
from ...shared.logs import echo
from ...shared.progress import Progress
from .baselines import BASELINE_NAMES
from .build import (
    DEFAULT_BPE_VOCAB_SIZE,
    DEFAULT_VALID_FRACTION,
    DocSource,
    counted,
    prepare_data_dir,
    prepare_tokenized_data_dir,
    say_baselines,
    size_warnings,
)
from .builtin import builtin_documents, builtin_source
from .documents import (
    DEFAULT_TEXT_FIELD,
    files_documents,
    path_documents,
)
from .import_deggs import import_data_dir
from .tokenizer import load_tokenizer


def _progress(line: str) -> None:
    echo(line, err=True)  # a console that fails drops progress, never the data being written


def _os_error(exc: OSError, out: Path) -> click.ClickException:
    """One line for an OSError: 'cannot write PATH: [Errno 28] ...' where it names a path in
    `out` (or none: the writes name theirs), else 'cannot use PATH: ...' (an input file)."""
    name = Path(exc.filename) if exc.filename is not None else None
    if name is None or name == out or out.resolve() in name.resolve().parents:
        return cannot_write(exc, out)
    return click.ClickException(f"cannot use {name}: {exc.strerror or exc}")


def _files_bytes(paths: tuple[Path, ...]) -> int | None:
    """The size of the input files (None if one cannot be read: its error comes later, or
    is gzipped: its size says little about its text)."""
    if any(p.name.lower().endswith(".gz") for p in paths):
        return None
    try:
        return sum(p.stat().st_size for p in paths)
    except OSError:
        return None


def _read_files(paths: tuple[Path, ...], text_field: str) -> list[bytes]:
    """The documents of every file, with progress through them."""
    reading = Progress("read", _files_bytes(paths), "B", say=lambda p: _progress(p.line()))
    docs: list[bytes] = []
    for path in paths:
        docs += path_documents(path, text_field)
        reading.advance(path.stat().st_size)
    reading.finish(say=False)  # the count of documents follows
    return docs


@command(group=True)
def main() -> None:
    """Build and inspect eggroll data directories (input.bin, valid.bin, decoding.bin,
    meta.json)."""


def _check_writable(out: Path) -> None:
    """Refuse an --out that cannot be written (a read-only file system, no permission)
    before the work, not after it: a file made and removed where it would go."""
    where = out
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        exc.filename = None  # the probe's name means nothing to the user
        raise cannot_write(exc, out) from None


def _valid_fraction_option(help: str) -> Callable[[F], F]:
    """`--valid-fraction` (passed as valid_fraction): the share held out in valid.bin."""
    return click.option(
        "--valid-fraction",
        type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
        default=DEFAULT_VALID_FRACTION,
        show_default=True,
        help=help,
    )


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
@_valid_fraction_option(
    "Share of documents held out in valid.bin (chosen by a hash of their text)."
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
@click.option(
    "--text-field",
    default=DEFAULT_TEXT_FIELD,
    show_default=True,
    help="The string field that holds each document in .jsonl and .jsonl.gz inputs.",
)
def prepare(
    text_files: tuple[Path, ...],
    out: Path,
    builtin: bool,
    valid_fraction: float,
    tokenizer_arg: str | None,
    vocab_size: int | None,
    text_field: str,
) -> None:
    """Tokenize TEXT_FILES (UTF-8; .jsonl and .jsonl.gz files hold a JSON document per line)
    or the built-in corpus into --out: as bytes, or with a BPE tokenizer (--tokenizer)."""
    if builtin and text_files:
        raise OneLineError("give text files or --builtin, not both")
    if not builtin and not text_files:
        raise OneLineError(
            "nothing to prepare: give text files, or --builtin for the built-in corpus"
        )
    if vocab_size is not None and tokenizer_arg != "bpe":
        raise OneLineError("--vocab-size sets the size of a trained BPE: add --tokenizer bpe")
    _check_writable(out)
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
                total = sum(len(d) for d in builtin_docs)
            else:
                source = ", ".join(p.name for p in text_files)
                docs = partial(files_documents, text_files, text_field)
                total = _files_bytes(text_files)
            meta = prepare_tokenized_data_dir(
                docs,
                out,
                source,
                tokenizer,
                vocab_size or DEFAULT_BPE_VOCAB_SIZE,
                valid_fraction,
                echo=_progress,
                total_bytes=total,
            )
        else:
            if builtin:
                all_docs = builtin_docs
            else:
                source = ", ".join(p.name for p in text_files)
                all_docs = _read_files(text_files, text_field)
            if not all_docs:
                raise DataError(f"no text found in {source}: the input files are empty")
            total = sum(len(d) for d in all_docs)
            _progress(f"gathered {counted(len(all_docs), 'document')}, {total:,} bytes of text")
            meta = prepare_data_dir(all_docs, out, source, valid_fraction, echo=_progress)
    except DataError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:  # a failed write left no directory that looks complete (build.py)
        raise _os_error(e, out) from None
    _summary(out, meta, time.monotonic() - start)


def _summary(out: Path, meta: DataMeta, elapsed: float) -> None:
    """The one stdout line of prepare and import, then the size warnings on stderr."""
    b, bb = meta.baselines, meta.baselines_per_byte
    echo(
        f"wrote {out}: {meta.train_tokens:,} train + {meta.valid_tokens:,} valid tokens "
        f"(vocab {meta.vocab_size:,}), sha256 {meta.sha256[:16]}, unigram {b['unigram']:.3f} / "
        f"bigram {b['bigram']:.3f} / gzip9 {b['gzip9']:.3f} bits/token = "
        f"{bb['unigram']:.3f} / {bb['bigram']:.3f} / {bb['gzip9']:.3f} bits/byte, "
        f"{elapsed:.1f} s"
    )
    for warning in size_warnings(meta.train_tokens, meta.valid_tokens, meta.vocab_size):
        echo(f"warning: {warning}", err=True)


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
@_valid_fraction_option("Share of the tokens held out in valid.bin, cut from the end of input.bin.")
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
    say_baselines(_progress, meta)
    _summary(out or directory, meta, time.monotonic() - start)


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

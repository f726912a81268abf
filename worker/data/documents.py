"""Documents from UTF-8 text files, read whole or streamed in blocks.

Each document becomes byte 0 (the document separator, as in nano-egg) followed by the UTF-8
bytes of its text; NUL characters are removed from the text and ``\\r\\n`` is read as
``\\n``. A text file is one document, unless it is larger than 64 KiB: then it is cut on
blank lines (``\\n\\n``) and the paragraphs are packed, in order, into documents of at
least 16 KiB (the last may be shorter). A paragraph larger than 64 KiB is cut the same way
on single newlines, and a line larger than that into pieces of 16 Ki characters.
Whitespace-only documents are dropped.

A ``.jsonl`` or ``.jsonl.gz`` file holds one document per line: a JSON object whose text
field (``text`` unless told otherwise) is read as if it were the whole of a text file, so it
is cleaned and cut by the same rule. Blank lines are skipped; any other line that is not
such an object stops the reading with an error naming the file and line.
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from ...shared.data import DataError

SPLIT_ABOVE_BYTES = 64 * 1024
DOC_TARGET_BYTES = 16 * 1024
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
DEFAULT_TEXT_FIELD = "text"
MAX_JSONL_LINE_BYTES = 64 << 20  # one JSON-lines record, its end of line included


def clean_text(text: str) -> str:
    """The text a document keeps: NUL characters removed, CRLF read as LF."""
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
    return [d.encode("utf-8") for d in split_text(clean_text(text)) if d.strip()]


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
    """The cleaned text of `path` (as clean_text gives it), decoded block by block."""
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


# JSON lines: one document per line, read a line at a time.


def is_jsonl(path: Path | str) -> bool:
    """Whether `path` is read as JSON lines (by its name: .jsonl or .jsonl.gz)."""
    return Path(path).name.lower().endswith(JSONL_SUFFIXES)


def _record_text(line: bytes, where: str, text_field: str) -> str:
    """The text field of one JSON line, or a DataError that starts with `where`."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (bad byte at column {e.start + 1})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object (one document per line is read)")
    if text_field not in record:
        keys = ", ".join(list(record)[:5]) or "none"
        raise DataError(
            f'{where}: no "{text_field}" field (its fields: {keys}; choose one with --text-field)'
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f'{where}: the "{text_field}" field is {type(text).__name__}, not text')
    return text


def jsonl_documents(path: Path | str, text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[bytes]:
    """The documents of a JSON-lines file (gzipped if its name ends in .gz), one at a time:
    each line's `text_field`, cleaned and cut as the text of a whole text file would be."""
    path = Path(path)
    _check_input(path)
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            # A line is read whole: bounded, so one without an end cannot fill the memory.
            lines = iter(lambda: f.readline(MAX_JSONL_LINE_BYTES + 1), b"")
            for number, line in enumerate(lines, 1):
                if len(line) > MAX_JSONL_LINE_BYTES:
                    raise DataError(
                        f"{path}:{number}: a line over {MAX_JSONL_LINE_BYTES >> 20} MiB "
                        "(one JSON document per line is read)"
                    )
                if number == 1:
                    line = line.removeprefix(codecs.BOM_UTF8)
                line = line.strip()
                if not line:
                    continue
                where = f"{path}:{number}"
                text = clean_text(_record_text(line, where, text_field))
                try:
                    docs = [d.encode("utf-8") for d in split_text(text) if d.strip()]
                except UnicodeEncodeError:  # JSON can escape a lone surrogate: \ud800
                    raise DataError(f"{where}: the text holds an unpaired surrogate") from None
                yield from docs
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"input file {path} is not a whole gzip file: {e}") from None


def path_documents(path: Path, text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[bytes]:
    """The documents of one input file, a text file or JSON lines, one at a time."""
    if is_jsonl(path):
        return jsonl_documents(path, text_field)
    return iter_file_documents(path)


def files_documents(paths: Sequence[Path], text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[bytes]:
    """The documents of every file in `paths`, in order, one at a time."""
    for path in paths:
        yield from path_documents(path, text_field)

"""Data-file formats shared by every replica (d-eggs compatible).

A data directory holds four files:

- ``input.bin`` / ``valid.bin``: headerless token ids, ``uint8`` when the vocabulary has
  256 entries, otherwise little-endian ``uint32`` (as d-eggs reads them).
- ``decoding.bin``: little-endian ``u32 count``, then per token ``u32 length`` and that many
  bytes (UTF-8 text, or a raw byte for a byte vocabulary).
- ``meta.json``: :class:`DataMeta`, written last so a half-written directory never looks
  complete.

A directory built with a trained tokenizer also holds ``tokenizer.json`` (the tokenizer that
produced the ids); nothing here reads it. Token id 0 is the document separator in every
vocabulary (the byte 0 of the byte vocabulary, a reserved special token otherwise).

Every writer here replaces its file atomically (temporary file in the same directory, then
``os.replace``), so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from .atomic_file import write_atomic

FORMAT_VERSION = 1
BYTE_VOCAB_SIZE = 256
INPUT_FILE = "input.bin"
VALID_FILE = "valid.bin"
DECODING_FILE = "decoding.bin"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
_MAX_VOCAB_SIZE = 2**32
_HASH_BLOCK_BYTES = 1 << 20
_REBUILD = "rebuild the data directory with `eggroll-data prepare`"


class DataError(Exception):
    """A data file is missing, malformed or inconsistent; the message says what to do."""


def _prepare_hint(directory: Path | str) -> str:
    return f"run `eggroll-data prepare --builtin --out {directory}` (or give your own text files)"


# --- atomic writes -------------------------------------------------------------------


# --- token files ---------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """On-disk dtype of token ids: uint8 for a 256-entry vocabulary, else little-endian uint32."""
    if not 1 <= vocab_size <= _MAX_VOCAB_SIZE:
        raise DataError(f"vocab_size must be in 1..2**32, got {vocab_size}")
    return np.dtype(np.uint8) if vocab_size == BYTE_VOCAB_SIZE else np.dtype("<u4")


def write_tokens(path: Path | str, tokens: np.ndarray | Sequence[int], vocab_size: int) -> None:
    """Write `tokens` (1-D, every id in [0, vocab_size)) as a headerless token file."""
    dtype = token_dtype(vocab_size)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise DataError(f"tokens for {path} must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"tokens for {path} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise DataError(f"tokens for {path} must lie in [0, {vocab_size}), got [{lo}, {hi}]")
    data = np.ascontiguousarray(arr.astype(dtype, copy=False))
    write_atomic(path, memoryview(data).cast("B"))


def read_tokens(path: Path | str, vocab_size: int) -> np.ndarray:
    """Read a token file: uint8 array for a byte vocabulary, else uint32 (host order).

    Raises DataError when the file is missing, empty, not a whole number of uint32 ids, or
    holds an id >= vocab_size.
    """
    path = Path(path)
    dtype = token_dtype(vocab_size)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path} does not exist: {_prepare_hint(path.parent)}") from None
    if size == 0:
        raise DataError(f"{path} is empty: {_prepare_hint(path.parent)}")
    if size % dtype.itemsize:
        raise DataError(
            f"{path} has {size} bytes, not a multiple of {dtype.itemsize} (uint32 ids for "
            f"vocab_size {vocab_size}): the file is truncated or was written for another "
            f"vocabulary; {_REBUILD}"
        )
    tokens = np.fromfile(path, dtype=dtype)
    if dtype.itemsize > 1:
        tokens = tokens.astype(np.uint32, copy=False)  # no-op on little-endian hosts
        hi = int(tokens.max())
        if hi >= vocab_size:  # uint8 ids always fit the 256-entry byte vocabulary
            raise DataError(
                f"{path} holds token id {hi} >= vocab_size {vocab_size}: the file belongs "
                f"to another vocabulary; {_REBUILD}"
            )
    return tokens


# --- decoding.bin --------------------------------------------------------------------


def write_decoding(path: Path | str, pieces: Sequence[bytes]) -> None:
    """Write the detokenisation table: u32 count, then u32 length + bytes per token (LE)."""
    parts = [struct.pack("<I", len(pieces))]
    for i, piece in enumerate(pieces):
        if not isinstance(piece, bytes | bytearray):
            raise DataError(f"decoding piece {i} must be bytes, got {type(piece).__name__}")
        parts.append(struct.pack("<I", len(piece)))
        parts.append(bytes(piece))
    blob = b"".join(parts)
    write_atomic(path, blob)


def read_decoding(path: Path | str) -> list[bytes]:
    """Read decoding.bin; raise DataError on a missing, truncated or over-long file."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path} does not exist: {_prepare_hint(path.parent)}") from None
    fix = _REBUILD
    if len(blob) < 4:
        raise DataError(f"{path} is truncated ({len(blob)} bytes, no token count): {fix}")
    (count,) = struct.unpack_from("<I", blob, 0)
    pieces: list[bytes] = []
    pos = 4
    for i in range(count):
        if pos + 4 > len(blob):
            raise DataError(f"{path} is truncated at token {i} of {count}: {fix}")
        (length,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        if pos + length > len(blob):
            raise DataError(f"{path} is truncated inside token {i} of {count}: {fix}")
        pieces.append(blob[pos : pos + length])
        pos += length
    if pos != len(blob):
        raise DataError(f"{path} has {len(blob) - pos} bytes after its {count} tokens: {fix}")
    return pieces


def byte_pieces() -> list[bytes]:
    """Decoding table of the byte vocabulary: token i is the single raw byte i."""
    return [bytes([i]) for i in range(BYTE_VOCAB_SIZE)]


def piece_lengths(decoding: Sequence[bytes]) -> np.ndarray:
    """Bytes of text each token id stands for (int64, indexed by id)."""
    return np.fromiter((len(p) for p in decoding), dtype=np.int64, count=len(decoding))


def text_bytes(tokens: np.ndarray, decoding: Sequence[bytes]) -> int:
    """Bytes of text `tokens` decode to: the denominator of bits per byte.

    The document separator counts as the one byte it decodes to, so for the byte vocabulary
    this is the token count and bits per byte equal bits per token.
    """
    return int(piece_lengths(decoding)[np.asarray(tokens, dtype=np.int64)].sum())


def decode_tokens(tokens: np.ndarray, decoding: Sequence[bytes]) -> bytes:
    """The bytes `tokens` stand for, concatenated (separators included)."""
    return b"".join([decoding[i] for i in np.asarray(tokens).tolist()])


# --- meta.json -----------------------------------------------------------------------


@dataclass(frozen=True)
class DataMeta:
    """Contents of meta.json.

    `sha256` is the data digest (see :func:`data_digest`) as lowercase hex. `source` names
    where the text came from, e.g. ``"builtin:python-3.11.7-docs"`` or the input file names.
    `baselines` maps "unigram", "bigram" and "gzip9" to bits per token on valid.bin, fitted
    on input.bin only; `baselines_per_byte` holds the same scores in bits per byte of the
    text valid.bin decodes to, which is `valid_bytes` bytes long (:func:`text_bytes`). A
    meta.json written before those two existed loads with ``{}`` and 0 (unknown).
    `ids_by_frequency` says that the ids after the separator (id 0) are ranked by their count
    in input.bin, the most frequent first (as `prepare --tokenizer bpe` numbers a vocabulary
    it trains; es.token_noise_rows relies on it); older files load with False.
    """

    format_version: int
    vocab_size: int
    train_tokens: int
    valid_tokens: int
    sha256: str
    source: str
    documents: int
    valid_documents: int
    baselines: dict[str, float] = field(default_factory=dict)
    baselines_per_byte: dict[str, float] = field(default_factory=dict)
    valid_bytes: int = 0
    ids_by_frequency: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = META_FILE) -> DataMeta:
        """Parse and check meta.json text; unknown keys are ignored (newer writers)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where} is not valid JSON ({e.msg}): {_REBUILD}") from None
        if not isinstance(raw, dict):
            raise DataError(f"{where} must hold a JSON object: {_REBUILD}")
        missing = [f.name for f in fields(cls) if f.name not in raw and f.name not in _OPTIONAL]
        if missing:
            raise DataError(f"{where} lacks {', '.join(missing)}: {_REBUILD}")
        version = raw["format_version"]
        if version != FORMAT_VERSION:
            raise DataError(
                f"{where} has format_version {version!r}, this version reads "
                f"{FORMAT_VERSION}: {_REBUILD}"
            )
        raw = {**_OPTIONAL, **raw}
        ints = (
            "vocab_size",
            "train_tokens",
            "valid_tokens",
            "documents",
            "valid_documents",
            "valid_bytes",
        )
        for name in ints:
            value = raw[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(f"{where}: {name} must be a non-negative integer, got {value!r}")
        sha = raw["sha256"]
        if not (isinstance(sha, str) and len(sha) == 64 and _is_hex(sha)):
            raise DataError(f"{where}: sha256 must be 64 hex digits, got {sha!r}")
        if not isinstance(raw["source"], str):
            raise DataError(f"{where}: source must be a string")
        for name in ("baselines", "baselines_per_byte"):
            scores = raw[name]
            if not isinstance(scores, dict) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in scores.values()
            ):
                raise DataError(f"{where}: {name} must map names to numbers")
        if not isinstance(raw["ids_by_frequency"], bool):
            raise DataError(f"{where}: ids_by_frequency must be true or false")
        token_dtype(raw["vocab_size"])  # range check
        return cls(
            format_version=version,
            vocab_size=raw["vocab_size"],
            train_tokens=raw["train_tokens"],
            valid_tokens=raw["valid_tokens"],
            sha256=sha.lower(),
            source=raw["source"],
            documents=raw["documents"],
            valid_documents=raw["valid_documents"],
            baselines={str(k): float(v) for k, v in raw["baselines"].items()},
            baselines_per_byte={str(k): float(v) for k, v in raw["baselines_per_byte"].items()},
            valid_bytes=raw["valid_bytes"],
            ids_by_frequency=raw["ids_by_frequency"],
        )


# Keys a meta.json from before bits per byte (or ranked ids) lacks, with the values it
# loads with.
_OPTIONAL: dict[str, object] = {
    "baselines_per_byte": {},
    "valid_bytes": 0,
    "ids_by_frequency": False,
}


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def write_meta(path: Path | str, meta: DataMeta) -> None:
    blob = meta.to_json().encode()
    write_atomic(path, blob)


def read_meta(path: Path | str) -> DataMeta:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path} does not exist: {_prepare_hint(path.parent)}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text: {_REBUILD}") from None
    return DataMeta.from_json(text, where=str(path))


# --- digest --------------------------------------------------------------------------


def data_digest(input_path: Path | str, valid_path: Path | str) -> bytes:
    """The data digest workers send in their handshake: 32 bytes.

    Defined as ``sha256(u64 len(input.bin) || input.bin || u64 len(valid.bin) || valid.bin)``
    with big-endian byte counts, so the split between the files is part of the digest.
    Streams the files in 1 MiB blocks.
    """
    h = hashlib.sha256()
    for p in (input_path, valid_path):
        h.update(os.path.getsize(p).to_bytes(8, "big"))
        with open(p, "rb") as f:
            while block := f.read(_HASH_BLOCK_BYTES):
                h.update(block)
    return h.digest()


def tokens_digest(train: np.ndarray, valid: np.ndarray, vocab_size: int) -> bytes:
    """:func:`data_digest` of the files `train` and `valid` would be written as."""
    dtype = token_dtype(vocab_size)
    h = hashlib.sha256()
    for arr in (train, valid):
        h.update((arr.size * dtype.itemsize).to_bytes(8, "big"))
        h.update(memoryview(np.ascontiguousarray(arr.astype(dtype, copy=False))).cast("B"))
    return h.digest()


# --- the data directory --------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """A loaded data directory. The token arrays are read-only: replicas must agree on them."""

    train: np.ndarray
    valid: np.ndarray
    decoding: list[bytes]
    meta: DataMeta
    digest: bytes


def load_data_dir(path: Path | str, verify: bool = True) -> Dataset:
    """Load and check a data directory; with `verify`, also check the sha256 in meta.json.

    Checks that all four files exist, that the token counts and the decoding table size
    agree with meta.json, and that every id is below the vocabulary size. Raises DataError
    with a line that says what to do.
    """
    root = Path(path)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise DataError(f"data directory {root} {what}: {_prepare_hint(root)}")
    for name in (INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE):
        if not (root / name).is_file():
            raise DataError(f"data directory {root} has no {name}: {_prepare_hint(root)}")
    meta = read_meta(root / META_FILE)
    itemsize = token_dtype(meta.vocab_size).itemsize
    for name, count in ((INPUT_FILE, meta.train_tokens), (VALID_FILE, meta.valid_tokens)):
        size = (root / name).stat().st_size
        if size != count * itemsize:
            raise DataError(
                f"{root / name} has {size} bytes but {META_FILE} says {count} tokens of "
                f"{itemsize} byte(s): the directory is stale or half-written; "
                f"{_prepare_hint(root)}"
            )
    train = read_tokens(root / INPUT_FILE, meta.vocab_size)
    valid = read_tokens(root / VALID_FILE, meta.vocab_size)
    decoding = read_decoding(root / DECODING_FILE)
    if len(decoding) != meta.vocab_size:
        raise DataError(
            f"{root / DECODING_FILE} has {len(decoding)} tokens but vocab_size is "
            f"{meta.vocab_size}: {_prepare_hint(root)}"
        )
    digest = bytes.fromhex(meta.sha256)
    if verify:
        actual = tokens_digest(train, valid, meta.vocab_size)
        if actual != digest:
            raise DataError(
                f"sha256 of {root / INPUT_FILE} + {VALID_FILE} is {actual.hex()[:16]}..., "
                f"{META_FILE} says {meta.sha256[:16]}...: the files changed after they were "
                f"built; {_prepare_hint(root)}"
            )
    train.flags.writeable = False
    valid.flags.writeable = False
    return Dataset(train=train, valid=valid, decoding=decoding, meta=meta, digest=digest)


def concat_documents(documents: Iterable[bytes]) -> np.ndarray:
    """Byte-vocabulary token stream: each document becomes byte 0 (separator) + its bytes."""
    return np.frombuffer(b"".join(b"\x00" + d for d in documents), dtype=np.uint8).copy()


__all__ = [
    "BYTE_VOCAB_SIZE",
    "DECODING_FILE",
    "FORMAT_VERSION",
    "INPUT_FILE",
    "META_FILE",
    "TOKENIZER_FILE",
    "VALID_FILE",
    "DataError",
    "DataMeta",
    "Dataset",
    "byte_pieces",
    "concat_documents",
    "data_digest",
    "decode_tokens",
    "load_data_dir",
    "piece_lengths",
    "read_decoding",
    "read_meta",
    "read_tokens",
    "text_bytes",
    "token_dtype",
    "tokens_digest",
    "write_decoding",
    "write_meta",
    "write_tokens",
]

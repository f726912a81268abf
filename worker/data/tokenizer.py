"""Byte-level BPE vocabularies for `eggroll-data prepare --tokenizer`.

A vocabulary trained here is GPT-2 style byte-level BPE (the `tokenizers` library, offline):
id 0 is the reserved special token ``<|doc|>``, the document separator (as byte 0 is in the
byte vocabulary), then the 256 byte symbols and the merges, which `prepare` renumbers by
frequency (`renumber`) once the train split is encoded. Every token stands for a fixed
string of raw bytes, so decoding.bin holds exactly those bytes and concatenating the pieces
of a document's ids gives back its UTF-8 text, byte for byte. The separator decodes to the
single byte 0, as in the byte vocabulary: both count the same bytes of text.

A tokenizer file from elsewhere (``--tokenizer FILE.json``) must have the same shape: a
special token at id 0 and byte-level pieces for everything that is not an added token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ...shared.data import DataError

__all__ = [
    "MIN_VOCAB_SIZE",
    "SEPARATOR",
    "bytes_to_unicode",
    "check_tokenizer",
    "encode_documents",
    "load_tokenizer",
    "renumber",
    "tokenizer_pieces",
    "train_bpe",
]

SEPARATOR = "<|doc|>"
# The separator and the 256 byte symbols: a smaller vocabulary cannot hold every byte.
MIN_VOCAB_SIZE = 257


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: byte -> the printable character that stands for it (GPT-2)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries (fewer if the text runs out of pairs).

    `texts` is consumed once, as it comes: the trainer keeps word counts, not the text.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size must be at least {MIN_VOCAB_SIZE} (the separator and the 256 "
            f"bytes), got {vocab_size}"
        )
    if vocab_size > 2**32:
        raise DataError(f"--vocab-size must be at most 2**32, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SEPARATOR],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    check_tokenizer(tok, "the trained tokenizer")
    return tok


def renumber(tok: Tokenizer, order: Sequence[int]) -> Tokenizer:
    """The same tokenizer with the token of old id order[i] as id i. A BPE's ids are labels:
    its merges name tokens by their strings, so encoding gives the same pieces, renumbered."""
    new_id = {int(old): new for new, old in enumerate(order)}
    data = json.loads(tok.to_str())
    if data.get("post_processor") is not None:  # it may name ids of its own
        raise ValueError("renumber: a tokenizer with a post-processor is not supported")
    data["model"]["vocab"] = {piece: new_id[i] for piece, i in data["model"]["vocab"].items()}
    for added in data["added_tokens"]:
        added["id"] = new_id[added["id"]]
    out = Tokenizer.from_str(json.dumps(data))
    check_tokenizer(out, "the renumbered tokenizer")
    return out


def load_tokenizer(path: Path | str) -> Tokenizer:
    """Read a tokenizer.json and check that it fits a data directory (see check_tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises bare Exceptions for malformed files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"tokenizer file {path} cannot be read: {first}") from None
    check_tokenizer(tok, str(path))
    return tok


def check_tokenizer(tok: Tokenizer, where: str) -> None:
    """Raise DataError unless id 0 is a special token and every other piece is byte-level."""
    size = tok.get_vocab_size(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    if 0 not in added or not added[0].special:
        raise DataError(
            f"{where}: id 0 must be a special token (the document separator), it is "
            f"{tok.id_to_token(0)!r}; train one with `--tokenizer bpe`"
        )
    for i in range(size):
        token = tok.id_to_token(i)
        if token is None:
            raise DataError(f"{where}: ids are not contiguous, id {i} of {size} has no token")
        if i not in added and any(c not in _BYTE_OF for c in token):
            raise DataError(
                f"{where}: token {i} ({token!r}) is not byte-level BPE: only byte-level "
                f"tokenizers map every id to fixed bytes"
            )


def tokenizer_pieces(tok: Tokenizer) -> list[bytes]:
    """decoding.bin of `tok`: the raw bytes of every id; the separator is byte 0."""
    added = tok.get_added_tokens_decoder()
    pieces = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        token = tok.id_to_token(i)
        if i == 0:
            pieces.append(b"\x00")
        elif i in added:
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(bytes(_BYTE_OF[c] for c in token))
    return pieces


def encode_documents(
    tok: Tokenizer, docs: Sequence[bytes], pieces: Sequence[bytes]
) -> list[list[int]]:
    """Token ids of each document (no separator), checked to decode back to its bytes.

    A special token's text inside a document is encoded as ordinary text, so id 0 only ever
    comes from the separator the caller puts between documents.
    """
    tok.encode_special_tokens = True
    encodings = tok.encode_batch([d.decode("utf-8") for d in docs], add_special_tokens=False)
    out = []
    for doc, enc in zip(docs, encodings, strict=True):
        ids = enc.ids
        if b"".join([pieces[i] for i in ids]) != doc:
            raise DataError(
                "the tokenizer does not give back the text it encodes (it normalizes or drops "
                f"characters), e.g. in the document starting {doc[:40]!r}: use a byte-level "
                "BPE without a normalizer"
            )
        out.append(ids)
    return out

"""Text <-> token ids through a data directory's decoding table, and safe display of text.

A vocabulary is the list of byte strings in decoding.bin (token i decodes to pieces[i]).
Text is encoded by greedy longest match over those pieces: the identity for the byte
vocabulary, and a valid (not necessarily the trainer's) split for any other.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

BYTE_VOCAB_SIZE = 256
NEWLINE_MARK = "\u21b5"  # ↵: a newline in one-line text (log lines)


class VocabError(ValueError):
    """Text that the vocabulary cannot express; the message says where."""


def is_byte_vocabulary(pieces: Sequence[bytes]) -> bool:
    return len(pieces) == BYTE_VOCAB_SIZE and all(p == bytes([i]) for i, p in enumerate(pieces))


def encode(text: bytes, pieces: Sequence[bytes]) -> list[int]:
    """Token ids of `text` by greedy longest match; VocabError at the first byte no piece
    starts with (token 0, the document separator, is never produced from text)."""
    if is_byte_vocabulary(pieces):
        return list(text)
    index: dict[bytes, int] = {}
    for i, piece in enumerate(pieces):
        if i and piece:
            index.setdefault(piece, i)
    longest = max(map(len, index), default=0)
    ids, pos = [], 0
    while pos < len(text):
        for size in range(min(longest, len(text) - pos), 0, -1):
            tok = index.get(text[pos : pos + size])
            if tok is not None:
                ids.append(tok)
                pos += size
                break
        else:
            raise VocabError(
                f"prompt byte {pos} (0x{text[pos]:02x}) is outside the vocabulary: no token "
                "starts with it"
            )
    return ids


class Detokenizer:
    """Token ids -> text, incrementally: a UTF-8 character split over tokens is held back
    until it is complete, bytes that are not UTF-8 become U+FFFD."""

    def __init__(self, pieces: Sequence[bytes]):
        self.pieces = pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if 0 <= token < len(self.pieces):
            return self._utf8.decode(self.pieces[token])
        return self._utf8.decode(b"") + f"<{token}>"

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def decode(tokens: Sequence[int], pieces: Sequence[bytes]) -> str:
    d = Detokenizer(pieces)
    return "".join(d.feed(t) for t in tokens) + d.flush()


def escape(text: str, keep_newlines: bool = True) -> str:
    """`text` with every control character written as an escape (\\x1b, \\r, \\x85, ...),
    so model output cannot move the cursor, recolour or retitle a terminal. Newlines (and
    tabs) stay when `keep_newlines`; otherwise the result is one line, with each newline
    shown as NEWLINE_MARK. Backslashes are left alone: this is for reading, not parsing."""
    out = []
    for ch in text:
        code = ord(ch)
        if keep_newlines and ch in "\n\t":
            out.append(ch)
        elif ch == "\n":
            out.append(NEWLINE_MARK)
        elif code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0 or ch in "\u2028\u2029":
            out.append(repr(ch)[1:-1] if code > 0xFF else f"\\x{code:02x}")
        else:
            out.append(ch)
    return "".join(out)

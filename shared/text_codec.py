"""The text codec of a model: how prompts become tokens and completions become text."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .config import RunConfig
from .data import Dataset
from .vocab import decode, encode


@dataclass(frozen=True)
class TextCodec:
    """A model's own tokenizer (a Hugging Face model's; the data's vocabulary otherwise):
    prompts are encoded with it, completions decoded, and a prompt longer than `context`
    tokens is refused."""

    encode: Callable[[str], Sequence[int]]
    decode: Callable[[Sequence[int]], str]
    context: int
    what: str = "es.seq_len"  # the setting that limits the context, for the error line


def data_codec(cfg: RunConfig, dataset: Dataset) -> TextCodec:
    """The data's vocabulary as a codec (the int8 models')."""
    pieces = dataset.decoding
    return TextCodec(
        lambda text: encode(text.encode("utf-8"), pieces),
        lambda tokens: decode(tokens, pieces),
        cfg.es.seq_len,
    )

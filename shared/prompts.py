"""The prompts a reward run's members continue: read, tokenized, held out and drawn.

Prompts file: one prompt per line (`\\n` escapes a newline, `\\\\` a backslash), or JSON lines
`{"prompt": "...", "answer": 42, ...}` whose other fields the batched reward receives. Every
8th prompt (index 7, 15, ...) is held out: never trained on, the unperturbed model's mean
reward on the first `fitness.held_out_prompts` of them is reported at every validation. With
`prompts = "data"`, train prompts begin the train split's documents and held-out ones the
valid split's. Step s continues `fitness.prompts_per_step` train prompts drawn by the
counter-based noise, with a sampling seed of its own (`generation_seed`), so every replica
draws the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import RunConfig
from .data import Dataset
from .noise import DOMAIN_PROMPT, combine_array, hash_key
from .objectives.reward import DATA_PROMPTS
from .pinned import GoalError, resolve
from .sample import SampleSettings
from .text_codec import TextCodec, data_codec
from .vocab import VocabError

HELD_OUT_EVERY = 8  # prompt i is held out when i % 8 == 7
MAX_PROMPTS_FILE_BYTES = 64 << 20
MAX_PROMPTS = 1 << 20
DATA_PROMPT_TOKENS = 16  # the beginning of a document that a "data" prompt keeps


@dataclass(frozen=True)
class Prompt:
    """One prompt: its number in the prompt set (the sampling seed's), text and tokens, and
    the fields a batched reward receives beside it."""

    index: int
    text: str
    tokens: tuple[int, ...]
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Prompts:
    train: list[Prompt]
    held_out: list[Prompt]


def _unescape(line: str) -> str:
    out, i = [], 0
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line) and line[i + 1] in "n\\":
            out.append("\n" if line[i + 1] == "n" else "\\")
            i += 2
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def read_prompts(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(text, fields) of every prompt in a prompts file; GoalError naming the line of the
    first that does not read."""
    try:
        size = path.stat().st_size
        if size > MAX_PROMPTS_FILE_BYTES:
            raise GoalError(
                f"prompts file {path} is {size:,} bytes; the limit is {MAX_PROMPTS_FILE_BYTES:,}"
            )
        raw = path.read_bytes()
    except FileNotFoundError:
        raise GoalError(f"prompts file {path} does not exist") from None
    except OSError as exc:
        raise GoalError(f"prompts file {path} cannot be read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GoalError(f"prompts file {path} is not UTF-8 (byte {exc.start})") from None
    out: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(out) == MAX_PROMPTS:
            raise GoalError(f"prompts file {path} holds more than {MAX_PROMPTS:,} prompts")
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # ValueError: also a 5,000-digit number
                raise GoalError(f"{path} line {number} is not valid JSON") from None
            prompt = record.pop("prompt", None) if isinstance(record, dict) else None
            if not isinstance(prompt, str):
                raise GoalError(f'{path} line {number} has no "prompt" string')
            out.append((prompt, record))
        else:
            out.append((_unescape(line), {}))
    if len(out) < HELD_OUT_EVERY:
        raise GoalError(
            f"prompts file {path} holds {len(out)} prompts; at least {HELD_OUT_EVERY} are needed "
            f"(every {HELD_OUT_EVERY}th is held out)"
        )
    return out


def _tokens(text: str, where: str, codec: TextCodec) -> tuple[int, ...]:
    try:
        ids = codec.encode(text)
    except VocabError as exc:
        raise GoalError(f"{where}: {exc}") from None
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        raise GoalError(f"{where} is not valid Unicode text") from None
    if len(ids) > codec.context:
        raise GoalError(
            f"{where} is {len(ids)} tokens, longer than the model's context of "
            f"{codec.context} ({codec.what}): shorten it"
        )
    return tuple(int(t) for t in ids)


def _document_starts(tokens: np.ndarray, limit: int) -> list[tuple[int, ...]]:
    """The first `limit` tokens of up to MAX_PROMPTS documents (token 0 separates them)."""
    starts = np.flatnonzero(tokens == 0) + 1
    starts = np.concatenate([[0], starts])[:MAX_PROMPTS]
    out = []
    for s in starts:
        window = tokens[s : s + limit]
        end = np.flatnonzero(window == 0)
        kept = window[: end[0]] if len(end) else window
        if len(kept):
            out.append(tuple(int(t) for t in kept))
    return out


def load_prompts(
    cfg: RunConfig, base: Path, dataset: Dataset | None, codec: TextCodec | None = None
) -> Prompts:
    """The run's prompts, tokenized with `codec` (default: the data's vocabulary; a run
    without data, `dataset` None, gives its model's); a prompt longer than the model's
    context is refused, naming it."""
    if dataset is None and (codec is None or cfg.fitness.prompts == DATA_PROMPTS):
        raise GoalError(
            "a run without a data directory needs a prompts file and a model with its own "
            f"tokenizer (fitness.prompts={cfg.fitness.prompts!r})"
        )
    codec = codec or data_codec(cfg, dataset)
    if cfg.fitness.prompts == DATA_PROMPTS:
        limit = min(DATA_PROMPT_TOKENS, codec.context)
        pieces = dataset.decoding
        made = []
        for split, tokens in ((0, dataset.train), (1, dataset.valid)):
            made.append(
                [
                    Prompt(
                        (split << 32) + i,
                        b"".join(pieces[t] for t in ids).decode("utf-8", "replace"),
                        ids,
                    )
                    for i, ids in enumerate(_document_starts(tokens, limit))
                ]
            )
        if not made[0] or not made[1]:
            raise GoalError("fitness.prompts='data' found no documents in a split of the data")
        return Prompts(made[0], made[1])
    path = resolve(cfg.fitness.prompts, base)
    train, held = [], []
    for i, (text, fields) in enumerate(read_prompts(path)):
        prompt = Prompt(i, text, _tokens(text, f"{path} prompt {i + 1}", codec), fields)
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(prompt)
    return Prompts(train, held)


def step_prompts(cfg: RunConfig, prompts: Prompts, step: int) -> list[Prompt]:
    """The prompts step `step` continues: key(PROMPT, data_seed, step, i) mod the train
    prompts, for i < prompts_per_step (drawn with replacement)."""
    base = hash_key(DOMAIN_PROMPT, cfg.data.data_seed, step)
    keys = combine_array(base, np.arange(cfg.fitness.prompts_per_step, dtype=np.uint64))
    picks = (keys % np.uint64(len(prompts.train))).astype(np.int64)
    return [prompts.train[int(i)] for i in picks]


def held_out(cfg: RunConfig, prompts: Prompts) -> list[Prompt]:
    return prompts.held_out[: cfg.fitness.held_out_prompts]


def generation_seed(cfg: RunConfig, step: int) -> int:
    """The sampling seed of step `step`'s completions (a held-out score uses its step's)."""
    return hash_key(DOMAIN_PROMPT, cfg.es.run_seed, step, 1)


def settings(cfg: RunConfig) -> SampleSettings:
    f = cfg.fitness
    return SampleSettings(
        temperature=f.temperature, min_p=f.min_p, top_k=0, presence_penalty=0, frequency_penalty=0
    )

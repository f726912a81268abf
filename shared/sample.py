"""Text generation: the next token from integer logits, exactly specified for every backend.

Any architecture generates through a `StepModel`: `start()` gives the state and logits at the
start of a document, `step(state, token)` reads one token. Logits are integers, base-2
log-odds in 1/16 bit (p(v) ~ 2**(l[v] / 16)), as the EGG model's head writes them.

Settings are integers in thousandths, so they cross the wire and the command line exactly:
temperature 600 = 0.6, min-p 80 = 0.08, penalties in thousandths of a bit. Choosing the token
at `position` of sample `sample` (all arithmetic on int64, no floats):

    c[v]   = occurrences of v among the context: the kept prompt and the tokens so far
    L[v]   = 1000 * l[v] - 16 * presence * (c[v] > 0) - 16 * frequency * c[v]   (1/16000 bit)
    temperature 0: the token is the first v with the largest L (greedy; no randomness)
    e[v]   = (16 * (max L - L[v])) // temperature                    (1/256 bit, floor)
    w[v]   = EXP[e[v] & 255] >> min(e[v] >> 8, 31)   with EXP[i] = floor(2**30 * 2**(-i/256))
    min-p: w[v] = 0 where 1000 * w[v] < min_p * 2**30                (2**30 is the top weight)
    top-k: w[v] = 0 outside the k tokens of largest L (ties: smaller id first)
    r      = key(SAMPLE, seed, sample, position) from shared.noise (64 bits)
    token  = the first v with w[0] + ... + w[v] > r mod (w[0] + ... + w[V-1])
             (the modulo's bias is below total / 2**64: under 2**-14 for 2**20 tokens)

So min-p drops exactly the tokens whose probability under w is below min_p * p_max, the
presence penalty counts a token once however often it occurs (d-eggs subtracted its
"presence" penalty per occurrence: that is the frequency penalty here), and the same model,
prompt, settings and seed give the same tokens on any machine.

A replica's sample is agreed the same way: held-out document d, seed s and these settings
give this text at a step, whoever writes it. `TrainingSamples` and `write_sample` say so
once, for eggroll-train, the worker daemon (SAMPLE) and eggroll-sample's checks alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any, Protocol

import numpy as np

from .data import Dataset
from .model import build_generator
from .noise import DOMAIN_SAMPLE, combine_array, hash_key
from .replica import ReplicaState
from .vocab import decode
from .window import held_out_prompt

MILLI = 1000
MAX_TEMPERATURE = 100 * MILLI
MAX_PENALTY = 100 * MILLI  # 100 bits: more than any logit range
MAX_TOP_K = 1 << 20
MAX_NEW_TOKENS = 1 << 16
TOP_WEIGHT = 1 << 30
# The default sample: a held-out prompt of 32 tokens (as d-eggs) continued by 64 tokens.
PROMPT_TOKENS = 32
NEW_TOKENS = 64


class SampleError(ValueError):
    """Invalid sampling settings or prompt; the message is one line that says why."""


@dataclass(frozen=True)
class SampleSettings:
    """Sampling settings in thousandths (see the module docstring for their exact effect)."""

    temperature: int = 600  # 0 = greedy
    min_p: int = 80  # 0 = off, 1000 = only the most likely tokens
    top_k: int = 0  # 0 = off
    presence_penalty: int = 200  # thousandths of a bit, once per distinct token present
    frequency_penalty: int = 0  # thousandths of a bit, per occurrence

    def __post_init__(self) -> None:
        for name, hi in (
            ("temperature", MAX_TEMPERATURE),
            ("min_p", MILLI),
            ("top_k", MAX_TOP_K),
            ("presence_penalty", MAX_PENALTY),
            ("frequency_penalty", MAX_PENALTY),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
                raise SampleError(f"{name}={value!r} must be an integer in 0..{hi}")

    def describe(self) -> str:
        top_k = self.top_k or "off"
        return (
            f"temperature {milli_text(self.temperature)}, min-p {milli_text(self.min_p)}, "
            f"top-k {top_k}, presence penalty {milli_text(self.presence_penalty)}, "
            f"frequency penalty {milli_text(self.frequency_penalty)}"
        )


def parse_milli(text: str, name: str) -> int:
    """'0.6' -> 600, exactly (decimal digits only, at most three after the point)."""
    match = re.fullmatch(r"([0-9]*)(?:\.([0-9]*))?", text.strip())
    whole, frac = (match.group(1), match.group(2) or "") if match else ("", "")
    if not (whole or frac):
        raise SampleError(f"{name} must be a non-negative decimal number, got {text!r}")
    if len(frac) > 3 and frac[3:].strip("0"):
        raise SampleError(f"{name}={text} has more than three decimals")
    return int(whole or "0") * MILLI + int((frac + "000")[:3])


def milli_text(value: int) -> str:
    """600 -> '0.6' (the inverse of parse_milli)."""
    whole, frac = divmod(value, MILLI)
    return f"{whole}.{frac:03d}".rstrip("0").rstrip(".") if frac else str(whole)


@cache
def exp_table() -> np.ndarray:
    """EXP[i] = floor(2**30 * 2**(-i/256)) for i in 0..255: the largest c with
    c**256 <= 2**(30*256 - i), found by integer bisection (no libm)."""
    table = []
    for i in range(256):
        lo, hi = 1, TOP_WEIGHT
        bound = 1 << (30 * 256 - i)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if mid**256 <= bound else (lo, mid - 1)
        table.append(lo)
    return np.array(table, dtype=np.int64)


def penalized(logits: np.ndarray, counts: np.ndarray, settings: SampleSettings) -> np.ndarray:
    """L: the logits in 1/16000 bit minus the presence and frequency penalties (int64)."""
    out = np.asarray(logits, dtype=np.int64) * MILLI
    if settings.presence_penalty or settings.frequency_penalty:  # a reward run's are 0
        counts = np.asarray(counts, dtype=np.int64)
        out -= 16 * settings.presence_penalty * (counts > 0)
        out -= 16 * settings.frequency_penalty * counts
    return out


def token_weights(logits: np.ndarray, counts: np.ndarray, settings: SampleSettings) -> np.ndarray:
    """w: the integer weight of every token (0 = filtered out); needs temperature > 0."""
    if settings.temperature == 0:
        raise SampleError("temperature 0 is greedy: it has no weights")
    big = penalized(logits, counts, settings)
    e = (16 * (big.max() - big)) // settings.temperature
    w = exp_table()[e & 255] >> np.minimum(e >> 8, 31)
    w[MILLI * w < settings.min_p * TOP_WEIGHT] = 0
    if settings.top_k and settings.top_k < len(w):
        order = np.lexsort((np.arange(len(big)), -big))  # largest L first, then smaller id
        w[order[settings.top_k :]] = 0
    return w


def draw(seed: int, sample: int, position: int) -> int:
    """The 64-bit random word of one generated token."""
    return hash_key(DOMAIN_SAMPLE, seed, sample, position)


def next_token(
    logits: np.ndarray,
    counts: np.ndarray,
    settings: SampleSettings,
    seed: int,
    sample: int,
    position: int,
) -> int:
    """The token at `position` of sample `sample` (see the module docstring)."""
    if settings.temperature == 0:
        return int(np.argmax(penalized(logits, counts, settings)))
    cumulative = np.cumsum(token_weights(logits, counts, settings))
    threshold = draw(seed, sample, position) % int(cumulative[-1])
    return int(np.searchsorted(cumulative, threshold, side="right"))


def next_tokens(
    logits: np.ndarray,
    counts: np.ndarray,
    settings: SampleSettings,
    seed: int,
    samples: np.ndarray,
    position: int,
) -> np.ndarray:
    """`next_token` for many rows at once: row i is token `position` of sample
    `samples[i]`, from its logits (M, V) and context counts (M, V); the same tokens, row by
    row, as `next_token` chooses (tests/test_sample.py holds them to it)."""
    big = penalized(logits, counts, settings)
    if settings.temperature == 0:
        return np.argmax(big, axis=1)
    e = (16 * (big.max(axis=1, keepdims=True) - big)) // settings.temperature
    w = exp_table()[e & 255] >> np.minimum(e >> 8, 31)
    w[MILLI * w < settings.min_p * TOP_WEIGHT] = 0
    if settings.top_k and settings.top_k < w.shape[1]:
        order = np.argsort(-big, axis=1, kind="stable")  # largest L first, then smaller id
        np.put_along_axis(w, order[:, settings.top_k :], 0, axis=1)
    cumulative = np.cumsum(w, axis=1)
    keys = combine_array(hash_key(DOMAIN_SAMPLE, seed), np.asarray(samples, dtype=np.uint64))
    r = combine_array(keys, np.full(len(keys), position, dtype=np.uint64))
    threshold = (r % cumulative[:, -1].astype(np.uint64)).astype(np.int64)
    return np.count_nonzero(cumulative <= threshold[:, None], axis=1)


class Decoder(Protocol):
    """Many rows of a (perturbed) model reading one token each at a time."""

    def read(self, tokens: np.ndarray) -> np.ndarray:
        """Read one token per row (M,); the logits (M, V) of the token after it."""
        ...


def generate_rows(
    decoder: Decoder,
    prompts: np.ndarray,
    new_tokens: int,
    settings: SampleSettings,
    seed: int,
    samples: np.ndarray,
) -> np.ndarray:
    """`generate` for rows of prompts of one length (M, L) at once: (M, new_tokens) tokens,
    row i the continuation `generate` writes for prompt i as sample `samples[i]`. Each row
    starts a document (token 0), then reads its prompt, as `generate` does."""
    m = prompts.shape[0]
    logits = decoder.read(np.zeros(m, dtype=np.int64))
    counts = np.zeros(logits.shape, dtype=np.int64)
    rows = np.arange(m)
    for t in range(prompts.shape[1]):
        logits = decoder.read(prompts[:, t])
        counts[rows, prompts[:, t]] += 1
    out = np.zeros((m, new_tokens), dtype=np.int64)
    for position in range(new_tokens):
        tok = next_tokens(logits, counts, settings, seed, samples, position)
        out[:, position] = tok
        counts[rows, tok] += 1
        if position + 1 < new_tokens:
            logits = decoder.read(tok)
    return out


@dataclass(frozen=True)
class Completions:
    """What members continue in a step of the reward objective: prompts (token ids), the
    sample number of each (its randomness), the step's seed, settings and length."""

    prompts: tuple[tuple[int, ...], ...]
    samples: tuple[int, ...]
    seed: int
    settings: SampleSettings
    new_tokens: int

    def groups(self) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
        """(indices, prompts (G, L), samples (G,)) of the prompts of each length L, which
        `generate_rows` reads together."""
        out = []
        for length in sorted({len(p) for p in self.prompts}):
            idx = [j for j, p in enumerate(self.prompts) if len(p) == length]
            tokens = np.array([self.prompts[j] for j in idx], dtype=np.int64).reshape(-1, length)
            out.append((idx, tokens, np.array([self.samples[j] for j in idx], dtype=np.int64)))
        return out


class StepModel(Protocol):
    """What generation needs of a model; the state is the model's own business."""

    vocab_size: int
    context: int  # prompt tokens conditioned on (a longer prompt keeps its last ones)

    def start(self) -> tuple[Any, np.ndarray]:
        """State and logits at the start of a document (before its first token)."""
        ...

    def step(self, state: Any, token: int) -> tuple[Any, np.ndarray]:
        """Read `token`; the next state and the logits of the token after it. May consume
        `state`. Must accept any number of steps (a windowed model slides its window)."""
        ...


def fit_prompt(prompt: Sequence[int], context: int, vocab_size: int) -> list[int]:
    """The prompt tokens the model conditions on: the last `context`, each checked."""
    kept = list(prompt)[len(prompt) - context :] if len(prompt) > context else list(prompt)
    for i, tok in enumerate(kept):
        if not 0 <= tok < vocab_size:
            raise SampleError(
                f"prompt token {i} is {tok}, outside the vocabulary 0..{vocab_size - 1}"
            )
    return kept


def generate(
    model: StepModel,
    prompt: Sequence[int],
    new_tokens: int,
    settings: SampleSettings,
    seed: int,
    sample: int = 0,
) -> Iterator[int]:
    """Yield `new_tokens` tokens that continue a document beginning with `prompt`, one at a
    time as they are chosen. Costs one model step per prompt token and per new token."""
    if not 0 <= new_tokens <= MAX_NEW_TOKENS:
        raise SampleError(f"tokens={new_tokens} must be in 0..{MAX_NEW_TOKENS}")
    kept = fit_prompt(prompt, model.context, model.vocab_size)
    counts = np.zeros(model.vocab_size, dtype=np.int64)
    state, logits = model.start()
    for tok in kept:
        state, logits = model.step(state, tok)
        counts[tok] += 1
    for position in range(new_tokens):
        tok = next_token(logits, counts, settings, seed, sample, position)
        yield tok
        counts[tok] += 1
        if position + 1 < new_tokens:
            state, logits = model.step(state, tok)


# --- held-out samples of a replica ----------------------------------------------------


@dataclass(frozen=True)
class TrainingSamples:
    """Every `every` steps (0: only when asked, as a worker is by SAMPLE), the unperturbed
    model continues a held-out document, by default document 0 with seed = step:
    `eggroll-sample SAVE_DIR --step S --seed S` writes the same text."""

    every: int
    valid: np.ndarray
    pieces: list[bytes]
    settings: SampleSettings = field(default_factory=SampleSettings)

    def tokens(
        self,
        state: ReplicaState,
        seed: int | None = None,
        document: int = 0,
        prompt_tokens: int = PROMPT_TOKENS,
        new_tokens: int = NEW_TOKENS,
    ) -> tuple[list[int], list[int]]:
        """(kept prompt, continuation) as token ids; the seed defaults to the state's step."""
        model = build_generator(state.config, state.params)
        prompt = held_out_prompt(self.valid, document, min(prompt_tokens, model.context))
        kept = fit_prompt(prompt, model.context, model.vocab_size)
        seed = state.step if seed is None else seed
        return kept, list(generate(model, kept, new_tokens, self.settings, seed=seed))

    def write(self, state: ReplicaState) -> tuple[str, str]:
        """(prompt, continuation) as text, unescaped."""
        kept, out = self.tokens(state)
        return decode(kept, self.pieces), decode(out, self.pieces)

    def request(self, step: int) -> SampleAsk:
        """The sample of step `step` as a request any backend answers (`write_sample`)."""
        return SampleAsk(step, 0, PROMPT_TOKENS, NEW_TOKENS, **asdict(self.settings))


class SampleRequest(Protocol):
    """What a sample request names (the protocol's SAMPLE message has these fields)."""

    @property
    def seed(self) -> int: ...
    @property
    def prompt_index(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def new_tokens(self) -> int: ...
    @property
    def temperature(self) -> int: ...
    @property
    def min_p(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def presence_penalty(self) -> int: ...
    @property
    def frequency_penalty(self) -> int: ...


@dataclass(frozen=True)
class SampleAsk:
    """A `SampleRequest` made here rather than received: a held-out document's continuation."""

    seed: int
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    temperature: int
    min_p: int
    top_k: int
    presence_penalty: int
    frequency_penalty: int


def write_sample(
    state: ReplicaState, dataset: Dataset, request: SampleRequest
) -> tuple[bytes, bytes]:
    """A sample request answered with the unperturbed `state`: (prompt, continuation) as
    the vocabulary's bytes, whole (the carrier cuts them to what it holds)."""
    settings = SampleSettings(
        temperature=request.temperature,
        min_p=request.min_p,
        top_k=request.top_k,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
    )
    samples = TrainingSamples(0, dataset.valid, dataset.decoding, settings)
    kept, out = samples.tokens(
        state, request.seed, request.prompt_index, request.prompt_tokens, request.new_tokens
    )
    pieces = dataset.decoding
    prompt, text = (b"".join(pieces[t] for t in ids) for ids in (kept, out))
    return prompt, text

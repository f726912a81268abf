"""Claims: the completions behind the results of a run checked through its text (a Hugging
Face model's reward; protocol CLAIM, SPEC §8 Checks).

A worker's RESULT in such a run comes right after a CLAIM of the token ids its members
wrote. The first claim of each distinct result of a chunk is kept (at most MAX_CLAIMS), and
a worker leased that chunk later is sent them before its JOB: it checks that the tokens are
what those members would write and scores their text with the run's reward, so that results
compare byte for byte. Pure bookkeeping for the run core: every size is checked against the
run's config before anything is kept, and all of it is dropped when a step opens."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from ..protocol import DEFAULT_MAX_PAYLOAD_BYTES, MAX_CLAIMS_PER_CHUNK, messages
from ..shared.config import RunConfig

__all__ = ["MAX_CLAIMS", "MAX_CLAIM_TOKENS", "Claims", "too_large"]

MAX_CLAIMS = MAX_CLAIMS_PER_CHUNK  # distinct results of one chunk a checker is sent
# A chunk's completions go in one CLAIM: 4 bytes a token and a 12-byte header in a frame.
MAX_CLAIM_TOKENS = (DEFAULT_MAX_PAYLOAD_BYTES - 12) // 4

Key = tuple[bytes, int]  # a result as compared: packed fitness, loss sum


def too_large(cfg: RunConfig) -> str | None:
    """Why the run's claims cannot be sent (one line), or None. A coordinator's limit: one
    process (eggroll-tune) sends none."""
    f = cfg.fitness
    ids = cfg.es.chunk_size * f.prompts_per_step * f.completion_tokens
    if ids <= MAX_CLAIM_TOKENS:
        return None
    return (
        f"es.chunk_size * fitness.prompts_per_step * fitness.completion_tokens is {ids:,} "
        f"tokens a chunk; a Hugging Face model's reward run sends them with each result, at "
        f"most {MAX_CLAIM_TOKENS:,}: lower es.chunk_size"
    )


class Claims:
    """The open step's claims: pending ones (a worker's CLAIM waiting for its RESULT) and,
    per chunk, the first claim of each distinct result."""

    def __init__(self, cfg: RunConfig) -> None:
        f = cfg.fitness
        self.ids = cfg.es.chunk_size * f.prompts_per_step * f.completion_tokens
        self.step = -1
        self.pending: dict[tuple[Hashable, int], bytes] = {}  # (worker, chunk) -> tokens
        self.held: dict[int, dict[Key, bytes]] = {}  # chunk -> result -> tokens

    def start(self, step: int) -> None:
        """A step opens (or the run rewound): claims of any other step mean nothing."""
        self.step = step
        self.pending.clear()
        self.held.clear()

    def problem(self, msg: messages.Claim, held: bool) -> str | None:
        """Why a worker's CLAIM is refused (one line), or None; `held`: the worker holds a
        lease of that chunk."""
        if msg.step != self.step:
            return None if msg.step < self.step else f"CLAIM for step {msg.step}, not yet open"
        if not held:
            return f"CLAIM for chunk {msg.chunk}, which is not leased to this worker"
        if len(msg.tokens) != 4 * self.ids:
            return (
                f"CLAIM of {len(msg.tokens) // 4} token ids; a chunk of this run writes "
                f"{self.ids} (members x prompts x completion tokens)"
            )
        return None

    def put(self, worker: Hashable, msg: messages.Claim) -> None:
        """Keep a checked CLAIM of the open step until its RESULT (one per chunk)."""
        if msg.step == self.step:
            self.pending[worker, msg.chunk] = msg.tokens

    def take(self, worker: Hashable, chunk: int) -> bytes | None:
        """The claim that came before `worker`'s RESULT for `chunk`, if any."""
        return self.pending.pop((worker, chunk), None)

    def attach(self, chunk: int, key: Key, tokens: bytes) -> None:
        """A result of `chunk` of the open step and its claim: kept if it is the first claim
        of that result and the chunk holds fewer than MAX_CLAIMS."""
        held = self.held.setdefault(chunk, {})
        if key not in held and len(held) < MAX_CLAIMS:
            held[key] = tokens

    def to_check(
        self, step: int, chunk: int, votes: Mapping[Key, Sequence[Hashable]]
    ) -> list[messages.Claim]:
        """The CLAIMs a worker leased `chunk` is sent before its JOB, in order of arrival:
        those of results that still have votes (a convicted worker's are dropped with them)."""
        if step != self.step:
            return []
        held = self.held.get(chunk, {})
        return [messages.Claim(step, chunk, t) for key, t in held.items() if votes.get(key)]

    def settled(self, chunk: int) -> None:
        """The chunk's result is decided: nobody is leased it again, its claims are freed."""
        self.held.pop(chunk, None)

    def forget(self, worker: Hashable) -> None:
        """A worker left: its pending claims will have no RESULT."""
        for key in [k for k in self.pending if k[0] == worker]:
            del self.pending[key]

"""What a chunk's fitness measures: the data's next-token loss, or a reward over generated
text (shared/objectives/reward.py). Both give a `ChunkResult` per chunk, held-out rewards
and samples, so the trainer and the worker daemon never ask which objective a run has: a
new objective is a module in shared/objectives/ and its runner here, in `MAKERS`.

`ChunkResult.loss_sum` is the chunk's integer loss (1/16 bit) for the loss, the sum of its
rewards in millionths (`shared.objectives.reward.REWARD_UNIT`) for a reward: what RESULT
carries, and what `shared.fitness.mean_score` turns into the step's mean loss or reward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import structlog

from ..shared.config import RunConfig
from ..shared.data import Dataset
from ..shared.fitness import checked_by_claims
from ..shared.objectives.reward import reward_fitness, reward_units
from ..shared.prompts import (
    Prompt,
    Prompts,
    generation_seed,
    held_out,
    load_prompts,
    settings,
    step_prompts,
)
from ..shared.sample import Completions, SampleRequest
from ..shared.text_codec import TextCodec, data_codec
from .backend import Backend, ChunkResult
from .reward import InProcessRunner, RewardRunner

__all__ = ["NextToken", "Objective", "Reward", "make_objective"]

log = structlog.get_logger("eggroll.worker")


class Objective(Protocol):
    def evaluate_chunk(self, backend: Backend, step: int, first: int, count: int) -> ChunkResult:
        """Members [first, first + count) of `step`: the worker daemon's one chunk."""
        ...

    def evaluate_chunks(
        self,
        backend: Backend,
        step: int,
        chunks: Sequence[tuple[int, int]],
        claims: Sequence[Sequence[np.ndarray]] = (),
    ) -> list[ChunkResult]:
        """(first_member, count) chunks of `step`, in order; `claims`, per chunk, other
        workers' completions to check first (runs checked by claims)."""
        ...

    def held_out(self, backend: Backend) -> float | None:
        """The unperturbed model's mean reward on the held-out prompts (None: no reward)."""
        ...

    @property
    def held_out_prompts(self) -> int:
        """How many prompts `held_out` scores (0: none)."""
        ...

    def parallel_chunks(self, backend: Backend) -> int:
        """How many chunks `evaluate_chunks` gains by taking at once (1: none)."""
        ...

    def sample(self, backend: Backend, request: SampleRequest) -> tuple[str, str]:
        """What the unperturbed model writes, as (prompt, text): what this objective
        scores (a reward: a held-out prompt's completion), else `request`'s held-out
        document's continuation."""
        ...

    def close(self) -> None: ...


class NextToken:
    """The loss of the data's windows: the backend's own evaluation."""

    def evaluate_chunk(self, backend: Backend, step: int, first: int, count: int) -> ChunkResult:
        return backend.evaluate_chunk(step, first, count)

    def evaluate_chunks(
        self,
        backend: Backend,
        step: int,
        chunks: Sequence[tuple[int, int]],
        claims: Sequence[Sequence[np.ndarray]] = (),
    ) -> list[ChunkResult]:
        return backend.evaluate_chunks(step, chunks)  # exact: compared without claims

    def held_out(self, backend: Backend) -> float | None:
        return None

    held_out_prompts = 0

    def parallel_chunks(self, backend: Backend) -> int:
        return backend.parallel_chunks

    def sample(self, backend: Backend, request: SampleRequest) -> tuple[str, str]:
        prompt, text = backend.write_sample(request)
        return prompt.decode("utf-8", "replace"), text.decode("utf-8", "replace")

    def close(self) -> None:
        pass


class Reward:
    """Members continue the step's prompts, the run's reward scores the completions."""

    def __init__(
        self,
        cfg: RunConfig,
        prompts: Prompts,
        runner: RewardRunner | InProcessRunner,
        codec: TextCodec,
    ) -> None:
        self.cfg, self.prompts, self.runner, self.codec = cfg, prompts, runner, codec
        self.claimed = checked_by_claims(cfg)  # results carry their completions
        self.reward_seconds = 0.0  # inside the reward function, for throughput reports
        self.generate_seconds = 0.0
        self.completions = 0

    def _request(self, chosen: list[Prompt], step: int) -> Completions:
        cfg = self.cfg
        return Completions(
            tuple(p.tokens for p in chosen),
            tuple(p.index for p in chosen),
            generation_seed(cfg, step),
            settings(cfg),
            cfg.fitness.completion_tokens,
        )

    def _rewards(self, chosen: list[Prompt], tokens: np.ndarray) -> np.ndarray:
        """Rewards (members, prompts) of completions (members, prompts, N)."""
        members = tokens.shape[0]
        texts = [self.codec.decode(row) for member in tokens.tolist() for row in member]
        prompts = [p.text for _ in range(members) for p in chosen]
        keys = sorted({k for p in chosen for k in p.fields})
        fields: dict[str, list[Any]] = {
            k: [p.fields.get(k) for _ in range(members) for p in chosen] for k in keys
        }
        t0 = time.perf_counter()
        values = self.runner.score(prompts, texts, fields)
        self.reward_seconds += time.perf_counter() - t0
        self.completions += len(texts)
        return np.array(values, dtype=np.float64).reshape(members, len(chosen))

    def evaluate_chunk(self, backend: Backend, step: int, first: int, count: int) -> ChunkResult:
        return self.evaluate_chunks(backend, step, [(first, count)])[0]

    def evaluate_chunks(
        self,
        backend: Backend,
        step: int,
        chunks: Sequence[tuple[int, int]],
        claims: Sequence[Sequence[np.ndarray]] = (),
    ) -> list[ChunkResult]:
        """Each chunk's completions (the first claimed ones its members would write, else
        their own), and the fitness of their rewards."""
        chosen = step_prompts(self.cfg, self.prompts, step)
        request = self._request(chosen, step)
        results = []
        for i, (first, count) in enumerate(chunks):
            t0 = time.perf_counter()
            claimed = claims[i] if i < len(claims) else ()
            tokens = self._confirmed(backend, step, (first, count), request, claimed)
            if tokens is None:
                tokens = backend.complete(step, (first, count), request)
            self.generate_seconds += time.perf_counter() - t0
            rewards = self._rewards(chosen, tokens)
            kept = tokens if self.claimed else None
            results.append(ChunkResult(reward_fitness(rewards), reward_units(rewards), kept))
        return results

    def _confirmed(
        self,
        backend: Backend,
        step: int,
        members: tuple[int, int],
        request: Completions,
        claimed: Sequence[np.ndarray],
    ) -> np.ndarray | None:
        """Of the claimed completions that are what these members would write (each token
        within the claim tolerance, worker/hf_claims.py), the closest to this worker's own
        reading (arrival order decides nothing), or None."""
        if not claimed:
            return None
        from .hf_claims import CLAIM_TOLERANCE, plausible  # torch's: claims are hf runs'

        best: tuple[float, int] | None = None
        for index, tokens in enumerate(claimed):
            check = backend.claim_distances  # type: ignore[attr-defined]
            distances = check(step, members, request, tokens)
            if plausible(distances):
                worst = float(distances.max(initial=0.0))
                best = min(best or (worst, index), (worst, index))
                continue
            log.info(
                "claim refuted",
                step=step,
                members=list(members),
                claim=index,
                tokens_off=int((distances > CLAIM_TOLERANCE).sum()),
                worst=round(float(distances.max()), 4),
            )
        return None if best is None else claimed[best[1]]

    def held_out(self, backend: Backend) -> float | None:
        chosen = held_out(self.cfg, self.prompts)
        if not chosen:
            return None
        tokens = backend.complete(backend.step, None, self._request(chosen, backend.step))
        return float(self._rewards(chosen, tokens).mean())

    @property
    def held_out_prompts(self) -> int:
        return len(held_out(self.cfg, self.prompts))

    def parallel_chunks(self, backend: Backend) -> int:
        return 1  # a reward's chunks are scored one after another: no gain in asking more

    def sample(self, backend: Backend, request: SampleRequest | None = None) -> tuple[str, str]:
        """The unperturbed model's completion of the first held-out prompt (prompt, text)."""
        chosen = held_out(self.cfg, self.prompts)[:1] or self.prompts.train[:1]
        tokens = backend.complete(backend.step, None, self._request(chosen, backend.step))
        return chosen[0].text, self.codec.decode(tokens[0, 0].tolist())

    def close(self) -> None:
        self.runner.close()


def _next_token(*_: object) -> Objective:
    return NextToken()  # the backend's own evaluation: nothing to read or start


def _reward(
    cfg: RunConfig,
    dataset: Dataset | None,
    base: Path,
    reward_timeout_s: float,
    codec: TextCodec | None,
    function: Callable[..., Any] | None,
) -> Objective:
    codec = codec or data_codec(cfg, dataset)
    prompts = load_prompts(cfg, base, dataset, codec)
    runner: RewardRunner | InProcessRunner = (
        RewardRunner.of(cfg, base, reward_timeout_s)
        if function is None
        else InProcessRunner(function, cfg.fitness.reward)
    )
    runner.start()  # a reward file that does not import fails here, not at the first chunk
    return Reward(cfg, prompts, runner, codec)


# The worker's side of each objective of `shared.objectives.OBJECTIVES`, by the same name.
MAKERS = {"next_token": _next_token, "reward": _reward}


def make_objective(
    cfg: RunConfig,
    dataset: Dataset | None,
    base: Path,
    reward_timeout_s: float = 120.0,
    codec: TextCodec | None = None,
    function: Callable[..., Any] | None = None,
) -> Objective:
    """The run's objective; goal files are read under `base` (GoalError if one is missing
    or not the run's: check them with `shared.pinned.check_files` first; RewardError if the
    reward does not import). Text is the model's own (`codec`: a Hugging Face tokenizer),
    else the data's vocabulary (`dataset` None: a run without data, whose reward reads
    its prompts file with `codec`). `function`: the reward as a Python function (the API's
    `python:` reward), called in this process."""
    return MAKERS[cfg.fitness.objective](cfg, dataset, base, reward_timeout_s, codec, function)

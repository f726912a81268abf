"""What the run core reports and asks that depends on nothing but its arguments: a committed
step's event, the SAMPLE request of a step (protocol/SPEC.md §8 Samples), a worker's LOG
line within its allowance. Pure code."""

from __future__ import annotations

import math

from ..protocol import messages
from ..shared.config import RunConfig
from ..shared.fitness import mean_score, member_tokens
from ..shared.objectives import objective_of
from ..shared.sample import NEW_TOKENS, PROMPT_TOKENS, SampleSettings
from .core_types import LOG_BURST, LOG_PER_S, Peer
from .events import Committed, Event, WorkerLog, WorkerLogsDropped
from .jobs import StepJobs


def committed(
    cfg: RunConfig, step: int, jobs: StepJobs, now: float, changed: int | None, workers: int
) -> Committed:
    """The event of step `step`, committed at `now` with `jobs` complete."""
    # From the step's first lease: time spent waiting for workers is not step time.
    seconds = max(now - (jobs.first_lease or jobs.opened), 1e-9)
    score = mean_score(cfg, jobs.loss_sum)
    scores = {objective_of(cfg).SCORE: score}  # "loss_bits" or "reward"
    return Committed(
        step=step,
        seconds=seconds,
        loss_bits=scores.get("loss_bits", math.nan),
        reward=scores.get("reward"),
        member_tokens=member_tokens(cfg, cfg.es.population),
        changed=changed or 0,
        workers=workers,
        requeued=sum(jobs.requeued.values()),
    )


def sample_request(step: int) -> messages.Sample:
    """The run's sample at `step`: `eggroll-sample SAVE_DIR --step S --seed S` writes it."""
    settings = SampleSettings()
    return messages.Sample(
        step=step,
        seed=step,
        prompt_index=0,
        prompt_tokens=PROMPT_TOKENS,
        new_tokens=NEW_TOKENS,
        temperature=settings.temperature,
        min_p=settings.min_p,
        top_k=settings.top_k,
        presence_penalty=settings.presence_penalty,
        frequency_penalty=settings.frequency_penalty,
    )


def worker_log(peer: Peer, msg: messages.Log, now: float) -> list[Event]:
    """A worker's line for the coordinator's log, within its allowance: a worker must not
    fill the disk or drown the log (LOG_BURST at once, then LOG_PER_S a second)."""
    refill = (now - peer.log_at) * LOG_PER_S
    peer.log_allowance, peer.log_at = min(LOG_BURST, peer.log_allowance + refill), now
    if peer.log_allowance < 1:
        peer.logs_dropped += 1
        return []
    peer.log_allowance -= 1
    out: list[Event] = []
    if peer.logs_dropped:
        out.append(WorkerLogsDropped(peer.name, peer.logs_dropped))
        peer.logs_dropped = 0
    return [*out, WorkerLog(peer.name, int(msg.level), msg.text)]

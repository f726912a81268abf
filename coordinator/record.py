"""How the run core's events are measured and logged: `events.py` says what happened, this
module what each costs in the metrics (`metrics.py`) and which log line it makes.

Log event names and fields are a contract (shared/logs.py names those eggroll-local reads).
A committed step, a held-out score and a sample are points of the run's curve too: they go
to the `curve` sink (history.log and the experiment tracker) as well as the log. Every event
belongs to one family below; one no family records is a bug, never a silent loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import structlog

from ..shared.logs import PROGRESS, SAMPLE, STEP, VALIDATION, held_out_fields
from ..shared.save_dir import DIGESTS_LOG, HISTORY_LOG, RUN_FILE
from ..shared.tracking import CurveSink
from . import events
from .core_types import LOG_PER_S
from .curve import REWOUND
from .jobs import Outcome
from .metrics import Metrics

__all__ = ["record"]

log = structlog.get_logger("eggroll.coordinator")

Net = tuple[int, int]  # bytes received and sent since the last commit
# Records one family's events; False for an event of another family.
Family = Callable[[Metrics, events.Event, Net, CurveSink | None], bool]


def record(
    metrics: Metrics,
    event: events.Event,
    net: Net = (0, 0),
    curve: CurveSink | None = None,
) -> None:
    """Measure and log one event of the run core. `net`: the bytes received and sent since
    the last commit, for a `Committed` step's line. Log event names and fields are a
    contract (shared/logs.py). `curve` gets the step, validation and sample lines as records
    too (history.log and the tracker)."""
    for family in _FAMILIES:
        if family(metrics, event, net, curve):
            return
    # A new event must be recorded here, or it would vanish silently.
    raise TypeError(f"no record for the event {event!r}")


def _record_curve(metrics: Metrics, event: events.Event, net: Net, curve: CurveSink | None) -> bool:
    """The points of the run's curve: a committed step, a held-out score, a sample."""
    match event:
        case events.Committed():
            metrics.committed(event.seconds, event.loss_bits, event.member_tokens, event.reward)
            score = (
                {"loss_bits": round(event.loss_bits, 4)}
                if event.reward is None
                else {"reward": round(event.reward, 4)}
            )
            _log(
                curve,
                STEP,
                step=event.step + 1,  # steps committed, this one included
                member_tokens=event.member_tokens,
                **score,
                step_s=round(event.seconds, 3),
                changed=event.changed,
                member_tok_s=round(event.member_tokens / event.seconds),
                workers=event.workers,
                net_in=net[0],
                net_out=net[1],
                requeued=event.requeued,
            )
        case events.Validated(scores=v):
            metrics.validated(v)
            streams = v.stream_tokens > 0  # 0: the model carries no state along a stream
            _log(
                curve,
                VALIDATION,
                step=v.step,
                **held_out_fields(
                    v.bits_per_token,
                    v.bits_per_byte,
                    v.stream_bits_per_token if streams else None,
                    v.stream_bits_per_byte,
                ),
                tokens=v.tokens,
                worker=event.worker,
                **({"held_out_reward": round(v.reward, 4)} if v.reward_prompts else {}),
            )
        case events.Sampled():
            metrics.sampled(event.step, event.worker, event.prompt, event.text)
            _log(
                curve,
                SAMPLE,
                step=event.step,
                worker=event.worker,
                prompt=event.prompt,
                text=event.text,
            )
        case _:
            return False
    return True


def _record_chunks(
    metrics: Metrics, event: events.Event, net: Net, curve: CurveSink | None
) -> bool:
    """The open step's chunks: leased, timed, settled, checked, dropped, re-queued."""
    match event:
        case events.Leased():
            metrics.chunks_leased.inc()
        case events.ChunkTimed():
            metrics.worker_chunk(event.worker, event.seconds, event.member_tokens)
        case events.ChunkAccepted():
            metrics.chunks_completed.inc()
        case events.ChunkChecked():
            metrics.chunk_checks.labels(event.result).inc(len(event.chunks))
            if event.result == "disputed":
                log.warning(
                    "results differ",
                    step=event.step,
                    chunk=event.chunks[0],
                    hint="further workers score the chunk; the result with the most votes wins",
                )
            elif event.result == "waived":
                log.info("checks waived", step=event.step, chunks=event.chunks)
        case events.ResultDropped():
            metrics.results_dropped.labels(event.reason).inc()
            if not event.refused:
                level = log.error if event.reason == Outcome.MISMATCH.value else log.info
                level(
                    "result dropped",
                    reason=event.reason,
                    worker=event.worker,
                    step=event.step,
                    chunk=event.chunk,
                )
        case events.Requeued():
            metrics.chunks_requeued.labels(event.reason).inc(len(event.chunks))
            log.info("chunks requeued", reason=event.reason, chunks=event.chunks, step=event.step)
        case events.Progress():
            log.info(
                PROGRESS,
                step=event.step,
                chunks_done=event.chunks_done,
                chunks=event.chunks,
                seconds=event.seconds,
            )
        case events.CatchupServed():
            metrics.catchup_steps.inc(event.steps)
        case _:
            return False
    return True


def _record_disputes(
    metrics: Metrics, event: events.Event, net: Net, curve: CurveSink | None
) -> bool:
    """Disputes that undo steps, wait, or stop the run (`trust.py`, `rewind.py`)."""
    match event:
        case events.Rewound():
            log.warning(
                "run rewound",
                from_step=event.first,
                to_step=event.end,
                chunks_suspect=event.chunks,
                why=event.why,
                kept=event.kept,
                hint="steps from from_step on are evaluated again without the convicted "
                "machine; every worker reconnects and replays the log",
            )
            if curve is not None:  # the curve's points past it are undone (curve.py)
                curve({"event": REWOUND, "step": event.first})
        case events.RewindOutside():
            log.warning(
                "rewind out of reach",
                first_step=event.first,
                last_step=event.last,
                chunks_suspect=event.chunks,
                why=event.why,
                hint="these steps lie beyond --rewind-steps and stay",
            )
        case events.Undecided():
            log.error(
                "results differ and no connected machine can decide",
                step=event.step,
                chunk=event.chunk,
                machines=",".join(event.hosts),
                hint="the run stops (its next line says why): a reward that is not "
                "deterministic, or a faulty machine; a worker on a third machine would decide",
            )
        case events.Unchecked():
            log.warning(
                "results wait for another machine",
                step=event.step,
                chunks=",".join(map(str, event.chunks)),
                machines=",".join(event.hosts),
                hint="these machines lost a vote and their results are never accepted "
                "unchecked: the run waits until a worker on another machine joins",
            )
        case events.Nondeterministic():
            log.error(
                "results differ: the run stops",
                step=event.step,
                chunk=event.chunk,
                workers=",".join(event.workers),
                reason=event.message,
            )
        case _:
            return False
    return True


def _record_trust(metrics: Metrics, event: events.Event, net: Net, curve: CurveSink | None) -> bool:
    """What the trust rules decided (`trust.py`): votes lost, stalls, identities, digests."""
    match event:
        case events.Outvoted():
            metrics.workers_outvoted.inc()
            log.error(
                "worker outvoted",
                worker=event.worker,
                peer=event.address,
                step=event.step,
                chunk=event.chunk,
                hint="its fitness differs from other workers' for the same chunk (a fault or "
                "a lie): its results of the step are dropped, it resyncs, and every result "
                "from its machine (its address, or its certificate) is checked from now on",
            )
        case events.Stalled():
            metrics.workers_stalled.inc()
            log.warning(
                "worker stalled",
                worker=event.worker,
                peer=event.address,
                step=event.step,
                seconds=event.seconds,
                hint="it holds a chunk long past its deadline, or has returned no result in "
                "that time: checks no longer wait for it until it returns one (a hung GPU? "
                "restart that worker)",
            )
        case events.SharedIdentity():
            log.warning(
                "one certificate from several addresses",
                machine=event.machine,
                addresses=",".join(event.addresses),
                hint="machines that share a certificate (or its common name), or a worker "
                "credential, count as one in the checks: give each machine its own (ignore "
                "this for one machine with several addresses)",
            )
        case events.DataDigestAgreed():
            log.info("data digest agreed", digest=event.digest.hex()[:16], workers=event.workers)
        case events.DigestMismatch():
            metrics.digest_mismatches.inc()
        case events.DigestsDisagree():
            metrics.digest_mismatches.inc()
            log.warning(
                "digests disagree",
                step=event.step,
                digests=event.digests,
                hint="no two workers agree on the replica: a backend or version differs",
            )
        case _:
            return False
    return True


def _record_workers(
    metrics: Metrics, event: events.Event, net: Net, curve: CurveSink | None
) -> bool:
    """Workers coming, going, refused, and what they say."""
    match event:
        case events.Joined():
            machine = {"machine": event.machine} if event.machine else {}
            log.info(
                "worker joined",
                worker=event.worker,
                peer=event.address,
                workers=event.workers,
                **machine,
            )
        case events.NameShared():
            log.warning(
                "two workers share a name",
                worker=event.worker,
                peer=event.address,
                other=event.other,
                hint="give each worker its own --name: their lines and metrics mix",
            )
        case events.Overprovisioned():
            log.warning(
                "more workers than chunks",
                workers=event.workers,
                chunks=event.chunks,
                hint=f"a step has {event.chunks} chunks: the workers beyond them wait, or "
                "score check and backup copies; a run with es.population of at least "
                f"workers x {event.chunk_size} keeps every worker busy",
            )
        case events.Left():
            log.info("worker left", worker=event.worker, workers=event.workers)
            if not event.namesakes:  # a reconnected worker's new session keeps its series
                metrics.worker_left(event.worker)
        case events.Rejected():
            metrics.protocol_errors.labels(event.code.name).inc()
            log.warning(
                "rejecting worker", worker=event.worker, code=event.code.name, reason=event.reason
            )
        case events.WorkerLog():
            log.info("worker log", worker=event.worker, level=event.level, text=event.text)
        case events.WorkerLogsDropped():
            log.warning(
                "worker log lines dropped",
                worker=event.worker,
                lines=event.lines,
                hint=f"a worker's LOG lines are kept at {LOG_PER_S:g} a second at most",
            )
        case events.WorkerError():
            log.warning("worker error", worker=event.worker, code=event.code, text=event.text)
        case _:
            return False
    return True


def _record_files(metrics: Metrics, event: events.Event, net: Net, curve: CurveSink | None) -> bool:
    """Snapshots and the save directory's other files."""
    match event:
        case events.NoSnapshotSource():
            log.info(
                "no worker at the current step for a final snapshot yet",
                step=event.step,
                hint="one is asked when it reaches the step, within 10 s",
            )
        case events.SnapshotRejected():
            log.warning("snapshot rejected", worker=event.worker, reason=event.reason)
        case events.SnapshotDropped():
            metrics.save_dir_write_failures.labels("snapshot").inc()
            log.warning(
                "snapshot dropped",
                step=event.step,
                path=event.path,
                error=event.error,
                free_bytes=event.free_bytes,
                hint="the run goes on (the fitness log holds every step); the next snapshot "
                "step tries again",
            )
        case events.FileDegraded():
            name = os.path.basename(event.path)
            metrics.save_dir_write_failures.labels(_DEGRADED_FILES.get(name, "other")).inc()
            log.warning(
                "save directory write failed",
                path=event.path,
                error=event.error,
                free_bytes=event.free_bytes,
                hint=_DEGRADED_HINTS.get(name, "the run goes on"),
            )
        case events.SnapshotStored():
            metrics.snapshot_stored()
            log.info(
                "snapshot stored",
                step=event.step,
                worker=event.worker,
                bytes=event.bytes,
                digest=event.digest,
            )
        case _:
            return False
    return True


_FAMILIES: tuple[Family, ...] = (
    _record_chunks,  # the most frequent first
    _record_curve,
    _record_trust,
    _record_disputes,
    _record_workers,
    _record_files,
)


def _log(curve: CurveSink | None, event: str, **fields: Any) -> None:
    """An info line of the log that is a point of the curve too."""
    log.info(event, **fields)
    if curve is not None:
        curve({"event": event, **fields})


# A degraded file of the save directory -> its metric label, and what its loss costs.
_DEGRADED_FILES = {DIGESTS_LOG: "digests", RUN_FILE: "run", HISTORY_LOG: "history"}
_DEGRADED_HINTS = {
    DIGESTS_LOG: "the run goes on: agreed digests stay in memory, later lines are tried "
    "again, and workers agree a missing one again after a restart",
    RUN_FILE: "the run goes on with the data digest in memory; run.json is written again "
    "at each commit (until then a restart agrees the data digest again)",
    HISTORY_LOG: "the run goes on: records of the curve (eggroll-inspect's history and plot) "
    "are dropped until a write succeeds",
}

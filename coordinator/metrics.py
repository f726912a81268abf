"""Prometheus metrics of a run, all in one `Metrics(registry)` object (no module globals).

Names follow Prometheus conventions: base units, `_total` counters, `_seconds`, `_bytes`,
bounded labels only (reasons, error codes, message types, and worker names, which are
removed when a worker leaves); never a step or chunk label.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import start_http_server

from ..protocol import ErrorCode, MsgType, Validation
from .jobs import Outcome

# Why a RESULT is not used: every outcome but those that count (a result that settles its
# chunk, or one kept for its check), and a diverged replica.
KEPT = (Outcome.ACCEPTED, Outcome.VOTED, Outcome.DISPUTED)
DROP_REASONS = (*(o.value for o in Outcome if o not in KEPT), "diverged")
CHECK_RESULTS = ("agreed", "disputed", "waived")  # how a chunk's check ended (or went on)

# Training steps take from milliseconds (tiny models) to minutes (GPU populations of 2**20).
STEP_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def _package_version() -> str:
    try:
        return version("eggroll-distributed")
    except PackageNotFoundError:
        return "unknown"


class RunStatus(Protocol):
    """What the gauges read at scrape time (the run core's `Status`)."""

    @property
    def step(self) -> int: ...
    @property
    def workers(self) -> int: ...
    @property
    def weights_changed(self) -> int | None: ...
    @property
    def undecided(self) -> int: ...


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # Declared in groups, in the order /metrics lists them.
        self._declare_build(r)
        self._declare_steps(r)
        self._declare_validation(r)
        self._declare_chunks(r)
        self._declare_traffic(r)
        self._declare_replica(r)
        self._declare_per_worker(r)
        self._unknown_until_measured()
        self._label_values()

    def _declare_build(self, r: CollectorRegistry) -> None:
        """The coordinator's version, the run served, the process."""
        self.build_info = Info("eggroll_build", "Version of the coordinator.", registry=r)
        self.build_info.info({"version": _package_version(), "python": platform.python_version()})
        self.run_info = Info("eggroll_run", "The run served.", registry=r)
        ProcessCollector(registry=r)  # start time, CPU, memory: restarts and leaks show
        PlatformCollector(registry=r)

    def _declare_steps(self, r: CollectorRegistry) -> None:
        """Steps committed and the training score."""
        self.step = Gauge("eggroll_step", "The open step (= steps committed).", registry=r)
        self.steps_committed = Counter(
            "eggroll_steps_committed_total",
            "Steps committed by this coordinator process.",
            registry=r,
        )
        self.step_duration = Histogram(
            "eggroll_step_duration_seconds",
            "Wall time from a step's opening to its commit.",
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self.train_loss = Gauge(
            "eggroll_train_loss_bits",
            "Mean population loss of the last step, bits per token.",
            registry=r,
        )
        self.train_reward = Gauge(
            "eggroll_train_reward",
            "Mean reward per completion of the last step's population (reward runs).",
            registry=r,
        )

    def _declare_validation(self, r: CollectorRegistry) -> None:
        """Held-out scores and samples."""
        self.valid_reward = Gauge(
            "eggroll_valid_reward",
            "Mean reward of the unperturbed model on the held-out prompts (reward runs).",
            registry=r,
        )
        self.valid_bits = Gauge(
            "eggroll_valid_bits_per_token",
            "Held-out bits per token of the unperturbed model (windows from a zero state).",
            registry=r,
        )
        self.valid_bits_per_byte = Gauge(
            "eggroll_valid_bits_per_byte",
            "Held-out bits per byte of text of the unperturbed model (windows).",
            registry=r,
        )
        self.valid_stream_bits = Gauge(
            "eggroll_valid_stream_bits_per_token",
            "Held-out bits per token over long streams, the recurrent state carried.",
            registry=r,
        )
        self.valid_stream_bits_per_byte = Gauge(
            "eggroll_valid_stream_bits_per_byte",
            "Held-out bits per byte of text over long streams, the recurrent state carried.",
            registry=r,
        )
        self.sample = Info(
            "eggroll_sample",
            "The latest sample of the model's writing (escaped, one line each).",
            registry=r,
        )
        self.valid_step = Gauge(
            "eggroll_valid_step", "Step at which the held-out bits were measured.", registry=r
        )

    def _declare_chunks(self, r: CollectorRegistry) -> None:
        """Work done, chunks leased, their checks."""
        self.member_tokens = Counter(
            "eggroll_member_tokens_total", "Tokens scored by population members.", registry=r
        )
        self.workers = Gauge("eggroll_workers_connected", "Workers past the handshake.", registry=r)
        self.chunks_leased = Counter("eggroll_chunks_leased_total", "Chunks leased.", registry=r)
        self.chunks_completed = Counter(
            "eggroll_chunks_completed_total", "Chunks whose first valid result arrived.", registry=r
        )
        self.chunks_requeued = Counter(
            "eggroll_chunks_requeued_total", "Chunks put back in the queue.", ["reason"], registry=r
        )
        self.results_dropped = Counter(
            "eggroll_results_dropped_total", "RESULT messages not used.", ["reason"], registry=r
        )
        self.chunk_checks = Counter(
            "eggroll_chunk_checks_total",
            "Chunks checked by a second worker: agreed, disputed (results differ: more workers "
            "decide), waived (no other worker connected could check).",
            ["result"],
            registry=r,
        )
        self.workers_outvoted = Counter(
            "eggroll_workers_outvoted_total",
            "Workers whose fitness lost a vote to other workers' (dropped, then checked).",
            registry=r,
        )
        self.workers_stalled = Counter(
            "eggroll_workers_stalled_total",
            "Workers connected but doing no work (a hung GPU?) that held up a check: it was "
            "waived without them.",
            registry=r,
        )
        self.checks_undecided = Gauge(
            "eggroll_checks_undecided",
            "Disputed chunks of the open step that no connected machine can decide (results "
            "differ, and every machine has voted): the step waits for another machine.",
            registry=r,
        )

    def _declare_traffic(self, r: CollectorRegistry) -> None:
        """Protocol errors, bytes, catch-up and snapshot transfers, writes."""
        self.protocol_errors = Counter(
            "eggroll_protocol_errors_total",
            "Protocol errors, received or sent.",
            ["code"],
            registry=r,
        )
        self.network_bytes = Counter(
            "eggroll_network_bytes_total",
            "Bytes on worker connections, headers included.",
            ["direction", "type"],
            registry=r,
        )
        self.catchup_steps = Counter(
            "eggroll_catchup_steps_served_total",
            "Steps of fitness sent to workers catching up.",
            registry=r,
        )
        self.snapshot_transfers = Counter(
            "eggroll_snapshot_transfers_total",
            "Snapshots received from or sent to workers.",
            ["direction"],
            registry=r,
        )
        self.save_dir_write_failures = Counter(
            "eggroll_save_dir_write_failures_total",
            "Writes to the save directory that failed and were given up (the fitness log's "
            "stops the coordinator instead).",
            ["file"],
            registry=r,
        )

    def _declare_replica(self, r: CollectorRegistry) -> None:
        """The replica agreed on, and when it was last committed and stored."""
        self.digest_mismatches = Counter(
            "eggroll_replica_digest_mismatches_total",
            "Replica digests that differed from the agreed one.",
            registry=r,
        )
        self.weights_changed = Gauge(
            "eggroll_weights_changed", "int8 weights changed by the last update.", registry=r
        )
        self.last_commit = Gauge(
            "eggroll_last_commit_timestamp_seconds", "Unix time of the last commit.", registry=r
        )
        self.last_snapshot = Gauge(
            "eggroll_last_snapshot_timestamp_seconds",
            "Unix time of the last stored snapshot.",
            registry=r,
        )

    def _declare_per_worker(self, r: CollectorRegistry) -> None:
        """Each connected worker's speed (labels removed when it leaves)."""
        self.worker_tokens_per_second = Gauge(
            "eggroll_worker_member_tokens_per_second",
            "Member-tokens per second of a worker's last chunk.",
            ["worker"],
            registry=r,
        )
        self.worker_chunk_seconds = Gauge(
            "eggroll_worker_chunk_seconds",
            "Lease-to-result time of a worker's last chunk.",
            ["worker"],
            registry=r,
        )
        self.worker_member_tokens = Counter(
            "eggroll_worker_member_tokens_total",
            "Member-tokens of the chunks a worker completed.",
            ["worker"],
            registry=r,
        )

    def _unknown_until_measured(self) -> None:
        """Unknown until measured: NaN, not a misleading 0."""
        for gauge in (
            self.train_loss,
            self.train_reward,
            self.valid_reward,
            self.valid_bits,
            self.valid_bits_per_byte,
            self.valid_stream_bits,
            self.valid_stream_bits_per_byte,
            self.valid_step,
            self.last_commit,
            self.last_snapshot,
            self.weights_changed,
        ):
            gauge.set(float("nan"))

    def _label_values(self) -> None:
        """Label values that exist from the start, so the first event shows in rate()."""
        for reason in ("disconnect", "deadline", "outvoted"):
            self.chunks_requeued.labels(reason)
        for reason in DROP_REASONS:
            self.results_dropped.labels(reason)
        for result in CHECK_RESULTS:
            self.chunk_checks.labels(result)
        for code in ErrorCode:
            self.protocol_errors.labels(code.name)
        for file in ("snapshot", "digests", "run", "history"):
            self.save_dir_write_failures.labels(file)
        for direction in ("in", "out"):
            self.snapshot_transfers.labels(direction)
            for msg_type in MsgType:
                self.network_bytes.labels(direction, msg_type.name)

    def observe(self, status: Callable[[], RunStatus], run_id: bytes, config_digest: bytes) -> None:
        """The run served, and the gauges read from `status()` at scrape time."""
        self.step.set_function(lambda: status().step)
        self.workers.set_function(lambda: status().workers)
        self.checks_undecided.set_function(lambda: status().undecided)

        def changed() -> float:
            value = status().weights_changed
            return float("nan") if value is None else value

        self.weights_changed.set_function(changed)
        self.run_info.info({"run_id": run_id.hex(), "config_digest": config_digest.hex()})

    def committed(
        self, seconds: float, loss_bits: float, member_tokens: int, reward: float | None = None
    ) -> None:
        self.steps_committed.inc()
        self.step_duration.observe(seconds)
        if reward is None:
            self.train_loss.set(loss_bits)
        else:
            self.train_reward.set(reward)
        self.member_tokens.inc(member_tokens)
        self.last_commit.set(time.time())

    def worker_chunk(self, name: str, seconds: float, member_tokens: int) -> None:
        self.worker_chunk_seconds.labels(name).set(seconds)
        self.worker_tokens_per_second.labels(name).set(member_tokens / seconds)
        self.worker_member_tokens.labels(name).inc(member_tokens)

    def validated(self, v: Validation) -> None:
        """A VALIDATION's scores; one not measured (no bytes, no streams) is NaN."""
        nan = float("nan")
        streams = v.stream_tokens > 0
        self.valid_bits.set(v.bits_per_token)
        self.valid_bits_per_byte.set(nan if v.bits_per_byte is None else v.bits_per_byte)
        self.valid_stream_bits.set(v.stream_bits_per_token if streams else nan)
        per_byte = v.stream_bits_per_byte
        self.valid_stream_bits_per_byte.set(nan if per_byte is None else per_byte)
        if v.reward_prompts:
            self.valid_reward.set(v.reward)
        self.valid_step.set(v.step)

    def sampled(self, step: int, worker: str, prompt: str, text: str) -> None:
        self.sample.info({"step": str(step), "worker": worker, "prompt": prompt, "text": text})

    def snapshot_stored(self) -> None:
        self.snapshot_transfers.labels("in").inc()
        self.last_snapshot.set(time.time())

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics over HTTP from a background thread."""
        start_http_server(port, addr=host, registry=self.registry)

    def worker_left(self, name: str) -> None:
        for gauge in (
            self.worker_tokens_per_second,
            self.worker_chunk_seconds,
            self.worker_member_tokens,
        ):
            try:
                gauge.remove(name)
            except KeyError:
                pass

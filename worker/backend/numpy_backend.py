"""The NumPy reference backend: evaluates chunks and applies committed steps on the CPU.

Every other backend must produce the same bytes as this one.

Its BLAS pool is sized here, not by the user: by default the cores this process may use,
divided by the workers on the host (EGGROLL_WORKERS_PER_HOST, else 1). An OpenBLAS pool as
large as the host in each of several processes, or on a busy host, spends its time waiting
for cores. The GEMMs are exact (integers in float32), so the thread count never changes a
result. The limit is applied with threadpoolctl around the backend's own compute, so it
works after NumPy is imported and leaves the rest of the process alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import numpy as np
import structlog
from threadpoolctl import ThreadpoolController

from ...shared.data import Dataset
from ...shared.fitness import pair_fitness
from ...shared.loss import token_loss, true_bits
from ...shared.model import Model, Recurrent, build_model, param_specs
from ...shared.perturb import member_noise, noise_scales, pair_noise
from ...shared.replica import ReplicaState
from ...shared.sample import Completions, SampleRequest, generate_rows, write_sample
from ...shared.update import apply_update
from ...shared.window import (
    VALIDATION_STREAMS,
    pair_windows,
    validation_streams,
    validation_windows,
)
from . import (
    BackendFactory,
    BackendUnavailable,
    ChunkResult,
    HeldOut,
    HostReplica,
    Validation,
    check_chunk,
)
from .held_out import no_room_for_copy

log = structlog.get_logger("eggroll.worker")

WORKERS_PER_HOST_VAR = "EGGROLL_WORKERS_PER_HOST"


def _cgroup_cpu_limit() -> float | None:
    """The CPU quota of this process's cgroup in cores (containers), or None if unlimited."""
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1: -1 means no quota
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (taskset, SLURM), capped by a cgroup
    CPU quota (containers)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # macOS, Windows
        cores = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def workers_per_host() -> int:
    """EGGROLL_WORKERS_PER_HOST (set by the launchers that start several workers), else 1."""
    raw = os.environ.get(WORKERS_PER_HOST_VAR, "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise BackendUnavailable(f"{WORKERS_PER_HOST_VAR}={raw!r} must be a whole number >= 1")
    return int(raw)


def default_threads() -> int:
    """BLAS threads for one worker: the usable cores shared by the workers on this host."""
    return max(1, usable_cores() // workers_per_host())


class NumpyBackend(HostReplica):
    """Holds one replica (weights) and the data, evaluates chunks, applies steps."""

    name = "numpy"
    codec = None  # text is the data's vocabulary
    device = "cpu"

    def __init__(
        self,
        dataset: Dataset,
        state: ReplicaState,
        batch_members: int = 1024,
        threads: int | None = None,
    ) -> None:
        """`threads`: BLAS threads while computing (default: `default_threads()`)."""
        if threads is not None and threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        self.dataset = dataset
        self.batch_members = max(2, batch_members - batch_members % 2)
        self.threads = threads or default_threads()
        self._pools = ThreadpoolController()
        # Bytes each token id decodes to, for bits per byte of the held-out text.
        self.piece_bytes = np.array([len(p) for p in dataset.decoding], dtype=np.int64)
        self.load_state(state)
        cfg = state.config
        for setting, on in (
            ("es.token_noise_rows", cfg.es.token_noise_rows),
            ("model.head_bias = 'zipf'", cfg.model.head_bias == "zipf"),
        ):
            if on and not dataset.meta.ids_by_frequency:
                log.warning(
                    f"{setting} assumes that low ids are the commonest tokens, but this "
                    "data's ids are not ranked by frequency (meta.json ids_by_frequency); "
                    "`eggroll-data prepare --tokenizer bpe` ranks the vocabulary it trains"
                )

    def _compute(self):  # a context manager; threadpoolctl's type is private
        """The BLAS (and OpenMP) pools limited to `self.threads`, restored afterwards."""
        return self._pools.limit(limits=self.threads)

    def load_state(self, state: ReplicaState) -> None:
        self.state = state
        self.model = build_model(state.config, state.params)

    def digest(self) -> int:
        return self.state.digest()

    @property
    def parallel_chunks(self) -> int:
        """Chunks `evaluate_chunks` scores at once: one per thread."""
        return self.threads

    def _check_range(self, step: int, first_member: int, count: int) -> None:
        check_chunk(self.config, self.step, step, first_member, count)

    def evaluate_chunk(self, step: int, first_member: int, count: int) -> ChunkResult:
        """Score members [first_member, first_member + count) of the population at `step`."""
        self._check_range(step, first_member, count)
        with self._compute():
            return self._evaluate(step, first_member, count)

    def evaluate_chunks(self, step: int, chunks: Sequence[tuple[int, int]]) -> list[ChunkResult]:
        """Several chunks of one step, up to `threads` at a time, each on its own thread with
        an equal share of the BLAS pool (one thread each when there are as many chunks as
        threads); results in order, each equal to `evaluate_chunk`'s.

        NumPy releases the GIL in its loops and GEMMs, and one chunk's GEMMs are too small to
        keep two BLAS threads busy: on two cores, one step's four chunks side by side take
        1.74x (`former-tiny`) and 1.28x (`tiny`) less time than one after the other
        (`scripts/bench_threads.py`). Evaluation is read-only, so the threads share the
        replica. The limit is set in each thread too: OpenMP builds of BLAS keep it per thread."""
        for first, count in chunks:
            self._check_range(step, first, count)
        workers = min(self.threads, len(chunks))
        if workers <= 1:
            with self._compute():
                return [self._evaluate(step, first, count) for first, count in chunks]
        share = max(1, self.threads // workers)

        def limit_this_thread() -> None:  # the thread ends with the pool: nothing to restore
            self._pools.limit(limits=share)

        with (
            self._pools.limit(limits=share),
            ThreadPoolExecutor(workers, initializer=limit_this_thread) as pool,
        ):
            return list(pool.map(lambda c: self._evaluate(step, *c), chunks))

    def _evaluate(self, step: int, first_member: int, count: int) -> ChunkResult:
        cfg = self.config
        losses = []
        specs = param_specs(cfg.model)
        scales = noise_scales(cfg, specs, self.state.opt)  # adaptive, token noise
        for lo in range(first_member, first_member + count, self.batch_members):
            hi = min(lo + self.batch_members, first_member + count)
            pairs = np.arange(lo // 2, hi // 2)
            noise = member_noise(
                pair_noise(cfg, specs, step, pairs, scales), self.state.params, cfg.es.sigma_shift
            )
            tokens = np.repeat(pair_windows(cfg, self.dataset.train, step, pairs), 2, axis=0)
            loss, _ = self.model.forward(tokens, noise)
            losses.append(loss)
        loss = np.concatenate(losses)
        return ChunkResult(pair_fitness(loss, cfg.fitness), int(loss.sum()))

    def write_sample(self, request: SampleRequest) -> tuple[bytes, bytes]:
        return write_sample(self.state, self.dataset, request)

    def complete(
        self, step: int, members: tuple[int, int] | None, request: Completions
    ) -> np.ndarray:
        """Tokens (count, P, N) that members [first, first + count) write for the request's
        P prompts (members None: the unperturbed model, (1, P, N)). Rows (pair, prompt, sign)
        read the prompts of one length together, each with its member's noise."""
        n = request.new_tokens
        count = 1 if members is None else members[1]
        out = np.zeros((count, len(request.prompts), n), dtype=np.int64)
        if members is not None:
            self._check_range(step, *members)
        cfg, params = self.config, self.state.params
        specs = param_specs(cfg.model)
        scales = noise_scales(cfg, specs, self.state.opt)
        with self._compute():
            for idx, prompts, samples in request.groups():
                g = len(idx)
                if members is None:
                    decoder = self.model.decoder(None, g)
                    out[0, idx] = generate_rows(
                        decoder, prompts, n, request.settings, request.seed, samples
                    )
                    continue
                first, count = members
                batch = max(2, self.batch_members // g // 2 * 2)
                for lo in range(first, first + count, batch):
                    hi = min(lo + batch, first + count)
                    pairs = np.arange(lo // 2, hi // 2)
                    noise = member_noise(
                        pair_noise(cfg, specs, step, np.repeat(pairs, g), scales),
                        params,
                        cfg.es.sigma_shift,
                    )
                    rows = np.tile(np.repeat(prompts, 2, axis=0), (len(pairs), 1))
                    decoder = self.model.decoder(noise, len(rows))
                    tokens = generate_rows(
                        decoder,
                        rows,
                        n,
                        request.settings,
                        request.seed,
                        np.tile(np.repeat(samples, 2), len(pairs)),
                    )  # rows (pair, prompt, sign) -> (member, prompt)
                    tokens = tokens.reshape(len(pairs), g, 2, n).transpose(0, 2, 1, 3)
                    out[lo - first : hi - first, idx] = tokens.reshape(hi - lo, g, n)
        return out

    def apply_step(self, fitness: np.ndarray) -> int:
        """Apply the committed fitness of step `self.step` (all pairs); returns weights changed."""
        cfg = self.config
        with self._compute():
            state = self.state
            updated = apply_update(cfg, state.step, state.params, state.opt, np.asarray(fitness))
        self.load_state(ReplicaState(cfg, state.step + 1, updated.params, updated.opt))
        return updated.changed

    def validate(self, rows_per_batch: int = 512, streams: int = VALIDATION_STREAMS) -> Validation:
        """Both held-out metrics of the unperturbed model over the same target tokens: the
        windows of training, and the span cut into `streams` streams with the state carried
        (only a model that `carries_state` has a state to carry)."""
        return self._validate(self.model, rows_per_batch, streams)

    def validation_copy(self) -> Callable[[], Validation] | None:
        """A host copy of the weights of this step and the call that scores it as `validate`
        does, on another thread while this backend goes on (NumPy releases the GIL in its
        loops and GEMMs); None when the host has no room for the copy (said in the log)."""
        try:
            params = {name: p.copy() for name, p in self.state.params.items()}
        except MemoryError:
            no_room_for_copy(self.name, "the host")
            return None
        model = build_model(self.config, params)
        return lambda: self._validate(model)

    def _validate(
        self, model: Model, rows_per_batch: int = 512, streams: int = VALIDATION_STREAMS
    ) -> Validation:
        cfg, valid = self.config, self.dataset.valid
        with self._compute():
            short = self._score_windows(model, validation_windows(cfg, valid), rows_per_batch)
            if not model.carries_state:
                return Validation(short, None)
            tokens, lengths = validation_streams(cfg, valid, streams)
            carried = self._score(cast(Recurrent, model), tokens, lengths, rows_per_batch)
        return Validation(short, carried)

    def _score_windows(self, model: Model, windows: np.ndarray, rows_per_batch: int) -> HeldOut:
        """The window metric: each window scored from its start, as in training."""
        loss, bits = 0, []
        for lo in range(0, len(windows), rows_per_batch):
            rows = windows[lo : lo + rows_per_batch]
            row_loss, row_bits = model.position_losses(rows, float_bits=True)
            loss += int(row_loss.sum())
            bits.append(row_bits.reshape(-1))
        n = windows.shape[0] * (windows.shape[1] - 1)
        text_bytes = int(self.piece_bytes[windows[:, 1:]].sum())
        return HeldOut(n, text_bytes, loss / n, math.fsum(np.concatenate(bits)) / n)

    def _score(
        self, model: Recurrent, tokens: np.ndarray, lengths: np.ndarray, rows_per_batch: int
    ) -> HeldOut:
        """Each row read token by token from a zero state, its state carried to the end (a
        `Recurrent` model): row i reads tokens[i, :lengths[i]] and predicts
        tokens[i, 1 : lengths[i] + 1] (lengths longest first). The bits are summed exactly
        (fsum), so neither the batching nor the cut of the span changes them beyond the
        per-token values."""
        loss, bits, text_bytes = 0, [], 0
        for lo in range(0, len(tokens), rows_per_batch):
            rows, ends = tokens[lo : lo + rows_per_batch], lengths[lo : lo + rows_per_batch]
            state = model.initial_state(len(rows))
            for t in range(int(ends[0])):
                reading = int(np.count_nonzero(ends > t))  # a prefix: longest rows first
                if reading < len(state[0]):
                    state = [s[:reading] for s in state]
                logits = model.step(state, rows[:reading, t])
                target = rows[:reading, t + 1]
                loss += int(token_loss(logits, target).sum())
                bits.append(true_bits(logits, target))
                text_bytes += int(self.piece_bytes[target].sum())
        n = int(lengths.sum())
        return HeldOut(n, text_bytes, loss / n, math.fsum(np.concatenate(bits)) / n)


def factory(batch_members: int = 1024, threads: int | None = None) -> BackendFactory:
    """The NumPy reference backend, `batch_members` members per forward sub-batch and
    `threads` BLAS threads (default: `default_threads()`, read now so that a bad setting
    stops the worker at start-up)."""
    threads = threads or default_threads()
    return BackendFactory(
        NumpyBackend.name,
        NumpyBackend.device,
        lambda dataset, state: NumpyBackend(dataset, state, batch_members, threads),
        threads,
    )

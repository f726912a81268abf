"""The worker's replica behind one async façade: the backend, its thread, its cached digest.

Every backend call (evaluate a chunk, apply a step, encode or decode a snapshot, copy the
weights for validation, write a sample) runs on one daemon thread: heartbeats and incoming
frames keep flowing while a long chunk runs, calls stay in order on one device context, and
a stopping worker need not wait for a chunk nobody will read. A validation scores its copy
of the weights on a second daemon thread (on a GPU, a second stream) while the first goes on
with the next steps; one copy is scored at a time. The replica outlives connections: it is
kept across reconnects while the coordinator's run id stays the same. `step`, `digest`,
`weights_changed`, `run_id` and `config_digest` are plain attributes the pure session reads
(`session.ReplicaView`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import structlog

from ..protocol import Sample
from ..protocol.messages import MAX_CHUNKS_PER_REQUEST, MAX_SAMPLE_TEXT_BYTES
from ..shared.config import RunConfig
from ..shared.data import Dataset
from ..shared.pinned import check_files
from ..shared.replica import CheckpointError, ReplicaState, decode_checkpoint, encode_checkpoint
from ..shared.start import initial_state
from .backend import Backend, BackendFactory, ChunkResult, Validation
from .objective import NextToken, Objective, make_objective
from .reward import RewardError

__all__ = ["Replica"]

log = structlog.get_logger("eggroll.worker")

T = TypeVar("T")

# A pass of chunks running this long is reported, and again each time as long again. Past
# HUNG_FACTOR times this replica's usual pass, and HUNG_S at least, the report is a warning:
# a hung device keeps the process heartbeating, and the coordinator stops waiting for it.
WATCH_S = 60.0
HUNG_FACTOR = 10
HUNG_S = 300.0


class _BackendThread(concurrent.futures.Executor):
    """One daemon thread for every backend call.

    One thread keeps calls in order and on one device context; a daemon thread lets the
    process exit on SIGTERM without waiting for a chunk that nobody will read.
    """

    def __init__(self, name: str = "eggroll-backend") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self.busy = False  # a call under way
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the backend thread is shut down")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            self.busy = True
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            finally:
                self.busy = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._jobs.put(None)
        if wait:
            self._thread.join()


class Replica:
    """The backend holding this worker's replica, or none yet; calls run on one thread, or
    at once on the caller's (`threaded=False`: the in-memory flow tests, where nothing else
    may run meanwhile)."""

    def __init__(
        self,
        dataset: Dataset,
        factory: BackendFactory,
        *,
        threaded: bool = True,
        goal_dir: Path | None = None,
        reward_timeout_s: float = 120.0,
        watch_s: float = WATCH_S,
        hung_s: float = HUNG_S,
    ) -> None:
        self.dataset = dataset
        self.factory = factory
        self.threaded = threaded
        # The worker's --goal-dir, the only place it reads a run's goal files from (None:
        # it reads none, shared/pinned.py: a run without goal files needs no folder at all).
        self.goal_dir = goal_dir
        self.reward_timeout_s = reward_timeout_s
        self.objective: Objective = NextToken()
        self.backend: Backend | None = None
        self.run_id: bytes | None = None
        self.digest = 0  # of backend.state, refreshed after every change
        self.weights_changed = 0  # by the update that produced the replica; 0 when unknown
        self._thread: _BackendThread | None = None
        self._scoring: _BackendThread | None = None  # scores validation's copies
        self._held_out: concurrent.futures.Future[Validation] | None = None  # being scored
        # Closed with a backend call still under way (a chunk nobody will read): the process
        # must then end without the interpreter's finalization (worker/cli.py).
        self.left_running = False
        self.watch_s, self.hung_s = watch_s, hung_s
        self._pass_s: deque[float] = deque(maxlen=16)  # the last passes' times

    # --- what the session reads --------------------------------------------------------

    @property
    def step(self) -> int:
        return -1 if self.backend is None else self.backend.step

    @property
    def parallel_chunks(self) -> int:
        """Chunks to ask for at once: what the backend scores in one pass, within the
        protocol's bound."""
        if self.backend is None:
            return 1
        own = self.objective.parallel_chunks(self.backend)
        return max(1, min(own, MAX_CHUNKS_PER_REQUEST))

    @property
    def config_digest(self) -> bytes | None:
        return None if self.backend is None else self.backend.config.digest()

    # --- lifetime ------------------------------------------------------------------------

    def open(self) -> None:
        self._thread = _BackendThread()
        self._scoring = _BackendThread("eggroll-held-out")

    def close(self) -> None:
        self.objective.close()
        if self._thread is not None:
            self.left_running = self._thread.busy
            self._thread.shutdown(wait=False)
            self._thread = None
        if self._scoring is not None:
            self.left_running |= self._scoring.busy
            self._scoring.shutdown(wait=False)
            self._scoring = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.threaded:
            return fn(*args)
        assert self._thread is not None, "backend calls happen between open() and close()"
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def drop(self) -> None:
        self.backend = None
        self.run_id = None
        self.objective.close()
        self.objective = NextToken()

    async def start(self, config: RunConfig, run_id: bytes) -> None:
        """A fresh replica at step 0 of the run, and the run's objective. GoalError when a
        goal file is missing or not the run's."""
        # The same goal everywhere (reward, prompts, start, model), under --goal-dir only.
        await self._call(check_files, config, self.goal_dir)
        base = self.goal_dir or Path(".")
        state = await self._call(initial_state, config, base)
        backend = await self._call(self.factory.build, self.dataset, state)
        objective = await self._call(  # off the event loop: heartbeats go on meanwhile
            make_objective,
            config,
            self.dataset,
            base,
            self.reward_timeout_s,
            backend.codec,
        )
        self.objective.close()
        self.objective = objective
        self.backend = backend
        self.run_id = run_id
        self.digest = await self._call(backend.digest)
        self.weights_changed = 0

    # --- backend calls -----------------------------------------------------------------

    def _backend(self) -> Backend:
        assert self.backend is not None, "no replica"
        return self.backend

    async def evaluate(
        self,
        step: int,
        chunks: list[tuple[int, int]],
        claims: Sequence[Sequence[np.ndarray]] = (),
    ) -> list[ChunkResult]:
        """Chunks' fitness, (first member, count) each, in one call of the backend (with,
        per chunk, the claimed completions to check first); RewardError when a reward run's
        reward fails on them."""
        backend, objective = self._backend(), self.objective
        if not self.threaded:  # nothing else runs meanwhile: nothing to watch
            return objective.evaluate_chunks(backend, step, chunks, claims)
        started = time.monotonic()
        call = asyncio.ensure_future(
            self._call(objective.evaluate_chunks, backend, step, chunks, claims)
        )
        try:
            while not (await asyncio.wait({call}, timeout=self.watch_s))[0]:
                self._still_evaluating(step, len(chunks), time.monotonic() - started)
        except asyncio.CancelledError:
            call.cancel()
            raise
        results = call.result()
        self._pass_s.append(time.monotonic() - started)
        return results

    def _still_evaluating(self, step: int, chunks: int, seconds: float) -> None:
        usual = statistics.median(self._pass_s) if self._pass_s else None
        fields = {"step": step, "chunks": chunks, "seconds": round(seconds)}
        if usual is not None:
            fields["usual_s"] = round(usual, 1)
        if usual is not None and seconds >= max(HUNG_FACTOR * usual, self.hung_s):
            log.warning(
                "still evaluating",
                **fields,
                hint="far longer than usual: is the device hung? the coordinator no longer "
                "waits for this worker's checks; restart it if this goes on",
            )
        else:
            log.info("still evaluating", **fields)

    async def apply(self, fitness: list[np.ndarray]) -> None:
        """Apply committed steps in order, one backend call per step (a stop or a heartbeat
        never waits for a whole batch)."""
        backend = self._backend()
        start, t0 = backend.step, time.monotonic()
        for values in fitness:
            self.weights_changed = await self._call(backend.apply_step, values)
        self.digest = await self._call(backend.digest)
        seconds = round(time.monotonic() - t0, 3)
        if len(fitness) == 1:
            # `step` counts the updates applied, so `digest` is the one reported for that step.
            log.info(
                "step applied",
                step=backend.step,
                changed=self.weights_changed,
                digest=f"{self.digest:016x}",
                seconds=seconds,
            )
        else:
            log.info("replayed", from_step=start, to_step=backend.step, seconds=seconds)

    async def encode(self) -> tuple[int, bytes]:
        state = await self._call(lambda: self._backend().state)  # a device copies it back
        return state.step, await self._call(encode_checkpoint, state)

    async def decode(self, blob: bytes) -> tuple[ReplicaState | None, str]:
        """The state in a checkpoint blob, or None and why it is not a valid one."""
        try:
            return await self._call(decode_checkpoint, blob), ""
        except CheckpointError as exc:
            return None, str(exc)

    async def load(self, state: ReplicaState) -> None:
        backend = self._backend()
        t0 = time.monotonic()
        await self._call(backend.load_state, state)
        self.weights_changed = 0  # unknown after a snapshot; 0 as at step 0
        self.digest = await self._call(backend.digest)
        log.info(
            "snapshot loaded",
            step=state.step,
            seconds=round(time.monotonic() - t0, 3),
            digest=f"{self.digest:016x}",
        )

    async def start_validation(self) -> concurrent.futures.Future[Validation]:
        """Validate the replica at its current step: the weights are copied now, in order
        with the chunks and steps, and the copy is scored on the scoring thread while the
        backend goes on; returns the scores' future. It is done at once where validation
        runs in order: an unthreaded replica, a reward run (its reward reads the live
        backend), a backend without copies or without room for one. A copy waits for the one
        before it to be scored."""
        backend, objective = self._backend(), self.objective
        if self._held_out is not None:
            await asyncio.wait({asyncio.wrap_future(self._held_out)})  # one copy at a time
        take = getattr(backend, "validation_copy", None)
        copy = None
        if self.threaded and take is not None and not objective.held_out_prompts:
            copy = await self._call(take)
        if copy is None:
            scores: concurrent.futures.Future[Validation] = concurrent.futures.Future()
            scores.set_result(await self.validate())
            return scores
        assert self._scoring is not None
        self._held_out = self._scoring.submit(copy)
        return self._held_out

    async def validate(self) -> Validation:
        """Both held-out metrics, and a reward run's held-out reward, in order with the
        other backend calls."""
        backend, objective = self._backend(), self.objective

        def score() -> Validation:
            v = backend.validate()
            try:
                reward = objective.held_out(backend)
            except RewardError as exc:  # reporting only: the run goes on without it
                log.warning("held-out reward failed", error=str(exc))
                reward = None
            if reward is None:
                return v
            return replace(v, reward=reward, reward_prompts=objective.held_out_prompts)

        return await self._call(score)

    async def sample(self, request: Sample) -> tuple[bytes, bytes]:
        """Generate from the host copy of the weights (as validation does on every backend),
        on the backend thread: in order with the chunks, never during an update. Prompt and
        continuation are each cut to what SAMPLE_TEXT carries."""
        backend = self._backend()

        prompt, text = await self._call(backend.write_sample, request)
        return prompt[:MAX_SAMPLE_TEXT_BYTES], text[:MAX_SAMPLE_TEXT_BYTES]

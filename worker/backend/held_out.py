"""Held-out scores off the training path: a copy of one step's weights, scored while the
backend evaluates and applies later steps (`Backend.validation_copy`).

The copy is scored by the very code of `validate`, so its numbers are those of `validate` at
that step, bit for bit. On the CuPy backend the copy is a twin of the backend that shares
everything read-only (data, tables, compiled kernels) and owns a device copy of the weights,
its own stream and its own captured held-out passes; the NumPy backend copies its host
weights (numpy_backend.py). A device or host without room for a copy validates in order, as
before, after one log line.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from . import Validation

if TYPE_CHECKING:
    from .cupy_backend import CupyBackend

__all__ = ["DeviceCopy", "no_room_for_copy"]

log = structlog.get_logger("eggroll.worker")


def no_room_for_copy(backend: str, where: str) -> None:
    """Say once that validation goes back to blocking training, and why."""
    log.warning(
        "validation runs in order",
        backend=backend,
        reason=f"no room on {where} for a copy of the weights: each validation holds up "
        "training while it runs",
    )


class DeviceCopy:
    """The CuPy backend's validation twin, made at the first validation and kept: a device
    copy of the weights (refreshed in stream order at each validation), scored on a second
    stream. Its first scoring runs at once, in order, since it allocates the held-out passes'
    buffers: a device without room for them (or the copy) is found there, and validation
    stays in order from then on."""

    def __init__(self, backend: CupyBackend) -> None:
        self.backend = backend
        self.twin: CupyBackend | None = None
        self.warm = False  # the twin's held-out passes are allocated
        self.failed = False  # no room: validation runs in order

    def take(self) -> Callable[[], Validation] | None:
        """The weights of the backend's current step copied (in its stream's order), and the
        call that scores them; None when the device has no room (then `validate`)."""
        if self.failed:
            return None
        b = self.backend
        try:
            twin = self.twin = self.twin or _twin(b)
            with b._scope():
                twin._flat[...] = b._flat  # after every update enqueued so far
                ready = None if b.stream is None else b.stream.record()
            score = _scorer(twin, ready)
            if not self.warm:
                scores = score()  # allocates on the device: here, where a failure can fall back
                self.warm = True
                return lambda: scores
        except MemoryError:
            self._give_up()
            return None
        return score

    def _give_up(self) -> None:
        self.failed, self.twin = True, None
        pool = getattr(self.backend.xp, "get_default_memory_pool", None)
        if pool is not None:
            pool().free_all_blocks()  # the twin's blocks, for the in-order validations
        no_room_for_copy(self.backend.name, f"the device ({self.backend.device})")


def _scorer(twin: CupyBackend, ready: Any) -> Callable[[], Validation]:
    def score() -> Validation:
        if ready is not None:
            twin.stream.wait_event(ready)  # the copy is done before the twin reads it
        return twin.validate()  # on the twin's stream (current on the calling thread)

    return score


def _twin(b: CupyBackend) -> CupyBackend:
    """A shallow copy of the backend with its own weights buffer, stream, kernel launcher
    and held-out passes; data, tables and compiled kernels are shared (read only)."""
    twin = copy.copy(b)
    twin._flat = b.xp.empty_like(b._flat)
    twin.w = {
        name: twin._flat[o : o + _size(shape)].reshape(shape)
        for name, (o, shape) in b._layout.items()
    }
    twin.stream = None if b.stream is None else type(b.stream)(non_blocking=True)
    twin.kernels = copy.copy(b.kernels)  # the same compiled functions, launched on its stream
    twin.kernels.stream = twin.stream
    twin.kernels._recording = None
    twin._held_out_graphs = {}
    twin._forward_graphs, twin._update_graph, twin._held_out_copy = {}, None, None
    return twin


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for side in shape:
        n *= side
    return n

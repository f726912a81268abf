"""Compute backends of the worker, behind one seam.

A backend holds one replica (weights and optimizer state) and the data, evaluates chunks of
the population and applies committed steps; every backend produces the same bytes as the
NumPy reference (`numpy_backend.py`). Which tokens are read comes from `shared.window`, so
backends agree on data by import. A new backend is one file in this folder plus one line in
`_REGISTRY`. This package is not the protocol loop (`worker/client.py`) and holds no I/O.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ...protocol.replica_messages import bits_per_byte
from ...shared.config import RunConfig
from ...shared.data import Dataset
from ...shared.logs import held_out_fields
from ...shared.model import ARCHS
from ...shared.replica import ReplicaState
from ...shared.sample import Completions, SampleRequest
from ...shared.text_codec import TextCodec

__all__ = [
    "Backend",
    "BackendFactory",
    "BackendUnavailable",
    "ChunkResult",
    "HeldOut",
    "HostReplica",
    "Validation",
    "check_chunk",
    "cuda_usable",
    "get_backend",
    "reference_backend",
]


@dataclass(frozen=True)
class ChunkResult:
    fitness: np.ndarray  # int8, one value in {-1, 0, 1} per pair of the chunk
    loss_sum: int  # sum of both members' integer losses over the chunk (1/16 bit)
    # The completions (members, prompts, tokens) the fitness comes from, in runs checked by
    # claims (shared.fitness.checked_by_claims): sent as the RESULT's CLAIM
    tokens: np.ndarray | None = None


@dataclass(frozen=True)
class HeldOut:
    """One held-out metric of the unperturbed model: `tokens` target tokens predicted, which
    decode to `text_bytes` bytes of text (the dataset's decoding table)."""

    tokens: int
    text_bytes: int
    loss_16: float  # mean integer loss per token, in 1/16 bit (the training metric)
    bits_per_token: float  # exact log-softmax of the integer logits, float64

    @property
    def bits_per_byte(self) -> float | None:
        return bits_per_byte(self.bits_per_token, self.tokens, self.text_bytes)


@dataclass(frozen=True)
class Validation:
    """Both held-out metrics over the same target tokens of valid.bin (`shared.window`)."""

    # Windows of seq_len + 1 tokens from a zero state, as in training; None for a run
    # without data (a reward's on the model's own tokens: it scores no text)
    windows: HeldOut | None
    # Long streams read token by token with the recurrent state carried across each one;
    # None for a model that carries no state from token to token.
    streams: HeldOut | None
    # A reward run: the unperturbed model's mean reward on the held-out prompts, and how many
    reward: float | None = None
    reward_prompts: int = 0

    def report(self) -> dict[str, float | int | None]:
        """Both metrics as the flat fields of the step log and summary JSON (None: not
        measured): `bits_per_token`, `bits_per_byte`, `loss_16`, `tokens`, and the same
        prefixed `stream_`."""
        out: dict[str, float | int | None] = {}
        for prefix, m in (("", self.windows), ("stream_", self.streams)):
            out[prefix + "tokens"] = 0 if m is None else m.tokens
            for key in ("bits_per_token", "bits_per_byte", "loss_16"):
                out[prefix + key] = None if m is None else getattr(m, key)
        if self.reward is not None:
            out["held_out_reward"] = self.reward
        return out

    def log_fields(self) -> dict[str, float | None]:
        """The held-out fields of a validation log event (`shared.logs.HELD_OUT_FIELDS`)."""
        r = self.report()
        keys = ("bits_per_token", "bits_per_byte", "stream_bits_per_token", "stream_bits_per_byte")
        return held_out_fields(*(r[k] for k in keys))


class Backend(Protocol):
    """One replica on one device. Calls come from one thread, in order."""

    name: str
    device: str
    # The model's own tokenizer (a Hugging Face model's), which a reward run's prompts and
    # completions use; None: the data's vocabulary
    codec: TextCodec | None

    @property
    def state(self) -> ReplicaState:
        """The replica as host arrays (copied back from the device when needed)."""
        ...

    @property
    def step(self) -> int: ...

    @property
    def config(self) -> RunConfig: ...

    def load_state(self, state: ReplicaState) -> None: ...

    def digest(self) -> int: ...

    def evaluate_chunk(self, step: int, first_member: int, count: int) -> ChunkResult:
        """Score members [first_member, first_member + count) of the population at `step`."""
        ...

    @property
    def parallel_chunks(self) -> int:
        """How many chunks `evaluate_chunks` gains by taking at once (1: none)."""
        ...

    def evaluate_chunks(self, step: int, chunks: Sequence[tuple[int, int]]) -> list[ChunkResult]:
        """Several (first_member, count) chunks of `step`, each result as `evaluate_chunk`'s."""
        ...

    def complete(
        self, step: int, members: tuple[int, int] | None, request: Completions
    ) -> np.ndarray:
        """Tokens (count, P, N) that members [first, first + count) of `step` write for the
        request's P prompts (the reward objective); members None: the unperturbed model,
        (1, P, N)."""
        ...

    def write_sample(self, request: SampleRequest) -> tuple[bytes, bytes]:
        """The unperturbed model continues held-out document `request.prompt_index`:
        (prompt, continuation) as UTF-8 bytes, whole (SAMPLE_TEXT cuts them)."""
        ...

    def apply_step(self, fitness: np.ndarray) -> int:
        """Apply the committed fitness of `self.step` (all pairs); returns weights changed."""
        ...

    def validate(self) -> Validation:
        """The unperturbed model on the held-out split: both metrics (`Validation`)."""
        ...

    # Optional (the NumPy and CuPy backends have it; without it validation runs in order):
    # def validation_copy(self) -> Callable[[], Validation] | None
    #     A copy of the current weights (the backend's own: host or device) and the call that
    #     scores it as `validate` would, safe on another thread while this backend evaluates
    #     and applies later steps (one copy scored at a time). None: no room for a copy (said
    #     once in the log): `validate` instead.


class HostReplica:
    """A backend whose replica is the host's `ReplicaState` (`state`), as the NumPy and
    PyTorch backends keep it."""

    state: ReplicaState

    @property
    def config(self) -> RunConfig:
        return self.state.config

    @property
    def step(self) -> int:
        return self.state.step


def check_chunk(cfg: RunConfig, replica_step: int, step: int, first: int, count: int) -> None:
    """ValueError unless members [first, first + count) of `step` are whole pairs of the
    population and the replica is at that step."""
    if step != replica_step:
        raise ValueError(f"replica is at step {replica_step}, chunk is for step {step}")
    if first % 2 or count % 2 or not 0 <= first < first + count <= cfg.es.population:
        raise ValueError(f"bad member range [{first}, {first + count})")


class BackendUnavailable(ValueError):
    """The requested compute backend cannot run here; the message says what to use."""


@dataclass(frozen=True)
class BackendFactory:
    """Builds the replica's backend; `name` and `device` are announced in HELLO, `threads`
    (the CPU threads of its compute; None where a device does the work) is logged."""

    name: str
    device: str
    build: Callable[[Dataset | None, ReplicaState], Backend]  # None: no data (hf rewards)
    threads: int | None = None
    families: tuple[str, ...] = ("int8",)  # the architectures' FAMILYs it evaluates

    def serves(self, cfg: RunConfig) -> str | None:
        """None, or one line saying that this backend does not evaluate the run's model
        and which backends do."""
        arch = cfg.model.arch
        if ARCHS[arch].FAMILY in self.families:
            return None
        others = [n for n, fams in FAMILIES.items() if ARCHS[arch].FAMILY in fams]
        return (
            f"the run trains model.arch={arch!r}, which the {self.name} backend does not "
            f"evaluate: start this worker with --backend {_choices(['auto', *others])}"
        )


def _choices(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _by_family(int8: BackendFactory, hf: Callable[[], BackendFactory]) -> BackendFactory:
    """`--backend auto`: the int8 models on `int8`, every other family on the PyTorch
    backend (made on its first run, so hosts without torch never import it)."""
    made: list[BackendFactory] = []

    def build(dataset: Dataset | None, state: ReplicaState) -> Backend:
        if ARCHS[state.config.model.arch].FAMILY in int8.families:
            return int8.build(dataset, state)
        if not made:
            made.append(hf())
        return made[0].build(dataset, state)

    families = (*int8.families, *FAMILIES["torch"])
    return BackendFactory(int8.name, int8.device, build, int8.threads, families)


# name -> "module:function(batch_members, threads)" returning a BackendFactory; imported
# only when chosen, so CPU hosts never import CuPy.
_REGISTRY = {
    "numpy": "numpy_backend:factory",
    "cupy": "cupy_backend:factory",
    "torch": "torch_backend:factory",
}
# The model families (`Architecture.FAMILY`) each backend evaluates; the first that
# evaluates a family is its reference, which the one-process commands run.
FAMILIES: dict[str, tuple[str, ...]] = {"numpy": ("int8",), "cupy": ("int8",), "torch": ("hf",)}


def reference_backend(cfg: RunConfig) -> str:
    """The backend a one-process command evaluates the run's model on."""
    family = ARCHS[cfg.model.arch].FAMILY
    return next(name for name, fams in FAMILIES.items() if family in fams)


def cuda_usable() -> bool:
    """Whether CuPy is installed and sees a CUDA device (imported lazily: CPU hosts lack it)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def get_backend(
    kind: str,
    batch_members: int | None = None,
    threads: int | None = None,
    goal_dir: Path | None = None,
    confined: bool = True,
) -> BackendFactory:
    """`auto`, `numpy`, `cupy` or `torch`; BackendUnavailable when the choice cannot run here.

    `batch_members`: members per forward pass (None: the backend's own default, 1,024 for
    NumPy, 32,768 for CuPy, whose pass is one CUDA graph, and at most 64 for PyTorch).
    `threads`: CPU threads of the backend's compute (None: its own default, which shares
    the usable cores among EGGROLL_WORKERS_PER_HOST workers). `goal_dir`: where an hf run's
    model directory is (the PyTorch backend's), `confined` to it for a worker. `auto` is
    cupy when CuPy sees a GPU, else numpy, and the PyTorch backend for Hugging Face models."""
    if kind == "auto":
        int8 = get_backend("cupy" if cuda_usable() else "numpy", batch_members, threads)
        return _by_family(
            int8, lambda: _load("torch")(min(batch_members or 64, 64), threads, goal_dir, confined)
        )
    if kind not in _REGISTRY:
        raise BackendUnavailable(f"unknown backend {kind!r}: use auto, numpy, cupy or torch")
    if kind == "torch":
        try:
            return _load("torch")(min(batch_members or 64, 64), threads, goal_dir, confined)
        except ValueError as exc:  # no torch here: one line naming the extra
            raise BackendUnavailable(str(exc)) from None
    if batch_members is None:
        return _load(kind)(threads=threads)
    return _load(kind)(batch_members, threads)


def _load(kind: str) -> Callable[..., BackendFactory]:
    module, function = _REGISTRY[kind].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)

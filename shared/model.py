"""The architectures: what a model must provide, and the registry that picks one by name.

An architecture is one module in this folder (shared/egg.py, shared/former.py) with
    FAMILY                  which backends evaluate it: "int8" (NumPy, CuPy) or "hf" (PyTorch)
    EXACT                   whether its results agree bit for bit on every device, so that
                            two workers' fitness for a chunk can be compared
    OWN_TOKENIZER           whether the model brings its own tokenizer (else it reads the
                            data's vocabulary, of model.vocab_size tokens)
    specs(m)                its tensors (`ParamSpec`), in noise-stream order
    check(cfg)              None, or one line naming the first setting of a run it refuses
    MODEL(cfg, params)      the forward pass of a batch of population members (`Model`)
    GENERATOR(cfg, params)  the unperturbed model one token at a time (`Generator`); a
                            family no NumPy code evaluates gives functions that refuse
and one line in `ARCHS`. The `hf` family (shared/hf.py) fills the seam differently: its
tensors are a Hugging Face model's target weights (their bit patterns), whose step 0 is read
from the model's files (`shared.hf_dir.base_state`, by `shared.start.initial_state`), not
made here; it brings its own `apply_update`, and PyTorch evaluates it
(worker/backend/torch_backend.py). Every int8
architecture perturbs its weights through shared/perturb.py and scores with shared/loss.py,
so the update rules, the replicas and the backends never ask which architecture they hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from . import egg, former, hf
from .loss import zipf_bias
from .noise import init_values
from .perturb import MemberNoise, ParamSpec

if TYPE_CHECKING:
    from .config import ModelConfig, RunConfig
    from .sample import Decoder


class Model(Protocol):
    """The forward pass of a batch of members (`noise`) or of unperturbed rows (None)."""

    #: True when the model reads tokens one at a time with a state (`initial_state`,
    #: `step`), so that held-out scoring can also carry the state along a long span.
    carries_state: bool

    def forward(
        self, tokens: np.ndarray, noise: MemberNoise | None = None, float_bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows (M, T + 1) -> integer loss per row (int64, 1/16 bit), float64 bits if asked."""
        ...

    def position_losses(
        self, tokens: np.ndarray, noise: MemberNoise | None = None, float_bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows (M, T + 1) -> integer loss (M, T) per position, float64 bits if asked."""
        ...

    def decoder(self, noise: MemberNoise | None, rows: int) -> Decoder:
        """`rows` rows (each a member of `noise`, or unperturbed) that read one token at a
        time, for generation (`shared.sample.generate_rows`)."""
        ...


class Recurrent(Model, Protocol):
    """A model that `carries_state`: it reads one token per row at a time."""

    def initial_state(self, rows: int) -> list[np.ndarray]:
        """The state before the first token."""
        ...

    def step(
        self, state: list[np.ndarray], tok: np.ndarray, noise: MemberNoise | None = None
    ) -> np.ndarray:
        """Read one token per row, update `state` in place, return the logits (M, V)."""
        ...


class Generator(Protocol):
    """The unperturbed model one token at a time, for `shared.sample.generate`."""

    vocab_size: int
    context: int  # the prompt tokens it conditions on

    def start(self) -> tuple[object, np.ndarray]:
        """The state and logits after the document separator (token 0)."""
        ...

    def step(self, state: object, token: int) -> tuple[object, np.ndarray]:
        """The state and logits (V,) after reading `token`."""
        ...


class Architecture(Protocol):
    """What an architecture module provides (see the module docstring)."""

    FAMILY: str
    EXACT: bool
    OWN_TOKENIZER: bool

    def specs(self, m: ModelConfig) -> tuple[ParamSpec, ...]: ...

    def check(self, cfg: RunConfig) -> str | None: ...

    MODEL: Callable[[RunConfig, dict[str, np.ndarray]], Model]
    GENERATOR: Callable[[RunConfig, dict[str, np.ndarray]], Generator]
    # Optional: `apply_update(cfg, step, params, fitness) -> (params, changed)` replaces the
    # update rules for an architecture whose tensors are not int8 weights (shared/hf.py).


ARCHS: dict[str, Architecture] = {"egg": egg, "former": former, "hf": hf}


def param_specs(m: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every tensor of the config's architecture, in noise-stream (tensor id) order."""
    return ARCHS[m.arch].specs(m)


def init_params(m: ModelConfig) -> dict[str, np.ndarray]:
    """Initial int8 weights, a pure function of the model config (ValueError for a model
    whose weights start from its files: shared/start.py's `initial_state` reads those)."""
    params = {}
    for spec in param_specs(m):
        if spec.init == "base":
            raise ValueError(
                f"model.arch={m.arch!r} starts from the weights of its model directory: "
                "its initial state is shared.start.initial_state's (shared.hf_dir.base_state)"
            )
        size = int(np.prod(spec.shape))
        if spec.init in ("gaussian", "small"):
            values = init_values(m.init_seed, spec.tensor_id, size)
            if spec.init == "small":  # an eighth, rounded toward zero: still symmetric
                values = np.sign(values) * (np.abs(values) >> 3)
        elif spec.init == "zipf":
            values = zipf_bias(m.vocab_size)
        else:
            values = np.full(size, 16 if spec.init == "sixteen" else 0, dtype=np.int8)
        params[spec.name] = np.clip(values, -127, 127).astype(spec.dtype).reshape(spec.shape)
    return params


def build_model(cfg: RunConfig, params: dict[str, np.ndarray]) -> Model:
    """The forward pass of the config's architecture."""
    return ARCHS[cfg.model.arch].MODEL(cfg, params)


def build_generator(cfg: RunConfig, params: dict[str, np.ndarray]) -> Generator:
    """The config's architecture one token at a time, for `shared.sample.generate`."""
    return ARCHS[cfg.model.arch].GENERATOR(cfg, params)

"""A Hugging Face causal LM evaluated for a population of EGGROLL members, on PyTorch.

The replica state is the target weights' bit patterns in the dtype of the model's files
(shared/hf.py), updated by an exact rule (worker/hf_update.py); this module evaluates members
in floating point. `PopulationLM` holds one model loaded from a local directory and

- writes the state's weights into the target modules (`load_state`: exact, since the
  evaluation dtype is the state's or wider; a narrower one, such as bfloat16 for a float32
  model on a GPU, rounds them for the evaluation only). Where the evaluation dtype is the
  state's (`holds_state`), the modules' weights are the state itself (`bits`);
- evaluates a chunk of members in one batch: rows are member-major (member i owns rows
  [i * R, (i + 1) * R)), every target module computes the shared base product, and its
  wrapped forward adds each member's low-rank correction
      y_m += sign_m * scale * (x_m @ B_k) @ A_k^T      (scale: `shared.hf.member_scale`)
  with batched matmuls, targets that read the same input sharing x @ B, the factors made on
  the model's device (worker/hf_engine.py). No member's weight matrix is ever formed; the
  extra memory is the factors (members x (out + in) x r per target) and the (rows, r)
  intermediates;
- scores rows of tokens (the members' next-token losses) and continues prompts (greedy, or
  sampled with one counter-based uniform per prompt and position shared by every member,
  so a pair's members differ by their noise only): one prefill, then a static-cache decode
  whose step is a replayed CUDA graph on a GPU.

Floating point may differ between devices: that changes which fitness a worker proposes,
never the replica state. torch and transformers are imported only by the hf family's
modules; hosts without them get one line naming `pip install 'eggroll-distributed[hf]'`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..shared import hf
from ..shared.config import RunConfig
from ..shared.hf_dir import (
    INSTALL,
    TOKENIZER_FILES,
    ModelDirError,
    first_line,
    linear_layers,
    mem_available,
    model_folder,
    parameter_count,
    read_config,
    refuse_tied,
    require_hf,
)
from ..shared.replica import ReplicaState
from .hf_engine import Engine, uniforms
from .hf_update import state_dtypes

if TYPE_CHECKING:
    import torch

__all__ = [
    "INSTALL",
    "HFModelError",
    "PopulationLM",
    "export_merged",
    "load_causal_lm",
    "load_tokenizer",
]


class HFModelError(ModelDirError):
    """A model directory, tokenizer or setting that cannot be used; one line."""


def load_causal_lm(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The model of a local directory (never downloaded), in eval mode without gradients;
    refused before loading when its weights do not fit the device's free memory."""
    torch, transformers = require_hf()
    path = model_folder(model_dir)
    config = read_config(path)
    weights = parameter_count(path)
    need = weights * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    free = _free_bytes(torch, device)
    if free is not None and need > free:
        raise HFModelError(
            f"{path} holds {weights / 1e6:.1f}M weights, {need / 2**30:.2f} GiB in {dtype}: "
            f"more than the {free / 2**30:.2f} GiB free on {device}"
        )
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            output_loading_info=True,
            dtype=getattr(torch, dtype),
            use_safetensors=True,  # never unpickle weights
            trust_remote_code=False,  # never run the directory's code
        )
    except ValueError as exc:
        kind = getattr(config, "model_type", "?")
        raise HFModelError(
            f"{path} holds a {kind!r} model, which is not a causal LM: {first_line(exc)}"
        ) from None
    except OSError as exc:
        raise HFModelError(f"{path} has no loadable weights: {first_line(exc)}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would start them from random values
        raise HFModelError(
            f"{path} lacks {len(missing)} weights of its causal LM (first: {missing[0]})"
        )
    model = model.to(device=device, dtype=getattr(torch, dtype))
    model.eval()
    model.requires_grad_(False)
    return model


def _free_bytes(torch: Any, device: str) -> int | None:
    """Free memory of a device (None: unknown)."""
    if str(device).startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return mem_available()


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer saved beside the model (HFModelError when there is none)."""
    _, transformers = require_hf()
    path = model_folder(model_dir)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise HFModelError(
            f"{path} has no usable tokenizer: none of {', '.join(TOKENIZER_FILES)} is there "
            "(save it beside the model with tokenizer.save_pretrained)"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise HFModelError(f"{path} has no usable tokenizer: {first_line(exc)}") from None
    if len(tokenizer) == 0:
        raise HFModelError(f"{path} has no usable tokenizer: its vocabulary is empty")
    return tokenizer


class PopulationLM:
    """One model, the weights of a replica state, and batched evaluation of its members."""

    def __init__(self, model: Any, cfg: RunConfig, state: ReplicaState | None = None) -> None:
        torch, _ = require_hf()
        self.torch = torch
        self.model, self.cfg = model, cfg
        self.targets = {t.name: t for t in hf.targets(cfg.model)}
        layers = {name: (module, t) for name, module, _, t in linear_layers(model)}
        missing = [name for name in self.targets if name not in layers]
        if missing:
            raise HFModelError(f"the model has no linear layer {missing[0]!r} of the run")
        self.modules = {name: layers[name][0] for name in self.targets}
        refuse_tied(model, self.modules)
        self.transposed = {name: layers[name][1] for name in self.targets}
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.scale, self.alpha = hf.member_scale(cfg), hf.weight_scale(cfg)
        # the state's dtype, and the integer dtype of its bits
        self.state_dtype, self.bits_dtype = state_dtypes(cfg.model.weight_dtype)
        # the fused population pass and the decode loop: wraps the targets' forwards once
        self.engine = Engine(model, cfg, self.modules)
        self.state = state  # None: the model's weights as loaded
        if state is not None:
            self.load_state(state)

    # --- weights -------------------------------------------------------------------------

    def _weight(self, name: str) -> torch.Tensor:
        """A target's weight as (out, in) (a view)."""
        w = self.modules[name].weight
        return w.T if self.transposed[name] else w

    @property
    def holds_state(self) -> bool:
        """Whether the target modules' weights are the state: their dtype is the state's.
        A wider float holds every value but not every bit pattern: narrowing it back
        rewrites NaN payloads, so the state is then the host copy."""
        return self.dtype == self.state_dtype

    def bits(self, name: str) -> torch.Tensor:
        """A target's weights as the state's bits ((out, in), C-contiguous, on the model's
        device); the state's only where `holds_state`."""
        with self.torch.no_grad():
            w = self._weight(name).detach().to(self.state_dtype)  # exact where it holds
            return w.contiguous().view(self.bits_dtype)

    def write_bits(self, name: str, bits: torch.Tensor) -> None:
        """Write a target's weights from the state's bits (int16 or int32, (out, in))."""
        with self.torch.no_grad():
            w = bits.to(self.device).view(self.state_dtype)
            self._weight(name).copy_(w)  # the evaluation dtype: exact where it holds

    def load_state(self, state: ReplicaState) -> None:
        """Write the state's weights into every target."""
        if state.config.digest() != self.cfg.digest():
            raise HFModelError("the state belongs to another run config")
        for name in self.modules:
            self.write_bits(name, self.torch.from_numpy(state.params[name]))
        self.state = state

    def member_weight(self, name: str, step: int, member: int) -> torch.Tensor:
        """The (out, in) weight member `member` of `step` sees, materialised (for tests)."""
        a, b = hf.member_factors(self.cfg, step, self.targets[name], member, 1)
        delta = self.scale * (a[0].astype(np.float64) @ b[0].astype(np.float64).T)
        w = self._weight(name).detach().double().cpu() + self.torch.from_numpy(delta)
        return w.to(device=self.device, dtype=self.dtype)

    # --- the population batch (worker/hf_engine.py) --------------------------------------

    @contextlib.contextmanager
    def members(self, step: int, first: int, count: int) -> Iterator[None]:
        """Forward passes inside see members [first, first + count) of `step`, member-major."""
        with self.engine.members(step, first, count):
            yield

    def logits(self, step: int, first: int, count: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (count, R, T, V) of each member on the same rows input_ids (R, T)."""
        rows = input_ids.shape[0]
        batch = input_ids.to(self.device).repeat(count, 1)
        with self.torch.no_grad(), self.members(step, first, count):
            out = self.model(input_ids=batch, use_cache=False).logits
        return out.reshape(count, rows, *out.shape[1:])

    def nll(self, members: tuple[int, int] | None, step: int, tokens: torch.Tensor) -> np.ndarray:
        """Next-token negative log-likelihood (nats, float64) of each member's rows tokens
        (count, R, T + 1), per position: (count, R, T). Members None: the state's model,
        count 1."""
        torch = self.torch
        count, rows = tokens.shape[:2]
        flat = tokens.reshape(count * rows, -1).to(self.device)  # member-major rows
        context = self.members(step, *members) if members is not None else _nothing()
        with torch.no_grad(), context:
            logits = self.model(input_ids=flat[:, :-1], use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), flat[:, 1:], reduction="none"
        )
        return nll.reshape(count, rows, -1).double().cpu().numpy()

    # --- completions ---------------------------------------------------------------------

    def complete(
        self,
        step: int,
        members: tuple[int, int] | None,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        pad_id: int = 0,
        samples: Sequence[int] | None = None,
        min_p: float = 0.0,
        graph: bool | None = None,
    ) -> np.ndarray:
        """Tokens (count, P, new_tokens) that members [first, first + count) of `step` write
        after each prompt (members None: the model of the state, count 1).

        temperature 0 is greedy; otherwise token t of prompt p is drawn by inverse CDF from
        the uniform of key(SAMPLE, seed, samples[p], t), the same for every member, among
        the tokens at least min_p times as likely as the likeliest. The prompts are read in
        one prefill and the tokens decoded on a static cache; `graph` replays each decode
        token as a captured CUDA graph (None: on CUDA devices; True on a CPU is refused)."""
        torch = self.torch
        if not prompts or min(len(p) for p in prompts) == 0:
            raise HFModelError("every prompt needs at least one token")
        if graph and self.device.type != "cuda":
            raise HFModelError(f"graph=True needs a CUDA device; the model is on {self.device}")
        samples = list(range(len(prompts))) if samples is None else list(samples)
        if len(samples) != len(prompts):
            raise HFModelError(f"{len(samples)} sample numbers for {len(prompts)} prompts")
        ids, mask = left_pad(torch, prompts, pad_id)
        u = uniforms(seed, samples, new_tokens) if temperature > 0 else None
        who = (step, *members) if members is not None else None
        use_graph = self.device.type == "cuda" if graph is None else graph
        return self.engine.complete(who, ids, mask, new_tokens, temperature, min_p, u, use_graph)

    def close(self) -> None:
        """Unwrap the target modules (the model then runs as the state's plain weights)."""
        self.engine.remove()


def left_pad(torch: Any, prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """ids and mask (P, W) of prompts padded on the left (mask 0 there): the last column is
    each prompt's end, where decoding goes on (and where a claim's tokens are read)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def export_merged(model_dir: str | Path, state: ReplicaState, out_dir: str | Path) -> Path:
    """Write the state's model to `out_dir` as a directory
    `AutoModelForCausalLM.from_pretrained` loads: safetensors weights in the dtype of the
    targets in the base model's files (the targets exactly the state's bits), its config and
    its tokenizer."""
    model = load_causal_lm(model_dir, state.config.model.weight_dtype)
    tokenizer = load_tokenizer(model_dir)
    lm = PopulationLM(model, state.config, state)
    lm.close()
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

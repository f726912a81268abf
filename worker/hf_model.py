"""A Hugging Face causal LM evaluated for a population of EGGROLL members, on PyTorch.

The replica state is integer (shared/hf.py: an int64 accumulator per target matrix); this
module only evaluates members in floating point. `PopulationLM` holds one
model loaded from a local directory and

- writes the state's weights `base + alpha * acc` into the target modules (`load_state`);
- evaluates a chunk of members in one batch: rows are member-major (member i owns rows
  [i * R, (i + 1) * R)), every target module computes the shared base product, and a
  forward hook adds each member's low-rank correction
      y_m += sign_m * scale * (x_m @ B_k) @ A_k^T      (scale: `shared.hf.member_scale`)
  with two small batched matmuls. No member's weight matrix is ever formed; the extra memory
  is the factors (members x (out + in) x r per target) and the (rows, r) intermediates;
- scores rows of tokens (the members' next-token losses) and continues prompts (greedy, or
  sampled with one counter-based uniform per prompt and position shared by every member,
  so a pair's members differ by their noise only).

Floating point may differ between devices: that changes which fitness a worker proposes,
never the replica state. torch and transformers are imported only by the hf family's
modules; hosts without them get one line naming `pip install 'eggroll-distributed[hf]'`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
    model_folder,
    parameter_count,
    read_config,
    refuse_tied,
    require_hf,
)
from ..shared.noise import DOMAIN_SAMPLE, combine_array, hash_key
from ..shared.replica import ReplicaState

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
    try:  # MemAvailable counts the page cache a load can reclaim (the files just hashed)
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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


@dataclass
class _Active:
    """The members a forward pass evaluates: per target, sign * scale * A and B."""

    a: dict[str, torch.Tensor]  # (members, out, r)
    b: dict[str, torch.Tensor]  # (members, in, r)
    members: int


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
        # The base weights in float32 on the host, (out, in): `load_state` rebuilds each
        # target from them, so the evaluated weights depend on the state only, not its path.
        self._base = {name: self._weight(name).float().cpu().clone() for name in self.modules}
        self._active: _Active | None = None
        # the key-value cache's argument: `cache` in newer transformers, else past_key_values
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        # generation needs the last position's logits only, not (rows, width, vocab)
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self._hooks = [
            m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()
        ]
        self.state = state if state is not None else ReplicaState.initial(cfg)
        if state is not None:
            self.load_state(state)

    # --- weights -------------------------------------------------------------------------

    def _weight(self, name: str) -> torch.Tensor:
        """A target's weight as (out, in) (a view)."""
        w = self.modules[name].weight
        return w.T if self.transposed[name] else w

    def load_state(self, state: ReplicaState) -> None:
        """Write base + alpha * acc into every target (float64 sum, then the model dtype)."""
        if state.config.digest() != self.cfg.digest():
            raise HFModelError("the state belongs to another run config")
        torch = self.torch
        with torch.no_grad():
            for name in self.modules:
                acc = torch.from_numpy(state.params[name]).double()
                w = self._base[name].double() + self.alpha * acc
                self._weight(name).copy_(w.to(device=self.device, dtype=self.dtype))
        self.state = state

    def member_weight(self, name: str, step: int, member: int) -> torch.Tensor:
        """The (out, in) weight member `member` of `step` sees, materialised (for tests)."""
        a, b = hf.member_factors(self.cfg, step, self.targets[name], member, 1)
        delta = self.scale * (a[0].astype(np.float64) @ b[0].astype(np.float64).T)
        w = self._weight(name).detach().double().cpu() + self.torch.from_numpy(delta)
        return w.to(device=self.device, dtype=self.dtype)

    # --- the population batch ------------------------------------------------------------

    def _hook(self, name: str) -> Callable[..., Any]:
        def hook(module: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> Any:
            active = self._active
            if active is None:
                return None
            x = inputs[0]
            a, b = active.a[name], active.b[name]
            xs = x.reshape(active.members, -1, x.shape[-1])  # member-major rows
            corr = self.torch.bmm(self.torch.bmm(xs, b), a.transpose(1, 2))
            return output + corr.reshape(output.shape)

        return hook

    @contextlib.contextmanager
    def members(self, step: int, first: int, count: int) -> Iterator[None]:
        """Forward passes inside see members [first, first + count) of `step`, member-major."""
        torch = self.torch
        a_all, b_all = {}, {}
        for name, t in self.targets.items():
            a, b = hf.member_factors(self.cfg, step, t, first, count)
            a_all[name] = torch.from_numpy(a).to(self.device, self.dtype) * self.scale
            b_all[name] = torch.from_numpy(b).to(self.device, self.dtype)
        self._active = _Active(a_all, b_all, count)
        try:
            yield
        finally:
            self._active = None

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
    ) -> np.ndarray:
        """Tokens (count, P, new_tokens) that members [first, first + count) of `step` write
        after each prompt (members None: the model of the state, count 1).

        temperature 0 is greedy; otherwise token t of prompt p is drawn by inverse CDF from
        the uniform of key(SAMPLE, seed, samples[p], t), the same for every member, among
        the tokens at least min_p times as likely as the likeliest."""
        torch = self.torch
        first, count = members if members is not None else (0, 1)
        if not prompts or min(len(p) for p in prompts) == 0:
            raise HFModelError("every prompt needs at least one token")
        samples = list(range(len(prompts))) if samples is None else list(samples)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: the last column is each prompt's end
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.repeat(count, 1).to(self.device), mask.repeat(count, 1).to(self.device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        out = np.zeros((count, len(prompts), new_tokens), dtype=np.int64)
        context = self.members(step, first, count) if members is not None else _nothing()
        past = None
        with torch.no_grad(), context:
            for t in range(new_tokens):
                result = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=position,
                    use_cache=True,
                    **{self._cache_arg: past},
                    **self._last_only,
                )
                past = getattr(result, self._cache_arg, None)
                logits = result.logits[:, -1, :]
                chosen = self._choose(logits, temperature, min_p, seed, samples, t)
                out[:, :, t] = chosen.reshape(count, len(prompts)).cpu().numpy()
                ids = chosen.reshape(-1, 1)
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
                position = position[:, -1:] + 1
        return out

    def _choose(
        self,
        logits: torch.Tensor,
        temperature: float,
        min_p: float,
        seed: int,
        samples: Sequence[int],
        t: int,
    ) -> torch.Tensor:
        torch = self.torch
        if temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        if min_p > 0:
            floor = min_p * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
        cdf = probs.cumsum(dim=-1)
        keys = combine_array(hash_key(DOMAIN_SAMPLE, seed), np.array(samples, dtype=np.uint64))
        keys = combine_array(keys, np.full(len(samples), t, dtype=np.uint64))
        u = torch.from_numpy((keys >> np.uint64(11)).astype(np.float64) * 2.0**-53)
        u = u.to(self.device).repeat(logits.shape[0] // len(samples)) * cdf[:, -1]
        chosen = torch.searchsorted(cdf, u.unsqueeze(-1)).squeeze(-1)
        return chosen.clamp(max=logits.shape[-1] - 1)

    def close(self) -> None:
        """Remove the hooks (the model then runs as the state's plain weights)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def export_merged(model_dir: str | Path, state: ReplicaState, out_dir: str | Path) -> Path:
    """Write the state's model (base + alpha * acc in every target) to `out_dir` as a
    directory `AutoModelForCausalLM.from_pretrained` loads: safetensors weights in the base
    model's dtype, its config and its tokenizer."""
    torch, _ = require_hf()
    model = load_causal_lm(model_dir)
    saved = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    tokenizer = load_tokenizer(model_dir)
    lm = PopulationLM(model, state.config, state)
    lm.close()
    if isinstance(saved, torch.dtype):
        model = model.to(saved)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

"""A Hugging Face causal LM evaluated for a population of EGGROLL members, on PyTorch.

The replica state is integer and lives in `shared.hf_state` (accumulators per target
matrix); this module only evaluates members in floating point. `PopulationLM` holds one
model loaded from a local directory and

- writes the state's weights `base + alpha * acc` into the target modules (`load_state`);
- evaluates a chunk of members in one batch: rows are member-major (member i owns rows
  [i * R, (i + 1) * R)), every target module computes the shared base product, and a
  forward hook adds each member's low-rank correction
      y_m += sign_m * sigma * (x_m @ B_k) @ A_k^T
  with two small batched matmuls. No member's weight matrix is ever formed; the extra memory
  is the factors (members x (out + in) x r per target) and the (rows, r) intermediates;
- continues prompts (greedy, or sampled with one counter-based uniform per prompt and
  position shared by every member, so a pair's members differ by their noise only) and
  computes a chunk's reward fitness with `shared.goal`'s exact ternary rule.

Floating point may differ between devices: that changes which fitness a worker proposes,
never the replica state. torch and transformers are imported here only; hosts without them
get one line naming `pip install 'eggroll-distributed[hf]'`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..shared.goal import reward_fitness, reward_units
from ..shared.hf_dir import ModelDirError, parameter_count
from ..shared.hf_state import HFSpec, HFState, member_factors, select_targets
from ..shared.noise import DOMAIN_SAMPLE, combine_array, hash_key
from .backend import ChunkResult

if TYPE_CHECKING:
    import torch

__all__ = [
    "INSTALL",
    "HFModelError",
    "PopulationLM",
    "export_merged",
    "linear_layers",
    "load_causal_lm",
    "load_tokenizer",
    "require_hf",
]

INSTALL = "pip install 'eggroll-distributed[hf]'"
# the files one of which a saved tokenizer has
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class HFModelError(ValueError):
    """A model directory, tokenizer or setting that cannot be used; one line."""


def require_hf() -> tuple[Any, Any]:
    """(torch, transformers), or HFModelError naming the extra to install."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise HFModelError(
            f"Hugging Face models need PyTorch and transformers ({exc.name} is missing): {INSTALL}"
        ) from None
    return torch, transformers


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise HFModelError(f"{path} is not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise HFModelError(f"{path} is not a Hugging Face model directory: it has no config.json")
    return path


def load_causal_lm(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The model of a local directory (never downloaded), in eval mode without gradients."""
    torch, transformers = require_hf()
    path = _model_dir(model_dir)
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise HFModelError(f"{path}/config.json does not read: {_first_line(exc)}") from None
    saved = [a for a in getattr(config, "architectures", None) or [] if not _causal(a)]
    if saved:
        raise HFModelError(f"{path} holds a {saved[0]}, which is not a causal LM")
    try:
        weights = parameter_count(path)
    except ModelDirError as exc:
        raise HFModelError(str(exc)) from None
    need = weights * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    free = _free_bytes(torch, device)
    if free is not None and need > free:
        raise HFModelError(
            f"{path} holds {weights / 1e6:.1f}M weights, {need / 2**30:.2f} GiB in {dtype}: "
            f"more than the {free / 2**30:.2f} GiB free on {device}"
        )
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, output_loading_info=True
        )
    except ValueError as exc:
        kind = getattr(config, "model_type", "?")
        raise HFModelError(
            f"{path} holds a {kind!r} model, which is not a causal LM: {_first_line(exc)}"
        ) from None
    except OSError as exc:
        raise HFModelError(f"{path} has no loadable weights: {_first_line(exc)}") from None
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
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _causal(architecture: str) -> bool:
    """Whether a config's `architectures` entry names a causal LM class."""
    return architecture.endswith(("ForCausalLM", "LMHeadModel"))


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer saved beside the model (HFModelError when there is none)."""
    _, transformers = require_hf()
    path = _model_dir(model_dir)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise HFModelError(
            f"{path} has no usable tokenizer: none of {', '.join(TOKENIZER_FILES)} is there "
            "(save it beside the model with tokenizer.save_pretrained)"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise HFModelError(f"{path} has no usable tokenizer: {_first_line(exc)}") from None
    if len(tokenizer) == 0:
        raise HFModelError(f"{path} has no usable tokenizer: its vocabulary is empty")
    return tokenizer


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def linear_layers(model: Any) -> list[tuple[str, Any, tuple[int, int], bool]]:
    """(name, module, (out, in), transposed) of every linear layer, in module order:
    nn.Linear, and GPT-2's Conv1D whose weight is stored (in, out) (`transposed`)."""
    torch, _ = require_hf()
    from transformers.pytorch_utils import Conv1D

    out = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            out.append((name, module, (module.out_features, module.in_features), False))
        elif isinstance(module, Conv1D):
            rows, cols = module.weight.shape[1], module.weight.shape[0]
            out.append((name, module, (int(rows), int(cols)), True))
    return out


def spec_for(
    model: Any,
    rank: int,
    seed: int,
    pairs: int,
    patterns: Sequence[str] = (),
    **settings: Any,
) -> HFSpec:
    """An `HFSpec` whose targets are the model's linear layers chosen by `patterns`."""
    candidates = [(name, shape) for name, _, shape, _ in linear_layers(model)]
    targets = select_targets(candidates, patterns, rank)
    return HFSpec(targets, rank=rank, seed=seed, pairs=pairs, **settings)


def _refuse_tied(model: Any, modules: dict[str, Any]) -> None:
    """HFModelError when a target's weight is also another module's (tied embeddings): the
    state's weights would move that module too, which its noise never perturbed."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    for name, module in modules.items():
        others = [o for o in owners.get(id(module.weight), []) if o != name]
        if others:
            raise HFModelError(
                f"target {name} shares its weight with {others[0]} (tied weights): "
                "leave it out of the target patterns"
            )


@dataclass
class _Active:
    """The members a forward pass evaluates: per target, sign * sigma * A and B."""

    a: dict[str, torch.Tensor]  # (members, out, r)
    b: dict[str, torch.Tensor]  # (members, in, r)
    members: int


class PopulationLM:
    """One model, the weights of an `HFState`, and batched evaluation of its members."""

    def __init__(self, model: Any, spec: HFSpec, state: HFState | None = None) -> None:
        torch, _ = require_hf()
        self.torch = torch
        self.model, self.spec = model, spec
        layers = {name: (module, t) for name, module, _, t in linear_layers(model)}
        missing = [t.name for t in spec.targets if t.name not in layers]
        if missing:
            raise HFModelError(f"the model has no linear layer {missing[0]!r} of the spec")
        self.modules = {t.name: layers[t.name][0] for t in spec.targets}
        _refuse_tied(model, self.modules)
        self.transposed = {t.name: layers[t.name][1] for t in spec.targets}
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # The base weights in float32 on the host, (out, in): `load_state` rebuilds each
        # target from them, so the evaluated weights depend on the state only, not its path.
        self._base = {name: self._weight(name).float().cpu().clone() for name in self.modules}
        self._active: _Active | None = None
        # the key-value cache's argument: `cache` in newer transformers, else past_key_values
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._hooks = [
            m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()
        ]
        self.state = state if state is not None else HFState.initial(spec)
        if state is not None:
            self.load_state(state)

    # --- weights -------------------------------------------------------------------------

    def _weight(self, name: str) -> torch.Tensor:
        """A target's weight as (out, in) (a view)."""
        w = self.modules[name].weight
        return w.T if self.transposed[name] else w

    def load_state(self, state: HFState) -> None:
        """Write base + alpha * acc into every target (float64 sum, then the model dtype)."""
        if state.spec != self.spec:
            raise HFModelError("the state belongs to another spec")
        torch = self.torch
        with torch.no_grad():
            for name in self.modules:
                acc = torch.from_numpy(state.acc[name]).double()
                w = self._base[name].double() + self.spec.alpha * acc
                self._weight(name).copy_(w.to(device=self.device, dtype=self.dtype))
        self.state = state

    def member_weight(self, name: str, step: int, member: int) -> torch.Tensor:
        """The (out, in) weight member `member` of `step` sees, materialised (for tests)."""
        a, b = member_factors(self.spec, step, self._target(name), member, 1)
        delta = self.spec.sigma * (a[0].astype(np.float64) @ b[0].astype(np.float64).T)
        w = self._weight(name).detach().double().cpu() + self.torch.from_numpy(delta)
        return w.to(device=self.device, dtype=self.dtype)

    def _target(self, name: str) -> Any:
        return next(t for t in self.spec.targets if t.name == name)

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
        for t in self.spec.targets:
            a, b = member_factors(self.spec, step, t, first, count)
            a_all[t.name] = (torch.from_numpy(a).to(self.device, self.dtype)) * self.spec.sigma
            b_all[t.name] = torch.from_numpy(b).to(self.device, self.dtype)
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

    def member_nll(self, step: int, first: int, count: int, tokens: torch.Tensor) -> np.ndarray:
        """Summed next-token negative log-likelihood (nats, float64) per member over rows
        tokens (R, T + 1): the perplexity objective's member losses."""
        torch = self.torch
        tokens = tokens.to(self.device)
        logits = self.logits(step, first, count, tokens[:, :-1]).float()
        logp = torch.log_softmax(logits, dim=-1)
        target = tokens[:, 1:].expand(count, *tokens[:, 1:].shape)
        nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        return nll.double().sum(dim=(1, 2)).cpu().numpy()

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
    ) -> np.ndarray:
        """Tokens (count, P, new_tokens) that members [first, first + count) of `step` write
        after each prompt (members None: the model of the state, count 1).

        temperature 0 is greedy; otherwise token t of prompt p is drawn by inverse CDF from
        the uniform of key(SAMPLE, seed, p, t), the same for every member."""
        torch = self.torch
        first, count = members if members is not None else (0, 1)
        if not prompts or min(len(p) for p in prompts) == 0:
            raise HFModelError("every prompt needs at least one token")
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
                )
                past = getattr(result, self._cache_arg, None)
                chosen = self._choose(result.logits[:, -1, :], temperature, seed, len(prompts), t)
                out[:, :, t] = chosen.reshape(count, len(prompts)).cpu().numpy()
                ids = chosen.reshape(-1, 1)
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
                position = position[:, -1:] + 1
        return out

    def _choose(
        self, logits: torch.Tensor, temperature: float, seed: int, prompts: int, t: int
    ) -> torch.Tensor:
        torch = self.torch
        if temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        cdf = probs.cumsum(dim=-1)
        keys = combine_array(hash_key(DOMAIN_SAMPLE, seed), np.arange(prompts, dtype=np.uint64))
        keys = combine_array(keys, np.full(prompts, t, dtype=np.uint64))
        u = torch.from_numpy((keys >> np.uint64(11)).astype(np.float64) * 2.0**-53)
        u = u.to(self.device).repeat(logits.shape[0] // prompts) * cdf[:, -1]
        chosen = torch.searchsorted(cdf, u.unsqueeze(-1)).squeeze(-1)
        return chosen.clamp(max=logits.shape[-1] - 1)

    def reward_chunk(
        self,
        step: int,
        first: int,
        count: int,
        prompts: Sequence[str],
        tokenizer: Any,
        reward: Callable[[str], float],
        new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> ChunkResult:
        """A chunk's fitness from a reward of its members' completions (`shared.goal`'s
        ternary rule: the sign of each pair's difference of exactly summed rewards)."""
        if first % 2 or count % 2:
            raise HFModelError("a chunk holds whole pairs: even first member and count")
        encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        tokens = self.complete(step, (first, count), encoded, new_tokens, temperature, seed, pad)
        rows = tokens.reshape(-1, new_tokens).tolist()
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
        rewards = np.array([reward(t) for t in texts], dtype=np.float64).reshape(count, -1)
        return ChunkResult(reward_fitness(rewards), reward_units(rewards))

    def close(self) -> None:
        """Remove the hooks (the model then runs as the state's plain weights)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def export_merged(model_dir: str | Path, state: HFState, out_dir: str | Path) -> Path:
    """Write the state's model (base + alpha * acc in every target) to `out_dir` as a
    directory `AutoModelForCausalLM.from_pretrained` loads: safetensors weights in the base
    model's dtype, its config and its tokenizer."""
    torch, _ = require_hf()
    model = load_causal_lm(model_dir)
    saved = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    tokenizer = load_tokenizer(model_dir)
    lm = PopulationLM(model, state.spec, state)
    lm.close()
    if isinstance(saved, torch.dtype):
        model = model.to(saved)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

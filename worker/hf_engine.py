"""The population of a Hugging Face causal LM at the speed of batched inference: the engine
behind `worker.hf_model.PopulationLM`'s scoring and completions.

Three pieces, each a plain pass-through when no members are active (then a forward, or a
completion, is the model's own plain inference):

- **Factors on the device.** `torch_noise.member_factors` makes every target's int8 factors
  where the model runs (only the pairs' keys cross the bus), and they are written once per
  (step, first, count) into persistent buffers: per target sign * scale * A^T
  (count, r, out), and per group of targets that read the same input their B side by side
  (count, in, k * r). The buffers keep their addresses, so a captured decode step reads
  whichever members the call set.
- **The fused pass.** Each target's `forward` is wrapped once (an instance attribute: the
  module tree and its parameter names stay as they are). With members active, rows are
  member-major and every target computes
      y = base(x) + (x_m @ B_m) @ (sign_m * scale * A_m)^T
  as two batched matmuls over the members. Targets that read the same input tensor (q, k
  and v projections; gate and up) are found once by a probe forward that records which
  tensor each target reads; the first of a group computes x @ [B_q B_k B_v] for all, the
  others take their columns. A follower that does not read its leader's tensor (same
  object, same version) computes its own product with a one-line notice, so the grouping
  can never give a wrong result, whatever the model family.
- **Static decode.** The prompts' prefill for all rows at once into transformers'
  `StaticCache`, then one decode step per token on fixed buffers (token, positions, cache
  slot, the sampling's uniforms, the output), the choice of the next token included. On
  CUDA the step is captured once per shape as a CUDA graph and replayed for every token
  (`graph`); on the CPU the same step runs eagerly. Attention masks are made here as 4D
  tensors, which transformers (4.56+ and 5.x) takes as given; 4.x writes the cache at the
  `cache_position` argument, 5.x at the cache's own counter, and both advance inside the
  step. Models the static cache does not fit (sliding windows, attention other than sdpa
  or eager) decode with a dynamic cache instead, after a one-line notice.

Tokens are chosen as `PopulationLM.complete` documents: greedy argmax, or inverse CDF of
one counter-based uniform per prompt and position shared by every member.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from ..shared import hf
from ..shared.config import RunConfig
from ..shared.hf_dir import require_hf
from ..shared.noise import DOMAIN_SAMPLE, combine_array, hash_key
from . import torch_noise

__all__ = ["Engine", "uniforms"]

log = structlog.get_logger("eggroll.worker")

CACHE_STEP = 32  # cache lengths are rounded up to this, so prompts of near widths share a plan
PLANS = 4  # decode plans (caches, buffers, graphs) kept per engine
FACTOR_SETS = 2  # member counts whose factor buffers are kept (a batch and a remainder)


def uniforms(seed: int, samples: list[int], tokens: int) -> np.ndarray:
    """(tokens, P) float64: the uniform of key(SAMPLE, seed, samples[p], t) in [0, 1)."""
    keys = combine_array(hash_key(DOMAIN_SAMPLE, seed), np.array(samples, dtype=np.uint64))
    t = np.arange(tokens, dtype=np.uint64)[:, None]
    return (combine_array(keys[None, :], t) >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass
class _Factors:
    """Persistent factor buffers for `count` members, and the call they hold."""

    count: int
    a: dict[str, Any]  # target -> (count, r, out): sign * scale * A^T
    b: list[Any]  # group -> (count, in, k * r): the group's B side by side
    key: tuple[int, int, int] | None = None  # (step, first, count)


@dataclass
class _Plan:
    """A decode shape's cache and buffers (and its CUDA graph once captured)."""

    rows: int
    prompts: int
    length: int  # the cache's positions
    cache: Any
    ids: Any  # (rows, 1) the token to read next
    position: Any  # (rows, 1) its position id
    slot: Any  # (1,) its cache slot
    t: Any  # (1,) the index of the token it chooses
    valid: Any  # (rows, length) False on the prompts' left padding
    cols: Any  # (length,) 0..length-1
    u: Any  # (tokens, P) float64 uniforms
    out: Any  # (rows, tokens) chosen tokens
    factors: _Factors | None
    weights: tuple[int, ...]  # the parameters' addresses a graph reads
    graph: Any = None


class Engine:
    """The fused population pass and the decode loop of one model (module docstring)."""

    def __init__(self, model: Any, cfg: RunConfig, modules: dict[str, Any]) -> None:
        torch, transformers = require_hf()
        self.torch, self.transformers = torch, transformers
        self.model, self.cfg, self.modules = model, cfg, modules
        self.targets = {t.name: t for t in hf.targets(cfg.model)}
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.scale, self.rank = hf.member_scale(cfg), cfg.model.rank
        self.active: _Factors | None = None
        self.groups: list[tuple[str, ...]] | None = None  # learned by the first probe
        self._place: dict[str, tuple[int, int]] = {}  # target -> (group, index in it)
        self._slot: tuple[int, Any, int, Any] | None = None  # (group, x, version, x @ B)
        self._recording: list[tuple[str, Any, int]] | None = None
        self._factors: OrderedDict[int, _Factors] = OrderedDict()
        self._plans: OrderedDict[tuple[Any, ...], _Plan] = OrderedDict()
        self._noticed: set[str] = set()
        forward = inspect.signature(model.forward).parameters
        # the key-value cache's argument: `cache` in transformers 5, else past_key_values
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self._cache_position = "cache_position" in forward  # 4.x writes the cache there
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        self._bool_mask = attention == "sdpa"
        # None: not yet known (the first plan checks the model's cache); True: a static
        # cache; False: transformers' dynamic cache (also a reference for checks)
        self.static: bool | None = None if attention in ("sdpa", "eager") else False
        if self.static is False:
            self._notice(f"attention {attention!r} takes no 4D mask: dynamic-cache decoding")
        self._saved = {name: m.__dict__.get("forward") for name, m in modules.items()}
        for name, module in modules.items():
            module.forward = self._wrap(name, module)

    def remove(self) -> None:
        """Unwrap every target (the model is then exactly as it was loaded)."""
        for name, module in self.modules.items():
            saved = self._saved.get(name)
            if saved is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved
        self._saved, self._plans, self._factors = {}, OrderedDict(), OrderedDict()

    def _notice(self, line: str, key: str | None = None) -> None:
        """Log a line once per engine (per `key` where given)."""
        if (key or line) not in self._noticed:
            self._noticed.add(key or line)
            log.info(line)

    # --- the fused pass ------------------------------------------------------------------

    def _wrap(self, name: str, module: Any) -> Callable[..., Any]:
        base = module.forward  # bound: the class's forward, or a wrapper already there

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            y = base(x, *args, **kwargs)
            if self.active is not None:
                return self._correct(name, x, y)
            if self._recording is not None:
                self._recording.append((name, x, x._version))
            return y

        return forward

    def _correct(self, name: str, x: Any, y: Any) -> Any:
        """y + each member's low-rank correction (rows member-major)."""
        torch, active, r = self.torch, self.active, self.rank
        assert active is not None
        g, i = self._place[name]
        size = len(self.groups[g]) if self.groups else 1
        xs = x.reshape(active.count, -1, x.shape[-1])
        b = active.b[g]
        part = None
        if i == 0:
            xb = torch.bmm(xs, b)
            part = xb if size == 1 else xb[:, :, :r]
            self._slot = (g, x, x._version, xb) if size > 1 else None
        else:
            slot = self._slot
            if slot is not None and slot[0] == g and slot[1] is x and slot[2] == x._version:
                part = slot[3][:, :, i * r : (i + 1) * r]
            else:
                self._notice(
                    f"{name} does not read its group's input: per-target corrections for it "
                    "and any other such target",
                    key="group",
                )
                part = torch.bmm(xs, b[:, :, i * r : (i + 1) * r])
            if i == size - 1:
                self._slot = None
        out = torch.baddbmm(y.reshape(active.count, -1, y.shape[-1]), part, active.a[name])
        return out.reshape(y.shape)

    def _learn_groups(self) -> None:
        """Group the targets that read the same input tensor, in call order, from one probe
        forward of two tokens (targets the probe does not reach stay alone)."""
        torch = self.torch
        self._recording = []
        try:
            with torch.no_grad():
                ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
                self.model(input_ids=ids, use_cache=False)
            recorded = self._recording
        except Exception as exc:  # a model the probe cannot run: no groups
            self._notice(f"no fused groups ({type(exc).__name__}): per-target corrections")
            recorded = []
        finally:
            self._recording = None
        groups: list[list[str]] = []
        seen: set[str] = set()
        last: tuple[Any, int, int] | None = None  # (x, version, in) of the last target
        for name, x, version in recorded:
            if name in seen:
                continue
            seen.add(name)
            width = self.targets[name].shape[1]
            if last is not None and x is last[0] and version == last[1] and width == last[2]:
                groups[-1].append(name)
            else:
                groups.append([name])
            last = (x, version, width)
        groups += [[name] for name in self.targets if name not in seen]
        self.groups = [tuple(g) for g in groups]
        self._place = {
            name: (g, i) for g, names in enumerate(self.groups) for i, name in enumerate(names)
        }

    def factors(self, step: int, first: int, count: int) -> _Factors:
        """The factor buffers of `count` members, holding members [first, first + count)
        of `step` (made on the device unless they hold them already)."""
        torch, r = self.torch, self.rank
        if self.groups is None:
            self._learn_groups()
        assert self.groups is not None
        f = self._factors.get(count)
        if f is None:
            a = {
                name: torch.empty((count, r, t.shape[0]), dtype=self.dtype, device=self.device)
                for name, t in self.targets.items()
            }
            b = [
                torch.empty(
                    (count, self.targets[g[0]].shape[1], len(g) * r),
                    dtype=self.dtype,
                    device=self.device,
                )
                for g in self.groups
            ]
            f = self._factors[count] = _Factors(count, a, b)
            while len(self._factors) > FACTOR_SETS:
                self._factors.popitem(last=False)
        self._factors.move_to_end(count)
        if f.key != (step, first, count):
            f.key = None  # half-written buffers hold no call
            order = list(self.targets.values())
            made = torch_noise.member_factors(self.cfg, step, order, first, count, self.device)
            for t, (a8, b8) in zip(order, made, strict=True):
                # int8 -> dtype is exact; then the same rounding as (A.to(dtype) * scale)
                f.a[t.name].copy_(a8.transpose(1, 2)).mul_(self.scale)
                g, i = self._place[t.name]
                f.b[g][:, :, i * r : (i + 1) * r].copy_(b8)
            f.key = (step, first, count)
        return f

    @contextlib.contextmanager
    def members(self, step: int, first: int, count: int) -> Iterator[None]:
        """Forward passes inside see members [first, first + count) of `step`, member-major."""
        self.active = self.factors(step, first, count)
        try:
            yield
        finally:
            self.active, self._slot = None, None

    # --- decoding -------------------------------------------------------------------------

    def complete(
        self,
        members: tuple[int, int, int] | None,
        ids: Any,
        mask: Any,
        new_tokens: int,
        temperature: float,
        min_p: float,
        u: np.ndarray | None,
        graph: bool,
    ) -> np.ndarray:
        """Tokens (count, P, new_tokens) after the left-padded prompts ids, mask (P, W) of
        members (step, first, count) (None: the plain model, count 1); u (new_tokens, P)
        the sampling's uniforms (None when greedy); `graph`: replay a captured CUDA graph."""
        torch = self.torch
        count = members[2] if members is not None else 1
        prompts, width = ids.shape
        if new_tokens == 0:
            return np.zeros((count, prompts, 0), dtype=np.int64)
        ids = ids.repeat(count, 1).to(self.device)
        mask = mask.repeat(count, 1).to(self.device)
        uniform = torch.from_numpy(u).to(self.device) if u is not None else None
        context = self.members(*members) if members is not None else contextlib.nullcontext()
        with torch.no_grad(), context:
            sampling = (temperature, min_p)
            plan = self._plan(count, prompts, width + new_tokens, new_tokens, graph, sampling)
            if plan is None:
                out = self._dynamic(ids, mask, new_tokens, temperature, min_p, uniform)
            else:
                self._prefill(plan, ids, mask, temperature, min_p, uniform)
                self._decode(plan, new_tokens - 1, temperature, min_p, graph)
                out = plan.out
        # a copy: on a CPU, .numpy() of the plan's buffer would share it with the next call
        return out.reshape(count, prompts, new_tokens).to("cpu", copy=True).numpy()

    def decodes_static(self, length: int = CACHE_STEP) -> bool:
        """Whether the model decodes on the static plan (4D masks), decided once: its cache
        must be a plain static one (not sliding windows, linear attention...)."""
        if self.static is None:
            cache = self.transformers.StaticCache(config=self.model.config, max_cache_len=length)
            kinds = {type(layer).__name__ for layer in getattr(cache, "layers", [None])}
            self.static = kinds == {"StaticLayer"}
            if not self.static:
                self._notice("the model's cache is not a plain static one: dynamic-cache decoding")
        return self.static

    def _plan(
        self,
        count: int,
        prompts: int,
        length: int,
        tokens: int,
        graph: bool,
        sampling: tuple[float, float] = (0.0, 0.0),
    ) -> _Plan | None:
        """The decode plan of this shape and `sampling` (temperature, min_p: a captured graph
        replays the choice it recorded), made or taken from the few kept; None for a model
        the static cache does not fit."""
        torch = self.torch
        if self.static is False:
            return None
        length = -(-length // CACHE_STEP) * CACHE_STEP
        rows = count * prompts
        factors = self.active
        weights = tuple(p.data_ptr() for p in self.model.parameters()) if graph else ()
        key = (rows, prompts, length, tokens, factors.count if factors else 0, graph, sampling)
        plan = self._plans.get(key)
        if plan is not None and plan.factors is factors and plan.weights == weights:
            self._plans.move_to_end(key)
            return plan
        if not self.decodes_static(length):
            return None
        cache = self.transformers.StaticCache(config=self.model.config, max_cache_len=length)

        def zeros(*shape: int, dtype: Any = torch.long) -> Any:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        plan = _Plan(
            rows, prompts, length, cache, zeros(rows, 1), zeros(rows, 1), zeros(1), zeros(1),
            zeros(rows, length, dtype=torch.bool),
            torch.arange(length, device=self.device), zeros(tokens, prompts, dtype=torch.float64),
            zeros(rows, tokens), factors, weights,
        )  # fmt: skip
        self._plans[key] = plan
        while len(self._plans) > PLANS:
            self._plans.popitem(last=False)
        return plan

    def _mask(self, attend: Any) -> Any:
        """A 4D boolean mask as the attention takes it: as is (sdpa), or additive (eager)."""
        if self._bool_mask:
            return attend
        floor = self.torch.finfo(self.dtype).min
        return self.torch.zeros(attend.shape, dtype=self.dtype, device=self.device).masked_fill(
            ~attend, floor
        )

    def _forward(self, ids: Any, mask: Any, position: Any, cache: Any, slots: Any) -> Any:
        extra = {"cache_position": slots} if self._cache_position else {}
        result = self.model(
            input_ids=ids,
            attention_mask=self._mask(mask),
            position_ids=position,
            use_cache=True,
            **{self._cache_arg: cache},
            **self._last_only,
            **extra,
        )
        return result.logits[:, -1, :]

    def _prefill(
        self, plan: _Plan, ids: Any, mask: Any, temperature: float, min_p: float, u: Any
    ) -> None:
        """Reset the plan's cache and buffers, read the prompts, choose token 0."""
        torch = self.torch
        width = ids.shape[1]
        plan.cache.reset()
        plan.valid.fill_(True)
        plan.valid[:, :width] = mask.bool()
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        q = torch.arange(width, device=self.device)[:, None]
        # causal over the valid columns; each position sees itself, so that no row of the
        # left padding is empty (its outputs are never read)
        attend = (plan.valid[:, None, :] & (plan.cols[None] <= q)) | (plan.cols[None] == q)
        plan.position.copy_(position[:, -1:])
        plan.slot.fill_(width - 1)
        plan.t.zero_()
        if u is not None:
            plan.u.copy_(u)
        logits = self._forward(ids, attend[:, None], position, plan.cache, q[:, 0])
        self._finish(plan, logits, temperature, min_p)

    def _step(self, plan: _Plan, temperature: float, min_p: float) -> None:
        """One decode token, on the plan's buffers only (what a CUDA graph captures)."""
        attend = (plan.valid & (plan.cols <= plan.slot))[:, None, None, :]
        logits = self._forward(plan.ids, attend, plan.position, plan.cache, plan.slot)
        self._finish(plan, logits, temperature, min_p)

    def _finish(self, plan: _Plan, logits: Any, temperature: float, min_p: float) -> None:
        """Choose token t from the last logits, store it, and advance the buffers."""
        u = None
        if temperature > 0:
            u = plan.u.index_select(0, plan.t).reshape(-1).repeat(plan.rows // plan.prompts)
        chosen = choose(self.torch, logits, temperature, min_p, u)
        plan.out.index_copy_(1, plan.t, chosen[:, None])
        plan.ids.copy_(chosen[:, None])
        plan.position.add_(1)
        plan.slot.add_(1)
        plan.t.add_(1)

    def _decode(
        self, plan: _Plan, steps: int, temperature: float, min_p: float, graph: bool
    ) -> None:
        """`steps` decode tokens: eagerly, or as replays of the plan's CUDA graph (captured
        after one eager warm-up step on a side stream the first time)."""
        torch = self.torch
        if not graph or steps <= 0:
            for _ in range(steps):
                self._step(plan, temperature, min_p)
            return
        if plan.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(plan, temperature, min_p)
            torch.cuda.current_stream().wait_stream(side)
            steps -= 1
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured, capture_error_mode="thread_local"):
                self._step(plan, temperature, min_p)  # recorded, not run
            plan.graph = captured
        for _ in range(steps):
            plan.graph.replay()

    def _dynamic(
        self, ids: Any, mask: Any, new_tokens: int, temperature: float, min_p: float, u: Any
    ) -> Any:
        """The same tokens with transformers' dynamic cache and 2D masks (models the static
        plan does not fit)."""
        torch = self.torch
        rows, prompts = ids.shape[0], (u.shape[1] if u is not None else 1)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        out = torch.zeros((rows, new_tokens), dtype=torch.long, device=self.device)
        past = None
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
            row = u[t].repeat(rows // prompts) if u is not None else None
            chosen = choose(torch, result.logits[:, -1, :], temperature, min_p, row)
            out[:, t] = chosen
            ids = chosen.reshape(-1, 1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            position = position[:, -1:] + 1
        return out


def choose(torch: Any, logits: Any, temperature: float, min_p: float, u: Any) -> Any:
    """Greedy argmax (temperature 0), or the inverse CDF at u (one per row, in [0, 1)) of
    softmax(logits / temperature) in float64 among the tokens at least min_p times as
    likely as the likeliest."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if min_p > 0:
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return chosen.clamp(max=logits.shape[-1] - 1)

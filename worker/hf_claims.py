"""How plausible claimed completions are as a Hugging Face population's own generations.

A reward chunk's result is computed from completions its members sampled
(`PopulationLM.complete`). A worker checking that result is given the completions (token
ids) and asks whether each token is one the member would have written. It reads them in one
teacher-forced forward per batch of members (the left-padded prompts and the claimed tokens,
with the attention mask and position ids the decode used) and measures, per token, how far
its own distribution is from choosing it:

- sampled (temperature > 0): `hf_engine.choose` draws token t at uniform u iff u lies in
  [lo(t), hi(t)), the token's interval of the cumulative distribution (float64 softmax of
  logits / temperature, the min_p floor applied, normalised by its total). The distance is
  0 inside, else how far u lies outside, in probability units;
- greedy: max prob - prob(t) under softmax(logits), 0 for the argmax.

The checker's floating point is not the writer's (float32 against bfloat16, another device,
a decode step against a full forward), so an honest token's distance is small, not zero:
`CLAIM_TOLERANCE` bounds it, and `plausible` tests every token against it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .hf_engine import uniforms
from .hf_model import HFModelError, PopulationLM, left_pad

__all__ = ["CLAIM_TOLERANCE", "claim_distances", "plausible"]

# The largest distance an honest token may have. Measured on the tiny GPT-2 and Llama of the
# tests, trained for a moment (peaked distributions; float32 and bfloat16 logits differ by
# 0.005 on average, 0.1 at most): 8 members, 4 prompts, 44 tokens, 160 steps and seeds per
# case, written in bfloat16 and checked in float32 and the reverse. Honest maxima: greedy
# 0.044, temperature 1.0 0.023, temperature 0.7 with min_p 0.05 0.078 (99.9th percentiles
# 0.005-0.009; in one dtype a full forward against decode steps: 0 in float32, at most 0.04
# in bfloat16). min_p makes the tail: a token near the floor that one dtype keeps and the
# other drops moves every later interval by its mass (min_p 0.1 reached 0.16; a temperature
# of 0.3 without it 0.083). Untrained models with large weights, whose bfloat16 logits
# stray by up to 0.7, reach 0.3: re-measure for a model whose dtypes disagree more.
# At 0.1 a liar may claim any token whose interval lies within 0.1 of u (about 0.2 of
# probability mass per token around the honest one's), or greedily any token within 0.1 of
# the likeliest's probability; rows caught there: another member's completions 0.79-0.99,
# one token changed 0.93-1.0, random tokens 1.0.
CLAIM_TOLERANCE = 0.1
FLOOR_MARGIN = 0.8  # a token under 0.8 of the min_p floor is off, whatever u is

_HEAD_ONLY: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
HEAD_BYTES = 1 << 27  # float64 probabilities reduced at a time: (positions, vocab) per piece


def claim_distances(
    lm: PopulationLM,
    step: int,
    members: tuple[int, int],
    prompts: Sequence[Sequence[int]],
    tokens: np.ndarray,
    temperature: float = 0.0,
    seed: int = 0,
    pad_id: int = 0,
    samples: Sequence[int] | None = None,
    min_p: float = 0.0,
) -> np.ndarray:
    """Distances (count, P, N) float64 in [0, 1] of the claimed `tokens` (count, P, N) of
    members (first, count) of `step` after `prompts`, as `PopulationLM.complete` with these
    arguments would write them (module docstring); a token outside the vocabulary is at 1.
    One forward of all count * P rows: the caller batches members."""
    torch = lm.torch
    first, count = members
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 3 or tokens.shape[:2] != (count, len(prompts)):
        raise HFModelError(
            f"claimed tokens {tokens.shape} for {count} members, {len(prompts)} prompts"
        )
    if not prompts or min(len(p) for p in prompts) == 0:
        raise HFModelError("every prompt needs at least one token")
    samples = list(range(len(prompts))) if samples is None else list(samples)
    if len(samples) != len(prompts):
        raise HFModelError(f"{len(samples)} sample numbers for {len(prompts)} prompts")
    new = tokens.shape[2]
    if new == 0:
        return np.zeros(tokens.shape, dtype=np.float64)
    ids, mask = left_pad(torch, prompts, pad_id)
    claimed = torch.from_numpy(tokens.reshape(count * len(prompts), new))
    vocab = _vocab(lm.model)
    known = (claimed >= 0) & (claimed < vocab)
    # the claimed tokens follow each prompt; an unknown id is read as the pad (its row's
    # distance is 1 there whatever follows)
    ids = torch.cat([ids.repeat(count, 1), torch.where(known, claimed, pad_id)[:, :-1]], 1)
    mask = torch.cat([mask.repeat(count, 1), torch.ones_like(claimed)[:, :-1]], 1)
    head_only = _head_only(lm)  # its probe runs outside the members
    with torch.no_grad(), lm.members(step, first, count):
        hidden, head = _hidden(lm, ids.to(lm.device), mask.to(lm.device), new, head_only)
    u = None
    if temperature > 0:
        u = torch.from_numpy(uniforms(seed, samples, new).T.copy()).repeat(count, 1)
    out = torch.ones(claimed.shape, dtype=torch.float64)
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), claimed.reshape(-1)
    piece = max(1, HEAD_BYTES // (8 * vocab))
    for lo in range(0, flat_t.shape[0], piece):
        logits = head(flat_h[lo : lo + piece])
        t = flat_t[lo : lo + piece].to(lm.device)
        uu = u.reshape(-1)[lo : lo + piece].to(lm.device) if u is not None else None
        out.view(-1)[lo : lo + piece] = _distance(torch, logits, t, temperature, min_p, uu).cpu()
    out[~known] = 1.0
    return out.reshape(tokens.shape).numpy()


def _vocab(model: Any) -> int:
    """The ids the model both reads and scores."""
    heads = (model.get_input_embeddings(), model.get_output_embeddings())
    return min(h.weight.shape[0] for h in heads if h is not None)


def plausible(distances: np.ndarray) -> bool:
    """Whether every claimed token is within `CLAIM_TOLERANCE` of being chosen."""
    return bool(np.all(np.asarray(distances) <= CLAIM_TOLERANCE))


def _hidden(lm: PopulationLM, ids: Any, mask: Any, new: int, head_only: bool) -> tuple[Any, Any]:
    """The states (rows, new, H) of the positions that predict the claimed tokens (the last
    `new`), and the function that makes logits of them: the model's head where the model's
    logits are exactly head(base model's states), else its own forward's logits kept."""
    torch, engine, model = lm.torch, lm.engine, lm.model
    position = (mask.cumsum(-1) - 1).clamp(min=0)  # as the decode counts them
    if engine.decodes_static():  # the static plan's mask: causal over valid columns, self always
        valid, q = mask.bool(), torch.arange(ids.shape[1], device=ids.device)
        attend = (valid[:, None, :] & (q[None, None, :] <= q[None, :, None])) | (
            q[None, None, :] == q[None, :, None]
        )
        mask = engine._mask(attend[:, None])
    args = {"input_ids": ids, "attention_mask": mask, "position_ids": position}
    if head_only:
        states = model.base_model(**args, use_cache=False).last_hidden_state[:, -new:]
        return states, model.get_output_embeddings()
    keep = {"logits_to_keep": new} if engine._last_only else {}
    logits = model(**args, use_cache=False, **keep).logits[:, -new:]
    return logits, lambda x: x


def _head_only(lm: PopulationLM) -> bool:
    """Whether the model's logits are its output embeddings of its base model's last states
    (no scaling or capping after the head), by one probe of two tokens; kept on the model."""
    model, torch = lm.model, lm.torch
    known = _HEAD_ONLY.get(model)
    if known is None:
        head, base = model.get_output_embeddings(), model.base_model
        known = False
        perturbed = any(m is head for m in lm.modules.values())  # outside the members: wrong
        if head is not None and base is not model and not perturbed:
            with torch.no_grad():
                ids = torch.zeros((1, 2), dtype=torch.long, device=lm.device)
                want = model(input_ids=ids, use_cache=False).logits
                got = head(base(input_ids=ids, use_cache=False).last_hidden_state)
            known = bool(torch.equal(want, got))
        _HEAD_ONLY[model] = known
    return known


def _distance(torch: Any, logits: Any, t: Any, temperature: float, min_p: float, u: Any) -> Any:
    """Each row's distance (float64) from choosing token t: `choose`'s arithmetic, read
    backwards (ids outside the vocabulary are clamped here and set to 1 by the caller)."""
    t = t.clamp(0, logits.shape[-1] - 1)[:, None]
    if temperature <= 0:
        probs = torch.softmax(logits.double(), dim=-1)
        return (probs.max(dim=-1, keepdim=True).values - probs.gather(1, t))[:, 0]
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    dropped = torch.zeros(t.shape[0], dtype=torch.bool, device=logits.device)
    if min_p > 0:
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        # a token clearly under the floor is never drawn: its zero-width interval must not
        # pass for being near u (one near the floor may be kept by the writer's dtype)
        dropped = (probs.gather(1, t) < FLOOR_MARGIN * floor)[:, 0]
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # choose takes the first token whose cdf reaches u * total: t iff cdf[t-1] < u * total
    # <= cdf[t]
    hi = cdf.gather(1, t) / total
    lo = torch.where(t > 0, cdf.gather(1, (t - 1).clamp(min=0)), 0.0) / total
    outside = torch.clamp(torch.maximum(lo - u[:, None], u[:, None] - hi), min=0.0)[:, 0]
    return torch.where(dropped, torch.ones_like(outside), outside)

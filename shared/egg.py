"""The EGG model: nano-egg's integer minGRU language model, NumPy reference.

nano-egg: https://github.com/ESHyperscale/nano-egg (the EGGROLL paper's int8 model).

Everything is integer: int8 weights in [-127, 127], int32 accumulation, floor shifts and
floor division (never C truncation), clip to [-127, 127]. Activations are fixed point with
16 = 1.0. The CuPy backend (worker/backend/egg.cu) mirrors this file kernel by kernel and
must match it exactly. MM and the embedding's perturbed rows are shared/perturb.py's.

    x = EMB[token]                                   # (M, D)  one row per population member
    for each layer (state s starts at 0, and is reset where the input token is 0):
        h = LN1(x)
        f = clip(MM(h, Wf) + MM(s, Uf) + bf)         # gate logits, no sigmoid
        g = ((f + 127) * s) >> 8
        c = clip(MM(h, Wh) + MM(g, Uh) + bh)         # candidate, no tanh
        s = s + (((f + 127) * (c - s)) >> 8)         # new state = layer output
        x = clip(x + s)
        x = clip(x + MM(MM(LN2(x), W1), W2))         # MLP: D -> 4D -> D, no activation
    logits = MM(LN_out(x), HEAD)                     # (M, V), base-2 log-odds in 1/16 bits

    LN(x)     = clip((x * w) // max(sum|x| // D, 1)) # mean-absolute-value norm

Unlike nano-egg, no hidden state is carried across steps: every antithetic pair reads its
own window of seq_len + 1 tokens (chunks move between workers) and starts from zero.
Held-out scoring may carry the state along a long span (`carries_state`).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from .loss import token_loss, true_bits
from .matmul import clip8, floor_div
from .perturb import INT8, MemberNoise, ParamSpec, int8_settings, perturbed_mm, perturbed_rows

if TYPE_CHECKING:
    from .config import ModelConfig, RunConfig


@cache
def specs(m: ModelConfig) -> tuple[ParamSpec, ...]:
    """The tensors in noise-stream (tensor id) order: matrices are (out, in)."""
    d, v = m.d_model, m.vocab_size
    layout: list[tuple[str, tuple[int, ...], str, str]] = [("emb", (v, d), "matrix", "gaussian")]
    for i in range(m.n_layer):
        p = f"layers.{i}."
        layout += [
            (p + "ln1", (d,), "vector", "sixteen"),
            (p + "wf", (d, d), "matrix", "gaussian"),
            (p + "uf", (d, d), "matrix", "gaussian"),
            (p + "bf", (d,), "vector", "zero"),
            (p + "wh", (d, d), "matrix", "gaussian"),
            (p + "uh", (d, d), "matrix", "gaussian"),
            (p + "bh", (d,), "vector", "zero"),
            (p + "ln2", (d,), "vector", "sixteen"),
            (p + "w1", (4 * d, d), "matrix", "gaussian"),
            (p + "w2", (d, 4 * d), "matrix", "gaussian"),
        ]
    layout += [("ln_out", (d,), "vector", "sixteen"), ("head", (v, d), "matrix", "gaussian")]
    return tuple(ParamSpec(n, s, k, i, tid) for tid, (n, s, k, i) in enumerate(layout))


FAMILY, EXACT, OWN_TOKENIZER = INT8  # the int8 family's answers (shared/perturb.py)


def check(cfg: RunConfig) -> str | None:
    """The EGG model has no settings beyond the common int8 ones, and no head bias."""
    m = cfg.model
    if m.head_bias != "none":
        return f"model.head_bias={m.head_bias!r} needs model.arch='former'"
    return int8_settings(cfg)


class EggModel:
    """Forward pass of the EGG model for a batch of members (or unperturbed rows)."""

    carries_state = True  # recurrent: a held-out span can be read with the state carried

    def __init__(self, cfg: RunConfig, params: dict[str, np.ndarray]):
        self.cfg = cfg
        self.params = params
        # float32 transposes for exact BLAS GEMMs (|x|, |w| <= 127; see matmul.py).
        self.wt = {
            s.name: np.ascontiguousarray(params[s.name].T, dtype=np.float32)
            for s in specs(cfg.model)
            if s.kind == "matrix" and s.name != "emb"
        }

    def _mm(self, x: np.ndarray, name: str, noise: MemberNoise | None) -> np.ndarray:
        return perturbed_mm(x, self.wt[name], noise, name, self.cfg)

    def _vector(self, name: str, noise: MemberNoise | None) -> np.ndarray:
        return self.params[name].astype(np.int32) if noise is None else noise.vectors[name]

    def _ln(self, x: np.ndarray, name: str, noise: MemberNoise | None) -> np.ndarray:
        d = x.shape[1]
        mav = np.maximum(np.abs(x).sum(axis=1, keepdims=True) // d, 1)  # (M, 1)
        return clip8(floor_div(x * self._vector(name, noise), mav))  # (M, D)

    def _embed(self, tok: np.ndarray, noise: MemberNoise | None) -> np.ndarray:
        return clip8(perturbed_rows(self.params["emb"], tok, noise, "emb", self.cfg))

    def initial_state(self, rows: int) -> list[np.ndarray]:
        """The recurrent state before the first token: zero in every layer."""
        d, n_layer = self.cfg.model.d_model, self.cfg.model.n_layer
        return [np.zeros((rows, d), dtype=np.int32) for _ in range(n_layer)]

    def step(
        self, state: list[np.ndarray], tok: np.ndarray, noise: MemberNoise | None = None
    ) -> np.ndarray:
        """Read one token per row, update `state` in place, return the logits (M, V) int32
        that predict the next token. forward() is this step in a loop."""
        x = self._embed(tok, noise)  # (M, D)
        reset = tok == 0  # a document starts: forget the previous one
        for i in range(self.cfg.model.n_layer):
            p = f"layers.{i}."
            s = state[i]  # (M, D)
            s[reset] = 0
            h = self._ln(x, p + "ln1", noise)
            f = clip8(
                self._mm(h, p + "wf", noise)
                + self._mm(s, p + "uf", noise)
                + self._vector(p + "bf", noise)
            )
            gate = f + 127  # 0..254: the gate in 1/256 units
            g = (gate * s) >> 8
            c = clip8(
                self._mm(h, p + "wh", noise)
                + self._mm(g, p + "uh", noise)
                + self._vector(p + "bh", noise)
            )
            s = s + ((gate * (c - s)) >> 8)
            state[i] = s
            x = clip8(x + s)
            hidden = self._mm(self._ln(x, p + "ln2", noise), p + "w1", noise)  # (M, 4D)
            x = clip8(x + self._mm(hidden, p + "w2", noise))  # (M, D)
        return self._mm(self._ln(x, "ln_out", noise), "head", noise)  # (M, V)

    def decoder(self, noise: MemberNoise | None, rows: int) -> EggDecoder:
        """`rows` rows (members, or unperturbed rows) reading one token at a time."""
        return EggDecoder(self, noise, rows)

    def window_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Unperturbed logits (M, T, V) after each of tokens[:, :T] for rows (M, T + 1)."""
        state = self.initial_state(tokens.shape[0])
        steps = [self.step(state, tokens[:, t]) for t in range(tokens.shape[1] - 1)]
        return np.stack(steps, axis=1)

    def position_losses(
        self, tokens: np.ndarray, noise: MemberNoise | None = None, float_bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Integer loss (M, T) int64 of each position predicting tokens[:, 1:] from a zero
        state, and if asked the exact float64 bits."""
        m, steps = tokens.shape[0], tokens.shape[1] - 1
        state = self.initial_state(m)
        loss = np.zeros((m, steps), dtype=np.int64)
        bits = np.zeros((m, steps), dtype=np.float64) if float_bits else None
        for t in range(steps):
            logits = self.step(state, tokens[:, t], noise)  # (M, V)
            loss[:, t] = token_loss(logits, tokens[:, t + 1])
            if bits is not None:
                bits[:, t] = true_bits(logits, tokens[:, t + 1])
        return loss, bits

    def forward(
        self, tokens: np.ndarray, noise: MemberNoise | None = None, float_bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Score rows of tokens (M, T + 1): predict tokens[:, 1:] from the prefix.

        Returns the integer loss per row (sum over T tokens, 1/16 bit units, int64) and,
        if asked, the exact float64 bits per row for reporting.
        """
        loss, bits = self.position_losses(tokens, noise, float_bits)
        return loss.sum(axis=1), None if bits is None else bits.sum(axis=1)


class EggDecoder:
    """Rows that read a token each per call, the state carried (shared.sample.Decoder)."""

    def __init__(self, model: EggModel, noise: MemberNoise | None, rows: int):
        self.model, self.noise = model, noise
        self.state = model.initial_state(rows)

    def read(self, tokens: np.ndarray) -> np.ndarray:
        return self.model.step(self.state, tokens, self.noise)


class EggGenerator:
    """The unperturbed EGG model one token at a time, for `shared.sample.generate`.

    Recurrent, so each token costs the same and no position table bounds the output. It
    was trained on windows of seq_len tokens from a zero state, so that is its context:
    the prompt tokens it conditions on. Generation starts where a document starts: after
    token 0, the separator that resets the state.
    """

    def __init__(self, cfg: RunConfig, params: dict[str, np.ndarray]):
        self.model = EggModel(cfg, params)
        self.vocab_size = cfg.model.vocab_size
        self.context = cfg.es.seq_len

    def start(self) -> tuple[list[np.ndarray], np.ndarray]:
        return self.step(self.model.initial_state(1), 0)

    def step(self, state: list[np.ndarray], token: int) -> tuple[list[np.ndarray], np.ndarray]:
        logits = self.model.step(state, np.array([token], dtype=np.int64))  # (1, V)
        return state, logits[0]


MODEL = EggModel
GENERATOR = EggGenerator

"""The EGG model's forward pass on the CuPy backend: its buffers and its launch sequence
(egg.cu), the structure of `shared/egg.py` kernel by kernel.

A pass is one token step per column of the pairs' windows, launches(n_layer) kernels each,
every layer's recurrent state carried in device buffers from one step to the next. A
held-out pass captures one token step at a device-side position and replays it once per
column, so a stream of thousands of tokens is one small graph, not thousands of steps'
launches.

As cupy_former.py, it has what cupy_backend.LAUNCH asks of an architecture: `check`,
`batch_members`, `tables`, `buffers` and `sequence` (a forward pass), `launches`, and for
held-out scores `CARRIES_STATE`, `held_out_batch`, `held_out_pass`, `held_out_counts`.
"""

from __future__ import annotations

from math import isqrt
from typing import TYPE_CHECKING, Any

import numpy as np

from .cupy_kernels import BLOCK, TILE_M, TILE_N

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...shared.config import RunConfig
    from .cupy_backend import CupyBackend

# The long held-out streams carry each layer's state across their windows.
CARRIES_STATE = True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launches(n_layer: int) -> int:
    """Kernels of one EGG token step: embed; per layer norm + dots, rowdot(s), gate,
    rowdot(g), candidate, norm + dot, w1, rowdot(hidden), w2; the final norm, head, loss."""
    return 1 + 9 * n_layer + 3


def check(cfg: RunConfig) -> str | None:
    """Why the kernels cannot run this config: never, past the backend's own checks."""
    return None


def batch_members(cfg: RunConfig, members: int) -> int:
    """Members per forward batch: as many as asked for (a member's buffers hold one token's
    activations and its state)."""
    return members


def tables(xp: Any, seq_len: int, head_dim: int) -> dict[str, Any]:
    """The model's device tables beyond the loss tables: none."""
    return {}


def buffers(
    backend: CupyBackend, n_pairs: int, steps: int | None = None, held_out: bool = False
) -> dict[str, Any]:
    """Everything a forward pass of n_pairs pairs over `steps` tokens (seq_len) reads and
    writes, allocated once per shape (its captured launches point at these); held out:
    with each step's logit counts of the even members (steps, P, 256) and targets."""
    xp, cfg = backend.xp, backend.config
    d, n_layer, v = cfg.model.d_model, cfg.model.n_layer, cfg.model.vocab_size
    m, steps = 2 * n_pairs, steps or cfg.es.seq_len
    bufs: dict[str, Any] = {
        "pairs": xp.zeros(n_pairs, dtype=xp.int64),
        "tokens": xp.zeros((n_pairs, steps + 1), dtype=xp.int32),
        "states": xp.zeros((n_layer, m, d), dtype=xp.int8),
        "hidden": xp.empty((m, 4 * d), dtype=xp.int8),
        "logits": xp.empty((m, v), dtype=xp.int8),
        "xb": [xp.empty(m, dtype=xp.int32) for _ in range(4)],
        "loss": xp.zeros(m, dtype=xp.int64),
    }
    for name in ("x", "h", "f", "g"):
        bufs[name] = xp.empty((m, d), dtype=xp.int8)
    if held_out:
        bufs["hist"] = xp.zeros((steps, n_pairs, 256), dtype=xp.int32)
        bufs["target"] = xp.zeros((steps, n_pairs), dtype=xp.int32)
        bufs["pos"] = xp.zeros(1, dtype=xp.int32)  # the column a replayed step reads
    bufs.update(backend.noise_buffers(n_pairs, zero=held_out))  # zero: no rank-1 correction
    return bufs


def sequence(backend: CupyBackend, bufs: dict[str, Any]) -> None:
    """The launches of one forward pass over bufs: windows, noise, then a token step of
    launches(n_layer) kernels per column of the windows. Every per-pass input is in device
    memory."""
    backend.gather(bufs)
    backend.noise(bufs["pairs"], len(bufs["pairs"]), bufs["a"], bufs["b"], bufs["vec"])
    for zeroed in (bufs["states"], bufs["loss"]):
        backend.zero(zeroed)
    for t in range(bufs["tokens"].shape[1] - 1):
        token_step(backend, bufs, t)


def held_out_batch(backend: CupyBackend, pairs: int) -> int:
    """Pairs per held-out pass: all asked for (its buffers are one token's per pair)."""
    return pairs


def held_out_pass(
    backend: CupyBackend, n_pairs: int, steps: int
) -> tuple[list[Callable[[], None]], dict[str, Any]]:
    """The captured launches of a held-out pass over n_pairs rows of `steps` columns, and
    its buffers: the start, then one token step replayed per column."""
    k = backend.kernels
    bufs = buffers(backend, n_pairs, steps, held_out=True)
    graphs = [k.capture(lambda: _held_out_start(backend, bufs))]
    graphs += [k.capture(lambda: _held_out_step(backend, bufs))] * steps
    return graphs, bufs


def held_out_counts(
    hist: np.ndarray, target: np.ndarray, n_pairs: int, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """A held-out pass's logit counts (P, L, 256) and target logits (P, L) from its buffers'
    host copies, which are by step: (L, P, 256) and (L, P)."""
    return hist.transpose(1, 0, 2), target.T


def _held_out_start(backend: CupyBackend, bufs: dict[str, Any]) -> None:
    """Before a held-out pass: zero states, counts, and the device-side position."""
    for zeroed in (bufs["states"], bufs["hist"], bufs["pos"]):
        backend.zero(zeroed)


def _held_out_step(backend: CupyBackend, bufs: dict[str, Any]) -> None:
    """One token step of a held-out pass at the device-side position, then the position
    moves on: captured once, replayed once per column."""
    token_step(backend, bufs, 0, bufs["pos"])
    backend.kernels("bump_i32", (1,), (1,), bufs["pos"])


def token_step(backend: CupyBackend, bufs: dict[str, Any], t: int, pos: Any = None) -> None:
    """launches(n_layer) kernels: read column t (+ *pos, a device-side position of a
    held-out pass) of every pair's window, score the next column: into the loss (training),
    or with pos, as logit counts into bufs["hist"] (held out: the unperturbed model, bufs'
    noise zero and its vectors the weights', each row a pair of identical members)."""
    step = _TokenStep(backend, bufs)
    step.embed(t, backend.null32 if pos is None else pos)
    for i in range(backend.config.model.n_layer):
        step.layer(f"layers.{i}.", bufs["states"][i])
    step.head(t, pos)


class _TokenStep:
    """One token step's launches over bufs (token_step), and the helpers its layers share:
    the rank-1 dot, the norm with its dots, MM."""

    def __init__(self, backend: CupyBackend, bufs: dict[str, Any]) -> None:
        cfg = backend.config
        self.backend, self.bufs, self.k, self.w = backend, bufs, backend.kernels, backend.w
        self.d, self.v = cfg.model.d_model, cfg.model.vocab_size
        self.m = 2 * len(bufs["pairs"])
        self.shift = np.int32(4 + cfg.es.sigma_shift)
        self.rows = (_cdiv(self.m, 8),)

    def rowdot(self, src: Any, name: str, out: Any) -> Any:
        i32, b = np.int32, self.bufs["b"]
        self.k(
            "rowdot", self.rows, (BLOCK,), src, b[name], i32(self.m), i32(1), i32(src.shape[1]), out
        )
        return out

    def norm(self, vector: str, dots: tuple[str, ...]) -> None:
        """h = the norm of x; with it the rank-1 dots of h for the tensors `dots` (into
        xb[0], then xb[2]: the slots the next kernels read)."""
        i32, bufs, null8, null32 = np.int32, self.bufs, self.backend.null8, self.backend.null32
        b, xb = bufs["b"], bufs["xb"]
        args = [(b[n], xb[slot]) for n, slot in zip(dots, (0, 2)[: len(dots)], strict=True)]
        args += [(null8, null32)] * (2 - len(args))
        self.k(
            "mav_norm",
            self.rows,
            (BLOCK,),
            *(bufs["x"], bufs["vec"][vector], null8, i32(self.m), i32(1), i32(self.d)),
            *(bufs["h"], *args[0], *args[1]),
        )

    def mm(self, src: Any, name: str, src_xb: Any, res: Any, out: Any) -> None:
        i32, w, m = np.int32, self.w, self.m
        n_out, k_in = w[name].shape
        self.k(
            "mm" + self.backend.suffix,
            (_cdiv(n_out, TILE_N), _cdiv(m, TILE_M)),
            (BLOCK,),
            *(src, w[name], src_xb, self.bufs["a"][name]),
            *(i32(m), i32(n_out), i32(k_in), self.shift, i32(16 * isqrt(k_in)), res, out),
        )

    def embed(self, t: int, at: Any) -> None:
        """x = the perturbed embedding of column t (+ *at) of each window; the layers'
        states reset where the token is 0."""
        i32, bufs, w = np.int32, self.bufs, self.w
        n_layer = self.backend.config.model.n_layer
        self.k(
            "embed",
            (self.m,),
            (128,),
            *(bufs["tokens"], i32(bufs["tokens"].shape[1]), i32(t), at, w["emb"]),
            *(bufs["a"]["emb"], bufs["b"]["emb"], i32(self.m), i32(self.d), i32(self.v)),
            *(self.shift, bufs["states"], i32(n_layer), bufs["x"]),
        )

    def layer(self, p: str, s: Any) -> None:
        """The layer with prefix p over its state s: the gate and the candidate (which
        update s and x), then the MLP with its residual."""
        i32, bufs, w, m, d = np.int32, self.bufs, self.w, self.m, self.d
        a, vec, xb = bufs["a"], bufs["vec"], bufs["xb"]
        h, f, g, x = bufs["h"], bufs["f"], bufs["g"], bufs["x"]
        div_d = i32(16 * isqrt(d))
        square = (_cdiv(d, TILE_N), _cdiv(m, TILE_M))
        sfx = self.backend.suffix
        self.norm(p + "ln1", (p + "wf", p + "wh"))
        self.k(
            "gate" + sfx,
            square,
            (BLOCK,),
            *(h, w[p + "wf"], xb[0], a[p + "wf"]),
            *(s, w[p + "uf"], self.rowdot(s, p + "uf", xb[1]), a[p + "uf"]),
            *(i32(m), i32(d), self.shift, div_d, vec[p + "bf"], f, g),
        )
        self.k(
            "cand" + sfx,
            square,
            (BLOCK,),
            *(h, w[p + "wh"], xb[2], a[p + "wh"]),
            *(g, w[p + "uh"], self.rowdot(g, p + "uh", xb[3]), a[p + "uh"]),
            *(i32(m), i32(d), self.shift, div_d, vec[p + "bh"], f, s, x),
        )
        self.norm(p + "ln2", (p + "w1",))
        null8, hidden = self.backend.null8, bufs["hidden"]
        self.mm(h, p + "w1", xb[0], null8, hidden)
        self.mm(hidden, p + "w2", self.rowdot(hidden, p + "w2", xb[0]), x, x)

    def head(self, t: int, pos: Any) -> None:
        """The final norm and the head, then the next column scored: into the loss, or with
        pos (held out) as logit counts and target logits."""
        i32, bufs, m, v = np.int32, self.bufs, self.m, self.v
        tokens, logits, t_cols = bufs["tokens"], bufs["logits"], bufs["tokens"].shape[1]
        self.norm("ln_out", ("head",))
        self.mm(bufs["h"], "head", bufs["xb"][0], self.backend.null8, logits)
        if pos is not None:
            self.k(
                "token_histogram",
                self.rows,
                (BLOCK,),
                *(logits, tokens, i32(t_cols), i32(t), pos, i32(m), i32(v)),
                *(bufs["hist"], bufs["target"]),
            )
            return
        self.k(
            "token_loss",
            self.rows,
            (BLOCK,),
            *(logits, tokens, i32(t_cols), i32(t + 1), i32(m), i32(v)),
            *(self.backend.exp2, self.backend.log2_th, bufs["loss"]),
        )


def read_step(backend: CupyBackend, bufs: dict[str, Any]) -> None:
    """One token per row (generation, cupy_generate.py): the token in bufs["cur"] (M,)
    read through the embedding and every layer, the state carried, and the logits of the
    token after it into bufs["logits"]. The launches of token_step but for the row's own
    token (a pair's members write different ones) and no score."""
    i32, w, step = np.int32, backend.w, _TokenStep(backend, bufs)
    n_layer = backend.config.model.n_layer
    backend.kernels(
        "gen_embed",
        (step.m,),
        (128,),
        *(bufs["cur"], w["emb"], bufs["a"]["emb"], bufs["b"]["emb"], i32(step.m)),
        *(i32(step.d), i32(step.v), step.shift, bufs["states"], i32(n_layer), bufs["x"]),
    )
    for i in range(n_layer):
        step.layer(f"layers.{i}.", bufs["states"][i])
    step.norm("ln_out", ("head",))
    step.mm(bufs["h"], "head", bufs["xb"][0], backend.null8, bufs["logits"])

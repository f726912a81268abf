"""The former's forward pass on the CuPy backend: its buffers and its launch sequence
(former.cu), the structure of `shared/former.py` kernel by kernel.

Rows are (member, position): member m's seq_len positions are rows m T .. m T + T - 1, and
every GEMM runs over all R = M T rows at once with the member's rank-1 correction in its
epilogue. Per layer: the norm with the q and k dots, the v dot, three GEMMs each followed by
the renorm (RoPE for q and k), the attention, the o dot and GEMM, the renorm with the
residual; then the MLP (norm with the up dot, the up GEMM with the GELU table in its epilogue,
the down dot and GEMM, the renorm with the residual and bias). A GEMM hands its renorm int8
(its clipped outputs), not int32 sums. The tied head is fused with the loss, so a chunk's
logits are never stored.
"""

from __future__ import annotations

from math import isqrt
from typing import TYPE_CHECKING, Any

import numpy as np

from ...shared.former import gelu_table, rope_table, softmax_table
from ...shared.model import param_specs

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...shared.config import RunConfig
    from .cupy_backend import CupyBackend

BATCH_BYTES = 1 << 32  # device memory of one forward batch's buffers (two shapes are kept)
ATTENTION_THREADS = 256  # former.cu ATT_THREADS
GEN_ATTENTION_THREADS = 128  # former_generate.cu FGEN_THREADS
# A pass reads each window whole: no state to carry, so no long held-out streams.
CARRIES_STATE = False


def attention_kernel(head_dim: int) -> str:
    """The attention kernel for this head size: tiles of 32 rows up to 64, fewer above."""
    return "former_attention" if head_dim <= 64 else "former_attention_wide"


def check(cfg: RunConfig) -> str | None:
    """Why the kernels cannot run this former config, or None (before any allocation)."""
    if 2 * member_bytes(cfg) > BATCH_BYTES:
        return (
            f"a pair of former members needs {2 * member_bytes(cfg) >> 20} MiB of device "
            f"buffers, over the {BATCH_BYTES >> 20} MiB of a forward batch: lower es.seq_len "
            "or model.d_model"
        )
    return None


def member_bytes(cfg: RunConfig) -> int:
    """Device bytes of one member in a forward batch: its seq_len rows of activations
    (x, h, q, k, v, att, a GEMM's output before its renorm, the 4D hidden, three dots, the
    loss sums),
    its half of its pair's noise and window, its own vector parameters."""
    d, t = cfg.model.d_model, cfg.es.seq_len
    rows = t * (7 * d + 4 * d + 3 * 4 + 8 + 4)
    noise = sum(
        sum(s.shape) // 2 if s.kind == "matrix" else s.shape[0] for s in param_specs(cfg.model)
    )
    return rows + noise + 2 * (t + 1) + 4 + 8


def batch_members(cfg: RunConfig, members: int) -> int:
    """Members per forward batch: at most `members`, and at most BATCH_BYTES of buffers."""
    return max(2, min(members, BATCH_BYTES // member_bytes(cfg)) // 2 * 2)


def tables(xp: Any, seq_len: int, head_dim: int) -> dict[str, Any]:
    """The former's tables (GELU, softmax, RoPE) on the device, int32; the loss tables are
    the backend's."""
    cos, sin = rope_table(seq_len, head_dim)
    return {
        name: xp.asarray(np.ascontiguousarray(table, dtype=np.int32))
        for name, table in (
            ("gelu", gelu_table()),
            ("softmax", softmax_table()),
            ("cos", cos),
            ("sin", sin),
        )
    }


def buffers(backend: CupyBackend, n_pairs: int, held_out: bool = False) -> dict[str, Any]:
    """Everything a forward pass of n_pairs pairs reads and writes; held out: with the even
    members' logit counts (P T, 256)."""
    xp, cfg = backend.xp, backend.config
    d, t = cfg.model.d_model, cfg.es.seq_len
    m = 2 * n_pairs
    r = m * t
    bufs: dict[str, Any] = {
        "pairs": xp.zeros(n_pairs, dtype=xp.int64),
        "tokens": xp.zeros((n_pairs, t + 1), dtype=xp.int32),
        "hidden": xp.empty((r, 4 * d), dtype=xp.int8),
        "xb": [xp.empty(r, dtype=xp.int32) for _ in range(3)],
        "total": xp.zeros(r, dtype=xp.uint64),
        "target": xp.zeros(r, dtype=xp.int32),
        "loss": xp.zeros(m, dtype=xp.int64),
    }
    for name in ("x", "h", "q", "k", "v", "att", "pre"):
        bufs[name] = xp.empty((r, d), dtype=xp.int8)
    if held_out:
        bufs["hist"] = xp.zeros((n_pairs * t, 256), dtype=xp.int32)
    bufs.update(backend.noise_buffers(n_pairs, zero=held_out))  # zero: no rank-1 correction
    return bufs


class Layers:
    """The former's launches (former.cu) over `rows` rows of bufs, `per` positions per
    member (a member's rows are consecutive): the structure of shared/former.py's hidden,
    kernel by kernel. rope: the (cos, sin) tables that rotate q and k, row r at position
    r % per."""

    def __init__(
        self, backend: CupyBackend, bufs: dict[str, Any], rows: int, per: int, rope: tuple
    ) -> None:
        cfg = backend.config
        self.backend, self.bufs, self.k, self.rope = backend, bufs, backend.kernels, rope
        self.d, self.heads = cfg.model.d_model, cfg.model.heads
        self.r, self.per = rows, np.int32(per)
        self.shift = np.int32(4 + cfg.es.sigma_shift)
        self.grid = (-(-rows // 8),)

    def norm(self, vector: str, dots: tuple[str, ...]) -> None:
        """h = NORM(x) with the member's gain and bias; the dots of h with the first two
        tensors' b into xb[0], xb[1]."""
        bufs, null8, null32 = self.bufs, self.backend.null8, self.backend.null32
        args = [(bufs["b"][name], bufs["xb"][i]) for i, name in enumerate(dots)]
        args += [(null8, null32)] * (2 - len(args))
        vec, i32 = bufs["vec"], np.int32
        self.k(
            "mav_norm",
            self.grid,
            (256,),
            *(bufs["x"], vec[vector], vec[vector + "_bias"], i32(self.r), self.per),
            *(i32(self.d), bufs["h"], *args[0], *args[1]),
        )

    def rowdot(self, src: Any, name: str, out: Any) -> Any:
        i32 = np.int32
        self.k(
            "rowdot",
            self.grid,
            (256,),
            *(src, self.bufs["b"][name], i32(self.r), self.per, i32(src.shape[1]), out),
        )
        return out

    def mm(
        self, src: Any, name: str, src_xb: Any, out: Any = None, bias: Any = None, gelu: Any = None
    ) -> None:
        """out (default pre) = MM(src, name), clipped; with a table, table[clip(MM + bias) +
        128] (the GELU table; an identity table adds a bias and clips)."""
        backend, i32 = self.backend, np.int32
        n_out, k_in = backend.w[name].shape
        tile_m, tile_n = backend.tile
        self.k(
            "former_mm" + backend.suffix,
            (-(-n_out // tile_n), -(-self.r // tile_m)),
            (256,),
            *(src, backend.w[name], src_xb, self.bufs["a"][name], i32(self.r), i32(n_out)),
            *(i32(k_in), self.per, self.shift, i32(16 * isqrt(k_in))),
            backend.null8 if bias is None else bias,
            backend.null32 if gelu is None else gelu,
            self.bufs["pre"] if out is None else out,
        )

    def renorm(self, out: Any, rope: bool = False, bias: Any = None) -> None:
        """out = R(pre) (RoPE first where `rope`); out = R(x + pre + bias) where out is x."""
        backend, x, i32 = self.backend, self.bufs["x"], np.int32
        cos, sin = self.rope if rope else (backend.null32, backend.null32)
        self.k(
            "former_renorm",
            self.grid,
            (256,),
            *(self.bufs["pre"], x if out is x else backend.null8),
            backend.null8 if bias is None else bias,
            *(i32(self.r), self.per, i32(self.d), i32(self.d // self.heads), cos, sin, out),
        )

    def mlp(self, p: str, ln: str) -> None:
        bufs, tab = self.bufs, self.backend.tables
        xb, hidden = bufs["xb"], bufs["hidden"]
        self.norm(p + ln, (p + "up",))
        self.mm(bufs["h"], p + "up", xb[0], hidden, bufs["vec"][p + "up_bias"], tab["gelu"])
        self.mm(hidden, p + "down", self.rowdot(hidden, p + "down", xb[1]))
        self.renorm(bufs["x"], bias=bufs["vec"][p + "down_bias"])

    def attention(self, p: str, attend: Callable[[], None]) -> None:
        """x = R(x + MM(ATTN, wo)): q, k, v of NORM(x), `attend` launching the attention of
        q, k, v into att."""
        bufs, h, xb = self.bufs, self.bufs["h"], self.bufs["xb"]
        self.norm(p + "ln1", (p + "wq", p + "wk"))
        for name, dots, out, rope in (
            ("wq", xb[0], bufs["q"], True),
            ("wk", xb[1], bufs["k"], True),
            ("wv", self.rowdot(h, p + "wv", xb[2]), bufs["v"], False),
        ):
            self.mm(h, p + name, dots)
            self.renorm(out, rope)
        attend()
        self.mm(bufs["att"], p + "wo", self.rowdot(bufs["att"], p + "wo", xb[0]))
        self.renorm(bufs["x"])

    def window_attention(self) -> None:
        """former_attention over each member's `per` positions, causal."""
        bufs, i32, dh = self.bufs, np.int32, self.d // self.heads
        self.k(
            attention_kernel(dh),
            (self.r // int(self.per), self.heads),
            (ATTENTION_THREADS,),
            *(bufs["q"], bufs["k"], bufs["v"], self.per, i32(self.d), i32(dh)),
            *(self.backend.tables["softmax"], bufs["att"]),
        )

    def layers(self, attend: Callable[[int], Callable[[], None]] | None = None) -> None:
        """Every layer after the embedding MLP; attend(i) the attention of layer i (default
        each window's own)."""
        for i in range(self.backend.config.model.n_layer):
            p = f"layers.{i}."
            self.attention(p, self.window_attention if attend is None else attend(i))
            self.mlp(p, "ln2")


def sequence(backend: CupyBackend, bufs: dict[str, Any], held_out: bool = False) -> None:
    """The launches of one forward pass over bufs: the noise, then the model. Held out: the
    unperturbed model (bufs' noise is zero, its vectors the weights'), each window a pair of
    identical members, the head counting the even members' logits into bufs["hist"]."""
    k, cfg, w, tab = backend.kernels, backend.config, backend.w, backend.tables
    d, v, t = cfg.model.d_model, cfg.model.vocab_size, cfg.es.seq_len
    n_pairs = len(bufs["pairs"])
    m = 2 * n_pairs
    r = m * t
    i32 = np.int32
    per, shift = i32(t), i32(4 + cfg.es.sigma_shift)
    a, b, vec = bufs["a"], bufs["b"], bufs["vec"]
    if not held_out:
        backend.gather(bufs)
        backend.noise(bufs["pairs"], n_pairs, a, b, vec)
    run = Layers(backend, bufs, r, t, (tab["cos"], tab["sin"]))
    k(
        "former_embed",
        (r,),
        (128,),
        *(bufs["tokens"], per, w["emb"], a["emb"], b["emb"], vec["emb_bias"]),
        *(i32(d), i32(v), shift, bufs["x"]),
    )
    run.mlp("emb_mlp.", "ln")
    run.layers()
    run.norm("ln_f", ("emb",))
    hist = bufs["hist"] if held_out else backend.null32
    backend.zero(hist if held_out else bufs["total"])
    tile_m, tile_n = backend.tile
    k(
        "former_head" + backend.suffix,
        (-(-v // tile_n), -(-r // tile_m)),
        (256,),
        *(bufs["h"], w["emb"], bufs["xb"][0], a["emb"], i32(r), i32(v), i32(d), per, shift),
        *(i32(16 * isqrt(d)), vec.get("head_bias", backend.null8), bufs["tokens"]),
        *(backend.exp2, bufs["total"], bufs["target"], hist),
    )
    if held_out:
        return
    k(
        "former_loss",
        (-(-m // 256),),
        (256,),
        *(bufs["total"], bufs["target"], i32(m), per, backend.log2_th, bufs["loss"]),
    )


def held_out_batch(backend: CupyBackend, pairs: int) -> int:
    """Pairs per held-out pass, at most `pairs`: its buffers within the forward's bound."""
    return min(pairs, backend.batch_members // 2)


def held_out_pass(
    backend: CupyBackend, n_pairs: int, steps: int
) -> tuple[list[Callable[[], None]], dict[str, Any]]:
    """The captured launches of a held-out pass over n_pairs windows (one pass over every
    position at once), and its buffers."""
    bufs = buffers(backend, n_pairs, held_out=True)
    return [backend.kernels.capture(lambda: sequence(backend, bufs, held_out=True))], bufs


def held_out_counts(
    hist: np.ndarray, target: np.ndarray, n_pairs: int, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """A held-out pass's logit counts (P, L, 256) and target logits (P, L) from its buffers'
    host copies, which are by row: the even members' counts (P L, 256), a target per row."""
    return hist.reshape(n_pairs, steps, 256), target[: n_pairs * steps].reshape(n_pairs, steps)


def launches(n_layer: int) -> int:
    """Kernels of one forward pass after the noise: embed; the embedding MLP (norm, up, dot,
    down, renorm); per layer the attention (norm, v dot, three GEMM + renorm pairs, attention,
    o dot, GEMM, renorm) and an MLP; the final norm, zeroing, head, loss."""
    mlp = 5
    return 1 + mlp + n_layer * (12 + mlp) + 4


# ------------------------------------------------------------------------- generation


def generation_rows(cfg: RunConfig) -> int:
    """Rows (an even number) per generation pass: their buffers (a member's in a forward
    batch, which holds a window pass's activations and the noise, plus every layer's
    key-value cache, the logits, context counts and a history, counted as 2 T tokens)
    within BATCH_BYTES."""
    d, t, v, n_layer = cfg.model.d_model, cfg.es.seq_len, cfg.model.vocab_size, cfg.model.n_layer
    row = member_bytes(cfg) + 2 * n_layer * t * d + 5 * v + 8 * t + d
    return max(2, BATCH_BYTES // row // 2 * 2)


def generation_buffers(
    backend: CupyBackend, n_pairs: int, reads: int, zero: bool
) -> dict[str, Any]:
    """The buffers of `reads` token steps of 2 n_pairs rows (generation, cupy_generate.py):
    the history of every row's tokens, each layer's keys and values (L, M, T, D), the
    activations of one position per row, or of whole windows where the reads outrun the
    context; zero: no noise (the unperturbed model)."""
    xp, cfg = backend.xp, backend.config
    d, t, v, n_layer = cfg.model.d_model, cfg.es.seq_len, cfg.model.vocab_size, cfg.model.n_layer
    m = 2 * n_pairs
    rows = m * t if reads > t else m
    half = d // cfg.model.heads // 2
    bufs: dict[str, Any] = {
        "pairs": xp.zeros(n_pairs, dtype=xp.int64),
        "cur": xp.zeros(m, dtype=xp.int32),
        "pos": xp.zeros(2, dtype=xp.int32),  # former_generate.cu: (read so far, this read's)
        "history": xp.zeros((m, reads), dtype=xp.int32),
        "cos_now": xp.zeros(half, dtype=xp.int32),
        "sin_now": xp.zeros(half, dtype=xp.int32),
        "kc": xp.zeros((n_layer, m, t, d), dtype=xp.int8),
        "vc": xp.zeros((n_layer, m, t, d), dtype=xp.int8),
        "last": xp.empty((m, d), dtype=xp.int8),  # the x of the position read
        "logits": xp.empty((m, v), dtype=xp.int8),
        "hidden": xp.empty((rows, 4 * d), dtype=xp.int8),
        "xb": [xp.empty(rows, dtype=xp.int32) for _ in range(3)],
        # identity[c + 128] = c: the head MM's epilogue adds the head bias and clips
        "identity": xp.asarray(np.arange(-128, 128, dtype=np.int32)),
    }
    for name in ("x", "h", "q", "k", "v", "att", "pre"):
        bufs[name] = xp.empty((rows, d), dtype=xp.int8)
    bufs.update(backend.noise_buffers(n_pairs, zero=zero))
    return bufs


def _step_views(bufs: dict[str, Any], m: int) -> dict[str, Any]:
    """bufs for one position per row: the first m rows of each activation, x its own."""
    views = {name: bufs[name][:m] for name in ("h", "q", "k", "v", "att", "pre", "hidden")}
    return {**bufs, **views, "x": bufs["last"], "xb": [xb[:m] for xb in bufs["xb"]]}


def _embed(backend: CupyBackend, bufs: dict[str, Any], per: int, x: Any) -> None:
    """The step's start (the token in cur into the history, the position moved on), then
    each row's window of `per` tokens ending there, embedded into x."""
    k, cfg, w, i32 = backend.kernels, backend.config, backend.w, np.int32
    m, reads = bufs["history"].shape
    d, v, t = cfg.model.d_model, cfg.model.vocab_size, cfg.es.seq_len
    k(
        "former_gen_begin",
        (1,),
        (256,),
        *(bufs["cur"], i32(m), i32(reads), i32(t), i32(len(bufs["cos_now"]))),
        *(backend.tables["cos"], backend.tables["sin"], bufs["pos"], bufs["history"]),
        *(bufs["cos_now"], bufs["sin_now"]),
    )
    k(
        "former_gen_embed",
        (m * per,),
        (128,),
        *(bufs["history"], i32(reads), bufs["pos"], i32(per), w["emb"], bufs["a"]["emb"]),
        *(bufs["b"]["emb"], bufs["vec"]["emb_bias"], i32(d), i32(v)),
        *(i32(4 + cfg.es.sigma_shift), x),
    )


def _head(backend: CupyBackend, step: Layers) -> None:
    """The logits (M, V) of the position in step's x: MM(NORM(x, ln_f), EMB), plus the
    member's head bias, clipped, where the model has one."""
    bufs = step.bufs
    step.norm("ln_f", ("emb",))
    bias = bufs["vec"].get("head_bias")
    gelu = None if bias is None else bufs["identity"]
    step.mm(bufs["h"], "emb", bufs["xb"][0], bufs["logits"], bias, gelu)


def cached_step(backend: CupyBackend, bufs: dict[str, Any]) -> None:
    """One token per row (bufs["cur"]) at its position p < T: the new position alone
    through the layers, attending to each layer's cache (which keeps its key and value);
    its logits into bufs["logits"]. shared/former.py FormerDecoder.read before the slide."""
    k, cfg, i32 = backend.kernels, backend.config, np.int32
    m, d, heads = len(bufs["cur"]), cfg.model.d_model, cfg.model.heads
    step = Layers(backend, _step_views(bufs, m), m, 1, (bufs["cos_now"], bufs["sin_now"]))
    _embed(backend, bufs, 1, bufs["last"])
    step.mlp("emb_mlp.", "ln")

    def attend(layer: int) -> Callable[[], None]:
        s = step.bufs
        return lambda: k(
            "former_gen_attend",
            (m, heads),
            (GEN_ATTENTION_THREADS,),
            *(s["q"], s["k"], s["v"], bufs["pos"], i32(cfg.es.seq_len), i32(d)),
            *(i32(d // heads), backend.tables["softmax"], bufs["kc"][layer]),
            *(bufs["vc"][layer], s["att"]),
        )

    step.layers(attend)
    _head(backend, step)


def window_step(backend: CupyBackend, bufs: dict[str, Any]) -> None:
    """One token per row past the context: each row's window of its last T tokens read
    whole (every position's RoPE angle has moved), the last position's logits into
    bufs["logits"]. FormerDecoder.read after the slide."""
    cfg, tab, i32 = backend.config, backend.tables, np.int32
    m, t, d = len(bufs["cur"]), cfg.es.seq_len, cfg.model.d_model
    window = Layers(backend, bufs, m * t, t, (tab["cos"], tab["sin"]))
    _embed(backend, bufs, t, bufs["x"])
    window.mlp("emb_mlp.", "ln")
    window.layers()
    backend.kernels("former_gen_last", (m,), (128,), bufs["x"], i32(t), i32(d), bufs["last"])
    _head(backend, Layers(backend, _step_views(bufs, m), m, 1, (tab["cos"], tab["sin"])))


def reader(
    backend: CupyBackend, n_pairs: int, reads: int, zero: bool
) -> tuple[dict[str, Any], Callable[[], None]]:
    """Buffers for `reads` token steps of 2 n_pairs rows, and the function that reads
    bufs["cur"] and writes bufs["logits"]: the captured cached step while the history fits
    the context, the captured window step after."""
    bufs = generation_buffers(backend, n_pairs, reads, zero)
    t, k = backend.config.es.seq_len, backend.kernels
    cached = k.capture(lambda: cached_step(backend, bufs))
    slid = k.capture(lambda: window_step(backend, bufs)) if reads > t else cached
    done = 0

    def read() -> None:
        nonlocal done
        done += 1
        (cached if done <= t else slid)()

    return bufs, read

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


def sequence(backend: CupyBackend, bufs: dict[str, Any], held_out: bool = False) -> None:
    """The launches of one forward pass over bufs: the noise, then the model. Held out: the
    unperturbed model (bufs' noise is zero, its vectors the weights'), each window a pair of
    identical members, the head counting the even members' logits into bufs["hist"]."""
    k, cfg, w, tab = backend.kernels, backend.config, backend.w, backend.tables
    d, v, t = cfg.model.d_model, cfg.model.vocab_size, cfg.es.seq_len
    heads = cfg.model.heads
    n_pairs = len(bufs["pairs"])
    m = 2 * n_pairs
    r = m * t
    i32 = np.int32
    per, shift, rows = i32(t), i32(4 + cfg.es.sigma_shift), (-(-r // 8),)
    a, b, vec = bufs["a"], bufs["b"], bufs["vec"]
    if not held_out:
        backend.gather(bufs)
        backend.noise(bufs["pairs"], n_pairs, a, b, vec)
    x, h, pre, xb, hidden = bufs["x"], bufs["h"], bufs["pre"], bufs["xb"], bufs["hidden"]
    null8, null32 = backend.null8, backend.null32
    sfx, block = backend.suffix, (256,)
    tile_m, tile_n = backend.tile

    def norm(vector: str, dots: tuple[str, ...]) -> None:
        """h = NORM(x) with the member's gain and bias; the dots of h with the first two
        tensors' b into xb[0], xb[1]."""
        args = [(b[name], xb[i]) for i, name in enumerate(dots)]
        args += [(null8, null32)] * (2 - len(args))
        k(
            "mav_norm",
            rows,
            block,
            *(x, vec[vector], vec[vector + "_bias"], i32(r), per, i32(d), h),
            *args[0],
            *args[1],
        )

    def rowdot(src: Any, name: str, out: Any) -> Any:
        k("rowdot", rows, block, src, b[name], i32(r), per, i32(src.shape[1]), out)
        return out

    def mm(src: Any, name: str, src_xb: Any, out: Any = pre, bias=null8, gelu=null32) -> None:
        """out = MM(src, name), clipped; with the GELU table GELU[clip(MM + bias) + 128]."""
        n_out, k_in = w[name].shape
        k(
            "former_mm" + sfx,
            (-(-n_out // tile_n), -(-r // tile_m)),
            block,
            *(src, w[name], src_xb, a[name], i32(r), i32(n_out), i32(k_in), per, shift),
            *(i32(16 * isqrt(k_in)), bias, gelu, out),
        )

    def renorm(out: Any, rope: bool = False, bias: Any = null8) -> None:
        """out = R(pre) (RoPE first where `rope`); out = R(x + pre + bias) where out is x."""
        cos, sin = (tab["cos"], tab["sin"]) if rope else (null32, null32)
        res = x if out is x else null8
        k(
            "former_renorm",
            rows,
            block,
            *(pre, res, bias, i32(r), per, i32(d), i32(d // heads), cos, sin, out),
        )

    def mlp(p: str, ln: str) -> None:
        norm(p + ln, (p + "up",))
        mm(h, p + "up", xb[0], hidden, vec[p + "up_bias"], tab["gelu"])
        mm(hidden, p + "down", rowdot(hidden, p + "down", xb[1]))
        renorm(x, bias=vec[p + "down_bias"])

    def attention(p: str) -> None:
        norm(p + "ln1", (p + "wq", p + "wk"))
        for name, dots, out, rope in (
            ("wq", xb[0], bufs["q"], True),
            ("wk", xb[1], bufs["k"], True),
            ("wv", rowdot(h, p + "wv", xb[2]), bufs["v"], False),
        ):
            mm(h, p + name, dots)
            renorm(out, rope)
        k(
            attention_kernel(d // heads),
            (m, heads),
            (ATTENTION_THREADS,),
            *(bufs["q"], bufs["k"], bufs["v"], per, i32(d), i32(d // heads), tab["softmax"]),
            bufs["att"],
        )
        mm(bufs["att"], p + "wo", rowdot(bufs["att"], p + "wo", xb[0]))
        renorm(x)

    k(
        "former_embed",
        (r,),
        (128,),
        *(bufs["tokens"], per, w["emb"], a["emb"], b["emb"], vec["emb_bias"]),
        *(i32(d), i32(v), shift, x),
    )
    mlp("emb_mlp.", "ln")
    for i in range(cfg.model.n_layer):
        attention(f"layers.{i}.")
        mlp(f"layers.{i}.", "ln2")
    norm("ln_f", ("emb",))
    hist = bufs["hist"] if held_out else null32
    backend.zero(hist if held_out else bufs["total"])
    k(
        "former_head" + sfx,
        (-(-v // tile_n), -(-r // tile_m)),
        block,
        *(h, w["emb"], xb[0], a["emb"], i32(r), i32(v), i32(d), per, shift, i32(16 * isqrt(d))),
        *(vec.get("head_bias", null8), bufs["tokens"], backend.exp2, bufs["total"]),
        *(bufs["target"], hist),
    )
    if held_out:
        return
    k(
        "former_loss",
        (-(-m // 256),),
        block,
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

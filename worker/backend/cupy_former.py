"""The former's forward pass on the CuPy backend: its buffers and its launch sequence
(former.cu), the structure of `shared/former.py` kernel by kernel.

Rows are (member, position): member m's seq_len positions are rows m T .. m T + T - 1, and
every GEMM runs over all R = M T rows at once with the member's rank-1 correction in its
epilogue. Per layer: the norm with the q and k dots, the v dot, three GEMMs each followed by
the renorm (RoPE for q and k), the attention, the o dot and GEMM with the residual, the
renorm; then the MLP (norm with the up dot, the up GEMM with the GELU table in its epilogue,
the down dot and GEMM with the residual and bias, the renorm). The tied head is fused with
the loss, so a chunk's logits are never stored.
"""

from __future__ import annotations

from math import isqrt
from typing import TYPE_CHECKING, Any

import numpy as np

from ...shared.former import gelu_table, rope_table, softmax_table
from ...shared.loss import exp2_table, log2_thresholds

if TYPE_CHECKING:
    from .cupy_backend import CupyBackend

MAX_POSITIONS = 1024  # former.cu's attention keeps a query's scores in shared memory
ROWS = 1 << 20  # (member, position) rows per forward batch: bounds its buffers
ATTENTION_THREADS = 128


def check(backend_config: Any) -> str | None:
    """Why the kernels cannot run this former config, or None."""
    if backend_config.es.seq_len > MAX_POSITIONS:
        return (
            f"the CuPy backend's former attention holds at most {MAX_POSITIONS} positions, "
            f"es.seq_len is {backend_config.es.seq_len}: lower it or use --backend numpy"
        )
    return None


def batch_members(seq_len: int, members: int) -> int:
    """Members per forward batch: at most `members`, and at most ROWS rows."""
    return max(2, min(members, ROWS // seq_len) // 2 * 2)


def tables(xp: Any, seq_len: int, head_dim: int) -> dict[str, Any]:
    """The reference's tables on the device (int32)."""
    cos, sin = rope_table(seq_len, head_dim)
    return {
        name: xp.asarray(np.ascontiguousarray(table, dtype=np.int32))
        for name, table in (
            ("gelu", gelu_table()),
            ("softmax", softmax_table()),
            ("cos", cos),
            ("sin", sin),
            ("exp2", exp2_table()),
        )
    } | {"log2_th": xp.asarray(log2_thresholds())}


def buffers(backend: CupyBackend, n_pairs: int) -> dict[str, Any]:
    """Everything a forward pass of n_pairs pairs reads and writes."""
    xp, cfg = backend.xp, backend.config
    d, t = cfg.model.d_model, cfg.es.seq_len
    m = 2 * n_pairs
    r = m * t
    bufs: dict[str, Any] = {
        "pairs": xp.zeros(n_pairs, dtype=xp.int64),
        "tokens": xp.zeros((n_pairs, t + 1), dtype=xp.int32),
        "hidden": xp.empty((r, 4 * d), dtype=xp.int8),
        "acc": xp.empty((r, d), dtype=xp.int32),
        "xb": [xp.empty(r, dtype=xp.int32) for _ in range(3)],
        "total": xp.zeros(r, dtype=xp.uint64),
        "target": xp.zeros(r, dtype=xp.int32),
        "loss": xp.zeros(m, dtype=xp.int64),
    }
    for name in ("x", "h", "q", "k", "v", "att"):
        bufs[name] = xp.empty((r, d), dtype=xp.int8)
    bufs.update(backend.noise_buffers(n_pairs))
    return bufs


def sequence(backend: CupyBackend, bufs: dict[str, Any]) -> None:
    """The launches of one forward pass over bufs: the noise, then the model."""
    k, cfg, w, tab = backend.kernels, backend.config, backend.w, backend.tables
    d, v, t = cfg.model.d_model, cfg.model.vocab_size, cfg.es.seq_len
    heads = cfg.model.heads
    n_pairs = len(bufs["pairs"])
    m = 2 * n_pairs
    r = m * t
    i32 = np.int32
    per, shift, rows = i32(t), i32(4 + cfg.es.sigma_shift), (-(-r // 8),)
    a, b, vec = bufs["a"], bufs["b"], bufs["vec"]
    backend.noise(bufs["pairs"], n_pairs, a, b, vec)
    x, h, acc, xb, hidden = bufs["x"], bufs["h"], bufs["acc"], bufs["xb"], bufs["hidden"]
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

    def mm(src: Any, name: str, src_xb: Any, *, bias=null8, res=null8, gelu=null32, out8=null8,
           out32=null32) -> None:  # fmt: skip
        n_out, k_in = w[name].shape
        k(
            "former_mm" + sfx,
            (-(-n_out // tile_n), -(-r // tile_m)),
            block,
            *(src, w[name], src_xb, a[name], i32(r), i32(n_out), i32(k_in), per, shift),
            *(i32(16 * isqrt(k_in)), bias, res, gelu, out8, out32),
        )

    def renorm(out: Any, rope: bool = False) -> None:
        cos, sin = (tab["cos"], tab["sin"]) if rope else (null32, null32)
        k("former_renorm", rows, block, acc, i32(r), per, i32(d), i32(d // heads), cos, sin, out)

    def mlp(p: str, ln: str) -> None:
        norm(p + ln, (p + "up",))
        mm(h, p + "up", xb[0], bias=vec[p + "up_bias"], gelu=tab["gelu"], out8=hidden)
        mm(hidden, p + "down", rowdot(hidden, p + "down", xb[1]), bias=vec[p + "down_bias"],
           res=x, out32=acc)  # fmt: skip
        renorm(x)

    def attention(p: str) -> None:
        norm(p + "ln1", (p + "wq", p + "wk"))
        for name, dots, out, rope in (
            ("wq", xb[0], bufs["q"], True),
            ("wk", xb[1], bufs["k"], True),
            ("wv", rowdot(h, p + "wv", xb[2]), bufs["v"], False),
        ):
            mm(h, p + name, dots, out32=acc)
            renorm(out, rope)
        k(
            "former_attention",
            (m, heads),
            (ATTENTION_THREADS,),
            *(bufs["q"], bufs["k"], bufs["v"], per, i32(d), i32(d // heads), tab["softmax"]),
            bufs["att"],
        )
        mm(bufs["att"], p + "wo", rowdot(bufs["att"], p + "wo", xb[0]), res=x, out32=acc)
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
    total = bufs["total"].view(np.int32)
    k("zero_i32", (-(-total.size // 256),), block, total, i32(total.size))
    k(
        "former_head" + sfx,
        (-(-v // tile_n), -(-r // tile_m)),
        block,
        *(h, w["emb"], xb[0], a["emb"], i32(r), i32(v), i32(d), per, shift, i32(16 * isqrt(d))),
        *(vec.get("head_bias", null8), bufs["tokens"], tab["exp2"], bufs["total"]),
        bufs["target"],
    )
    k(
        "former_loss",
        (-(-m // 256),),
        block,
        *(bufs["total"], bufs["target"], i32(m), per, tab["log2_th"], bufs["loss"]),
    )


def launches(n_layer: int) -> int:
    """Kernels of one forward pass after the noise: embed; the embedding MLP (norm, up, dot,
    down, renorm); per layer the attention (norm, v dot, three GEMM + renorm pairs, attention,
    o dot, GEMM, renorm) and an MLP; the final norm, zeroing, head, loss."""
    mlp = 5
    return 1 + mlp + n_layer * (12 + mlp) + 4

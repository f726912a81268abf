"""The CuPy backend: the EGG model's and the former's forward passes, every rule's update,
held-out scores and the replica digest as int8 RawKernels, one module (`cupy_kernels.py`):
what every architecture shares (`common.cuh`, `noise.cu`, `gemm.cu`, `loss.cu`, `rules.cu`,
`digest.cu`) and each one's layers (`egg.cu`, `former.cu`), which its launch module in
`LAUNCH` drives (`cupy_egg.py`, `cupy_former.py`).

Same bytes as the NumPy reference, by construction kernel by kernel (see the .cu files).
The class is written against two seams so that the test suite runs this very code without
a GPU:

- an array module `xp`: `cupy` on a GPU, `numpy` under test;
- a kernel-module factory `(source, kernel names) -> module` whose `get_function(name)` gives
  a callable `(grid, block, args)`: `cupy.RawModule` on a GPU, a g++ build of the same
  source under test.

Per step: host NumPy computes the cheap scalar parts (the noise and data keys, the z-test
threshold, AdamW's learning rate and bias correction, each chunk's fitness from its members'
losses); the device gathers every pair's window from the resident train split, generates
its noise, runs the forward pass (one CUDA graph per batch shape) and the update. The
update's launch sequence reads every per-step value from device memory, so it is captured
once as a CUDA graph and replayed every step. The weights live in one flat device buffer
followed by the update's changed-weights counter, the rule's state (the momentum M, AdamW's
moments and accumulator) in one buffer per kind, the adaptive-noise overlays in one more. A
step copies back its changed count; the digest, its leaf hashes (32 bytes a 64 KiB piece);
the state itself only when asked for (a checkpoint, generation).

Validation (both held-out metrics of the unperturbed model) runs on the device too and
copies back each position's 256 logit counts, from which shared/loss.py finishes both; a
worker scores a device copy of the weights on a second stream while training goes on
(`validation_copy`, held_out.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ...shared.config import RunConfig
from ...shared.data import Dataset
from ...shared.fitness import pair_fitness
from ...shared.loss import exp2_table, histogram_bits, histogram_loss, log2_thresholds
from ...shared.model import param_specs
from ...shared.noise import DOMAIN_DATA, DOMAIN_NOISE, NOISE_KINDS, hash_key, max_abs
from ...shared.perturb import TOKEN_TENSORS, ParamSpec, overlay_specs
from ...shared.replica import DIGEST_LEAF, ReplicaState, digest_of_leaves
from ...shared.rules.adamw import bias_correction, grad_shift, lr_at
from ...shared.rules.fixedpoint import fixed16
from ...shared.rules.momentum import momentum_gain
from ...shared.rules.ztest import alpha_at, move_threshold
from ...shared.sample import Completions, SampleRequest, write_sample
from ...shared.update import state_specs
from ...shared.window import pair_windows, validation_streams, validation_windows
from . import (
    BackendFactory,
    BackendUnavailable,
    ChunkResult,
    HeldOut,
    Validation,
    check_chunk,
    cupy_egg,
    cupy_former,
    cupy_generate,
)
from .cupy_kernels import BLOCK, STAGE_WORDS, TILE_M, TILE_N, Kernels, ModuleFactory, cupy_module
from .held_out import DeviceCopy

# Each architecture's launch module: its checks, batch size and tables, its forward pass's
# buffers and launches, and its held-out passes (cupy_egg.py lists them).
LAUNCH: dict[str, ModuleType] = {"egg": cupy_egg, "former": cupy_former}
ALIGN = 16  # byte alignment of each tensor in the flat weight buffer
PAIR_PAD = 64  # the update GEMM's K (pairs) is padded to whole 64-byte stages
# The update's transposed noise is materialised a slab of pairs at a time within this many
# bytes (d-eggs' embedding alone would take 1.34 GB at once); each slab's Z GEMM adds into Z.
UPDATE_SCRATCH_BYTES = 1 << 28
# The update's Z GEMMs split K (the pairs) until about this many blocks run: a 256 x 256 Z
# is 8 tiles, far too few for a GPU of 100+ multiprocessors.
Z_GEMM_BLOCKS = 512
FORWARD_GRAPHS = 2  # captured forward shapes kept (each holds its buffers)
INT32_MAX = (1 << 31) - 1
HELD_OUT_ROWS = 1 << 16  # held-out positions per pass: bounds the logit counts' 1 KiB each
# A train split up to this size lives on the device and each pass gathers its windows there
# (only the pairs go up); a larger one is read on the host and its windows uploaded.
RESIDENT_TRAIN_BYTES = 1 << 32


# Each rule's state kinds resident on the device (their names: shared/rules/<rule>.py).
OPT_KINDS: dict[str, tuple[tuple[str, Any], ...]] = {
    "ztest": (),
    "momentum": (("momentum", np.int32),),
    "adamw": (("adamw.m", np.int32), ("adamw.v", np.int64), ("adamw.acc", np.int32)),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(length: int, unit: int, blocks: int) -> int:
    """How much of a summed dimension of `length` each block takes, in whole `unit`s, so that
    `blocks` blocks of the other dimensions become about Z_GEMM_BLOCKS."""
    units = _cdiv(length, unit)
    return _cdiv(units, min(units, max(1, Z_GEMM_BLOCKS // blocks))) * unit


def z_split(out: int, inp: int, k: int, vmax: int) -> int:
    """K words per block of the (out x inp, K = k bytes) Z GEMM: whole stages, at most as
    many as keep a block's int32 sums exact (4 pairs a word, each product <= vmax**2)."""
    exact = INT32_MAX // (4 * vmax * vmax) // STAGE_WORDS * STAGE_WORDS
    return min(_split(k // 4, STAGE_WORDS, _cdiv(inp, TILE_N) * _cdiv(out, TILE_M)), exact)


def vector_split(n: int, pairs: int, vmax: int) -> int:
    """Pairs per block row of vector_z for a length-n vector: whole tiles of BLOCK pairs, at
    most as many as keep a block's int32 sums exact (each term <= vmax**2)."""
    exact = INT32_MAX // (vmax * vmax) // BLOCK * BLOCK
    return min(_split(pairs, BLOCK, _cdiv(n, BLOCK)), exact)


def _address(a: Any) -> int:
    """A device array's address (CuPy), or the host array's standing in for it."""
    return int(a.data.ptr) if hasattr(a.data, "ptr") else int(a.ctypes.data)


def _host(xp: Any, a: Any) -> np.ndarray:
    return xp.asnumpy(a) if hasattr(xp, "asnumpy") else np.array(a, copy=True)


# Members per forward pass by default: a captured pass this large keeps an H100 busy
# (egg-paper: 15.0 M member-tokens/s at 32,768 on the worker's path, 2.6 M at 1,024 on
# older kernels; scripts/RESULTS.md).
BATCH_MEMBERS = 32768


class CupyBackend:
    """One replica on one device; see the module docstring for the seams."""

    name = "cupy"
    codec = None  # text is the data's vocabulary

    def __init__(
        self,
        dataset: Dataset,
        state: ReplicaState,
        *,
        xp: Any,
        module_factory: ModuleFactory,
        device: str = "cuda",
        stream: Any = None,
        tensor_cores: bool = True,
        batch_members: int = BATCH_MEMBERS,
    ) -> None:
        cfg = state.config
        self._config = cfg
        d = cfg.model.d_model
        if d % 4:
            raise BackendUnavailable(f"the CuPy backend needs model.d_model % 4 == 0, got {d}")
        if cfg.model.arch not in LAUNCH:
            raise BackendUnavailable(
                f"the CuPy backend has kernels for the egg and former models, not model.arch = "
                f"{cfg.model.arch!r}: use --backend torch"
            )
        if why := self.launch.check(cfg):
            raise BackendUnavailable(why)
        self.dataset = dataset
        self.device = device
        self.xp = xp
        self.batch_members = max(2, batch_members - batch_members % 2)
        self.batch_members = self.launch.batch_members(cfg, self.batch_members)
        self.suffix = "_tc" if tensor_cores else "_dp4a"
        self.kernels = Kernels(xp, module_factory, stream)
        self.tile = (TILE_M, TILE_N)
        heads = cfg.model.heads
        self.tables = self.launch.tables(xp, cfg.es.seq_len, d // heads)
        self.stream = stream
        self._alloc_state()
        self._step_scalars = xp.zeros(2, dtype=xp.int64)  # adamw: LR_t, K_t
        self._step_key = xp.zeros(1, dtype=xp.uint64)
        self._data_key = xp.zeros(1, dtype=xp.uint64)  # key(DATA, data_seed, step)
        train = np.asarray(dataset.train)
        self._span = len(train) - cfg.es.seq_len  # window starts: [0, span)
        self._train: Any = None
        if self._span >= 1 and train.nbytes <= RESIDENT_TRAIN_BYTES and train.itemsize <= 4:
            little = np.ascontiguousarray(train, dtype=train.dtype.newbyteorder("<"))
            self._train = xp.asarray(little.view(np.uint8))
            self._train_width = train.itemsize
        self._threshold = xp.zeros(1, dtype=xp.int64)
        self._fitness = xp.zeros(cfg.pairs, dtype=xp.int8)
        self.exp2 = xp.asarray(exp2_table())  # the loss tables (shared/loss.py)
        self.log2_th = xp.asarray(log2_thresholds())
        self.null8 = xp.zeros(0, dtype=xp.int8)  # a null pointer for optional arguments
        self.null32 = xp.zeros(0, dtype=xp.int32)
        self._update_graph: Callable[[], None] | None = None
        # captured forward passes by pair count, with their buffers (the last partial batch
        # of a step has its own shape)
        self._forward_graphs: dict[int, tuple[Callable[[], None], dict[str, Any]]] = {}
        # the held-out passes by (pairs, steps)
        self._held_out_graphs: dict[tuple[int, int], tuple[list[Callable[[], None]], dict]] = {}
        # bytes each token id decodes to, for bits per byte of the held-out text
        self.piece_bytes = np.array([len(piece) for piece in dataset.decoding], dtype=np.int64)
        self._update_buffers: dict[str, Any] = {}
        self._leaf_tables()
        self._digest: tuple[int, int] | None = None
        self._held_out_copy: DeviceCopy | None = DeviceCopy(self)  # validation's twin
        self.load_state(state)

    def _alloc_state(self) -> None:
        """The replica's device buffers: the weights followed by the changed counter, the
        rule's state, the adaptive-noise overlays (each one flat buffer)."""
        xp, cfg = self.xp, self._config
        self._specs = param_specs(cfg.model)
        self._layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for spec in self._specs:
            self._layout[spec.name] = (offset, spec.shape)
            offset += _cdiv(int(np.prod(spec.shape)), ALIGN) * ALIGN
        self._changed_at = offset
        self._flat = xp.zeros(offset + 8, dtype=xp.int8)  # weights, then the u64 counter
        self.w = {
            name: self._flat[o : o + int(np.prod(shape))].reshape(shape)
            for name, (o, shape) in self._layout.items()
        }
        self._changed = self._flat[offset : offset + 8].view(xp.uint64)
        # The rule's state per weight, resident on the device: one flat buffer per kind
        # (`OPT_KINDS`), laid out as the weights (offsets in elements).
        self._rule = cfg.update.rule
        self._opt_flat = {
            kind: xp.zeros(offset, dtype=dtype) for kind, dtype in OPT_KINDS[self._rule]
        }
        self.opt = {
            f"{kind}.{name}": flat[o : o + int(np.prod(shape))].reshape(shape)
            for kind, flat in self._opt_flat.items()
            for name, (o, shape) in self._layout.items()
        }
        # The adaptive-noise overlays (int8 per matrix row and column, per vector element),
        # resident in one buffer: the noise kernels scale by them, overlay_step moves them.
        self._overlay_layout: dict[str, tuple[int, int]] = {}
        at = 0
        for ov in overlay_specs(self._specs) if cfg.es.adaptive_noise else ():
            self._overlay_layout[ov.name] = (at, ov.shape[0])
            at += _cdiv(ov.shape[0], ALIGN) * ALIGN
        self._overlay_flat = xp.zeros(at, dtype=xp.int8)
        self.overlay = {
            name: self._overlay_flat[o : o + n] for name, (o, n) in self._overlay_layout.items()
        }

    # ---------------------------------------------------------------------- replica

    @property
    def config(self) -> RunConfig:
        return self._config

    @property
    def step(self) -> int:
        return self._step

    @property
    def launch(self) -> ModuleType:
        """The model's launch module (`LAUNCH`): its forward and held-out passes."""
        return LAUNCH[self._config.model.arch]

    @property
    def state(self) -> ReplicaState:
        """The replica on the host, copied back from the device when first asked for at a
        step (a checkpoint, generation): steps and digests need no copy."""
        if self._state.step != self._step:
            self._state = self._copy_back()
        return self._state

    def _scope(self) -> contextlib.AbstractContextManager:
        return self.stream if self.stream is not None else contextlib.nullcontext()

    def load_state(self, state: ReplicaState) -> None:
        shapes = {name: np.shape(p) for name, p in state.params.items()}
        if shapes != {name: shape for name, (_, shape) in self._layout.items()}:
            raise ValueError("the state's tensors do not match this backend's model")
        host = np.zeros(self._changed_at + 8, dtype=np.int8)
        for name, (o, shape) in self._layout.items():
            host[o : o + int(np.prod(shape))] = np.asarray(state.params[name]).reshape(-1)
        with self._scope():
            self._flat[...] = self.xp.asarray(host)
            for kind, flat in self._opt_flat.items():
                values = np.zeros(self._changed_at, dtype=flat.dtype)
                for name, (o, shape) in self._layout.items():
                    values[o : o + int(np.prod(shape))] = state.opt[f"{kind}.{name}"].reshape(-1)
                flat[...] = self.xp.asarray(values)
            if self.overlay:
                values = np.zeros(self._overlay_flat.size, dtype=np.int8)
                for name, (o, n) in self._overlay_layout.items():
                    values[o : o + n] = state.opt[name]
                self._overlay_flat[...] = self.xp.asarray(values)
        self._state, self._step = state, state.step
        self._digest = None  # of another state, maybe at this very step

    def _keep(self, spec: ParamSpec) -> int:
        """The rows of a matrix's a (the elements of a vector) that get noise: all, or under
        es.token_noise_rows the commonest tokens' (factor 64 below it, 0 above:
        `perturb.token_row_factors`)."""
        rows = spec.shape[0]
        token_rows = self.config.es.token_noise_rows
        return min(rows, token_rows) if token_rows and spec.name in TOKEN_TENSORS else rows

    def _leaf_tables(self) -> None:
        """Where the digest's leaves live: the device address and length of every
        DIGEST_LEAF-byte piece of every tensor, in digest order (shared/replica.py)."""
        views = [self.w[s.name] for s in self._specs]
        views += [
            self.opt[s.name] if s.name in self.opt else self.overlay[s.name]
            for s in state_specs(self.config)
        ]
        address, length = [], []
        for view in views:
            base, nbytes = _address(view), int(view.nbytes)
            assert base % 8 == 0, "digest_leaves reads 8-byte words: tensors are 16-aligned"
            for lo in range(0, max(nbytes, 1), DIGEST_LEAF):
                address.append(base + lo)
                length.append(min(DIGEST_LEAF, nbytes - lo))
        self._leaf_address = self.xp.asarray(np.array(address, dtype=np.uint64))
        self._leaf_length = self.xp.asarray(np.array(length, dtype=np.int64))
        self._leaf_out = self.xp.zeros(4 * len(address), dtype=self.xp.uint64)

    def overlays(self, spec: ParamSpec) -> tuple[Any, Any]:
        """The adaptive-noise overlays on the device that scale a matrix's a and b, or a
        vector's elements (and a null pointer); null pointers without adaptive noise."""
        if spec.kind == "matrix":
            names = (f"overlay.rows.{spec.name}", f"overlay.cols.{spec.name}")
        else:
            names = (f"overlay.{spec.name}", "")
        return self.overlay.get(names[0], self.null8), self.overlay.get(names[1], self.null8)

    def _put_step_key(self, step: int) -> None:
        """key(NOISE, run_seed, step) into device memory, where every noise kernel reads it,
        and key(DATA, data_seed, step), where gather_windows reads it."""
        cfg = self.config
        for dst, key in (
            (self._step_key, hash_key(DOMAIN_NOISE, cfg.es.run_seed, step)),
            (self._data_key, hash_key(DOMAIN_DATA, cfg.data.data_seed, step)),
        ):
            dst[...] = self.xp.asarray(np.array([key], dtype=np.uint64))

    def gather(self, bufs: dict[str, Any]) -> None:
        """The pass's windows from the resident train split into bufs["tokens"]; nothing
        when the split is not resident (`_forward` uploads the windows then)."""
        if self._train is None:
            return
        n_pairs, cols = bufs["tokens"].shape
        self.kernels(
            "gather_windows",
            (n_pairs,),
            (128,),
            *(self._data_key, bufs["pairs"], self._train, np.int32(self._train_width)),
            *(np.int64(self._span), np.int32(cols), bufs["tokens"]),
        )

    def digest(self) -> int:
        """The replica digest (shared/replica.py) from its leaves hashed on the device: 32
        bytes a leaf come back, not the state."""
        if self._digest is None or self._digest[0] != self._step:
            k, n = self.kernels, len(self._leaf_length)
            with self._scope():
                k("digest_leaves", (_cdiv(n, 64),), (64,), self._leaf_address, self._leaf_length,
                  np.int32(n), self._leaf_out)  # fmt: skip
                leaves = _host(self.xp, self._leaf_out).astype("<u8").tobytes()
            self._digest = (self._step, digest_of_leaves(self.config.digest(), self._step, leaves))
        return self._digest[1]

    # ---------------------------------------------------------------- evaluation

    @property
    def parallel_chunks(self) -> int:
        """Chunks `evaluate_chunks` scores at once: as many as fill one forward batch."""
        return max(1, self.batch_members // self.config.es.chunk_size)

    def evaluate_chunk(self, step: int, first_member: int, count: int) -> ChunkResult:
        """Score members [first_member, first_member + count) of the population at `step`."""
        return self.evaluate_chunks(step, [(first_member, count)])[0]

    def evaluate_chunks(self, step: int, chunks: Sequence[tuple[int, int]]) -> list[ChunkResult]:
        """Several chunks in one forward pass (more rows per launch); fitness per chunk."""
        cfg = self.config
        for first, count in chunks:
            check_chunk(cfg, self.step, step, first, count)
        pairs = np.concatenate([np.arange(f // 2, (f + c) // 2) for f, c in chunks])
        with self._scope():
            self._put_step_key(step)
            losses = []
            per_batch = self.batch_members // 2
            for lo in range(0, len(pairs), per_batch):
                losses.append(self._forward(pairs[lo : lo + per_batch]))
        loss = np.concatenate(losses)
        results, at = [], 0
        for _, count in chunks:
            part = loss[at : at + count]
            results.append(ChunkResult(pair_fitness(part, cfg.fitness), int(part.sum())))
            at += count
        return results

    def noise_buffers(self, n_pairs: int, zero: bool = False) -> dict[str, dict[str, Any]]:
        """The noise of n_pairs pairs: "a" (P, out) and "b" (P, in) per matrix, "vec" the
        members' (M, n) per vector parameter. zero (a held-out pass, which never writes
        them): every matrix's a and b are views of one zero buffer of the largest side."""
        xp, out = self.xp, {"a": {}, "b": {}, "vec": {}}
        if zero:
            flat = xp.zeros(n_pairs * max(self._largest_sides()), dtype=xp.int8)
        for spec in self._specs:
            if spec.kind == "matrix":
                for key, side in zip("ab", spec.shape, strict=True):
                    out[key][spec.name] = (
                        flat[: n_pairs * side].reshape(n_pairs, side)
                        if zero
                        else xp.empty((n_pairs, side), dtype=xp.int8)
                    )
            else:
                out["vec"][spec.name] = xp.empty((2 * n_pairs, spec.shape[0]), dtype=xp.int8)
        return out

    def noise(self, pairs_dev: Any, n_pairs: int, a: dict, b: dict, vec: dict) -> None:
        """Every matrix's a (P, out), b (P, in) and every member's vector parameters (M, n)
        into the given buffers."""
        k, es = self.kernels, self.config.es
        kind = np.int32(NOISE_KINDS.index(es.noise))
        shift = np.int32(4 + es.sigma_shift)
        for spec in self._specs:
            tid = np.uint64(spec.tensor_id)
            if spec.kind == "matrix":
                out, inp = spec.shape
                for start, count, keep, overlay, dst in (
                    (0, out, self._keep(spec), self.overlays(spec)[0], a[spec.name]),
                    (out, inp, inp, self.overlays(spec)[1], b[spec.name]),
                ):
                    k(
                        "noise_rows",
                        (n_pairs, _cdiv(count, BLOCK)),
                        (BLOCK,),
                        *(self._step_key, pairs_dev, tid, np.uint32(start), np.int32(count)),
                        *(np.int32(keep), kind, overlay, dst),
                    )
            else:
                (n,) = spec.shape
                k(
                    "member_vector",
                    (2 * n_pairs, _cdiv(n, BLOCK)),
                    (BLOCK,),
                    *(self._step_key, pairs_dev, tid, np.int32(n), np.int32(self._keep(spec))),
                    *(kind, self.overlays(spec)[0], self.w[spec.name]),
                    *(shift, vec[spec.name]),
                )

    def _forward(self, pairs: np.ndarray) -> np.ndarray:
        """Integer loss (sum over seq_len tokens) of members 2 p, 2 p + 1 for each pair p:
        the pairs and their windows into device buffers, then one replay of the pass's
        launches, captured on the first pass of this many pairs."""
        xp, n_pairs = self.xp, len(pairs)
        if n_pairs not in self._forward_graphs:
            if len(self._forward_graphs) >= FORWARD_GRAPHS:
                self._forward_graphs.pop(next(iter(self._forward_graphs)))  # the least recent
            bufs = self.launch.buffers(self, n_pairs)
            replay = self.kernels.capture(lambda: self.launch.sequence(self, bufs))
            self._forward_graphs[n_pairs] = (replay, bufs)
        replay, bufs = self._forward_graphs.pop(n_pairs)
        self._forward_graphs[n_pairs] = (replay, bufs)  # the most recently used is kept longest
        if self._train is None:  # else the pass gathers its windows on the device
            windows = pair_windows(self.config, self.dataset.train, self.step, pairs)
            bufs["tokens"][...] = xp.asarray(windows.astype(np.int32))
        bufs["pairs"][...] = xp.asarray(pairs.astype(np.int64))
        replay()
        return _host(xp, bufs["loss"])

    # -------------------------------------------------------------------- update

    def _alloc_update_buffers(self) -> None:
        """The update's scratch: a slab of the largest tensors' transposed noise, and Z."""
        xp = self.xp
        out, inp = self._largest_sides()
        buf = self._update_buffers
        buf["at"] = xp.empty(out * self._slab, dtype=xp.int8)
        buf["bt"] = xp.empty(inp * self._slab, dtype=xp.int8)
        largest = max(int(np.prod(s.shape)) for s in self._specs)
        buf["z"] = xp.empty(largest, dtype=xp.int64)
        # which weights the apply kernel moved, for the overlays' update (adaptive noise)
        buf["moved"] = xp.empty(largest, dtype=xp.int8) if self.overlay else self.null8

    def _largest_sides(self) -> tuple[int, int]:
        """The largest output and the largest input of any matrix."""
        matrices = [s.shape for s in self._specs if s.kind == "matrix"]
        return max(out for out, _ in matrices), max(inp for _, inp in matrices)

    @property
    def _slab(self) -> int:
        """Pairs per slab of the update's transposed noise: whole stages, the scratch of the
        largest output and input within UPDATE_SCRATCH_BYTES (one stage at least)."""
        rows = sum(self._largest_sides())
        ppad = _cdiv(self.config.pairs, PAIR_PAD) * PAIR_PAD
        return min(ppad, max(PAIR_PAD, UPDATE_SCRATCH_BYTES // rows // PAIR_PAD * PAIR_PAD))

    def zero(self, a: Any) -> None:
        """a[...] = 0 for a contiguous device array, as a launch (captured with the rest)."""
        words = a.reshape(-1).view(np.int32)
        self.kernels("zero_i32", (_cdiv(words.size, BLOCK),), (BLOCK,), words, np.int32(words.size))

    def _update_sequence(self) -> None:
        """Per tensor: Z, the rule's apply kernel, and with adaptive noise the overlays' step
        (after Z, which reads them as the members saw them): launches only, every per-step
        scalar read from device memory."""
        k, cfg = self.kernels, self.config
        kind = np.int32(NOISE_KINDS.index(cfg.es.noise))
        pairs, ppad, slab = cfg.pairs, _cdiv(cfg.pairs, PAIR_PAD) * PAIR_PAD, self._slab
        buf = self._update_buffers
        for spec in self._specs:
            tid = np.uint64(spec.tensor_id)
            size = int(np.prod(spec.shape))
            z = buf["z"][:size]
            if spec.kind == "matrix":
                out, inp = spec.shape
                self.zero(z)
                for first in range(0, ppad, slab):
                    width = min(slab, ppad - first)
                    at = buf["at"][: out * width].reshape(out, width)
                    bt = buf["bt"][: inp * width].reshape(inp, width)
                    # Z += (F a)^T b over the slab: the fitness weighs a only (null: b
                    # unweighted).
                    for start, count, keep, overlay, weight, dst in (
                        (0, out, self._keep(spec), self.overlays(spec)[0], self._fitness, at),
                        (out, inp, inp, self.overlays(spec)[1], self.null8, bt),
                    ):
                        k(
                            "noise_cols",
                            (_cdiv(width, 128), _cdiv(count, 64)),
                            (128,),
                            *(self._step_key, tid, np.uint32(start), np.int32(count)),
                            *(np.int32(keep), kind, overlay, weight, np.int32(pairs)),
                            *(np.int32(first), np.int32(width), dst),
                        )
                    k_split = z_split(out, inp, width, max_abs(cfg.es.noise))
                    k(
                        "zgemm" + self.suffix,
                        (_cdiv(inp, TILE_N), _cdiv(out, TILE_M), _cdiv(width // 4, k_split)),
                        (BLOCK,),
                        *(at, bt, np.int32(out), np.int32(inp), np.int32(width)),
                        *(np.int32(k_split), z),
                    )
            else:
                per = vector_split(size, pairs, max_abs(cfg.es.noise))
                self.zero(z)
                k(
                    "vector_z",
                    (_cdiv(size, BLOCK), _cdiv(pairs, per)),
                    (BLOCK,),
                    *(self._step_key, tid, np.int32(size), np.int32(self._keep(spec)), kind),
                    *(self.overlays(spec)[0], self._fitness),
                    *(np.int32(pairs), np.int32(per), z),
                )
            w, n, grid = self.w[spec.name].reshape(-1), np.int32(size), (_cdiv(size, BLOCK),)
            moved = buf["moved"][:size] if self.overlay else self.null8
            opt = {kind: self.opt[f"{kind}.{spec.name}"].reshape(-1) for kind in self._opt_flat}
            if self._rule == "momentum":
                k(
                    "momentum_apply",
                    grid,
                    (BLOCK,),
                    *(z, self._threshold, np.int32(cfg.update.momentum_shift), n),
                    *(opt["momentum"], w, self._changed, moved),
                )
            elif self._rule == "adamw":
                up = cfg.update
                betas = (np.int64(fixed16(up.beta1)), np.int64(fixed16(up.beta2)))
                k(
                    "adamw_apply",
                    grid,
                    (BLOCK,),
                    *(z, self._step_scalars, *betas, np.int64(fixed16(up.weight_decay))),
                    *(np.int32(grad_shift(cfg)), np.int32(spec.kind == "matrix"), n),
                    *(opt["adamw.m"], opt["adamw.v"], opt["adamw.acc"], w, self._changed, moved),
                )
            else:
                k(
                    "ztest_apply",
                    (_cdiv(size, BLOCK),),
                    (BLOCK,),
                    *(z, self._threshold, np.int32(size), w, self._changed, moved),
                )
            if self.overlay:
                rows, cols = spec.shape if spec.kind == "matrix" else (size, 1)
                k(
                    "overlay_step",
                    (_cdiv(rows + cols, BLOCK),),
                    (BLOCK,),
                    *(moved, np.int32(rows), np.int32(cols), *self.overlays(spec)),
                )

    def apply_step(self, fitness: np.ndarray) -> int:
        """Apply the committed fitness of step `self.step` (all pairs); returns weights changed."""
        cfg, xp = self.config, self.xp
        fitness = np.asarray(fitness)
        if fitness.shape != (cfg.pairs,):
            raise ValueError(f"fitness has shape {fitness.shape}, expected ({cfg.pairs},)")
        gain = momentum_gain(cfg.update.momentum_shift) if self._rule == "momentum" else 1
        alpha = alpha_at(cfg.update, self.step)
        threshold = move_threshold(cfg.pairs, alpha, cfg.es.noise, gain)
        scalars = [lr_at(cfg.update, self.step), bias_correction(cfg.update, self.step)]
        with self._scope():
            self._put_step_key(self.step)
            self._threshold[...] = xp.asarray(np.array([threshold], dtype=np.int64))
            self._step_scalars[...] = xp.asarray(np.array(scalars, dtype=np.int64))
            self._fitness[...] = xp.asarray(fitness.astype(np.int8))
            self._changed[...] = 0
            if self._update_graph is None:
                self._alloc_update_buffers()  # never inside a capture
                self._update_graph = self.kernels.capture(self._update_sequence)
            self._update_graph()
            changed = int(_host(xp, self._changed)[0])  # the step's one copy back
        self._step += 1
        return changed

    def _copy_back(self) -> ReplicaState:
        """The replica state on the host: the weights, the rule's state and the overlays."""
        with self._scope():
            host = _host(self.xp, self._flat)
            state = {kind: _host(self.xp, flat) for kind, flat in self._opt_flat.items()}
            overlays = _host(self.xp, self._overlay_flat)
        params = {
            name: host[o : o + int(np.prod(shape))].reshape(shape).copy()
            for name, (o, shape) in self._layout.items()
        }
        opt = {
            f"{kind}.{name}": flat[o : o + int(np.prod(shape))].reshape(shape).copy()
            for kind, flat in state.items()
            for name, (o, shape) in self._layout.items()
        }
        for name, (o, n) in self._overlay_layout.items():
            opt[name] = overlays[o : o + n].copy()
        return ReplicaState(self.config, self._step, params, opt)

    def validate(self) -> Validation:
        """Both held-out metrics of the unperturbed model (the windows; for the EGG model
        also the long streams, state carried) on the device; only each position's logit
        counts come back, from which shared/loss.py finishes both losses."""
        cfg, valid = self.config, self.dataset.valid
        with self._scope():
            short = self._held_out(validation_windows(cfg, valid), None)
            if not self.launch.CARRIES_STATE:  # the long streams need state carried
                return Validation(short, None)
            return Validation(short, self._held_out(*validation_streams(cfg, valid)))

    def validation_copy(self) -> Callable[[], Validation] | None:
        """A device copy of this step's weights, scored on a second stream by a twin of this
        backend (held_out.py) while this one goes on; None: no room on the device."""
        assert self._held_out_copy is not None, "a twin makes no copies"
        return self._held_out_copy.take()

    def _held_out(self, rows: np.ndarray, lengths: np.ndarray | None) -> HeldOut:
        """One metric over rows (N, L + 1) of held-out tokens, row i predicting
        rows[i, 1 : lengths[i] + 1] (lengths None: all L), in batches of at most
        HELD_OUT_ROWS positions."""
        steps = rows.shape[1] - 1
        per_batch = self.launch.held_out_batch(self, max(1, HELD_OUT_ROWS // steps))
        loss, bits, text_bytes, n = 0, [], 0, 0
        for lo in range(0, len(rows), per_batch):
            part = rows[lo : lo + per_batch]
            hist, target = self._held_out_counts(part)  # (P, L, 256), (P, L)
            reading = np.ones(target.shape, dtype=bool)
            if lengths is not None:
                reading = np.arange(steps)[None, :] < lengths[lo : lo + per_batch, None]
            hist, target = hist[reading], target[reading]
            loss += int(histogram_loss(hist, target).sum())
            bits.append(histogram_bits(hist, target))
            text_bytes += int(self.piece_bytes[part[:, 1:][reading]].sum())
            n += int(reading.sum())
        return HeldOut(n, text_bytes, loss / n, math.fsum(np.concatenate(bits)) / n)

    def _held_out_counts(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The logit counts (P, L, 256) and target logits (P, L) of the unperturbed model
        over rows (P, L + 1), each row a pair of identical members: one replay of a pass
        captured per shape, after the weights are copied into its vector buffers."""
        xp, n_pairs, steps = self.xp, len(rows), rows.shape[1] - 1
        key = (n_pairs, steps)
        if key not in self._held_out_graphs:
            if len(self._held_out_graphs) >= 2 * FORWARD_GRAPHS:
                self._held_out_graphs.pop(next(iter(self._held_out_graphs)))
            self._held_out_graphs[key] = self.launch.held_out_pass(self, n_pairs, steps)
        graphs, bufs = self._held_out_graphs[key]
        for name, vector in bufs["vec"].items():
            vector[...] = self.w[name]  # every member's vector is the weights' own
        bufs["tokens"][...] = xp.asarray(rows.astype(np.int32))
        for replay in graphs:
            replay()
        hist, target = _host(xp, bufs["hist"]), _host(xp, bufs["target"])
        return self.launch.held_out_counts(hist, target, n_pairs, steps)

    def write_sample(self, request: SampleRequest) -> tuple[bytes, bytes]:
        """From the host copy of the weights, with the NumPy reference: a sample is rare and
        short, and the host's text is the same bytes."""
        return write_sample(self.state, self.dataset, request)

    def complete(
        self, step: int, members: tuple[int, int] | None, request: Completions
    ) -> np.ndarray:
        """Generation for the reward objective: the NumPy backend's tokens, written on the
        device (cupy_generate.py)."""
        if members is not None:
            check_chunk(self.config, self.step, step, *members)
        return cupy_generate.complete(self, step, members, request)


def compute_major(capability: str) -> int:
    """The major version of CuPy's compute capability string, major * 10 + minor: "86" is
    8, "100" (Blackwell) is 10, not the "1" of its first character."""
    return int(capability) // 10


def describe_device() -> str:
    """'cuda:N NAME (sm_XY)' of the current CUDA device."""
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"cuda:{dev.id} {name} (sm_{props['major']}{props['minor']})"


def factory(batch_members: int = BATCH_MEMBERS, threads: int | None = None) -> BackendFactory:
    """The CuPy backend on the current CUDA device; BackendUnavailable without one.
    `threads` (CPU threads) has nothing to size here: the device does the work."""
    from . import cuda_usable

    if not cuda_usable():
        raise BackendUnavailable(
            "--backend cupy needs CuPy and a usable CUDA GPU (pip install "
            "'eggroll-distributed[gpu]'): none found, use --backend numpy"
        )
    import cupy

    device = describe_device()
    major = compute_major(cupy.cuda.Device().compute_capability)

    def build(dataset: Dataset, state: ReplicaState) -> CupyBackend:
        return CupyBackend(
            dataset,
            state,
            xp=cupy,
            module_factory=cupy_module,
            device=device,
            stream=cupy.cuda.Stream(non_blocking=True),
            tensor_cores=major >= 8,  # int8 mma.sync m16n8k32 needs sm_80
            batch_members=max(batch_members, 2),
        )

    return BackendFactory(CupyBackend.name, device, build)

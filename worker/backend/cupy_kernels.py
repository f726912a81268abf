"""The CuPy backend's kernel module: its CUDA sources joined into one, the launch geometry
the kernels are written for, each kernel's parameters, and `Kernels`, which checks every
launch's arguments and captures launch sequences (a CUDA graph on a GPU). On a GPU the
module comes from a prebuilt cubin when one fits (cubins.py), else from NVRTC."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from . import cubins

# One module from these sources in this order: each uses the helpers of those before it
# (common.cuh's everywhere, gemm.cu's GEMM core in egg.cu and former.cu).
SOURCE_FILES = (
    "common.cuh",
    "noise.cu",
    "gemm.cu",
    "egg.cu",
    "loss.cu",
    "rules.cu",
    "former.cu",
    "digest.cu",
    "generate.cu",
    "former_generate.cu",
)
BLOCK = 256  # threads per block of most kernels (a multiple of 32: full-warp collectives)
TILE_M, TILE_N = 128, 64  # output tile of the GEMM kernels
STAGE_WORDS = 16  # the GEMMs' K stage: 16 words of 4 int8

# Each kernel's parameters, as the backend passes them: "*dtype" is a device array of that
# dtype (C-contiguous), "dtype" a NumPy scalar. Checked before every launch.
I8, I32, I64, U8, U32, U64 = "*int8", "*int32", "*int64", "*uint8", "*uint32", "*uint64"
_MM = (I8, I8, I32, I8, "int32", "int32", "int32", "int32", "int32", I8, I8)
_GATE = (I8, I8, I32, I8, I8, I8, I32, I8, "int32", "int32", "int32", "int32", I8, I8, I8)
_CAND = (*_GATE[:-2], I8, I8, I8)
_ZGEMM = (I8, I8, "int32", "int32", "int32", "int32", I64)
_OPT = (I32, I64, I32, I8, U64)  # adamw's m, v, acc, the weights, the changed counter
_SIZES = ("int32",) * 6  # rows, outputs, K, rows per member, the noise shift, the divisor
_FORMER_MM = (I8, I8, I32, I8, *_SIZES, I8, I32, I8)
_FORMER_HEAD = (I8, I8, I32, I8, *_SIZES, I8, I32, I32, U64, I32, I32)
_ATTENTION = (I8, I8, I8, "int32", "int32", "int32", I32, I8)
SIGNATURES: dict[str, tuple[str, ...]] = {
    "noise_rows": (U64, I64, "uint64", "uint32", "int32", "int32", "int32", I8, I8),
    "noise_cols": (
        U64,
        "uint64",
        "uint32",
        "int32",
        "int32",
        "int32",
        I8,
        I8,
        "int32",
        "int32",
        "int32",
        I8,
    ),
    "member_vector": (U64, I64, "uint64", "int32", "int32", "int32", I8, I8, "int32", I8),
    "vector_z": (U64, "uint64", "int32", "int32", "int32", I8, I8, "int32", "int32", I64),
    "zero_i32": (I32, "int32"),
    "gather_windows": (U64, I64, U8, "int32", "int64", "int32", I32),
    "embed": (
        I32,
        "int32",
        "int32",
        I32,
        I8,
        I8,
        I8,
        "int32",
        "int32",
        "int32",
        "int32",
        I8,
        "int32",
        I8,
    ),
    "mav_norm": (I8, I8, I8, "int32", "int32", "int32", I8, I8, I32, I8, I32),
    "rowdot": (I8, I8, "int32", "int32", "int32", I32),
    "mm_tc": _MM,
    "mm_dp4a": _MM,
    "gate_tc": _GATE,
    "gate_dp4a": _GATE,
    "cand_tc": _CAND,
    "cand_dp4a": _CAND,
    "zgemm_tc": _ZGEMM,
    "zgemm_dp4a": _ZGEMM,
    "token_loss": (I8, I32, "int32", "int32", "int32", "int32", I32, I64, I64),
    "token_histogram": (I8, I32, "int32", "int32", I32, "int32", "int32", I32, I32),
    "bump_i32": (I32,),
    "ztest_apply": (I64, I64, "int32", I8, U64, I8),
    "momentum_apply": (I64, I64, "int32", "int32", I32, I8, U64, I8),
    "adamw_apply": (*(I64, I64, "int64", "int64", "int64", "int32", "int32", "int32"), *_OPT, I8),
    "overlay_step": (I8, "int32", "int32", I8, I8),
    # the former (former.cu)
    "former_embed": (I32, "int32", I8, I8, I8, I8, "int32", "int32", "int32", I8),
    "former_mm_tc": _FORMER_MM,
    "former_mm_dp4a": _FORMER_MM,
    "former_head_tc": _FORMER_HEAD,
    "former_head_dp4a": _FORMER_HEAD,
    "former_loss": (U64, I32, "int32", "int32", I64, I64),
    "former_renorm": (I8, I8, I8, "int32", "int32", "int32", "int32", I32, I32, I8),
    "former_attention": _ATTENTION,
    "former_attention_wide": _ATTENTION,
    # the replica digest's leaves (digest.cu)
    "digest_leaves": (U64, I64, "int32", U64),
    # a reward run's generation (generate.cu)
    "gen_embed": (I32, I8, I8, I8, "int32", "int32", "int32", "int32", I8, "int32", I8),
    "gen_feed": (I32, "int32", "int32", "int32", "int32", I32, I32),
    "sample_tokens": (I8, "int32", I64, "uint64", I64, "int32", I64, I32, I32, I32, "int32"),
    # the former's generation (former_generate.cu)
    "former_gen_begin": (I32, *("int32",) * 4, I32, I32, I32, I32, I32, I32),
    "former_gen_embed": (I32, "int32", I32, "int32", I8, I8, I8, I8, *("int32",) * 3, I8),
    "former_gen_attend": (I8, I8, I8, I32, "int32", "int32", "int32", I32, I8, I8, I8),
    "former_gen_last": (I8, "int32", "int32", I8),
}
TENSOR_CORE_KERNELS = ("mm_tc", "gate_tc", "cand_tc", "zgemm_tc", "former_mm_tc", "former_head_tc")
# Options given to cupy.RawModule (CuPy adds the architecture and its own flags; the CI
# compile check adds the same). No float flag can change a result: the kernels' one float,
# the attention's quotient estimate (former.cu att_quotient), is within 1/32 of the quotient
# under any rounding mode, fused or not, and an exact integer step finishes it.
NVRTC_OPTIONS: tuple[str, ...] = ()

ModuleFactory = Callable[[str, tuple[str, ...]], Any]


def kernel_source() -> str:
    """The CUDA source of every kernel (package data), one module."""
    files = resources.files(__package__)
    return "\n".join(files.joinpath(name).read_text() for name in SOURCE_FILES)


class Kernels:
    """The compiled kernels, with an argument check before every launch and graph capture.

    `stream` is a CuPy stream (capture becomes a CUDA graph) or None: then capture records
    the launches and replay runs them again, with the same arguments, as a graph would.
    """

    def __init__(self, xp: Any, module_factory: ModuleFactory, stream: Any = None):
        self.xp = xp
        self.stream = stream
        names = tuple(SIGNATURES)
        module = module_factory(kernel_source(), names)
        self._fn = {name: module.get_function(name) for name in names}
        # where the kernels came from and how long it took (a prebuilt cubin or NVRTC)
        self.origin: str | None = getattr(module, "origin", None)
        self._recording: list | None = None
        self.replays = 0  # captured sequences replayed (graph launches on a GPU)

    def check(self, name: str, args: Sequence[Any]) -> None:
        spec = SIGNATURES[name]
        if len(args) != len(spec):
            raise TypeError(f"{name}: {len(args)} arguments for {len(spec)} parameters")
        for i, (arg, want) in enumerate(zip(args, spec, strict=True)):
            if want.startswith("*"):
                if not isinstance(arg, self.xp.ndarray) or arg.dtype != np.dtype(want[1:]):
                    got = getattr(arg, "dtype", type(arg).__name__)
                    raise TypeError(f"{name} arg {i}: needs a {want[1:]} device array, got {got}")
                if not arg.flags.c_contiguous:
                    raise TypeError(f"{name} arg {i}: array is not C-contiguous")
            elif not isinstance(arg, np.generic) or arg.dtype != np.dtype(want):
                raise TypeError(f"{name} arg {i}: needs a NumPy {want} scalar, got {arg!r}")

    def __call__(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], *args) -> None:
        self.check(name, args)
        if self._recording is not None and self.stream is None:
            self._recording.append((name, grid, block, args))
            return
        self._fn[name](grid, block, args)

    def capture(self, sequence: Callable[[], None]) -> Callable[[], None]:
        """Record the launches of `sequence` once; returns a function that replays them."""
        if self.stream is not None:
            self.stream.begin_capture()
            try:
                sequence()
            finally:
                graph = self.stream.end_capture()

            def launch() -> None:
                self.replays += 1
                graph.launch(self.stream)

            return launch
        self._recording = []
        try:
            sequence()
        finally:
            recorded, self._recording = self._recording, None

        def replay() -> None:
            self.replays += 1
            for name, grid, block, args in recorded:
                self._fn[name](grid, block, args)

        return replay


def cupy_module(code: str, names: tuple[str, ...]) -> Any:
    """The module on the current CUDA device: a prebuilt cubin of this very source when one
    fits the device (cubins.py), else cupy.RawModule's NVRTC compile; the log says which."""
    import cupy

    def compile_module() -> Any:
        return cupy.RawModule(code=code, options=NVRTC_OPTIONS, name_expressions=names)

    def load(path: Any) -> Any:
        return cupy.RawModule(path=str(path))

    capability = int(cupy.cuda.Device().compute_capability)
    return cubins.load_or_compile(code, NVRTC_OPTIONS, names, capability, load, compile_module)

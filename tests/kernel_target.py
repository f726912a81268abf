"""Where the GPU kernel tests run: the CPU build of the kernels (default) or CuPy on a GPU.

EGGROLL_KERNEL_TARGET=cupy runs the same tests through cupy.RawModule (scripts/gpu_check.py
does). EGGROLL_CUDAEMU_SANITIZE=1 builds the CPU kernels with the undefined-behaviour
sanitizer. On the CPU build every test runs under three thread orders.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cudaemu

from eggroll_dist.worker.backend.cupy_backend import Kernels

ON_GPU = os.environ.get("EGGROLL_KERNEL_TARGET") == "cupy"
# The CPU build needs g++ and the emulation layer's x86-64 context switch.
CPU_BUILD_MISSING = (
    None
    if ON_GPU or (shutil.which("g++") and platform.machine() in ("x86_64", "AMD64"))
    else "the CPU build of the kernels needs g++ on x86-64"
)
SANITIZE = os.environ.get("EGGROLL_CUDAEMU_SANITIZE") == "1"
# ascending, descending and seeded random thread order between barriers
VARIANTS = ("gpu",) if ON_GPU else ("ascending", "descending", "random")


def array_module():
    if ON_GPU:
        import cupy

        if os.environ.get("EGGROLL_CUPY_POOL") == "0":  # compute-sanitizer: no memory pool
            cupy.cuda.set_allocator(None)
        return cupy
    return np


def module_factory(variant: str):
    if ON_GPU:
        from eggroll_dist.worker.backend.cupy_backend import cupy_module

        return cupy_module
    order = VARIANTS.index(variant)
    return cudaemu.module_factory(order=order, seed=12345 + order, sanitize=SANITIZE)


def kernels(variant: str) -> Kernels:
    return Kernels(array_module(), module_factory(variant))


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.array(a, copy=True)


def dev(a: np.ndarray):
    """A device copy (kernels write some inputs in place)."""
    return array_module().array(np.ascontiguousarray(a))


def poisoned(shape, dtype):
    """A device array of garbage: outputs start so."""
    return array_module().asarray(np.full(shape, 99, dtype=dtype))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

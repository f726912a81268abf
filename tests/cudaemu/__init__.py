"""CuPy's RawModule API over `cudaemu.h`: the backend's .cu source, built by g++, run on NumPy.

    mod = RawModule(code=src, name_expressions=("kern",), order=2, seed=7)
    mod.get_function("kern")((blocks,), (threads,), (a, b, np.int32(n)))

The source is compiled once into a shared library (cached by content hash) with one launch
stub per kernel name. Before every launch the arguments are checked against the kernel's
C++ signature, more strictly than CuPy does: an ndarray of the pointee's dtype for each
pointer, C-contiguous, writeable unless the pointee is const; a NumPy scalar of the exact
size and kind for each scalar (CuPy passes a Python int as 8 bytes and a float as a double).
A zero-size array is a null pointer, as with CuPy.

Knobs, per module or per launch: `order` 0 ascending, 1 descending, 2 seeded random thread
order between barriers; `os_threads` runs blocks on that many OS threads; `sanitize=True`
builds with the undefined-behaviour sanitizer (signed overflow, shifts past the width,
misaligned loads abort the process with a report).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

HEADER = Path(__file__).resolve().parent / "cudaemu.h"
CACHE = Path(os.environ.get("CUDAEMU_CACHE", Path(tempfile.gettempdir()) / "cudaemu-cache"))
MAX_ARGS = 64
ORDERS = (0, 1, 2)

_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w\s:<>,]*?)\s+"
    r"(?:__align__\s*\(\s*\d+\s*\)\s*)?(\w+)\s*\[\s*\]\s*;"
)
_KINDS = {"i", "u", "f", "b"}


class LaunchError(RuntimeError):
    """A fault the emulator found inside a kernel (deadlock, divergent barrier, bad mask)."""


def _rewrite(code: str) -> str:
    # `extern __shared__ T name[];` (dynamic shared memory) has no host C++ spelling.
    return _EXTERN_SHARED.sub(
        r"\1* const \2 = reinterpret_cast<\1*>(::cudaemu::dyn_smem_ptr());", code
    )


def _stubs(names: tuple[str, ...]) -> str:
    out = []
    for i, expr in enumerate(names):
        out.append(
            f'extern "C" int cudaemu_launch_{i}(const unsigned* g, const unsigned* b, '
            f"size_t sm, void** a, const long long* o, char* e, size_t n) "
            f"{{ return ::cudaemu::launch(&{expr}, g, b, sm, a, o, e, n); }}\n"
            f'extern "C" int cudaemu_sig_{i}(long long* out, int max) '
            f"{{ return ::cudaemu::signature(&{expr}, out, max); }}\n"
        )
    return "".join(out)


def build(code: str, names: tuple[str, ...], options=(), sanitize: bool = False) -> Path:
    """The shared library of `code` with launch stubs for `names` (built once, then cached)."""
    defines = [o for o in options if o.startswith(("-D", "-I"))]
    flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-pthread"]
    if sanitize:  # signed overflow is reported, not defined away
        flags += ["-fsanitize=undefined", "-fno-sanitize-recover=all", "-g"]
    else:
        flags += ["-fwrapv"]  # wrap like the hardware; never let g++ exploit overflow
    source = f'#include "{HEADER}"\n#line 1 "kernel.cu"\n{_rewrite(code)}\n{_stubs(names)}'
    key = hashlib.sha256(
        "\0".join([source, HEADER.read_text(), *flags, *defines]).encode()
    ).hexdigest()[:24]
    CACHE.mkdir(parents=True, exist_ok=True)
    lib = CACHE / f"mod-{key}.so"
    if not lib.exists():
        src = CACHE / f"mod-{key}.{os.getpid()}.cpp"
        src.write_text(source)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run(
            ["g++", *flags, *defines, "-o", str(tmp), str(src)], capture_output=True, text=True
        )
        src.unlink()
        if proc.returncode:
            raise RuntimeError(f"g++ failed on the kernel source:\n{proc.stderr}")
        os.replace(tmp, lib)
    return lib


class RawModule:
    """A g++ build of CUDA source with cupy.RawModule's interface."""

    def __init__(
        self,
        code: str,
        options=(),
        name_expressions=(),
        sanitize: bool = False,
        order: int = 0,
        seed: int = 0,
        os_threads: int = 1,
    ):
        self.names = tuple(name_expressions)
        t0 = time.perf_counter()
        self.path = build(code, self.names, options, sanitize)
        self.build_s = time.perf_counter() - t0
        self._lib = ctypes.CDLL(str(self.path))
        self.launch_options = {"order": order, "seed": seed, "os_threads": os_threads}

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(self, self.names.index(name))


class RawKernel:
    def __init__(self, module: RawModule, index: int):
        lib = module._lib
        self.name = module.names[index]
        self.defaults = module.launch_options
        self._launch = getattr(lib, f"cudaemu_launch_{index}")
        self._launch.restype = ctypes.c_int
        sig = getattr(lib, f"cudaemu_sig_{index}")
        buf = (ctypes.c_longlong * (3 * MAX_ARGS))()
        n = sig(buf, MAX_ARGS)
        # (kind: 0 scalar, 1 pointer, 2 pointer to const; size; type code i/u/f/b/?)
        self.params = [(buf[3 * i], buf[3 * i + 1], chr(buf[3 * i + 2])) for i in range(n)]

    def _check_dtype(self, i: int, dtype: np.dtype, size: int, code: str) -> None:
        if size and (dtype.itemsize != size or (code in _KINDS and dtype.kind != code)):
            raise TypeError(f"{self.name} arg {i}: kernel expects {code}{size}, got {dtype}")

    def _marshal(self, args) -> tuple[ctypes.Array, list]:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} params")
        holders: list = []
        for i, (arg, (kind, size, code)) in enumerate(zip(args, self.params, strict=True)):
            if kind:  # a pointer
                if not isinstance(arg, np.ndarray):
                    raise TypeError(f"{self.name} arg {i}: a pointer parameter needs an ndarray")
                self._check_dtype(i, arg.dtype, size, code)
                if not arg.flags.c_contiguous:
                    raise TypeError(f"{self.name} arg {i}: array is not C-contiguous")
                if kind == 1 and not arg.flags.writeable:
                    raise TypeError(f"{self.name} arg {i}: non-const pointer to read-only array")
                holders.append(ctypes.c_void_p(arg.ctypes.data if arg.size else None))
            else:
                if not isinstance(arg, np.generic):
                    raise TypeError(
                        f"{self.name} arg {i}: pass a NumPy scalar of {code}{size} "
                        "(CuPy would pass a Python int as 8 bytes)"
                    )
                self._check_dtype(i, arg.dtype, size, code)
                holders.append(ctypes.create_string_buffer(arg.tobytes(), size))
        ptrs = (ctypes.c_void_p * max(1, len(holders)))(
            *[
                ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
                if isinstance(h, ctypes.c_void_p)
                else ctypes.cast(h, ctypes.c_void_p)
                for h in holders
            ]
        )
        return ptrs, holders

    def __call__(self, grid, block, args, shared_mem: int = 0, **options) -> None:
        opt = {**self.defaults, **options}
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        ptrs, holders = self._marshal(args)
        knobs = (opt["order"], opt["seed"], opt["os_threads"], 128 * 1024, 1)
        err = ctypes.create_string_buffer(512)
        rc = self._launch(
            (ctypes.c_uint * 3)(*grid),
            (ctypes.c_uint * 3)(*block),
            ctypes.c_size_t(shared_mem),
            ptrs,
            (ctypes.c_longlong * 5)(*knobs),
            err,
            ctypes.c_size_t(len(err)),
        )
        del holders
        if rc:
            raise LaunchError(f"{self.name}: {err.value.decode()}")


def module_factory(**knobs):
    """A kernel-module factory for the CuPy backend: (source, names) -> RawModule."""

    def make(code: str, names: tuple[str, ...]) -> RawModule:
        return RawModule(code, name_expressions=names, **knobs)

    return make

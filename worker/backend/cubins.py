"""Kernels built ahead of time: a CuPy kernel module compiled by NVRTC into one cubin per
GPU architecture, with no GPU, and a worker's choice of one for its device.

On a fresh machine CuPy compiles the module with NVRTC before the first step (about 40 s on
an H200; CuPy's kernel cache only helps a machine that compiled before). A kernel folder
made here lets a worker load the machine code instead:

- `kernels-<key>.json`: the key (a SHA-256 of the exact source and NVRTC options, the
  architecture aside), the options, the NVRTC version, each kernel's lowered name and each
  architecture's cubin file with its SHA-256;
- `kernels-<key>.sm_XY.cubin`: the module for sm_XY, compiled as cupy.RawModule compiles it
  (the backend's options plus what CuPy adds), through the NVRTC library of the
  nvidia-cuda-nvrtc-cu12 wheel (the cuda-check extra) or of a CUDA install.

A cubin for sm_XY runs on devices of the same major version and a minor version of at least
Y (CUDA's binary compatibility); the closest one is chosen. A worker looks in
EGGROLL_KERNEL_DIR (`eggroll-worker --kernel-dir`), then in the package's own
`prebuilt-kernels/` folder (what `scripts/gpu_check.py wheelhouse` puts in the wheel). A
folder made for another source or options has another key and is never loaded: the worker
compiles with NVRTC then, and its log says which it did and why.

The folder is made by `python -m eggroll_dist.worker.backend.prebuild DIR` (prebuild.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import sysconfig
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("eggroll.worker")

KERNEL_DIR_ENV = "EGGROLL_KERNEL_DIR"
# The package's own kernel folder: package data (a name Python cannot import, so that
# setuptools takes it for data, not for a package).
BUNDLED = "prebuilt-kernels"
FORMAT = 1
# What CuPy's RawModule adds to the user's options on its NVRTC path (besides -arch).
CUPY_ADDED = ("-ftz=true", "--device-as-default-execution-space")
# Ampere, Hopper and data-centre Blackwell (about 25 s of compile each): sm_86 and sm_89 run
# the sm_80 cubin; others (sm_120) with --arch. Those this NVRTC does not know are left out.
DEFAULT_ARCHS = ("80", "90", "100")
MODULE_NAME = "eggroll_kernels.cu"


class NvrtcMissing(RuntimeError):
    """No NVRTC library to compile with."""


def compile_options(options: Sequence[str]) -> tuple[str, ...]:
    """The options of a RawModule's compile, -arch aside: the module's and CuPy's own."""
    return (*options, *CUPY_ADDED)


def source_key(source: str, options: Sequence[str]) -> str:
    """SHA-256 (hex) of the exact source and options: a cubin is loaded for this key only."""
    text = json.dumps({"source": source, "options": list(options)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def stem(key: str) -> str:
    return f"kernels-{key[:16]}"


# --- choice (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Prebuilt:
    """A cubin chosen for a device: its file, SHA-256, architecture, kernels' lowered names."""

    path: Path
    sha256: str
    arch: str
    names: dict[str, str]


def arch_name(capability: int) -> str:
    return f"sm_{capability}"


def pick_arch(available: Iterable[int], capability: int) -> int | None:
    """The architecture whose cubin runs on a device of `capability` (86 for sm_86): the same
    major version and the highest minor version not above the device's; None if none."""
    major, minor = divmod(capability, 10)
    fits = [a for a in available if a // 10 == major and a % 10 <= minor]
    return max(fits, default=None)


def choose(
    manifests: Sequence[tuple[Path, Mapping[str, Any]]],
    key: str,
    capability: int,
    names: Sequence[str],
) -> tuple[Prebuilt | None, str]:
    """The cubin to load from these (folder, manifest) pairs, in order of preference, or
    None and why not, in a few words."""
    if not manifests:
        return None, "no prebuilt cubins"
    mine = [(d, m) for d, m in manifests if m.get("format") == FORMAT and m.get("key") == key]
    if not mine:
        others = ", ".join(sorted({str(m.get("key", "?"))[:12] for _, m in manifests}))
        return None, (
            f"stale: the prebuilt cubins are for another kernel source or options "
            f"(key {others}, not {key[:12]})"
        )
    have: set[int] = set()
    for folder, m in mine:
        cubins = m.get("cubins", {})
        archs = [int(a.removeprefix("sm_")) for a in cubins if a.removeprefix("sm_").isdigit()]
        have.update(archs)
        arch = pick_arch(archs, capability)
        if arch is None:
            continue
        lowered = m.get("names", {})
        if missing := [n for n in names if n not in lowered]:
            return None, f"{folder} lacks kernels {', '.join(missing[:3])}"
        entry = cubins[arch_name(arch)]
        return Prebuilt(folder / entry["file"], entry["sha256"], arch_name(arch), dict(lowered)), ""
    listed = ", ".join(arch_name(a) for a in sorted(have)) or "none"
    return None, f"no prebuilt cubin for {arch_name(capability)} (have {listed})"


# --- NVRTC (build) ---------------------------------------------------------------------------


def site_file(pattern: str) -> Path | None:
    """The first file of site-packages matching `pattern`, or None."""
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        found = sorted(Path(base).glob(pattern))
        if found:
            return found[0]
    return None


def load_nvrtc() -> ctypes.CDLL:
    """NVRTC 12: the nvidia-cuda-nvrtc-cu12 wheel's, else a CUDA install's (by soname)."""
    lib = site_file("nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    if lib is not None:
        for builtins in lib.parent.glob("libnvrtc-builtins.so.*"):  # dlopened by soname
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        path = str(lib)
    else:
        path = ctypes.util.find_library("nvrtc") or "libnvrtc.so.12"
    try:
        nvrtc = ctypes.CDLL(path)
    except OSError as exc:
        raise NvrtcMissing(
            f"no NVRTC library ({exc}): pip install nvidia-cuda-nvrtc-cu12 "
            "(or 'eggroll-distributed[cuda-check]')"
        ) from None
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    return nvrtc


def nvrtc_version(nvrtc: ctypes.CDLL) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def supported_archs(nvrtc: ctypes.CDLL) -> list[int]:
    """The architectures this NVRTC compiles for (80 for sm_80)."""
    count = ctypes.c_int()
    nvrtc.nvrtcGetNumSupportedArchs(ctypes.byref(count))
    archs = (ctypes.c_int * count.value)()
    nvrtc.nvrtcGetSupportedArchs(archs)
    return list(archs)


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str
    cubin: bytes
    lowered: dict[str, str]  # name expression -> lowered (mangled) name


def compile_cubin(
    nvrtc: ctypes.CDLL,
    source: str,
    name: str,
    options: Sequence[str],
    name_expressions: Sequence[str] = (),
) -> Compiled:
    """One NVRTC compile to a cubin, with the lowered name of each name expression."""
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc:
        raise RuntimeError(f"nvrtcCreateProgram: {nvrtc.nvrtcGetErrorString(rc).decode()}")
    try:
        for expr in name_expressions:
            nvrtc.nvrtcAddNameExpression(prog, expr.encode())
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        text = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, text)
        cubin, lowered = b"", {}
        if rc == 0:
            nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetCUBIN(prog, buf)
            cubin = buf.raw
            for expr in name_expressions:
                out = ctypes.c_char_p()
                nvrtc.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out))
                lowered[expr] = (out.value or b"").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return Compiled(rc == 0, text.value.decode(errors="replace"), cubin, lowered)


def write_kernel_dir(
    out: Path,
    key: str,
    options: Sequence[str],
    nvrtc: str,
    names: Mapping[str, str],
    cubins: Mapping[str, bytes],
) -> Path:
    """Write the cubins (by architecture, "sm_90") and their manifest, last, into `out`;
    the manifest's path. Cubins of the same key already there are kept (added to)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem(key)}.json"
    entries: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        old = json.loads(path.read_text())
        if old.get("key") == key and old.get("names") == dict(names):
            entries = {a: e for a, e in old["cubins"].items() if (out / e["file"]).is_file()}
    for arch, data in sorted(cubins.items()):
        cubin = out / f"{stem(key)}.{arch}.cubin"
        _write_atomic(cubin, data)
        entries[arch] = {"file": cubin.name, "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {
        "format": FORMAT,
        "key": key,
        "options": list(options),
        "nvrtc": nvrtc,
        "names": dict(names),
        "cubins": dict(sorted(entries.items())),
    }
    _write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build(
    out: Path,
    source: str,
    module_options: Sequence[str],
    names: Sequence[str],
    archs: Sequence[str] | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> Path:
    """Compile a module as cupy.RawModule(code=source, options=module_options,
    name_expressions=names) would, for each architecture ("90"; default: DEFAULT_ARCHS that
    this NVRTC knows), into the kernel folder `out`; its manifest's path. NvrtcMissing
    without NVRTC, ValueError for an architecture it does not know or a compile error."""
    nvrtc = load_nvrtc()
    known = supported_archs(nvrtc)
    if archs is None:
        archs = [a for a in DEFAULT_ARCHS if int(a) in known]
    if unknown := [a for a in archs if not a.isdigit() or int(a) not in known]:
        raise ValueError(f"NVRTC {nvrtc_version(nvrtc)} does not know sm_{', sm_'.join(unknown)}")
    options = compile_options(module_options)
    cubins: dict[str, bytes] = {}
    lowered: dict[str, str] = {}
    for arch in archs:
        t0 = time.perf_counter()
        got = compile_cubin(nvrtc, source, MODULE_NAME, [*options, f"-arch=sm_{arch}"], names)
        if not got.ok:
            raise ValueError(f"NVRTC failed for sm_{arch}:\n{got.log}")
        if lowered and got.lowered != lowered:
            raise ValueError(f"sm_{arch}: lowered names differ from another architecture's")
        cubins[f"sm_{arch}"], lowered = got.cubin, got.lowered
        say(f"sm_{arch}: {len(got.cubin) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    key = source_key(source, options)
    return write_kernel_dir(out, key, options, nvrtc_version(nvrtc), lowered, cubins)


# --- the worker's side -----------------------------------------------------------------------


def kernel_dirs() -> list[Path]:
    """Where a worker looks for cubins, in order: EGGROLL_KERNEL_DIR, then the package's."""
    dirs = []
    if os.environ.get(KERNEL_DIR_ENV):
        dirs.append(Path(os.environ[KERNEL_DIR_ENV]))
    with contextlib.suppress(TypeError, FileNotFoundError, NotADirectoryError):
        dirs.append(Path(str(resources.files(__package__).joinpath(BUNDLED))))
    return dirs


def read_manifests(dirs: Iterable[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """Every readable kernel manifest in these folders (unreadable ones are skipped)."""
    found = []
    for folder in dirs:
        for path in sorted(folder.glob("kernels-*.json")) if folder.is_dir() else []:
            with contextlib.suppress(OSError, ValueError):
                manifest = json.loads(path.read_text())
                if isinstance(manifest, dict):
                    found.append((folder, manifest))
    return found


class Resolved:
    """A module's kernels, looked up once: `get_function(name)` as cupy.RawModule's, and
    where they came from (`origin`, one line with the time it took)."""

    def __init__(self, functions: dict[str, Any], origin: str):
        self._functions = functions
        self.origin = origin

    def get_function(self, name: str) -> Any:
        return self._functions[name]


def load_or_compile(
    source: str,
    module_options: Sequence[str],
    names: Sequence[str],
    capability: int,
    load: Callable[[Path], Any],
    compile_module: Callable[[], Any],
    dirs: Sequence[Path] | None = None,
) -> Resolved:
    """The kernels from a prebuilt cubin that matches the source, its options and the
    device, else from `compile_module()` (NVRTC); says which in one log line. `load(path)`
    and `compile_module()` give modules with `get_function(name)`."""
    t0 = time.perf_counter()
    key = source_key(source, compile_options(module_options))
    dirs = kernel_dirs() if dirs is None else dirs
    manifests = read_manifests(dirs)
    try:
        chosen, why = choose(manifests, key, capability, names)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a hand-edited manifest
        chosen, why = None, f"a kernel manifest is malformed ({type(exc).__name__}: {exc})"
    if not manifests:
        why += f" in {', '.join(map(str, dirs))}" if dirs else ""
    if chosen is not None:
        try:
            if hashlib.sha256(chosen.path.read_bytes()).hexdigest() != chosen.sha256:
                raise ValueError("its SHA-256 differs from the manifest's")
            module = load(chosen.path)
            functions = {n: module.get_function(chosen.names[n]) for n in names}
            origin = f"kernels loaded from {chosen.path} ({chosen.arch})"
            return _said(functions, origin, t0)
        except Exception as exc:  # a damaged file, a driver too old for the cubin
            why = f"{chosen.path.name} did not load: {type(exc).__name__}: {exc}"
    module = compile_module()
    functions = {n: module.get_function(n) for n in names}  # CuPy compiles on first use
    return _said(functions, f"kernels compiled with NVRTC ({why})", t0)


def _said(functions: dict[str, Any], origin: str, t0: float) -> Resolved:
    seconds = time.perf_counter() - t0
    log.info(origin, seconds=round(seconds, 2))
    return Resolved(functions, f"{origin} in {seconds:.1f} s")

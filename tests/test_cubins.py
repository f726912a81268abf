"""Kernels built ahead of time (worker/backend/cubins.py, prebuild.py): the choice of a cubin
for a device, the key that refuses a stale one, the worker's fallback to NVRTC and its log
line, and (with the NVRTC library of the cuda-check extra) real cubins for sm_80 and sm_90
from the current source. Loading one on a device is scripts/gpu_check.py's preflight."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import structlog

from eggroll_dist.worker.backend import cubins
from eggroll_dist.worker.backend.cupy_kernels import (
    NVRTC_OPTIONS,
    SIGNATURES,
    Kernels,
    cupy_module,
    kernel_source,
)
from eggroll_dist.worker.backend.prebuild import build_kernels

OPTIONS = cubins.compile_options(NVRTC_OPTIONS)  # what the key covers, -arch aside
NAMES = ("noise_rows", "mm_tc")
LOWERED = {"noise_rows": "_Z10noise_rowsv", "mm_tc": "_Z5mm_tcv"}  # as if mangled


class FakeModule:
    """A module whose kernels are their own names (what get_function was asked for)."""

    def __init__(self, origin: str):
        self.origin = origin

    def get_function(self, name: str) -> tuple[str, str]:
        return self.origin, name


def kernel_dir(folder: Path, source: str, archs=("sm_80", "sm_90"), names=LOWERED) -> Path:
    key = cubins.source_key(source, OPTIONS)
    blobs = {arch: f"cubin {arch}".encode() for arch in archs}
    return cubins.write_kernel_dir(folder, key, OPTIONS, "12.9", names, blobs)


def load_or_compile(source: str, capability: int, dirs: list[Path], load=None):
    loaded: list[Path] = []

    def default_load(path: Path) -> FakeModule:
        loaded.append(path)
        return FakeModule("cubin")

    with structlog.testing.capture_logs() as logs:
        module = cubins.load_or_compile(
            source,
            NVRTC_OPTIONS,
            NAMES,
            capability,
            load or default_load,
            lambda: FakeModule("nvrtc"),
            dirs,
        )
    assert len(logs) == 1, logs  # one line says which, and how long
    return module, loaded, logs[0]


@pytest.mark.parametrize(
    ("capability", "want"),
    [(80, 80), (86, 80), (89, 89), (90, 90), (100, 100), (103, 100), (121, 120), (75, None)],
)
def test_a_cubin_runs_on_its_major_version_from_its_minor_up(capability, want) -> None:
    assert cubins.pick_arch([80, 89, 90, 100, 120], capability) == want


def test_no_cubin_for_an_older_minor_or_another_major() -> None:
    assert cubins.pick_arch([86], 80) is None  # sm_86 code on sm_80: not allowed
    assert cubins.pick_arch([90], 100) is None  # Hopper's cubin on Blackwell
    assert cubins.pick_arch([100], 120) is None
    assert cubins.pick_arch([], 90) is None


def test_the_key_covers_the_source_and_the_options() -> None:
    source, options = kernel_source(), OPTIONS
    key = cubins.source_key(source, options)
    assert key == cubins.source_key(source, options)
    assert key != cubins.source_key(source + " ", options)
    assert key != cubins.source_key(source, (*options, "-lineinfo"))
    assert key != cubins.source_key(source, options[::-1])


def test_choice_prefers_the_first_folder_that_fits(tmp_path: Path) -> None:
    source = 'extern "C" __global__ void k() {}'
    first = kernel_dir(tmp_path / "mine", source, archs=("sm_90",))
    second = kernel_dir(tmp_path / "image", source, archs=("sm_80", "sm_90"))
    manifests = cubins.read_manifests([first.parent, second.parent])
    key = cubins.source_key(source, OPTIONS)
    chosen, _ = cubins.choose(manifests, key, 90, NAMES)
    assert chosen is not None and chosen.path.parent == first.parent and chosen.arch == "sm_90"
    chosen, _ = cubins.choose(manifests, key, 86, NAMES)  # only the second has sm_80
    assert chosen is not None and chosen.path.parent == second.parent and chosen.arch == "sm_80"
    assert chosen.path.read_bytes() == b"cubin sm_80"
    assert chosen.sha256 == hashlib.sha256(b"cubin sm_80").hexdigest()
    chosen, why = cubins.choose(manifests, key, 75, NAMES)
    assert chosen is None and why == "no prebuilt cubin for sm_75 (have sm_80, sm_90)"
    chosen, why = cubins.choose(manifests, key, 90, (*NAMES, "new_kernel"))
    assert chosen is None and "lacks kernels new_kernel" in why


def test_a_second_build_adds_architectures(tmp_path: Path) -> None:
    source = kernel_source()
    kernel_dir(tmp_path, source, archs=("sm_80", "sm_90"))
    manifest = json.loads(kernel_dir(tmp_path, source, archs=("sm_120",)).read_text())
    assert list(manifest["cubins"]) == ["sm_120", "sm_80", "sm_90"]
    other = json.loads(kernel_dir(tmp_path, source + " ", archs=("sm_100",)).read_text())
    assert list(other["cubins"]) == ["sm_100"]  # another source: a manifest of its own


def test_a_matching_cubin_is_loaded_by_its_lowered_names(tmp_path: Path) -> None:
    source = kernel_source()
    manifest = kernel_dir(tmp_path, source)
    module, loaded, line = load_or_compile(source, 90, [tmp_path])
    assert loaded == [tmp_path / manifest.name.replace(".json", ".sm_90.cubin")]
    assert module.get_function("noise_rows") == ("cubin", "_Z10noise_rowsv")
    assert module.get_function("mm_tc") == ("cubin", "_Z5mm_tcv")
    assert line["event"] == f"kernels loaded from {loaded[0]} (sm_90)"
    assert line["log_level"] == "info" and line["seconds"] >= 0
    assert module.origin.startswith(line["event"] + " in ") and module.origin.endswith(" s")


def test_a_stale_cubin_is_refused_and_the_log_says_why(tmp_path: Path) -> None:
    folder = kernel_dir(tmp_path, kernel_source()).parent
    changed = kernel_source() + "\n// one more line\n"
    module, loaded, line = load_or_compile(changed, 90, [folder])
    assert loaded == [] and module.get_function("mm_tc") == ("nvrtc", "mm_tc")
    assert line["event"].startswith("kernels compiled with NVRTC (stale: the prebuilt cubins ")
    assert "another kernel source or options" in line["event"]


@pytest.mark.parametrize(
    ("capability", "damage", "why"),
    [
        (75, None, "no prebuilt cubin for sm_75 (have sm_80, sm_90)"),
        (90, "file", "did not load: ValueError: its SHA-256 differs from the manifest's"),
        (90, "driver", "did not load: RuntimeError: CUDA_ERROR_NO_BINARY_FOR_GPU"),
    ],
)
def test_fallback_to_nvrtc(tmp_path: Path, capability: int, damage, why: str) -> None:
    manifest = kernel_dir(tmp_path, kernel_source())
    cubin = tmp_path / json.loads(manifest.read_text())["cubins"]["sm_90"]["file"]
    if damage == "file":
        cubin.write_bytes(b"cubin sm_9")  # cut short

    def load(path: Path) -> FakeModule:
        if damage == "driver":
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")
        return FakeModule("cubin")

    module, _, line = load_or_compile(kernel_source(), capability, [tmp_path], load)
    assert module.get_function("mm_tc") == ("nvrtc", "mm_tc")
    assert line["event"].startswith("kernels compiled with NVRTC (") and why in line["event"]


def test_no_folder_and_an_unreadable_manifest_mean_nvrtc(tmp_path: Path) -> None:
    (tmp_path / "kernels-0123456789abcdef.json").write_text("{not json")
    _, _, line = load_or_compile(kernel_source(), 90, [tmp_path / "absent", tmp_path])
    assert line["event"].startswith("kernels compiled with NVRTC (no prebuilt cubins in ")


def test_a_malformed_manifest_means_nvrtc(tmp_path: Path) -> None:
    manifest = kernel_dir(tmp_path, kernel_source())
    text = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**text, "cubins": ["sm_90"]}))
    _, loaded, line = load_or_compile(kernel_source(), 90, [tmp_path])
    assert loaded == [] and "a kernel manifest is malformed" in line["event"]


def test_the_worker_looks_in_its_variable_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(cubins.KERNEL_DIR_ENV, str(tmp_path))
    dirs = cubins.kernel_dirs()
    assert dirs[0] == tmp_path and dirs[-1].name == cubins.BUNDLED
    monkeypatch.delenv(cubins.KERNEL_DIR_ENV)
    assert [d.name for d in cubins.kernel_dirs()] == [cubins.BUNDLED]


def test_the_cupy_factory_loads_the_devices_cubin_or_compiles(tmp_path: Path, monkeypatch) -> None:
    """cupy_module against a stand-in CuPy on an sm_89 device: RawModule(path=) of the sm_80
    cubin when it matches the source, RawModule(code=...) as before when it does not."""
    made: list[dict] = []

    class RawModule:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def get_function(self, name: str) -> str:
            return name

    device = types.SimpleNamespace(compute_capability="89")
    cuda = types.SimpleNamespace(Device=lambda: device)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule, cuda=cuda))
    manifest = kernel_dir(tmp_path, kernel_source(), names={n: n for n in SIGNATURES})
    monkeypatch.setenv(cubins.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(cubins, "BUNDLED", "absent")  # whatever this install carries
    kernels = Kernels(np, cupy_module)
    cubin = tmp_path / manifest.name.replace(".json", ".sm_80.cubin")
    assert made == [{"path": str(cubin)}]
    assert kernels.origin is not None
    assert kernels.origin.startswith(f"kernels loaded from {cubin} (sm_80) in ")
    monkeypatch.setenv(cubins.KERNEL_DIR_ENV, str(tmp_path / "elsewhere"))
    kernels = Kernels(np, cupy_module)
    compiled = {"code": kernel_source(), "options": NVRTC_OPTIONS}
    assert made[1:] == [{**compiled, "name_expressions": tuple(SIGNATURES)}]
    assert kernels.origin is not None
    assert kernels.origin.startswith("kernels compiled with NVRTC (no prebuilt cubins in ")


# --- real cubins (NVRTC, no GPU) -------------------------------------------------------------


def _nvrtc_missing() -> str | None:
    try:
        cubins.load_nvrtc()
    except cubins.NvrtcMissing as exc:
        return str(exc)
    return None


NO_NVRTC = _nvrtc_missing()
needs_nvrtc = pytest.mark.skipif(NO_NVRTC is not None, reason=f"{NO_NVRTC}")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The backend's module for sm_80 and sm_90 (about 25 s each on one core)."""
    return build_kernels(tmp_path_factory.mktemp("kernels"), ["80", "90"])


def elf_arch(cubin: bytes) -> int:
    """The SM version a CUDA ELF is for (EM_CUDA; e_flags, as its ABI version places it)."""
    assert cubin[:4] == b"\x7fELF" and struct.unpack_from("<H", cubin, 18)[0] == 190
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF


@needs_nvrtc
def test_cubins_for_sm80_and_sm90_of_the_current_source(built: Path) -> None:
    manifest = json.loads(built.read_text())
    assert manifest["key"] == cubins.source_key(kernel_source(), OPTIONS)
    assert built.name == f"{cubins.stem(manifest['key'])}.json"
    assert manifest["options"] == list(OPTIONS)
    assert set(manifest["cubins"]) == {"sm_80", "sm_90"}
    for arch, entry in manifest["cubins"].items():
        data = (built.parent / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert elf_arch(data) == int(arch.removeprefix("sm_"))
        # every kernel the backend launches (Kernels refuses any other) is in each cubin
        assert set(manifest["names"]) == set(SIGNATURES)
        for lowered in manifest["names"].values():
            assert b"\0" + lowered.encode() + b"\0" in data, (arch, lowered)


@needs_nvrtc
def test_the_worker_picks_the_built_cubin_or_compiles(built: Path) -> None:
    names = tuple(SIGNATURES)
    key = cubins.source_key(kernel_source(), OPTIONS)
    for capability, arch in ((80, "sm_80"), (86, "sm_80"), (89, "sm_80"), (90, "sm_90")):
        chosen, _ = cubins.choose(cubins.read_manifests([built.parent]), key, capability, names)
        assert chosen is not None and chosen.arch == arch
    _, loaded, line = load_or_compile(kernel_source() + "\n", 90, [built.parent])
    assert loaded == [] and "stale" in line["event"]


@needs_nvrtc
def test_the_command_refuses_an_unknown_architecture(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "eggroll_dist.worker.backend.prebuild", str(tmp_path)]
    done = subprocess.run(
        [*command, "--arch", "95"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: NVRTC 12.") and "does not know sm_95" in done.stderr
    assert list(tmp_path.iterdir()) == []

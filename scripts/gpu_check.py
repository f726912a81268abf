"""A verdict on the CuPy backend from a bare GPU machine: two commands of at most 9 minutes.

Here, on a machine that reaches the package registries, once:

    python scripts/gpu_check.py wheelhouse WHEELS

writes the project's wheel, with the kernels prebuilt as cubins when NVRTC is here (the
cuda-check extra), and the small dependencies a GPU image without network may lack (for
CPython 3.12 on x86-64 Linux; numpy, CuPy and PyTorch are the image's own) into WHEELS,
under 64 MiB. Carry WHEELS and the checkout to the GPU machine, then:

    python3 scripts/gpu_check.py verdict LOG_DIR --wheels WHEELS   # 2 to 4 min, 9 at most
    python3 scripts/gpu_check.py bench LOG_DIR --wheels WHEELS     # about 3 min, 9 at most
    python3 scripts/gpu_check.py hf LOG_DIR --wheels WHEELS        # about 5 min, 9 at most

Each part runs under its own deadline and its result is printed the moment it is known;
its log goes to LOG_DIR/<part>.log. The verdict's parts:

  install    the wheels into LOG_DIR/site (no network, no dependency resolution)
  preflight  device, driver, CUDA runtime, NVRTC, CuPy, and the kernels: loaded from the
             wheel's prebuilt cubin or compiled with NVRTC, and how long it took; without a
             device it prints one line and the command exits 2
  parity     tests/test_gpu_kernels.py and tests/test_cupy_backend.py on the device
             (EGGROLL_KERNEL_TARGET=cupy): the emulated mma, ldmatrix, cp.async and __dp4a
             against the chip
  chunk      three steps of a 2-layer, width-256 model (the GEMMs' 16-byte path, several
             tiles) on the device against the NumPy backend: fitness, loss sums, digests
  mixed      a coordinator, a NumPy and then a CuPy worker on loopback; at least MIN_AGREED
             agreed step digests, and any DIVERGED or disagreeing digest fails
  memcheck, racecheck, initcheck, synccheck
             the kernel tests under compute-sanitizer, with CuPy's memory pool off so that
             every array is its own allocation

`bench` runs scripts/bench_gpu.py, then scripts/bench_run.py: a coordinator and a CuPy worker
training egg-paper end to end (member-tokens/s beside the evaluation alone, the time to the
first step, validation's share of the run). `hf` runs scripts/gpu_check_hf.py's parts (the
Hugging Face path: the replica's exactness on the device, eggroll-tune against a NumPy replay,
and bench_hf). The exit status is 1 if any part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARITY_TESTS = [
    "tests/test_gpu_kernels.py",
    "tests/test_former_kernels.py",
    "tests/test_cupy_backend.py",
    "tests/test_cupy_generate.py",
]
KERNEL_TESTS = PARITY_TESTS[:2]  # what the sanitizers run
MIN_AGREED = 5  # steps whose digest both workers reported, at the least
MIXED_CONFIG = """\
preset = "tiny"
[es]
population = 256
chunk_size = 64
seq_len = 16
"""
# Deadlines in seconds: the verdict's sum, and the bench's with install and preflight, stay
# within 9 minutes. Each is about twice the longest seen on an H100 (the kernels' first
# compile, in preflight, took 30 s on one machine and over 45 s on another).
VERDICT = {
    "install": 30,
    "preflight": 80,
    "parity": 140,
    "chunk": 45,
    "mixed": 60,
    "memcheck": 45,
    "racecheck": 60,
    "initcheck": 40,
    "synccheck": 40,
}
# The bench's parts: scripts/bench_gpu.py, then scripts/bench_run.py on egg-paper (a real run:
# the kernels' first compile, the steps and their validations); with install and
# preflight, 9 minutes.
BENCH = {"bench": 240, "run": 150}
# `hf`: scripts/gpu_check_hf.py's parts (a 0.5B-class model built on the machine).
HF = {"hf-exact": 90, "hf-tune": 240, "hf-bench": 180}
RUN_STEPS = 60  # egg-paper validates every 10 steps: six validations
# What a GPU image without network may lack (the image has numpy, CuPy, PyTorch, pytest,
# click, uvloop and prometheus-client, but not structlog): every small runtime and test
# dependency, pinned by what this machine resolves, so the install needs no resolver.
WHEEL_DEPS = [
    "structlog",
    "pytest-asyncio",
    "click",
    "prometheus-client",
    "threadpoolctl",
    "tokenizers",
    "safetensors",
    "uvloop",
    "hypothesis",
    "sortedcontainers",
    "attrs",
]
WHEELHOUSE_LIMIT = 64 << 20
PACKAGE_FILES = ("pyproject.toml", "README.md", "coordinator", "protocol", "shared", "worker")
SANITIZED_TESTS = "gemm or mm_ or gate or update_noise or apply or overlay or attention or head"
RACE_TESTS = "gemm_tiles or attention or head_fused"  # shared memory between threads


def wheelhouse(out: Path) -> int:
    """The project's wheel and WHEEL_DEPS for CPython 3.12, manylinux x86-64."""
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory() as tmp:  # built from a copy: no build/ left here
        for name in PACKAGE_FILES:
            copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
            copy(ROOT / name, Path(tmp) / name)
        _prebuild_kernels(Path(tmp) / "worker" / "backend" / "prebuilt-kernels")
        subprocess.run([*pip, "wheel", "--no-deps", "-q", "-w", str(out), tmp], check=True)
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    subprocess.run(
        [
            *(*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out)),
            *("--python-version", "3.12", "--implementation", "cp"),
            *[a for p in platforms for a in ("--platform", p)],
            *WHEEL_DEPS,
        ],
        check=True,
    )
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"wheelhouse {out}: {len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    if size > WHEELHOUSE_LIMIT:
        print(f"wheelhouse is over {WHEELHOUSE_LIMIT >> 20} MiB")
        return 1
    return 0


def _prebuild_kernels(folder: Path) -> None:
    """The kernels' cubins, from the sources beside `folder` (the copy the wheel is built
    from), into the wheel's prebuilt-kernels/: a worker on a fresh GPU machine loads them instead of
    compiling. Without NVRTC here, the wheel has none."""
    from eggroll_dist.worker.backend import cubins
    from eggroll_dist.worker.backend.cupy_kernels import SOURCE_FILES
    from eggroll_dist.worker.backend.prebuild import build_kernels

    shutil.rmtree(folder, ignore_errors=True)  # none from the checkout, for another source
    source = "\n".join((folder.parent / name).read_text() for name in SOURCE_FILES)
    t = time.perf_counter()
    try:
        manifest = build_kernels(folder, source=source)
    except cubins.NvrtcMissing as exc:
        print(f"wheelhouse: no prebuilt kernels in the wheel ({exc})")
        return
    archs = ", ".join(json.loads(manifest.read_text())["cubins"])
    print(f"wheelhouse: kernels prebuilt for {archs} in {time.perf_counter() - t:.0f} s")


def preflight() -> int:
    """One line per fact; one line and exit 2 without a usable device."""
    try:
        import cupy
    except ImportError as exc:
        print(f"preflight: no CuPy here ({exc}): this is not a GPU machine")
        return 2
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a driver that sees no device
        print(f"preflight: no CUDA device ({type(exc).__name__}: {exc})")
        return 2
    if count == 0:
        print("preflight: no CUDA device")
        return 2
    import numpy

    from eggroll_dist.worker.backend.cupy_backend import Kernels, cupy_module, describe_device

    free, total = cupy.cuda.runtime.memGetInfo()
    runtime = cupy.cuda.runtime
    print(f"device   {describe_device()}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    print(f"driver   CUDA {runtime.driverGetVersion()}, runtime {runtime.runtimeGetVersion()}")
    nvrtc = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    print(f"nvrtc    {nvrtc}, CuPy {cupy.__version__}, numpy {numpy.__version__}")
    t = time.perf_counter()
    kernels = Kernels(cupy, cupy_module)
    print(f"kernels  {kernels.origin or f'compiled in {time.perf_counter() - t:.1f} s'}")
    return 0


def chunk_check() -> int:
    """Whole chunks at width 256 on the device against the NumPy backend, three steps and
    the held-out scores: the EGG model, and the former with d-eggs' settings."""
    from eggroll_dist.shared.config import (
        ESConfig,
        FitnessConfig,
        ModelConfig,
        RunConfig,
        UpdateConfig,
    )

    egg = RunConfig(
        model=ModelConfig(n_layer=2, d_model=256, vocab_size=256),
        es=ESConfig(population=512, chunk_size=128, seq_len=8),
    )
    former = RunConfig(
        model=ModelConfig(arch="former", n_layer=2, d_model=256, n_head=4, vocab_size=600),
        es=ESConfig(population=512, chunk_size=128, seq_len=16, adaptive_noise=True),
        fitness=FitnessConfig(chunk_mean_filter=True, adaptive_threshold=True),
        update=UpdateConfig(rule="adamw"),
    )
    return max(_chunk_check(name, cfg) for name, cfg in (("egg", egg), ("former", former)))


def _chunk_check(name: str, cfg: Any, device: Any = None) -> int:
    """cfg's chunks, three steps and the held-out scores on `device` (bench_gpu's Device;
    None: the CUDA device) against the NumPy backend; the exit status."""
    import numpy as np

    from eggroll_dist.shared.replica import ReplicaState
    from eggroll_dist.worker.backend.numpy_backend import NumpyBackend

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gpu import cuda_device, synthetic_dataset

    data = synthetic_dataset(cfg.model.vocab_size, 1 << 16)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = (device or cuda_device()).backend(data, ReplicaState.initial(cfg), 256)
    size = cfg.es.chunk_size
    chunks = [(c * size, size) for c in range(cfg.chunks)]
    for step in range(3):
        want = [ref.evaluate_chunk(step, *c) for c in chunks]
        got = gpu.evaluate_chunks(step, chunks)
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if (g.fitness.tobytes(), g.loss_sum) != (w.fitness.tobytes(), w.loss_sum):
                print(f"{name} step {step} chunk {i}: the device's fitness or loss differs")
                return 1
        fitness = np.concatenate([w.fitness for w in want])
        changed = ref.apply_step(fitness)
        if gpu.apply_step(fitness) != changed or gpu.digest() != ref.digest():
            print(f"{name} step {step}: the device's update differs ({changed} weights moved)")
            return 1
        print(f"{name} step {step}: {len(chunks)} chunks and the update equal, {changed} moved")
    if gpu.validate() != ref.validate():
        print(f"{name}: the device's held-out scores differ")
        return 1
    print(f"{name}: held-out scores equal")
    return 0


def _command(module: str) -> list[str]:
    """A console script by its module: with a --target install its scripts are not on PATH."""
    return [sys.executable, "-c", f"from eggroll_dist.{module} import main; main()"]


def mixed_run(log_dir: Path, backends: list[str], steps: int = 200) -> tuple[bool, str]:
    """A coordinator and one worker per backend on loopback; no DIVERGED, all steps done."""
    from eggroll_dist.shared.save_dir import Layout, read_digests
    from eggroll_dist.worker.data.build import prepare_data_dir

    work = log_dir / "mixed"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "of", "and", "int8", "worker", "egg"]
    docs = [" ".join(rng.choice(words) for _ in range(400)).encode() for _ in range(60)]
    prepare_data_dir(docs, work / "data", "gpu-check:words", valid_fraction=0.2)
    (work / "run.toml").write_text(MIXED_CONFIG)
    logs = {name: (work / f"{name}.log").open("w") for name in ["coordinator", *backends]}
    coord = subprocess.Popen(
        [
            *(*_command("coordinator.cli"), "--save-dir", str(work / "run")),
            *("--config", str(work / "run.toml"), "--host", "127.0.0.1", "--port", "0"),
            *("--metrics-port", "0", "--max-steps", str(steps), "--log-format", "json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    port = None
    assert coord.stdout is not None
    for line in coord.stdout:
        logs["coordinator"].write(line)
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "listening":
            port = event["port"]
            break

    def start(i: int, backend: str) -> subprocess.Popen:
        return subprocess.Popen(
            [
                *(*_command("worker.cli"), f"127.0.0.1:{port}", "--data-dir", str(work / "data")),
                *("--backend", backend, "--name", f"{backend}-{i}", "--log-format", "json"),
                *("--max-retry-s", "1"),
            ],
            stdout=logs[backend],
            stderr=subprocess.STDOUT,
        )

    # The first worker (the slower CPU one) joins before the second starts, and the run is
    # long enough that it cannot finish alone before the other arrives.
    workers = [start(0, backends[0])]
    for line in coord.stdout:
        logs["coordinator"].write(line)
        if '"worker joined"' in line and f'"{backends[0]}-0"' in line:
            break
    workers += [start(i, b) for i, b in enumerate(backends) if i > 0]
    for line in coord.stdout:
        logs["coordinator"].write(line)
    coord.wait(timeout=1200)
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
        try:
            w.wait(timeout=30)
        except subprocess.TimeoutExpired:
            w.kill()
    for f in logs.values():
        f.close()
    text = {name: (work / f"{name}.log").read_text() for name in logs}
    with (log_dir / "mixed-processes.log").open("w") as out:
        for name, body in text.items():
            out.write(f"===== {name}\n{body}\n")
    digests = read_digests(Layout(work / "run").digests_log)[0] if port else {}
    diverged = any("DIVERGED" in body or "diverged" in body for body in text.values())
    diverged |= "digests disagree" in text["coordinator"]
    joined = all(f'"worker": "{b}-{i}"' in text["coordinator"] for i, b in enumerate(backends))
    # A digest is agreed once two workers report it, so only steps after the second joined
    # count; how many depends on how fast the first worker is.
    ok = coord.returncode == 0 and not diverged and joined and len(digests) >= MIN_AGREED
    detail = (
        f"{len(digests)} agreed digests, backends {'+'.join(backends)}, "
        f"{'DIVERGED' if diverged else 'no divergence'}, "
        f"{'both joined' if joined else 'a worker never joined'}"
    )
    return ok, detail


def _sanitizer(tool: str) -> list[str]:
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    extra = ["--racecheck-report=all"] if tool == "racecheck" else []
    tests = ["-k", RACE_TESTS if tool == "racecheck" else SANITIZED_TESTS]
    return [
        *(exe, f"--tool={tool}", "--error-exitcode=3", *extra, sys.executable, "-m", "pytest"),
        *("-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS, *tests),
    ]


def part_command(name: str, log_dir: Path, wheels: Path | None) -> list[str]:
    py = [sys.executable]
    if name == "install":
        return [
            *(*py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"),
            *("--upgrade", "--target", str(log_dir / "site")),
            *sorted(str(w) for w in (wheels or Path(".")).glob("*.whl")),
        ]
    if name == "parity":
        return [*py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *PARITY_TESTS]
    if name in ("memcheck", "racecheck", "initcheck", "synccheck"):
        return _sanitizer(name)
    if name == "bench":
        return [*py, str(ROOT / "scripts" / "bench_gpu.py")]
    if name in HF:
        script = str(ROOT / "scripts" / "gpu_check_hf.py")
        return [*py, script, name.removeprefix("hf-"), str(log_dir)]
    if name == "run":
        script = str(ROOT / "scripts" / "bench_run.py")
        return [
            *py,
            script,
            "--preset",
            "egg-paper",
            "--backend",
            "cupy",
            "--steps",
            str(RUN_STEPS),
        ]
    return [*py, __file__, "_part", name, str(log_dir)]


def run_part(name: str, deadline: int, log_dir: Path, wheels: Path | None) -> int:
    """Run one part under its deadline; print its result line at once; its exit status."""
    env = {**os.environ, "EGGROLL_KERNEL_TARGET": "cupy", "PYTHONUNBUFFERED": "1"}
    if wheels is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(log_dir / "site"), env.get("PYTHONPATH", "")])
    if name in ("memcheck", "racecheck", "initcheck", "synccheck"):
        env["EGGROLL_CUPY_POOL"] = "0"  # plain allocations: the tools see every array's end
    log = log_dir / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        cmd = part_command(name, log_dir, wheels)
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:  # its own process group: a deadline ends the part and everything it started
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            out.write(f"{exc}\n")
            proc, rc = None, 127
        if proc is not None:
            try:
                rc = proc.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                rc = 124
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the coordinator and workers of mixed too
            proc.wait()
    lines = [ln for ln in log.read_text().splitlines()[1:] if ln.strip()]  # after the "$ cmd"
    last = "past its deadline" if rc == 124 else (lines[-1] if lines else "")
    if name == "install" and rc == 0:
        last = f"{len(list((wheels or Path('.')).glob('*.whl')))} wheels into {log_dir / 'site'}"
    if name == "preflight" and rc == 0:
        last = lines[0] if lines else ""
    verdict = (
        "ok" if rc == 0 else ("NO GPU" if rc == 2 and name in ("preflight", "hf-exact") else "FAIL")
    )
    print(f"{name:<10} {verdict:<6} {time.perf_counter() - t0:6.1f} s  {last[:110]}", flush=True)
    if name == "preflight" and rc == 0:
        for line in lines[1:]:  # the first is on the result line
            print(f"           {line}", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{wheelhouse,verdict,bench,hf}"
    )
    w = sub.add_parser("wheelhouse", help="here: the wheels to carry to the GPU machine")
    w.add_argument("out", type=Path)
    for name, text in (
        ("verdict", "on the GPU machine: every check"),
        ("bench", "the speed"),
        ("hf", "the Hugging Face path: exactness, eggroll-tune, speed"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("log_dir", type=Path)
        p.add_argument("--wheels", type=Path, help="install these first (wheelhouse's folder)")
        if name == "verdict":
            p.add_argument("--only", nargs="+", choices=list(VERDICT), help="just these parts")
    hidden = sub.add_parser("_part")
    hidden.add_argument("name")
    hidden.add_argument("log_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "wheelhouse":
        return wheelhouse(args.out)
    if args.command == "_part":
        if args.name == "preflight":
            return preflight()
        if args.name == "chunk":
            return chunk_check()
        ok, detail = mixed_run(args.log_dir, ["numpy", "cupy"])
        print(detail)
        return 0 if ok else 1
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.log_dir = args.log_dir.resolve()
    wheels = args.wheels.resolve() if args.wheels else None
    if args.command == "bench":
        parts = {"install": VERDICT["install"], "preflight": VERDICT["preflight"]}
        parts |= BENCH
    elif args.command == "hf":
        parts = {"install": VERDICT["install"], **HF}
    else:
        parts = {k: v for k, v in VERDICT.items() if not args.only or k in args.only}
    if wheels is None:
        parts.pop("install", None)
    failed = []
    for name, deadline in parts.items():
        rc = run_part(name, deadline, args.log_dir, wheels)
        if rc == 2 and name in ("preflight", "hf-exact"):
            print("verdict: no GPU here", flush=True)
            return 2
        if rc:
            failed.append(name)
            if name == "install":
                break  # nothing else can run
    print("verdict:", "ok" if not failed else "FAILED " + " ".join(failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

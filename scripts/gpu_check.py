"""Everything a GPU machine must confirm about the CuPy backend, in one command.

    python scripts/gpu_check.py LOG_DIR [--skip-bench] [--mixed-backends cupy numpy]

1. parity: the kernel and backend parity tests (tests/test_gpu_kernels.py,
   tests/test_cupy_backend.py) against real CuPy (EGGROLL_KERNEL_TARGET=cupy): this is what
   confirms the emulated mma fragment layout and __dp4a against the chip;
2. memcheck, racecheck: the kernel tests under compute-sanitizer;
3. mixed run: a coordinator and two workers on loopback, one CuPy and one NumPy, for a few
   steps of a small config, the second worker started once the first has joined; the
   replica digests of both must agree on at least MIN_AGREED steps, and any DIVERGED or
   disagreeing digest fails the check;
4. bench: scripts/bench_gpu.py.

Each part writes its log to LOG_DIR/<part>.log; one summary table is printed at the end and
the exit status is 1 if any part failed. Needs the `gpu` and `test` extras installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARITY_TESTS = ["tests/test_gpu_kernels.py", "tests/test_cupy_backend.py"]
MIN_AGREED = 5  # steps whose digest both workers reported, at the least
MIXED_CONFIG = """\
preset = "tiny"
[es]
population = 256
chunk_size = 64
seq_len = 16
"""


def run_logged(name: str, cmd: list[str], log_dir: Path, env: dict | None = None, timeout=1800):
    """Run cmd with its output in LOG_DIR/name.log; (ok, seconds, last line)."""
    t0 = time.perf_counter()
    log = log_dir / f"{name}.log"
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            proc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout
            )
            ok = proc.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    return ok, time.perf_counter() - t0, lines[-1] if lines else ""


def parity(log_dir: Path) -> tuple[bool, float, str]:
    env = {**os.environ, "EGGROLL_KERNEL_TARGET": "cupy"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PARITY_TESTS]
    return run_logged("parity", cmd, log_dir, env)


def sanitizer(tool: str, log_dir: Path) -> tuple[bool, float, str]:
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(exe).exists():
        (log_dir / f"{tool}.log").write_text("compute-sanitizer not found\n")
        return False, 0.0, "compute-sanitizer not found (install the CUDA toolkit)"
    env = {**os.environ, "EGGROLL_KERNEL_TARGET": "cupy"}
    cmd = [
        exe,
        f"--tool={tool}",
        "--error-exitcode=3",
        *(["--racecheck-report=all"] if tool == "racecheck" else []),
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        PARITY_TESTS[0],
    ]
    return run_logged(tool, cmd, log_dir, env, timeout=3600)


def _script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def mixed_run(log_dir: Path, backends: list[str], steps: int = 40) -> tuple[bool, float, str]:
    """A coordinator and one worker per backend on loopback; no DIVERGED, all steps done."""
    from eggroll_dist.shared.save_dir import Layout, read_digests
    from eggroll_dist.worker.data.build import prepare_data_dir

    t0 = time.perf_counter()
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
            *(_script("eggroll-coordinator"), "--save-dir", str(work / "run")),
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
                *(_script("eggroll-worker"), f"127.0.0.1:{port}", "--data-dir", str(work / "data")),
                *("--backend", backend, "--name", f"{backend}-{i}", "--log-format", "json"),
                *("--max-retry-s", "1"),
            ],
            stdout=logs[backend],
            stderr=subprocess.STDOUT,
        )

    # The first worker (the GPU's, whose kernels compile first) joins before the second
    # starts, so neither can finish the run alone before the other arrives.
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
    with (log_dir / "mixed.log").open("w") as out:
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
    return ok, time.perf_counter() - t0, detail


def bench(log_dir: Path) -> tuple[bool, float, str]:
    return run_logged("bench", [sys.executable, "scripts/bench_gpu.py"], log_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--mixed-backends", nargs=2, default=["cupy", "numpy"])
    parser.add_argument("--only", nargs="+", help="run only these parts")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    parts = {
        "parity": lambda: parity(args.log_dir),
        "memcheck": lambda: sanitizer("memcheck", args.log_dir),
        "racecheck": lambda: sanitizer("racecheck", args.log_dir),
        "mixed": lambda: mixed_run(args.log_dir, args.mixed_backends),
        "bench": lambda: bench(args.log_dir),
    }
    if args.skip_bench:
        del parts["bench"]
    if args.only:
        parts = {k: v for k, v in parts.items() if k in args.only}
    results = {}
    for name, fn in parts.items():
        print(f"running {name} ...", flush=True)
        results[name] = fn()
    print(f"\n{'part':<10} {'result':<6} {'seconds':>8}  detail (logs in {args.log_dir})")
    for name, (ok, seconds, detail) in results.items():
        print(f"{name:<10} {'ok' if ok else 'FAIL':<6} {seconds:8.1f}  {detail[:110]}")
    return 0 if all(ok for ok, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

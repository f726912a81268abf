"""Benchmark a whole run end to end: a coordinator and one worker on loopback, training a
preset on the built-in corpus at its own validation cadence.

Prints, from the processes' own JSON logs:
  end to end      member-tokens/s of the committed steps after the first (the update, the
                  protocol, the held-out scores and every wait included), and steps/s
  first step      seconds from the worker's start to the first committed step (kernel
                  compiles or cache loads, data, the first chunk: a fresh machine's wait)
  validation      the share of the run's wall time (first to last step) the worker spent
                  scoring held-out text, from its "validation" lines
and, measured in the same run as the reference, the backend's evaluation alone: all chunks of
a step through `evaluate_chunks` in-process (no coordinator, no update, no validation), as
scripts/bench_gpu.py (CuPy) and scripts/bench_eval.py (NumPy) measure it. The ratio of the
two is how much of the kernels' speed a real run keeps.

    python scripts/bench_run.py [--preset tiny] [--steps 40] [--backend auto|numpy|cupy]
        [--population N] [--validate-every N] [--threads N] [--keep DIR]

The worker is started after the coordinator listens; a worker on CuPy compiles (or loads)
its kernels inside the timed first step, as on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _command(module: str) -> list[str]:
    return [sys.executable, "-c", f"from eggroll_dist.{module} import main; main()"]


def _events(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def _when(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def write_config(path: Path, args: argparse.Namespace) -> None:
    lines = [f'preset = "{args.preset}"']
    if args.population:
        lines += ["[es]", f"population = {args.population}"]
    if args.validate_every is not None:
        lines += ["[validation]", f"every_steps = {args.validate_every}"]
    path.write_text("\n".join(lines) + "\n")


def prepare(work: Path) -> Path:
    """The built-in corpus, prepared as `eggroll-data prepare --builtin` does."""
    data = work / "data"
    subprocess.run(
        [*_command("worker.data.cli"), "prepare", "--builtin", "--out", str(data)],
        check=True,
        capture_output=True,
    )
    return data


def run(work: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Train args.steps steps with a coordinator and one worker; the times from their logs."""
    coord_log, worker_log = work / "coordinator.log", work / "worker.log"
    with coord_log.open("w") as out:
        coord = subprocess.Popen(
            [
                *(*_command("coordinator.cli"), "--save-dir", str(work / "run")),
                *("--config", str(work / "run.toml"), "--host", "127.0.0.1", "--port", "0"),
                *("--metrics-port", "0", "--max-steps", str(args.steps)),
                *("--log-format", "json"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        port = _wait_port(coord_log, coord)
        threads = ["--threads", str(args.threads)] if args.threads else []
        with worker_log.open("w") as wout:
            started = time.time()
            worker = subprocess.Popen(
                [
                    *(*_command("worker.cli"), f"127.0.0.1:{port}", "--data-dir", str(data)),
                    *("--backend", args.backend, "--name", "bench", "--log-format", "json"),
                    *threads,
                ],
                stdout=wout,
                stderr=subprocess.STDOUT,
            )
            try:
                coord.wait(timeout=args.timeout)
            finally:
                for proc in (worker, coord):
                    if proc.poll() is None:
                        proc.terminate()
                    proc.wait(timeout=60)
    if coord.returncode != 0:
        raise SystemExit(f"the coordinator exited {coord.returncode}: see {coord_log}")
    return summarise(list(_events(coord_log)), list(_events(worker_log)), started)


def _wait_port(log: Path, proc: subprocess.Popen) -> int:
    deadline = time.time() + 120
    while time.time() < deadline:
        for event in _events(log):
            if event.get("event") == "listening":
                return int(event["port"])
        if proc.poll() is not None:
            raise SystemExit(f"the coordinator exited {proc.returncode}: see {log}")
        time.sleep(0.1)
    raise SystemExit("the coordinator did not listen within 120 s")


def summarise(coord: list[dict], worker: list[dict], started: float) -> dict[str, Any]:
    """End-to-end rate, time to the first step and validation's share, from the logs."""
    steps = [e for e in coord if e.get("event") == "step"]
    if len(steps) < 2:
        raise SystemExit(f"only {len(steps)} steps were committed: too few to time")
    first, last = _when(steps[0]), _when(steps[-1])
    wall = last - first
    tokens = sum(int(e["member_tokens"]) for e in steps[1:])
    validations = [e for e in worker if e.get("event") == "validation" and first < _when(e) <= last]
    valid_s = sum(float(e.get("seconds", 0.0)) for e in validations)
    return {
        "steps": len(steps),
        "member_tokens_per_s": tokens / wall,
        "steps_per_s": (len(steps) - 1) / wall,
        "first_step_s": first - started,
        "validations": len(validations),
        "validation_share": valid_s / wall,
        "wall_s": wall,
    }


def reference(args: argparse.Namespace, data: Path) -> float:
    """Member-tokens/s of the backend's evaluation alone: every chunk of a step, best of 2."""
    from eggroll_dist.shared.config import load_config
    from eggroll_dist.shared.data import load_data_dir
    from eggroll_dist.shared.replica import ReplicaState
    from eggroll_dist.worker.backend import get_backend

    cfg = load_config(Path(args.work) / "run.toml")
    factory = get_backend(args.backend, threads=args.threads or None)
    backend = factory.build(load_data_dir(data), ReplicaState.initial(cfg))
    size = cfg.es.chunk_size
    chunks = [(c * size, size) for c in range(cfg.es.population // size)]
    backend.evaluate_chunks(0, chunks)  # warm-up: compiles, allocations
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        backend.evaluate_chunks(0, chunks)
        best = min(best, time.perf_counter() - t)
    return len(chunks) * size * cfg.es.seq_len / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--backend", default="auto", choices=["auto", "numpy", "cupy"])
    parser.add_argument("--population", type=int, default=0, help="0: the preset's")
    parser.add_argument("--validate-every", type=int, help="default: the preset's")
    parser.add_argument("--threads", type=int, default=0, help="the worker's CPU threads")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the run")
    parser.add_argument("--keep", type=Path, help="keep the run's folder and logs here")
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-run-"))
    work.mkdir(parents=True, exist_ok=True)
    args.work = work
    try:
        write_config(work / "run.toml", args)
        data = prepare(work)
        r = run(work, data, args)
        ref = reference(args, data)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"preset {args.preset}, backend {args.backend}, {r['steps']} steps")
    print(
        f"end to end: {r['member_tokens_per_s']:,.0f} member-tokens/s, "
        f"{r['steps_per_s']:.2f} steps/s over {r['wall_s']:.1f} s"
    )
    print(f"evaluation alone (same backend, same run): {ref:,.0f} member-tokens/s")
    print(f"end to end / evaluation alone: {r['member_tokens_per_s'] / ref:.2f}")
    print(f"first step: {r['first_step_s']:.1f} s after the worker started")
    print(
        f"validation: {r['validations']} runs, {100 * r['validation_share']:.1f}% of the "
        "run's wall time"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

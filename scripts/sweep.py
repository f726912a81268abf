"""A one-factor sweep of the trainer at equal wall time (or equal steps), in one process.

Each variant is the base preset with a few settings changed; it trains with the NumPy
backend until the budget is spent and is then scored on the held-out split. The table
printed at the end is the one scripts/RESULTS.md keeps, so the presets' choices can be re-checked:

    python scripts/sweep.py --data-dir data --seconds 300
    python scripts/sweep.py --data-dir data --steps 300 --variant momentum:update.rule=momentum

Variants are `name:section.key=value,section.key=value` (values parsed as TOML).
Screens should be long enough that seed-to-seed noise (about 0.01 bits at 300 steps of
`tiny`) is smaller than the differences read from them.
"""

from __future__ import annotations

import argparse
import time
import tomllib
from pathlib import Path

from eggroll_dist.shared.config import RunConfig, ValidationConfig, from_dict, preset
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend import get_backend
from eggroll_dist.worker.train import train

DEFAULT_VARIANTS = [
    "uniform-s4:es.noise='uniform',es.sigma_shift=4",
    "gaussian-s3:es.noise='gaussian',es.sigma_shift=3",
    "gaussian-s3-momentum2:es.noise='gaussian',es.sigma_shift=3,"
    "update.rule='momentum',update.momentum_shift=2",
    "gaussian-s3-momentum3:es.noise='gaussian',es.sigma_shift=3,"
    "update.rule='momentum',update.momentum_shift=3",
]


def variant(base: RunConfig, spec: str) -> tuple[str, RunConfig]:
    name, _, settings = spec.partition(":")
    tables: dict[str, dict] = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        section, _, field = key.strip().partition(".")
        tables.setdefault(section, {})[field] = tomllib.loads(f"v = {value}")["v"]
    return name, from_dict(tables, base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, default=Path("data"))
    ap.add_argument("--base", default="tiny", help="preset the variants change")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float, help="wall time per variant")
    budget.add_argument("--steps", type=int, help="steps per variant")
    ap.add_argument("--variant", action="append", help="name:section.key=value,...")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    dataset = load_data_dir(args.data_dir)
    base = preset(args.base)
    factory = get_backend("numpy", threads=args.threads)
    rows = []
    for spec in args.variant or DEFAULT_VARIANTS:
        name, cfg = variant(base, spec)
        cfg = cfg.replace(validation=ValidationConfig(every_steps=0, max_tokens=32768))
        steps = args.steps or 10**9
        backend = factory.build(dataset, ReplicaState.initial(cfg))
        cpu0 = time.process_time()
        result = train(cfg, backend, steps, max_seconds=args.seconds)
        final = result.curve[-1]
        rows.append(
            (
                name,
                result.state.step,
                final["bits_per_token"],
                final.get("stream_bits_per_token"),
                result.train_seconds,
                time.process_time() - cpu0,
            )
        )
        print(f"# {name}: {rows[-1]}", flush=True)
    print(
        f"\nbase preset {args.base}; budget: {args.seconds or args.steps} "
        f"{'s' if args.seconds else 'steps'}; bigram {dataset.meta.baselines['bigram']:.3f}"
    )
    print("| variant | steps | held-out bits/token | stream bits/token | train s | CPU s |")
    print("|---|---|---|---|---|---|")
    for name, steps, bits, stream, secs, cpu in rows:
        stream_text = f"{stream:.3f}" if stream is not None else "-"
        print(f"| {name} | {steps} | {bits:.3f} | {stream_text} | {secs:.0f} | {cpu:.0f} |")


if __name__ == "__main__":
    main()

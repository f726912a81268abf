"""The update's cost as the population grows: population is the axis to scale with workers.

For the `tiny` preset at 1x, 4x and 16x its population (chunk size unchanged, so the
chunk count grows with it), prints per step: the time to evaluate the whole population on
this machine, the time of the update every replica applies (ztest and momentum), and the
update's share of the step. Evaluation is spread over the workers; the update is not (every
replica applies it), so the update's share of one worker's step is update / (eval / workers
+ update), shown for as many workers as chunks allow at 4 chunks each.

    python scripts/bench_update.py [--data-dir data] [--scales 1,4,16]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from eggroll_dist.shared.config import UpdateConfig, preset
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend import get_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, default=Path("data"))
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    dataset = load_data_dir(args.data_dir)
    factory = get_backend("numpy", threads=args.threads)
    base = preset("tiny")
    print(
        "| population | chunks | eval s/step | rule | update s/step | update/eval "
        "| workers (4 chunks each) | update share of a worker's step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for scale in (int(s) for s in args.scales.split(",")):
        es = base.es
        pop_cfg = base.replace(es=dataclasses.replace(es, population=es.population * scale))
        backend = factory.build(dataset, ReplicaState.initial(pop_cfg))
        t = time.perf_counter()
        fitness = np.concatenate(
            [
                backend.evaluate_chunk(0, c * es.chunk_size, es.chunk_size).fitness
                for c in range(pop_cfg.chunks)
            ]
        )
        eval_s = time.perf_counter() - t
        for rule in ("ztest", "momentum"):
            cfg = pop_cfg.replace(update=UpdateConfig(rule=rule))
            backend.load_state(ReplicaState.initial(cfg))
            t = time.perf_counter()
            backend.apply_step(fitness)
            update_s = time.perf_counter() - t
            workers = max(1, pop_cfg.chunks // 4)
            share = update_s / (eval_s / workers + update_s)
            print(
                f"| {cfg.es.population} | {cfg.chunks} | {eval_s:.2f} | {rule} | "
                f"{update_s:.3f} | {update_s / eval_s:.1%} | {workers} | {share:.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

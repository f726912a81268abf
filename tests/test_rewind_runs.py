"""Rewinds with real processes: a liar commits made-up fitness while few chunks are checked;
the run's final stretch (--rewind-steps before --max-steps) checks every chunk, catches it,
and the run goes back and ends at the honest replica digest."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import Proc
from helpers import TINY_RUN, digest_at, start_coordinator, start_worker, trained_digest

STEPS = 24
HORIZON = 12  # steps 12.. are checked in full, and a rewind from there reaches step 0

# A worker whose fitness is made up: "every" chunk flipped, "half" (the chunks of even
# index) flipped, or "lazy": the first chunk's result reused for every chunk, computing
# nothing. It paces itself, so that it holds chunks of every step.
LIAR = """
import sys, time
import numpy as np
from eggroll_dist.worker.backend import ChunkResult, numpy_backend
from eggroll_dist.worker.cli import main
real = numpy_backend.NumpyBackend.evaluate_chunks
kind, cached = sys.argv.pop(1), []
def lie(self, step, chunks):
    time.sleep(0.3)
    if kind == "lazy":
        cached[:] = cached or real(self, step, chunks[:1])
        return [cached[0] for _ in chunks]
    flip = lambda r: ChunkResult(np.where(r.fitness == 1, -1, 1).astype(np.int8), r.loss_sum)
    out = real(self, step, chunks)
    lies = [kind == "every" or first // 8 % 2 == 0 for first, _ in chunks]  # 8 a chunk
    return [flip(r) if lie else r for r, lie in zip(out, lies)]
numpy_backend.NumpyBackend.evaluate_chunks = lie
sys.exit(main())
"""


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rewind") / "run.toml"
    path.write_text(TINY_RUN)
    return path


@pytest.mark.parametrize("kind", ["every", "half", "lazy"])
def test_a_liar_caught_late_leaves_no_lie_in_the_log(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, kind: str
) -> None:
    save = tmp_path / "run"
    coord, port = start_coordinator(
        spawn,
        save,
        config_file,
        *("--max-steps", str(STEPS), "--rewind-steps", str(HORIZON)),
        *("--verify-fraction", "0.01"),
    )
    flags = ("--data-dir", str(words_data), "--name", "liar", "--log-format", "json")
    liar = Proc([sys.executable, "-c", LIAR, kind, f"127.0.0.1:{port}", *flags], "liar")
    try:
        coord.wait_for(lambda e: e.get("event") == "step" and e["step"] >= 1, 60, "lies")
        started = time.monotonic()
        for i in range(2):
            start_worker(spawn, port, words_data, f"honest{i}")
        rewound = coord.wait_for(lambda e: e.get("event") == "run rewound", 60, "rewind")
        assert rewound["from_step"] == 0 and rewound["chunks_suspect"] >= 1
        assert coord.wait(180) == 0
        seconds = time.monotonic() - started
    finally:
        liar.stop()
        coord.stop()
    run = json.loads((save / "run.json").read_text())
    print(f"{kind}: rewinds {run['rewinds']}, {seconds:.1f} s from the honest workers' start")
    assert (save / "rewound" / run["rewinds"][0]["tail"]).exists()
    assert digest_at(save, STEPS) == trained_digest(words_data, config_file, STEPS)

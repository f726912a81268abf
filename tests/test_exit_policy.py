"""One exit-status policy for the three supervisors: the table of `exit_policy` itself, and
eggroll-local acting on it with real processes (a worker that computes differently ends
alone; one that refuses the run stops it; with no worker left the coordinator is stopped).
eggroll-ray's use of it is in test_ray.py, run-workers.sh's in test_run_workers.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_RUN, command, running

from eggroll_dist.worker.exits import (
    FAILED,
    FAULTY,
    KILLED,
    LOST,
    LOST_KIND,
    STOPPED,
    Tally,
    exit_policy,
)
from eggroll_dist.worker.session_types import COMPUTES_DIFFERENTLY

KILL, TERM = signal.SIGKILL, signal.SIGTERM


@pytest.mark.parametrize(
    ("status", "asked", "kind", "stop_all", "code"),
    [
        (0, False, STOPPED, False, 0),  # the run is complete, or a clean stop
        (2, False, FAILED, True, 2),  # a bad flag, a config or data the run refuses
        (1, False, FAILED, True, 1),  # bad data
        (70, False, FAILED, True, 70),  # any other
        (COMPUTES_DIFFERENTLY, False, FAULTY, False, 3),  # outvoted: maybe its device alone
        (-KILL, False, KILLED, False, 128 + KILL),  # the OOM killer
        (128 + KILL, False, KILLED, False, 128 + KILL),  # the same, as a shell reports it
        (-TERM, False, KILLED, False, 128 + TERM),  # a SIGTERM not ours
        (LOST, False, LOST_KIND, False, 1),  # its Ray actor or node
        # Once a stop is asked: our SIGTERM is a clean stop, and nothing stops anything.
        (-TERM, True, STOPPED, False, 0),
        (128 + TERM, True, STOPPED, False, 0),
        (-KILL, True, KILLED, False, 128 + KILL),  # killed after the stop timeout
        (2, True, FAILED, False, 2),
        (3, True, FAULTY, False, 3),
    ],
)
def test_the_exit_policy_table(
    status: int | None, asked: bool, kind: str, stop_all: bool, code: int
) -> None:
    verdict = exit_policy(status, asked)
    assert (verdict.kind, verdict.stop_all, verdict.code) == (kind, stop_all, code)


def test_the_supervisor_status_is_the_cause_else_the_first_failure() -> None:
    def status(*ends: tuple[int | None, bool]) -> int:
        tally = Tally()
        for end in ends:
            tally.add(exit_policy(*end))
        return tally.status

    assert status((0, False), (-TERM, True)) == 0
    assert status((3, False), (0, False)) == 3  # the run completed without the faulty one
    assert status((LOST, False), (2, False), (1, True)) == 2  # 2 stopped the others
    assert status((-KILL, False), (3, False)) == 128 + KILL


# eggroll-local whose workers run the executable given first instead of eggroll-worker.
LOCAL = """
import sys
from eggroll_dist.worker import local
fake, real = sys.argv.pop(1), local._exe
local._exe = lambda name: fake if name == "eggroll-worker" else real(name)
local.main()
"""

# The worker named local-{faulty} ends at once with {status} (as one that computes
# differently from the run, 3, or refuses it, 2, would end); the others are real workers.
FAKE_WORKER = """#!/usr/bin/env bash
echo $$ >> {pids}
for arg; do
    if [[ $arg == local-{faulty} ]]; then exit {status}; fi
done
exec {worker} "$@"
"""


def _local(
    tmp_path: Path, data: Path, status: int, workers: int, steps: int
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """eggroll-local run to its end, its last worker ending at once with `status`: the
    run, and the pids of its workers."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_RUN)
    fake = tmp_path / "fake-worker"
    pids = tmp_path / "pids"
    worker = command("eggroll-worker")
    fake.write_text(FAKE_WORKER.format(pids=pids, faulty=workers - 1, status=status, worker=worker))
    fake.chmod(0o755)
    done = subprocess.run(
        [
            *(sys.executable, "-c", LOCAL, str(fake), "--config", str(config)),
            *("--workers", str(workers), "--steps", str(steps), "--metrics-port", "0"),
            *("--save-dir", str(tmp_path / "run"), "--data-dir", str(data)),
            *("--snapshot-every", "0", "--sample-every", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    return done, [int(p) for p in pids.read_text().split()]


def test_a_worker_that_computes_differently_ends_alone(words_data: Path, tmp_path: Path) -> None:
    """local-1 exits with 3: local-0 trains the run to its end, and eggroll-local's status is
    3 (the run is complete, but one worker computes differently)."""
    done, _ = _local(tmp_path, words_data, COMPUTES_DIFFERENTLY, workers=2, steps=3)
    assert done.returncode == 3, done.stdout
    assert "worker 1 exited with code 3: it computes differently from the run" in done.stdout
    assert "the others go on" in done.stdout
    assert "done: 3 steps" in done.stdout, done.stdout


def test_a_worker_that_refuses_the_run_stops_it(words_data: Path, tmp_path: Path) -> None:
    """local-1 exits with 2, as every worker would: the run stops with that status."""
    done, pids = _local(tmp_path, words_data, 2, workers=2, steps=1_000_000)
    assert done.returncode == 2, done.stdout
    assert "Error: worker 1 exited with code 2; see " in done.stdout
    assert not [pid for pid in pids if running(pid)]


def test_with_no_worker_left_the_coordinator_is_stopped(words_data: Path, tmp_path: Path) -> None:
    """The only worker computes differently: nobody is left to train, so eggroll-local stops
    the coordinator and ends with 3 instead of waiting for ever."""
    done, _ = _local(tmp_path, words_data, COMPUTES_DIFFERENTLY, workers=1, steps=1_000_000)
    assert done.returncode == 3, done.stdout
    assert "no worker left: stopping the coordinator" in done.stdout
    assert "Traceback" not in done.stdout
    assert "stopped before the first step was committed" in done.stdout, done.stdout

"""eggroll-local leaves no process behind: not on a Ctrl-C that lands just as a child is
made, nor when it is killed by SIGKILL (on Linux its children then get SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_RUN, command, running

from eggroll_dist.worker.local import _dies_with

# eggroll-local with a Ctrl-C that lands just as its first child whose command ends with
# the second argument is made (between Popen and what follows it); every child's pid goes
# to the file named first. Without PR_SET_PDEATHSIG, as elsewhere than on Linux: cleanup
# alone must stop every child.
INTERRUPTED = """
import signal
import subprocess
import sys
from eggroll_dist.worker import local
pids, target = sys.argv.pop(1), sys.argv.pop(1)
local._dies_with = lambda parent: None

class Popen(subprocess.Popen):
    fired = False

    def __init__(self, args, *rest, **options):
        super().__init__(args, *rest, **options)
        with open(pids, "a") as out:
            out.write(f"{self.pid}\\n")
        if args[0].endswith(target) and not Popen.fired:
            Popen.fired = True
            signal.raise_signal(signal.SIGINT)

subprocess.Popen = Popen
local.main()
"""


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _kill_all(pids: list[int]) -> None:
    """Only after a failed test: leave nothing running."""
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def _local_flags(tmp_path: Path, data: Path) -> list[str]:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_RUN)
    return [
        *("--config", str(config), "--steps", "1000000000", "--metrics-port", "0"),
        *("--save-dir", str(tmp_path / "run"), "--data-dir", str(data)),
        *("--snapshot-every", "0", "--sample-every", "0"),
    ]


@pytest.mark.parametrize("target", ["eggroll-coordinator", "eggroll-worker"])
def test_ctrl_c_as_a_child_is_made_stops_it_too(
    words_data: Path, tmp_path: Path, target: str
) -> None:
    pids = tmp_path / "pids"
    # Output to a file: a child left behind would hold a pipe open for ever.
    with open(tmp_path / "out", "w") as out:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                INTERRUPTED,
                str(pids),
                target,
                *_local_flags(tmp_path, words_data),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
    started = [int(p) for p in pids.read_text().split()]
    left = [pid for pid in started if running(pid)]
    _kill_all(left)
    text = (tmp_path / "out").read_text()
    assert proc.returncode == 130, text
    assert len(started) == (1 if target == "eggroll-coordinator" else 2), text
    assert not left, text
    assert text.splitlines()[-1].startswith("stopped "), text  # what is kept


def test_children_of_a_killed_eggroll_local_stop(words_data: Path, tmp_path: Path) -> None:
    """SIGKILL leaves eggroll-local no chance to stop its children: they get SIGTERM from
    the kernel (PR_SET_PDEATHSIG) and stop by themselves."""
    out_path = tmp_path / "out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [command("eggroll-local"), *_local_flags(tmp_path, words_data)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "\nstep " not in out_path.read_text() or len(_children(proc.pid)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)
        children = _children(proc.pid)  # the coordinator and both workers, training
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 60
        while any(running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if running(pid)], out_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _kill_all(children)


def test_a_child_whose_parent_died_before_prctl_ends() -> None:
    """A child made for a parent that is no longer its parent when it asks for the signal
    (the parent died between fork and prctl) ends before running anything."""
    preexec = _dies_with(-1)  # no process's pid: its parent is never that one
    if preexec is None:
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=preexec
    )
    assert child.wait(30) == 128 + signal.SIGTERM

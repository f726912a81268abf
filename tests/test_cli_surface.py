"""What every command shares: --version, help text for every option and an EGGROLL_*
variable for it named in --help, and eggroll-local's explicit --steps (a total) versus
--more (beyond the run's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from eggroll_dist.coordinator.cli import main as coordinator_main
from eggroll_dist.coordinator.inspect import main as inspect_main
from eggroll_dist.shared.config import preset
from eggroll_dist.shared.fitness_log import FitnessLog, packed_size
from eggroll_dist.worker.cli import main as worker_main
from eggroll_dist.worker.data.cli import main as data_main
from eggroll_dist.worker.export import main as export_main
from eggroll_dist.worker.local import main as local_main
from eggroll_dist.worker.ray_launch import main as ray_main
from eggroll_dist.worker.sample import main as sample_main
from eggroll_dist.worker.train import main as train_main
from eggroll_dist.worker.tune import main as tune_main

COMMANDS = {
    "eggroll-worker": worker_main,
    "eggroll-coordinator": coordinator_main,
    "eggroll-train": train_main,
    "eggroll-local": local_main,
    "eggroll-inspect": inspect_main,
    "eggroll-sample": sample_main,
    "eggroll-export": export_main,
    "eggroll-tune": tune_main,
    "eggroll-ray": ray_main,
    "eggroll-data prepare": data_main.commands["prepare"],
    "eggroll-data info": data_main.commands["info"],
}


def _exe(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


@pytest.mark.parametrize("name", sorted({n.split()[0] for n in COMMANDS}))
def test_every_command_has_version(name: str) -> None:
    done = subprocess.run([_exe(name), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{name} ") and done.stdout.split()[1][0].isdigit()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_and_a_variable_named_in_it(name: str) -> None:
    command = COMMANDS[name]
    ctx = click.Context(command, info_name=name)
    text = " ".join(command.get_help(ctx).split())
    for param in command.params:
        if isinstance(param, click.Option) and param.expose_value:
            assert param.help, f"{name} {param.opts[0]} has no help text"
            assert isinstance(param.envvar, str) and param.envvar.startswith("EGGROLL_")
            assert f"env var: {param.envvar}" in text


def test_a_variable_sets_the_option(words_data: Path, tmp_path: Path) -> None:
    # A bad EGGROLL_THREADS is refused as the flag would be.
    env = {**os.environ, "EGGROLL_THREADS": "0"}
    done = subprocess.run(
        [_exe("eggroll-train"), "--data-dir", str(words_data)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "EGGROLL_THREADS" not in done.stdout
    assert "--threads" in done.stderr and "0 is not in the range x>=1" in done.stderr


def _finished_run(save_dir: Path, steps: int) -> None:
    cfg = preset("tiny")
    save_dir.mkdir()
    log = FitnessLog.create(save_dir / "fitness.log", cfg.pairs, cfg.digest())
    for step in range(steps):
        log.append(step, bytes(packed_size(cfg.pairs)))


def test_local_on_a_finished_run_says_so(words_data: Path, tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    _finished_run(save_dir, 3)
    done = subprocess.run(
        [
            *(_exe("eggroll-local"), "--steps", "3", "--save-dir", str(save_dir)),
            *("--data-dir", str(words_data), "--metrics-port", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "already has 3 steps" in done.stdout and "--more N" in done.stdout
    assert not (save_dir / "logs").exists()  # nothing was started


def test_local_steps_and_more_exclude_each_other(tmp_path: Path) -> None:
    done = subprocess.run(
        [_exe("eggroll-local"), "--steps", "3", "--more", "2", "--save-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "not both" in done.stderr

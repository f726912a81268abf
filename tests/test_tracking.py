"""Experiment tracking (shared/tracking.py): TensorBoard event files and a W&B run hold every
quantity at every step, read back with each one's own reader, and a resumed run continues
its curves without writing a step twice. Without the `track` extra the flags fail at once.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner
from helpers import TINY_RUN, TRAIN_RUN, command, start_coordinator, start_worker

from eggroll_dist.coordinator.cli import main as coordinator_main
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.save_dir import read_history
from eggroll_dist.shared.tracking import (
    INSTALL,
    SAMPLE_TAG,
    STEP_TAGS,
    VALID_TAGS,
    Tracker,
    baseline_tags,
)
from eggroll_dist.worker.local import main as local_main
from eggroll_dist.worker.train import main as train_main

# Validation and a sample every 2 steps, steps in milliseconds.
TRACKED_RUN = TINY_RUN.replace("every_steps = 0", "every_steps = 2")


def needs_track_extra() -> None:
    for module in ("tensorboardX", "tensorboard", "wandb"):
        pytest.importorskip(module, reason="the track extra is not installed")


def accumulator(logdir: Path) -> Any:
    """TensorBoard's own reader of the event files in `logdir`, every event kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def tensorboard_steps(logdir: Path) -> dict[str, list[int]]:
    """Every tag of the event files in `logdir` and the steps it holds, in file order, read
    with TensorBoard's own reader (which drops what a purge_step purges)."""
    acc = accumulator(logdir)
    tags = acc.Tags()
    found = {tag: [e.step for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    assert "custom_scalars__config__" in tags["tensors"]  # the charts over the baselines
    for tag in tags["tensors"]:
        if tag.endswith("/text_summary"):  # add_text's tag
            found[tag.removesuffix("/text_summary")] = [e.step for e in acc.Tensors(tag)]
    return found


def expected(steps: range, every: int, baselines: dict[str, float]) -> dict[str, list[int]]:
    """What each tag holds after `steps` with validation and a sample every `every` steps."""
    held_out = [s for s in steps if s % every == 0]
    reward = ("train/reward", "valid/reward")  # only a reward run has them
    return {
        **{tag: list(steps) for tag in STEP_TAGS.values() if tag not in reward},
        **{
            tag: held_out
            for tag in [*VALID_TAGS.values(), *baselines, SAMPLE_TAG]
            if tag not in reward
        },
    }


def test_the_coordinator_writes_every_quantity_once_across_a_restart(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path
) -> None:
    needs_track_extra()
    config, save_dir, logdir = tmp_path / "tiny.toml", tmp_path / "run", tmp_path / "tb"
    config.write_text(TRACKED_RUN)
    flags = ("--data-dir", words_data, "--tensorboard", logdir, "--sample-every", "2")
    for steps in (4, 6):  # run, stop at 4, continue the same run to 6
        coord, port = start_coordinator(spawn, save_dir, config, *flags, "--max-steps", str(steps))
        start_worker(spawn, port, words_data)
        assert coord.wait(60) == 0
    meta = load_data_dir(words_data).meta
    baselines = baseline_tags(meta.baselines, meta.baselines_per_byte)
    assert len(baselines) == 6
    assert tensorboard_steps(logdir) == expected(range(1, 7), 2, baselines)
    # The values are the coordinator's: its history.log holds the same records.
    acc = accumulator(logdir)
    records = read_history(save_dir / "history.log")
    losses = [r["loss_bits"] for r in records if r["event"] == "step"]
    assert [e.value for e in acc.Scalars("train/loss_bits_per_token")] == pytest.approx(losses)
    workers = [e.value for e in acc.Scalars("run/workers")]
    assert workers == [1.0] * 6
    gzip = [e.value for e in acc.Scalars("baseline/gzip9_bits_per_token")]
    assert gzip == pytest.approx([meta.baselines["gzip9"]] * 3)


def wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb file (W&B's transaction log: a 7-byte header, then LevelDB's
    log format: 32 KiB blocks of records, each with a 7-byte head: CRC, length, type)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a head is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            out.append(pending)
            pending = b""
    return out


def wandb_history(wandb_dir: Path) -> list[tuple[int, set[str]]]:
    """(step, keys) of every history row of the offline runs under `wandb_dir`, oldest run
    first, parsed with W&B's own record schema."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for run in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        (log,) = run.glob("*.wandb")
        for payload in wandb_records(log):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                keys = {item.key or "/".join(item.nested_key) for item in record.history.item}
                rows.append((record.history.step.num, keys))
    return rows


def test_train_logs_the_same_keys_to_wandb_offline_and_tensorboard(
    words_data: Path, tmp_path: Path
) -> None:
    needs_track_extra()
    config, save_dir, logdir = tmp_path / "train.toml", tmp_path / "run", tmp_path / "tb"
    config.write_text(TRAIN_RUN)  # validation every 3 steps and at the end
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        **{f"WANDB_{v}_DIR": str(tmp_path / v.lower()) for v in ("CONFIG", "CACHE", "DATA")},
        "WANDB_DIR": str(tmp_path),
    }
    # 4 steps, 6 in all, then once more with nothing to train: its final held-out score is
    # of step 6 again, and must not be written twice.
    for steps in (4, 6, 6):
        done = subprocess.run(
            [
                *(command("eggroll-train"), "--data-dir", str(words_data), "--config", str(config)),
                *("--steps", str(steps), "--save-dir", str(save_dir), "--sample-every", "2"),
                *("--tensorboard", str(logdir), "--wandb-project", "eggroll-test"),
                *("--log-format", "json"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0, done.stderr
    meta = load_data_dir(words_data).meta
    baselines = baseline_tags(meta.baselines, meta.baselines_per_byte)
    want = expected(range(1, 7), 2, baselines)
    for tag in [*VALID_TAGS.values(), *baselines]:  # every 3 steps, and each session's end
        if tag != "valid/reward":  # a reward run's
            want[tag] = [3, 4, 6]
    assert tensorboard_steps(logdir) == want
    rows = wandb_history(tmp_path)
    assert [step for step, _ in rows] == [1, 2, 3, 4, 5, 6]  # two runs, one curve
    logged: dict[str, list[int]] = {}
    for step, keys in rows:
        # A table is logged as fields under its key ("sample/_type", ...); W&B's own keys
        # (_step, _runtime, _timestamp) start with "_".
        for key in {k.split("/")[0] if k.startswith(f"{SAMPLE_TAG}/") else k for k in keys}:
            if not key.startswith("_"):
                logged.setdefault(key, []).append(step)
    assert logged == want
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    run_id = json.loads((save_dir / "run.json").read_text())["run_id"]
    assert len(runs) == 3 and all(r.name.endswith(run_id) for r in runs)


class Sink:
    name = "memory"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.written: list[tuple[int, dict[str, float]]] = []
        self.samples: list[int] = []

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.written.append((step, values))

    def sample(self, step: int, prompt: str, text: str) -> None:
        self.samples.append(step)

    def close(self) -> None:
        pass


def test_a_tracker_drops_the_steps_an_earlier_session_wrote_and_survives_a_sink() -> None:
    good, bad = Sink(), Sink(fail=True)
    tracker = Tracker([bad, good], start_step=4, baselines={"baseline/unigram_bits_per_token": 5})
    step = {"event": "step", "loss_bits": 7.5, "step_s": 0.5, "member_tok_s": 10, "workers": 2}
    held_out = {"event": "validation", "valid_bits": 6.5, "stream_bits": None}
    with structlog.testing.capture_logs() as logs:
        for s in (3, 4, 5):
            tracker.record({**step, "step": s, "requeued": 0, "changed": 9})
        tracker.record({**held_out, "step": 4})
        tracker.record({**held_out, "step": 6})
        tracker.record({"event": "sample", "step": 6, "prompt": "a", "text": "b"})
        tracker.close()
    assert [e["event"] for e in logs] == ["tracking failed"]  # once, and the run goes on
    assert good.written == [
        # every step tag but a reward run's train/reward (the last)
        (5, dict(zip(list(STEP_TAGS.values())[:-1], (7.5, 0.5, 10, 2, 0, 9), strict=True))),
        (6, {"valid/bits_per_token": 6.5, "baseline/unigram_bits_per_token": 5}),
    ]
    assert good.samples == [6]


@pytest.mark.parametrize("flag", ["--tensorboard", "--wandb-project"])
@pytest.mark.parametrize("name", ["eggroll-train", "eggroll-coordinator", "eggroll-local"])
def test_without_the_extra_a_flag_fails_at_once_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, flag: str
) -> None:
    module = {"--tensorboard": "tensorboardX", "--wandb-project": "wandb"}[flag]
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    main = {"eggroll-train": train_main, "eggroll-coordinator": coordinator_main}.get(
        name, local_main
    )
    save_dir = tmp_path / "run"
    args = ["--save-dir", str(save_dir), "--data-dir", str(tmp_path), flag, str(tmp_path / "x")]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2, done.output
    line = f"Error: {flag} needs the {module} package: {INSTALL}"
    assert done.output.strip().splitlines() == [line]
    assert not save_dir.exists()

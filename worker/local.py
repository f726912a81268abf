"""`eggroll-local`: a whole distributed run on this machine, in one command.

Prepares the built-in data if needed, starts a coordinator and N workers as real
subprocesses on loopback, shows progress, and ends with a summary: held-out bits per token
of the final snapshot against the data's baselines, steps/s, and where everything is.
Started again on the same --save-dir it resumes the run (up to --steps in total).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ..shared.cli import (
    OneLineError,
    cannot_write,
    command,
    config_options,
    data_dir_option,
    every_option,
    init_from_option,
    metrics_port_option,
    reward_timeout_option,
    run_config,
    save_dir_option,
    steps_option,
    summary_json_option,
    threads_option,
    tracking_options,
)
from ..shared.config import ConfigError, preset_of
from ..shared.data import META_FILE, DataError, load_data_dir
from ..shared.fitness_log import FitnessLog, FitnessLogError
from ..shared.logs import (
    LISTENING,
    PROGRESS,
    SAMPLE,
    SHOWN_EVENTS,
    STEP,
    VALIDATION,
    LogFile,
    baselines_text,
    echo,
    held_out_text,
    readable,
)
from ..shared.pinned import GoalError
from ..shared.progress import YEAR_S, duration_text
from ..shared.replica import load_checkpoint
from ..shared.run_writer import run_summary, write_summary
from ..shared.save_dir import Layout
from ..shared.tracking import TrackingError, check_available
from ..shared.vocab import escape
from ..shared.window import data_too_short
from .backend import get_backend
from .data.build import prepare_data_dir, vocabulary_mismatch
from .data.builtin import builtin_documents, builtin_source
from .exits import FAILED, SHELL_SIGNAL, STOPPED, Tally, exit_policy, killed_by

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops the run
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _exe(name: str) -> str:
    """A console script of this installation (beside the running Python)."""
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else name


class CoordinatorProcess:
    """The coordinator subprocess; its JSON log lines become progress output."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        total_steps: int,
        start: Callable[..., subprocess.Popen],
    ):
        self.proc = start(
            [_exe("eggroll-coordinator"), *args],
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # see _interrupt: Ctrl-C is this command's to handle
        )
        self.port: int | None = None
        self.ready = threading.Event()
        self.start_step = 0
        self.last_step = 0
        self.tail: deque[str] = deque(maxlen=20)
        self.total = total_steps
        self.quiet = False  # set when stopping: the console says only why and what is kept
        self.warned_eta = False
        self._first: tuple[int, float] | None = None  # first step seen, and when (for the ETA)
        self.thread = threading.Thread(target=self._read, args=(log_path,), daemon=True)
        self.thread.start()

    def _read(self, log_path: Path) -> None:
        # Every line is read whatever becomes of it: a log file or console that cannot be
        # written drops lines (and says so once), never stops draining the pipe, as a full
        # pipe would stall the coordinator.
        assert self.proc.stderr is not None
        log = LogFile(log_path)
        try:
            for line in self.proc.stderr:
                log.write(line)
                self.tail.append(line.rstrip())
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and not self.quiet:
                    try:
                        self._show(event)
                    except (KeyError, TypeError, ValueError):  # an odd line costs its line only
                        pass
        finally:
            log.close()
            self.ready.set()  # the process ended (maybe before listening)

    def _show(self, event: dict) -> None:
        """The console's line(s) for one event of the coordinator's log."""
        if event.get("event") == LISTENING:
            self.port, self.start_step = event["port"], event["step"]
            self.last_step = self.start_step
            self.ready.set()
        elif event.get("event") == STEP:
            self.last_step = event["step"]
            score = (
                f"reward {event['reward']:.4f}"
                if "reward" in event
                else f"loss {event['loss_bits']:.3f} bits/token"
            )
            eta = self._eta(event["step"])
            echo(
                f"step {event['step']:>6}/{self.total}  {score}  {event['step_s']:.2f} s  "
                f"{event['member_tok_s']:>9,} member-tok/s  workers {event['workers']}  "
                f"requeued {event['requeued']}  ETA {'?' if eta is None else duration_text(eta)}"
            )
            if eta is not None and eta > YEAR_S and not self.warned_eta:
                self.warned_eta = True
                echo(
                    f"warning: at this pace the {self.total:,} steps take {duration_text(eta)} "
                    "more: is --steps what you meant? (Ctrl-C stops and keeps every step)"
                )
        elif event.get("event") == PROGRESS:
            echo(
                f"  step {event['step']}: {event['chunks_done']}/{event['chunks']} chunks "
                f"in, {event['seconds']} s so far"
            )
        elif event.get("event") == VALIDATION:
            reward = event.get("held_out_reward")
            extra = "" if reward is None else f"; held-out reward {reward:.4f}"
            echo(f"held-out at step {event['step']}: {held_out_text(event)}{extra}")
        elif event.get("event") == SAMPLE:
            # Escaped by the coordinator already; again here, as it costs nothing.
            prompt, text = (escape(event[k], keep_newlines=False) for k in ("prompt", "text"))
            echo(f"sample at step {event['step']} by {event['worker']}")
            echo(f"  prompt: {prompt}")
            echo(f"  text:   {text}")
        elif event.get("level") in ("warning", "error", "critical") or (
            event.get("event") in SHOWN_EVENTS
        ):
            fields = {
                k: v
                for k, v in event.items()
                if k not in ("event", "level", "timestamp", "exception")
            }
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            # The exception's type and message say why; its traceback stays in the log file.
            exc = event.get("exception")
            if isinstance(exc, dict):
                text += f" exception={exc.get('type')}: {exc.get('message')}"
            echo(f"  coordinator: {event.get('event')} {text}".rstrip())

    def _eta(self, step: int) -> float | None:
        """Seconds left at the mean pace of the steps committed in this session (None at
        the first)."""
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
            return None
        done, seconds = step - self._first[0], now - self._first[1]
        return max(self.total - step, 0) * seconds / max(done, 1)


# A worker's lines shown on the console too: long work before it trains (a replay of the
# fitness log, a snapshot's download) is not silence.
WORKER_SHOWN = ('"event": "catching up"', '"event": "downloading snapshot"')


def _copy_output(proc: subprocess.Popen, log_path: Path, name: str) -> threading.Thread:
    """A thread that copies a worker's output into its log file until the worker ends. The
    pipe is always drained: a log file that cannot be written drops lines (and says so on
    stderr once) rather than leave the worker blocked on a full pipe."""

    def copy() -> None:
        assert proc.stdout is not None
        log = LogFile(log_path)
        try:
            for line in proc.stdout:
                log.write(line)
                if any(shown in line for shown in WORKER_SHOWN):
                    echo(f"{name}: {readable(line.rstrip())}")
        finally:
            log.close()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _committed_steps(save_dir: Path) -> int:
    """Steps the run in `save_dir` has committed (0 for a new run; a damaged log is left
    to the coordinator to repair or report)."""
    try:
        return FitnessLog.open(Layout(save_dir).fitness_log, repair=False).steps
    except (OSError, FitnessLogError):
        return 0


def _kept(save_dir: Path) -> str:
    """What an interrupted run keeps, in one line."""
    steps = _committed_steps(save_dir)
    if not steps:
        return f"stopped before the first step was committed; nothing to keep in {save_dir}"
    return f"stopped at step {steps}; steps 1..{steps} are kept in {save_dir}: run again to resume"


def _ensure_data(data_dir: Path) -> None:
    if (data_dir / META_FILE).exists():
        return
    echo(f"preparing the built-in corpus in {data_dir} ...")
    try:
        prepare_data_dir(builtin_documents(), data_dir, builtin_source(), echo=echo)
    except OSError as exc:  # it leaves no directory that looks complete (see build.py)
        raise cannot_write(exc, data_dir) from None


def _stop_now(children: list[subprocess.Popen]) -> None:
    """Stop at once: the workers (what they hold is in the fitness log), then the
    coordinator (the first child), which then finds no worker to wait for."""
    _stop(children[1:], timeout_s=3.0)
    _stop(children[:1])


def _stop(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@command()
@click.option(
    "--workers",
    default=2,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Workers to start; they share this machine's cores.",
)
@steps_option(None, "Train until this many steps are committed in total (default: the config's).")
@click.option(
    "--more",
    type=click.IntRange(min=1),
    default=None,
    help="Train this many steps beyond those the run already has (instead of --steps).",
)
@config_options()
@save_dir_option(Path("checkpoints/local"), "Run directory (resumed if it holds a run).")
@data_dir_option(Path("data"), "Data directory (the built-in corpus is prepared there if missing).")
@every_option("--snapshot-every", 100, "Steps between snapshots (0: only the final one).")
@every_option(
    "--sample-every", 100, "Print a sample of the model's writing every N steps (0: never)."
)
@metrics_port_option("The coordinator's Prometheus endpoint (0: off).")
@summary_json_option
@init_from_option
@reward_timeout_option
@tracking_options
@threads_option
def main(
    workers: int,
    steps: int | None,
    more: int | None,
    preset_name: str | None,
    config_path: str | None,
    save_dir: Path,
    data_dir: Path,
    snapshot_every: int,
    sample_every: int,
    metrics_port: int,
    summary_json: Path | None,
    init_from: Path | None,
    reward_timeout: float,
    tensorboard: Path | None,
    wandb_project: str | None,
    threads: int | None,
) -> None:
    """Train with a coordinator and N workers on this machine (loopback TCP)."""
    if steps is not None and more is not None:
        raise click.UsageError("give --steps (a total) or --more (beyond the run's), not both")
    cfg, goal_dir, dataset = _prepare(
        preset_name, config_path, init_from, data_dir, tensorboard is not None, wandb_project
    )
    done = _committed_steps(save_dir)
    steps = done + more if more is not None else steps or cfg.steps
    if done >= steps:
        echo(
            f"the run in {save_dir} already has {done} steps (the target is {steps}): nothing "
            f"to train; pass --more N, or --steps above {done}"
        )
        return
    if metrics_port and not _port_free(metrics_port):
        echo(
            f"metrics port {metrics_port} is busy: metrics are off for this run "
            "(pass --metrics-port to pick another)"
        )
        metrics_port = 0
    layout = Layout(save_dir)
    try:
        layout.logs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cannot_write(exc, layout.logs) from None
    coord_args = _coordinator_args(
        save_dir,
        data_dir,
        steps,
        snapshot_every,
        sample_every,
        metrics_port,
        preset_name,
        config_path,
        init_from,
        tensorboard,
        wandb_project,
    )
    started = time.monotonic()
    plan = _Workers(workers, data_dir, goal_dir, reward_timeout, threads)
    coordinator, watch = _train(coord_args, plan, layout, steps)
    if watch.abandoned:  # no worker was left to train: the run is not complete
        echo(_kept(save_dir))
    else:
        seconds = time.monotonic() - started
        _summarise(save_dir, dataset, coordinator, seconds, summary_json)
    if watch.tally.status:
        sys.exit(watch.tally.status)


def _prepare(
    preset_name: str | None,
    config_path: str | None,
    init_from: Path | None,
    data_dir: Path,
    tensorboard: bool,
    wandb_project: str | None,
) -> tuple[Any, Path, Any]:
    """The run's config, its goal directory and its data (prepared if missing), each
    checked before anything starts: (config, goal_dir, dataset)."""
    try:
        check_available(tensorboard, wandb_project is not None)
    except TrackingError as exc:
        raise OneLineError(str(exc)) from None
    try:
        cfg, goal_dir = run_config(preset_name, config_path, init_from)
        _ensure_data(data_dir)
        dataset = load_data_dir(data_dir)
    except (ConfigError, GoalError, DataError) as exc:
        raise click.ClickException(str(exc)) from None
    if cfg.model.arch == "hf":
        raise click.ClickException(
            "eggroll-local trains the int8 models: fine-tune a Hugging Face model with "
            "eggroll-tune (one process), or eggroll-coordinator and `eggroll-worker --backend "
            "torch` workers"
        )
    mismatch = vocabulary_mismatch(data_dir, dataset.meta.vocab_size, cfg.model.vocab_size)
    if mismatch is not None:  # before anything starts: the workers would each refuse the run
        raise click.ClickException(mismatch)
    short = data_too_short(cfg, len(dataset.train), len(dataset.valid))
    if short is not None:
        raise click.ClickException(f"data in {data_dir}: {short}")
    return cfg, goal_dir, dataset


def _coordinator_args(
    save_dir: Path,
    data_dir: Path,
    steps: int,
    snapshot_every: int,
    sample_every: int,
    metrics_port: int,
    preset_name: str | None,
    config_path: str | None,
    init_from: Path | None,
    tensorboard: Path | None,
    wandb_project: str | None,
) -> list[str]:
    """The coordinator's flags: on loopback, any free port, logging JSON for the console."""
    coord_args = [
        "--save-dir",
        str(save_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-steps",
        str(steps),
        "--snapshot-every",
        str(snapshot_every),
        "--sample-every",
        str(sample_every),
        "--metrics-port",
        str(metrics_port),
        "--log-format",
        "json",
        "--data-dir",  # the data's baselines go into history.log (and the tracked curves)
        str(data_dir),
    ]
    coord_args += ["--config", config_path] if config_path else ["--preset", preset_name or "tiny"]
    if init_from is not None:
        coord_args += ["--init-from", str(init_from)]
    coord_args += ["--tensorboard", str(tensorboard)] if tensorboard else []
    coord_args += ["--wandb-project", wandb_project] if wandb_project else []
    return coord_args


@dataclass(frozen=True)
class _Workers:
    """The workers to start: how many, and what they share."""

    count: int
    data_dir: Path
    goal_dir: Path
    reward_timeout: float
    threads: int | None

    def command(self, i: int, port: int) -> list[str]:
        return [
            _exe("eggroll-worker"),
            f"127.0.0.1:{port}",
            "--data-dir",
            str(self.data_dir),
            "--name",
            f"local-{i}",
            "--goal-dir",
            str(self.goal_dir),
            "--reward-timeout",
            str(self.reward_timeout),
            "--log-format",
            "json",
        ]

    def env(self) -> dict[str, str]:
        # Workers share this machine's cores: each sizes its BLAS pool to its share.
        env = {**os.environ, "EGGROLL_WORKERS_PER_HOST": str(self.count), "PYTHONUNBUFFERED": "1"}
        if self.threads is not None:
            env["EGGROLL_THREADS"] = str(self.threads)
        return env


def _dies_with(parent: int) -> Callable[[], None] | None:
    """A preexec_fn that has the child get SIGTERM when `parent` (this process) dies, even
    by SIGKILL: Linux's PR_SET_PDEATHSIG, through ctypes. None elsewhere, where children
    outlive a killed eggroll-local as they always did. The signal follows the thread that
    made the child, not the process: children are made from the main thread only."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    sigterm = ctypes.c_ulong(signal.SIGTERM)  # made here: the child only calls

    def preexec() -> None:  # in the child, between fork and exec: no lock is taken
        prctl(PR_SET_PDEATHSIG, sigterm)
        if os.getppid() != parent:  # it died before prctl: no signal would come
            os._exit(SHELL_SIGNAL + signal.SIGTERM)

    return preexec


class _Children:
    """Every process this command starts, registered as it is made, so that the cleanup
    reaches each one. SIGINT, SIGTERM and SIGHUP stop the run as Ctrl-C does (a
    KeyboardInterrupt), but never between a child's creation and its registration: there
    the interrupt waits until the child is in `procs`. The children run in sessions of
    their own, so a terminal's Ctrl-C or hangup reaches this process only: it stops the
    workers first, so the coordinator has nobody to wait for a last snapshot from."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []  # the coordinator first, then the workers
        self._preexec = _dies_with(os.getpid())
        self._held = False  # a stop signal now waits (`_pending`) instead of interrupting
        self._pending = False
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        self._old = {sig: signal.signal(sig, self._interrupt) for sig in STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def hold(self) -> None:
        """From now on no stop signal interrupts: the cleanup is bounded, and must end."""
        self._held = True

    def _interrupt(self, signum: int, frame: object) -> None:
        if self._held:
            self._pending = True
            return
        raise KeyboardInterrupt

    def start(self, args: list[str], **options: Any) -> subprocess.Popen:
        """subprocess.Popen(args, **options), from the main thread (see `_dies_with`), in
        `procs` before any stop signal that came meanwhile interrupts. (Blocking the
        signals with pthread_sigmask would not do: the kernel hands them to another thread,
        a log reader, whose handler still interrupts the main thread; and the child would
        inherit the mask.)"""
        held, self._held = self._held, True
        try:
            proc = subprocess.Popen(args, preexec_fn=self._preexec, **options)
            self.procs.append(proc)
        finally:
            self._held = held
        if self._pending and not held:
            self._pending = False
            raise KeyboardInterrupt
        return proc


def _train(
    coord_args: list[str], plan: _Workers, layout: Layout, steps: int
) -> tuple[CoordinatorProcess, _Watch]:
    """Start the coordinator and the workers and watch them until the coordinator ends;
    Ctrl-C (or SIGTERM, SIGHUP) stops them all and exits with 130. No child is left
    running, whatever happens."""
    children = _Children()
    children.install()
    coordinator: CoordinatorProcess | None = None
    copiers: list[threading.Thread] = []
    try:
        coordinator = CoordinatorProcess(coord_args, layout.coordinator_log, steps, children.start)
        coordinator.ready.wait(60)
        if coordinator.port is None:
            coordinator.proc.wait(10)
            raise click.ClickException(
                "the coordinator did not start:\n" + "\n".join(coordinator.tail)
            )
        echo(
            f"coordinator on 127.0.0.1:{coordinator.port}, run in {layout.root} "
            f"(from step {coordinator.start_step}); starting {plan.count} workers"
        )
        env = plan.env()
        for i in range(plan.count):
            proc = children.start(
                plan.command(i, coordinator.port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env=env,
                start_new_session=True,
            )
            copiers.append(_copy_output(proc, layout.worker_log(i), f"local-{i}"))
        watch = _Watch(children.procs[1:], layout)
        watch.until_done(coordinator.proc)
        coordinator.thread.join(5)
        if coordinator.proc.returncode != 0:
            raise click.ClickException(
                f"the coordinator exited with code {coordinator.proc.returncode}:\n"
                + "\n".join(coordinator.tail)
            )
        return coordinator, watch
    except KeyboardInterrupt:
        children.hold()  # a second Ctrl-C waits: this stop is bounded
        if coordinator is not None:
            coordinator.quiet = True
        _stop_now(children.procs)
        echo(_kept(layout.root))
        sys.exit(130)
    finally:
        children.hold()
        _stop(children.procs)  # every child ever started (only those left are running)
        for thread in copiers:
            thread.join(5)
        children.restore()


class _Watch:
    """The workers' ends, judged by `exit_policy` (worker/exits.py), as eggroll-ray and
    deploy/run-workers.sh judge theirs: a failure every worker would share stops the run
    with that worker's status; a run complete (0), a worker that computes differently (3)
    or one killed by a signal ends alone, and the others go on."""

    def __init__(self, workers: list[subprocess.Popen], layout: Layout) -> None:
        self.running = dict(enumerate(workers))
        self.layout = layout
        self.tally = Tally()
        self.clean = False  # a worker ended with 0: the run is complete, or stopped
        self.abandoned = False  # no worker was left, so the coordinator was stopped

    def until_done(self, coordinator: subprocess.Popen) -> None:
        """Until the coordinator ends. Once every worker has ended and none of them with
        0 (which the run's end explains), the coordinator is stopped: nobody would train."""
        while coordinator.poll() is None:
            self.check()
            if not self.running and not self.clean and not self.abandoned:
                echo("no worker left: stopping the coordinator")
                coordinator.send_signal(signal.SIGTERM)
                self.abandoned = True
            time.sleep(0.2)
        self.check(asked=True)  # those that ended with it; the others are stopped next

    def check(self, asked: bool = False) -> None:
        """Judge the workers that ended since the last check; a ClickException with the
        worker's status when its end stops the run."""
        for i, proc in list(self.running.items()):
            status = proc.poll()
            if status is None:
                continue
            del self.running[i]
            verdict = exit_policy(status, asked)
            self.tally.add(verdict)
            self.clean = self.clean or status == 0
            log = self.layout.worker_log(i)
            if verdict.stop_all:
                error = click.ClickException(f"worker {i} exited with code {status}; see {log}")
                error.exit_code = verdict.code
                raise error
            if verdict.kind not in (STOPPED, FAILED):
                going = "; the others go on" if self.running else ""
                echo(f"worker {i} {_how(status)}{going} (see {log})")


def _how(status: int) -> str:
    """How a worker that ends alone ended, in words."""
    signum = killed_by(status)
    if signum is not None:
        name = signal.Signals(signum).name if signum in signal.valid_signals() else signum
        return f"was killed by {name}"
    return f"exited with code {status}: it computes differently from the run (outvoted)"


def _summarise(
    save_dir: Path,
    dataset,
    coordinator: CoordinatorProcess,
    seconds: float,
    summary_json: Path | None,
) -> None:
    layout = Layout(save_dir)
    steps = layout.snapshot_steps()
    if not steps:
        raise click.ClickException(f"no snapshot in {layout.snapshots} to evaluate")
    snapshot = layout.snapshot(steps[-1])
    state = load_checkpoint(snapshot)
    validation = get_backend("numpy").build(dataset, state).validate()
    ran = coordinator.last_step - coordinator.start_step
    base = dataset.meta.baselines
    summary = run_summary(
        steps=state.step,
        preset=preset_of(state.config),
        config_digest=state.config.digest().hex(),
        replica_digest=state.digest_hex(),
        held_out=validation.report(),
        baselines=base,
        baselines_per_byte=dataset.meta.baselines_per_byte,
        seconds=seconds,
        steps_per_second=ran / seconds if ran else 0.0,
        save_dir=save_dir,
        snapshot=snapshot,
    )
    try:  # each whole or not at all; the run itself is committed already, so a retry says so
        if summary_json is not None:
            write_summary(summary_json, summary)
        write_summary(layout.summary, summary)  # for inspect
    except OSError as exc:
        raise cannot_write(exc, layout.summary) from None
    echo(
        f"done: {state.step} steps ({ran} now, {summary['steps_per_second']:.2f} steps/s); "
        f"held-out {held_out_text(validation.log_fields())} "
        f"(baselines: {baselines_text(base, dataset.meta.baselines_per_byte)}); replica digest "
        f"{state.digest_hex()}; checkpoints in {layout.snapshots}, logs in {layout.logs}"
    )

"""The Python API: the runs of eggroll-train and eggroll-tune, configured and driven from
Python, with the same results as the commands (the same config, data and fitness log give
the same replica digest).

    from eggroll_dist.worker.api import Trainer, Tuner

    run = Trainer(preset="tiny", steps=100, save_dir="runs/api").run(on_record=print)
    print(run.digest, run.scores[-1], run.held_out)

    tuned = Tuner(
        "./my-model",
        reward=lambda text: text.count("e") / max(len(text), 1),
        prompts=["Write about eggs:", "Describe a kitchen:", ...],
        steps=20,
        save_dir="runs/tuned",
    ).run()
    tuned.export("runs/tuned-lora", lora=8)

A reward is a file ("score.py:score"), a built-in, a lambda's text, or a Python function.
A function is called in this process, pinned by the sha256 of its code: a run with workers
cannot load it (each worker pins a reward file's bytes and loads its own copy), so
`coordinator_config` refuses it. Prompts given as a list are written once, by content, under
the cache folder (XDG_CACHE_HOME or ~/.cache, then eggroll-distributed/prompts/), so the
same list pins the same file and a run continues. Every refusal is `RunError`, one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import threading
import tomllib
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ..shared.config import (
    ConfigError,
    RunConfig,
    from_dict,
    preset,
    resolve_config,
)
from ..shared.objectives import objective_of
from ..shared.objectives.reward import PYTHON
from ..shared.pinned import GoalError, pin
from ..shared.replica import ReplicaState
from .train import TrainOptions, TrainResult, run_inputs, run_training
from .tune import PERPLEXITY, TuneSettings, config_toml, resolve_model_dir, tune_config

__all__ = ["Result", "RunError", "Trainer", "Tuner", "function_digest"]

Record = dict[str, Any]
Reward = Callable[..., Any] | str


class RunError(Exception):
    """A run that cannot start or failed: one line, as the command would print it."""


def function_digest(function: Callable[..., Any]) -> str:
    """The sha256 of a function's code (bytecode, constants, names, defaults and the values
    it closes over; not where it stands in its file), which pins a reward given as a
    function. The same in every process: sets are written sorted, not in hash order."""
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType):
        raise RunError(
            f"a reward given as a function must be a Python function (def or lambda), not "
            f"{type(function).__name__}: wrap it in one"
        )
    cells = tuple(_stable(c.cell_contents) for c in function.__closure__ or ())
    defaults = (_stable(function.__defaults__), _stable(function.__kwdefaults__))
    return hashlib.sha256(repr((_stable(code), cells, defaults)).encode()).hexdigest()


def _stable(value: Any) -> Any:
    """`value` as a structure whose repr is the same in every process (code objects by their
    parts, sets sorted by the repr of their elements)."""
    if isinstance(value, types.CodeType):
        parts = (value.co_code.hex(), value.co_names, value.co_varnames, value.co_freevars)
        return (*parts, tuple(_stable(c) for c in value.co_consts))
    if isinstance(value, frozenset | set):
        return ("set", sorted(repr(_stable(v)) for v in value))
    if isinstance(value, tuple | list):
        return tuple(_stable(v) for v in value)
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), repr(_stable(v))) for k, v in value.items()))
    return repr(value)


def _prompts_file(prompts: Sequence[str]) -> Path:
    """A list of prompts as a prompts file (one a line, newlines and backslashes escaped),
    stored by its content's digest under the cache folder."""
    text = "".join(p.replace("\\", "\\\\").replace("\n", "\\n") + "\n" for p in prompts)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = (
        cache
        / "eggroll-distributed"
        / "prompts"
        / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".txt")
    )
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def _reward_fields(reward: Reward, prompts: Sequence[str] | str | Path | None) -> dict[str, Any]:
    """The fitness settings of a reward given to the API, and the function, if one."""
    if isinstance(prompts, str | Path):
        prompt_source = str(prompts)
    elif prompts is not None:
        prompt_source = str(_prompts_file(list(prompts)))
    else:
        raise RunError("a reward needs prompts: a list of strings, a prompts file or 'data'")
    fields: dict[str, Any] = {"objective": "reward", "prompts": prompt_source}
    if callable(reward):
        name = getattr(reward, "__qualname__", type(reward).__qualname__)
        fields.update(reward=PYTHON + name, reward_sha256=function_digest(reward))
    else:
        fields["reward"] = reward
    return fields


@dataclass(frozen=True)
class Result:
    """A run's outcome: its config, the replica it ended with, every record of its curve
    (steps, validations, samples, in order), summary.json's content (None after a stop) and
    where it was kept."""

    config: RunConfig
    state: ReplicaState
    records: list[Record]
    summary: Record | None
    save_dir: Path | None
    stopped: str = ""
    data_dir: Path | None = None

    @property
    def digest(self) -> str:
        return self.state.digest_hex()

    @property
    def steps(self) -> int:
        return self.state.step

    @property
    def scores(self) -> list[float]:
        """Each step's mean score: bits per token, or a reward run's mean reward."""
        name = objective_of(self.config).SCORE
        return [r[name] for r in self.records if r.get("event") == "step" and name in r]

    @property
    def held_out(self) -> Record | None:
        """The last held-out scores (windows and long streams, per token and byte)."""
        found = [r for r in self.records if r.get("event") == "validation"]
        return found[-1] if found else None

    def export(self, out: str | Path, lora: int | None = None, force: bool = False) -> Path:
        """The replica as eggroll-export writes it (a Hugging Face run: the merged model, or
        with `lora` its change as a PEFT adapter of that rank); needs the run's save_dir."""
        if self.save_dir is None:
            raise RunError("export reads the run's save directory: give the run a save_dir")
        from .export import main as export_main

        args = [str(self.save_dir), "--out", str(out), "--step", str(self.steps)]
        args += ["--lora", str(lora)] if lora is not None else []
        args += ["--force"] if force else []
        args += ["--data-dir", str(self.data_dir)] if self.data_dir is not None else []
        _one_line(lambda: export_main.main(args, standalone_mode=False))
        return Path(out)


def _one_line(call: Callable[[], Any]) -> Any:
    """`call`, with the commands' one-line failures as RunError."""
    try:
        return call()
    except click.ClickException as exc:
        raise RunError(exc.format_message()) from None
    except (ConfigError, GoalError) as exc:
        raise RunError(str(exc)) from None


@dataclass
class _Run:
    """What both kinds of run share: the pinned config, where its files are read, and how
    it is kept and reported."""

    config: RunConfig
    base: Path
    data_dir: Path | None  # None: ./data, which a reward run of an hf model may go without
    steps: int
    save_dir: Path | None
    threads: int | None
    options: Record = field(default_factory=dict)  # the rest of TrainOptions
    function: Callable[..., Any] | None = None

    def run(
        self,
        on_record: Callable[[Record], None] | None = None,
        stop: Callable[[], str] | None = None,
    ) -> Result:
        """Train up to `steps` in all (a run in save_dir continues); `on_record` hears each
        step's, validation's and sample's record as it is made; `stop` says why to stop
        after the chunk under way ("": go on)."""
        records: list[Record] = []

        def record(point: Record) -> None:
            records.append(point)
            if on_record is not None:
                on_record(point)

        given = self.data_dir is not None
        dataset, factory = _one_line(
            lambda: run_inputs(
                self.config, self.base, self.data_dir or Path("data"), self.threads, given
            )
        )
        options = TrainOptions(
            self.steps,
            self.save_dir,
            on_record=record,
            reward_function=self.function,
            stop=stop,
            **self.options,
        )
        done: TrainResult = _one_line(
            lambda: run_training(self.config, self.base, dataset, factory, options)
        )
        return Result(
            self.config, done.state, records, done.summary, self.save_dir, done.stopped,
            self.data_dir,
        )  # fmt: skip

    def records(self) -> Iterator[Record]:
        """The run's records as they are made (it runs in a thread meanwhile). Leaving the
        loop early stops the run after the chunk under way; its committed steps are kept."""
        items: queue.Queue[Any] = queue.Queue()
        leaving = threading.Event()
        outcome: list[Any] = []

        def work() -> None:
            try:
                outcome.append(self.run(items.put, lambda: "stopped" if leaving.is_set() else ""))
            except BaseException as exc:  # handed to the caller's thread below
                outcome.append(exc)
            items.put(None)

        thread = threading.Thread(target=work, name="eggroll-run", daemon=True)
        thread.start()
        try:
            while (item := items.get()) is not None:
                yield item
        finally:
            leaving.set()
            while thread.is_alive():  # it stops after the chunk under way: never leave it
                try:  # writing the save directory behind the caller's back
                    thread.join()
                except KeyboardInterrupt:
                    continue
        if outcome and isinstance(outcome[0], BaseException):
            raise outcome[0]


class Trainer(_Run):
    """An int8 run (eggroll-train): a config (a RunConfig, a dict shaped like the TOML, or a
    TOML file's path) or a preset, the data directory, and optionally a reward with prompts
    to train for instead of the next-token loss."""

    def __init__(
        self,
        config: RunConfig | Mapping[str, Any] | str | Path | None = None,
        *,
        preset: str | None = None,
        data_dir: str | Path = "data",
        steps: int | None = None,
        save_dir: str | Path | None = None,
        reward: Reward | None = None,
        prompts: Sequence[str] | str | Path | None = None,
        threads: int | None = None,
        sample_every: int = 100,
        snapshot_every: int = 100,
        max_minutes: float | None = None,
        reward_timeout: float = 120.0,
    ) -> None:
        cfg, base = _one_line(lambda: _int8_config(config, preset))
        function = None
        if reward is not None:
            fields = _reward_fields(reward, prompts)
            function = reward if callable(reward) else None
            cfg = _one_line(lambda: cfg.replace(fitness=dataclasses.replace(cfg.fitness, **fields)))
        super().__init__(
            _one_line(lambda: pin(cfg, base)),
            base,
            Path(data_dir),
            steps or cfg.steps,
            None if save_dir is None else Path(save_dir),
            threads,
            {
                "sample_every": sample_every,
                "snapshot_every": snapshot_every,
                "max_minutes": max_minutes,
                "reward_timeout": reward_timeout,
                "preset": preset if config is None else None,
            },
            function,
        )

    def coordinator_config(self, path: str | Path) -> Path:
        """The run as a TOML file for `eggroll-coordinator --config` (workers read the
        reward and prompts files under their --goal-dir)."""
        _refuse_function(self.function, self.config)
        data = self.config.to_dict()
        data.pop("format", None)
        Path(path).write_text(_toml(data))
        return Path(path)


class Tuner(_Run):
    """A Hugging Face model fine-tuned by a reward (eggroll-tune): the model's directory
    (or ORG/NAME of the local Hugging Face cache), the reward and its prompts, the settings
    of eggroll-tune's flags (data_dir None: ./data, which a reward run goes without when
    it is absent, as eggroll-tune does)."""

    def __init__(
        self,
        model: str | Path,
        reward: Reward,
        prompts: Sequence[str] | str | Path | None = None,
        *,
        steps: int = 50,
        population: int = 32,
        chunk_size: int | None = None,
        rank: int = 8,
        sigma: float = 0.01,
        lr: float = 1.0,
        targets: Sequence[str] = (),
        seed: int = 0,
        seq_len: int = 32,
        prompts_per_step: int = 8,
        completion_tokens: int = 32,
        temperature: float = 1.0,
        valid_tokens: int = 4096,
        validate_every: int = 25,
        data_dir: str | Path | None = None,
        save_dir: str | Path | None = None,
        threads: int | None = None,
        reward_timeout: float = 120.0,
    ) -> None:
        model_dir = _one_line(lambda: resolve_model_dir(Path(model)))
        perplexity = reward == PERPLEXITY
        fields = {} if perplexity else _reward_fields(reward, prompts)
        # A function's name and code go in below: eggroll-tune's settings name a spec.
        spec = PERPLEXITY if perplexity else fields["reward"]
        settings = TuneSettings(
            model_dir,
            (spec if not callable(reward) else "builtin:letter_e",),
            None if perplexity else Path(fields["prompts"]),
            population,
            chunk_size,
            rank,
            sigma,
            lr,
            tuple(targets),
            seed,
            seq_len,
            prompts_per_step,
            completion_tokens,
            temperature,
            valid_tokens,
            validate_every,
        )
        cfg = _one_line(lambda: tune_config(settings))
        function = reward if callable(reward) else None
        if function is not None:  # the function's name and code, in place of the stand-in
            cfg = cfg.replace(
                fitness=dataclasses.replace(
                    cfg.fitness, reward=fields["reward"], reward_sha256=fields["reward_sha256"]
                )
            )
        base = Path.cwd()
        super().__init__(
            _one_line(lambda: pin(cfg, base)),
            base,
            None if data_dir is None else Path(data_dir),
            steps,
            None if save_dir is None else Path(save_dir),
            threads,
            {"sample_every": 0, "reward_timeout": reward_timeout},
            function,
        )

    def coordinator_config(self, path: str | Path) -> Path:
        """The run as eggroll-tune --print-config writes it, for `eggroll-coordinator
        --config` with `eggroll-worker --backend torch --goal-dir DIR` workers."""
        _refuse_function(self.function, self.config)
        Path(path).write_text(config_toml(self.config, self.steps))
        return Path(path)


def _refuse_function(function: Callable[..., Any] | None, cfg: RunConfig) -> None:
    """A config for workers names its goal files as they find them: relative to their
    --goal-dir, and files, not code."""
    if function is not None or objective_of(cfg).inline_code(cfg) is not None:
        raise RunError(
            "a reward given as a Python function or a lambda runs in this process only: a "
            "run with workers needs a reward file (each worker pins its bytes and loads its "
            "own copy)"
        )
    for what, path in (("prompts", cfg.fitness.prompts), ("model", cfg.model.path)):
        if path and Path(path).is_absolute():
            raise RunError(
                f"the run's {what} is at {path}: workers read goal files only under their "
                "--goal-dir, so a run for them names it relative to its config (a prompts "
                "file instead of a list; a model directory instead of a cached name)"
            )


def _int8_config(
    config: RunConfig | Mapping[str, Any] | str | Path | None, preset_name: str | None
) -> tuple[RunConfig, Path]:
    """The config and the folder its files are read under (a TOML file's, else this one)."""
    if isinstance(config, RunConfig):
        return config, Path.cwd()
    if isinstance(config, str | Path):
        return resolve_config(None, str(config)), Path(config).parent
    if config is None:
        return resolve_config(preset_name or "tiny", None), Path.cwd()
    data = dict(config)
    name = data.pop("preset", preset_name)
    return from_dict(data, preset(name) if name else None), Path.cwd()


def _toml(data: Mapping[str, Any]) -> str:
    """A run config's dict as TOML (top-level values first, then one table a section)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, values in data.items():
        if isinstance(values, dict):
            lines += ["", f"[{section}]", *(f"{k} = {value(v)}" for k, v in values.items())]
    text = "\n".join(lines) + "\n"
    tomllib.loads(text)  # what we write must read back
    return text

"""The run's reward function, called in a child process with a time limit.

A reward is user code: it may hang, crash, print or leak. It runs in its own Python process
(this module run with `-m`), so a hung one is killed at the limit and a crashed one takes
nothing of the worker with it. Requests and answers are JSON lines on private pipes; the
child's stdout is its stderr, so a reward's prints cannot corrupt them.

Two forms of reward function, told apart by their positional parameters:
    score(completion: str) -> float                                 one completion at a time
    reward(prompts: list[str], completions: list[str], **fields) -> list[float]    batched
The batched form gets every other field of JSON-lines prompts as a list per key, aligned with
the completions (`fields["answer"][i]` belongs to completion i). An inline reward is a lambda
of either form ("lambda text: ...", "lambda prompts, completions, **fields: [...]"): user
code like a file, evaluated here from the config's text with the usual builtins. A weighted
combination loads every part in this one process; a completion's reward is the fsum of
weight * part reward in config order, the same float on every machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..shared.objectives.reward import (
    BUILTIN_REWARDS,
    MAX_REWARD,
    PYTHON,
    RewardPart,
    is_lambda,
    lambda_problem,
    reward_parts,
    reward_target,
)
from ..shared.pinned import GoalError

if TYPE_CHECKING:
    from ..shared.config import RunConfig

__all__ = ["RewardError", "RewardRunner"]

START_TIMEOUT_S = 60.0  # importing a reward module (it may import a parser, a model...)
MAX_ANSWER_BYTES = 256 << 20


class RewardError(Exception):
    """The reward failed on a chunk; str() is one line naming the function and the prompt."""


def check_rewards(
    values: Sequence[Any],
    expected: int,
    function: str,
    prompt_of: Callable[[int], str] | None = None,
) -> list[float]:
    """The reward function's answer as floats, or one line (GoalError) naming the function
    and, with `prompt_of`, the prompt of the completion at fault."""

    def at(i: int) -> str:
        return "" if prompt_of is None else f" (prompt {prompt_of(i)})"

    if not isinstance(values, list | tuple):
        raise GoalError(f"{function} returned {type(values).__name__}, not a list of numbers")
    if len(values) != expected:
        raise GoalError(f"{function} returned {len(values)} rewards for {expected} completions")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise GoalError(
                f"{function} returned {type(v).__name__} {v!r} for completion {i}{at(i)}"
            )
        v = float(v)
        if not math.isfinite(v) or abs(v) > MAX_REWARD:
            raise GoalError(
                f"{function} returned {v!r} for completion {i}: rewards must be finite and "
                f"within ±{MAX_REWARD:g}{at(i)}"
            )
        out.append(v)
    return out


def _load(spec: str, base: Path, sha256: str) -> tuple[Callable[..., Any], str]:
    """The reward function and its name for messages, run from the very bytes whose digest
    is `sha256` (the run's pin; "" where nothing pins it): read once, checked, compiled, so
    neither a file changed since nor a stale .pyc runs instead. Modules it imports from its
    folder are not pinned. A lambda is compiled from its text, which the config pins."""
    if spec.startswith(PYTHON):
        raise GoalError(
            f"the run's reward {spec} is a Python function of the process that started it: "
            "continue it from Python with the same function; workers and commands need a "
            "reward file, a built-in or a lambda (workers pin a file's bytes and load their copy)"
        )
    if is_lambda(spec):
        return _lambda(spec)
    try:
        path, name = reward_target(spec)
    except ValueError as exc:  # a config that was never validated
        raise GoalError(str(exc)) from None
    if not path:
        return BUILTIN_REWARDS[name], spec
    file = Path(path) if Path(path).is_absolute() else base / path
    try:
        source = file.read_bytes()
    except FileNotFoundError:
        raise GoalError(f"reward file {file} does not exist") from None
    except OSError as exc:
        raise GoalError(f"reward file {file} cannot be read: {exc.strerror}") from None
    if sha256 and hashlib.sha256(source).hexdigest() != sha256:
        raise GoalError(f"reward file {file} changed after the run pinned it")
    module = types.ModuleType(f"eggroll_reward_{file.stem}")
    module.__file__ = str(file)
    sys.path.insert(0, str(file.parent))  # a reward may import its neighbours
    try:
        exec(compile(source, str(file), "exec"), module.__dict__)  # the pinned bytes, once
    except Exception as exc:  # the user's module failed to import
        raise GoalError(f"reward file {file} raised {exc!r} on import") from None
    # A bare file: its score(text), else its reward(prompts, completions, **fields).
    for candidate in (name,) if name else ("score", "reward"):
        function = getattr(module, candidate, None)
        if callable(function):
            return function, f"{file}:{candidate}"
    if name:
        raise GoalError(f"reward file {file} has no function {name!r}")
    raise GoalError(
        f"reward file {file} has neither a score nor a reward function (or name one: "
        f"{path}:FUNCTION)"
    )


def _lambda(spec: str) -> tuple[Callable[..., Any], str]:
    """A lambda reward from its text, in a fresh namespace: the usual builtins, nothing
    imported (a lambda that needs a module calls __import__ itself)."""
    problem = lambda_problem(spec)
    if problem:
        raise GoalError(problem)
    where = f"the reward {_shown(spec.strip())}"
    try:
        # the config's text, as a file's bytes: user code, run in this child on purpose
        return eval(compile(spec.strip(), "<reward>", "eval"), {}), where
    except Exception as exc:  # e.g. a default value that raises
        raise GoalError(f"{where} raised {exc!r} when it was evaluated") from None


def _batched(function: Callable[..., Any]) -> bool:
    """Whether the function takes (prompts, completions, ...) rather than one text."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: one text at a time
        return False
    # Those a call must fill: `def score(text, scale=1.0)` is the one-text form.
    required = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(required) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _shown(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _call(
    function: Callable[..., Any],
    where: str,
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list[Any]],
) -> list[float]:
    """The rewards of the completions; GoalError naming the function and the prompt."""
    if not _batched(function):
        values = []
        for i, text in enumerate(completions):
            try:
                values.append(function(text))
            except Exception as exc:
                raise GoalError(
                    f"{where} raised {exc!r} on the completion of prompt {_shown(prompts[i])}"
                ) from None
            check_rewards(
                values[-1:], 1, f"{where} on the completion of prompt {_shown(prompts[i])}"
            )
        return [float(v) for v in values]
    try:
        values = function(prompts, completions, **fields)
    except Exception as exc:
        # Find the prompt it fails on, one completion at a time.
        for i in range(len(completions)):
            one = {k: v[i : i + 1] for k, v in fields.items()}
            try:
                function(prompts[i : i + 1], completions[i : i + 1], **one)
            except Exception as single:
                raise GoalError(
                    f"{where} raised {single!r} on the completion of prompt {_shown(prompts[i])}"
                ) from None
        raise GoalError(f"{where} raised {exc!r} on a batch of {len(completions)}") from None
    return check_rewards(values, len(completions), where, lambda i: _shown(prompts[i]))


def _score(
    loaded: list[tuple[Callable[..., Any], str, float | None]],
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list[Any]],
) -> list[float]:
    """One reward per completion: the only part's, or the weighted parts' exactly rounded
    sum (fsum over the parts in config order, so every machine gets the same float)."""
    scored = [(_call(f, where, prompts, completions, fields), w) for f, where, w in loaded]
    if len(scored) == 1 and scored[0][1] is None:
        return scored[0][0]
    weighted = [(r, w) for r, w in scored if w is not None]  # every part of a combination
    sums = [math.fsum(w * r[i] for r, w in weighted) for i in range(len(completions))]
    return check_rewards(
        sums, len(completions), "the weighted rewards", lambda i: _shown(prompts[i])
    )


def _child(parts: str, base: str, fd_in: str, fd_out: str) -> None:
    """The child process: answer JSON-line requests read from `fd_in` on `fd_out`. `parts`
    is JSON: [[reward, weight or null, pinned sha256], ...]."""
    channel_in = os.fdopen(int(fd_in), "r", encoding="utf-8")
    channel_out = os.fdopen(int(fd_out), "w", encoding="utf-8")
    os.dup2(2, 1)  # a reward's prints go to stderr, never into the channel
    sys.stdout = sys.stderr

    def answer(payload: dict[str, Any]) -> None:
        channel_out.write(json.dumps(payload) + "\n")
        channel_out.flush()

    try:
        loaded = [(*_load(spec, Path(base), sha), w) for spec, w, sha in json.loads(parts)]
    except GoalError as exc:
        answer({"error": str(exc)})
        return
    answer({"ready": " + ".join(where for _, where, _ in loaded)})
    for line in channel_in:
        request = json.loads(line)
        try:
            rewards = _score(loaded, request["prompts"], request["completions"], request["fields"])
            answer({"rewards": rewards})
        except GoalError as exc:
            answer({"error": str(exc)})


def _reward_env() -> dict[str, str]:
    """The worker's environment less its secrets: a reward is user code, and the run's
    token (EGGROLL_TOKEN, or the file EGGROLL_TOKEN_FILE names) is none of its business."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EGGROLL_TOKEN")}


class RewardRunner:
    """The reward function of a run in a child process, started on first use and again after
    a timeout; `score` raises RewardError with one line when the reward fails."""

    def __init__(self, spec: str, base: Path, timeout_s: float = 120.0, sha256: str = "") -> None:
        """`sha256`: the reward file's pinned digest, checked on the bytes the child runs."""
        self.spec, self.base, self.timeout_s = spec, base, timeout_s
        self.parts = [RewardPart(spec, "", None, sha256)]
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_child: Any = None
        self._from_child: Any = None
        self._buffer = b""

    @classmethod
    def of(cls, cfg: RunConfig, base: Path, timeout_s: float = 120.0) -> RewardRunner:
        """The run's reward: its one function, or every part of its weighted combination,
        each file checked against its pinned digest."""
        try:
            parts = reward_parts(cfg.fitness)
        except ValueError as exc:  # a config that was never validated
            raise GoalError(str(exc)) from None
        runner = cls(cfg.fitness.reward or " + ".join(cfg.fitness.rewards), base, timeout_s)
        runner.parts = parts
        return runner

    def start(self) -> None:
        """Start the child and import the reward (RewardError naming what failed)."""
        if self._proc is None:
            self._start()

    def _start(self) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        code = "import sys; from eggroll_dist.worker.reward import _child; _child(*sys.argv[1:])"
        parts = json.dumps([[p.spec, p.weight, p.sha256] for p in self.parts])
        args = [parts, str(self.base), str(to_r), str(from_w)]
        self._proc = subprocess.Popen(
            # -P: the current folder never shadows a module the child imports
            [sys.executable, "-P", "-c", code, *args],
            stdin=subprocess.DEVNULL,
            pass_fds=(to_r, from_w),
            start_new_session=True,  # Ctrl-C is the worker's to handle; a kill takes the group
            env=_reward_env(),
        )
        os.close(to_r)
        os.close(from_w)
        self._to_child = os.fdopen(to_w, "wb")
        self._from_child = from_r
        self._buffer = b""
        ready = self._read(START_TIMEOUT_S, "starting")
        if "error" in ready:
            self.close()
            raise RewardError(ready["error"])

    def _read(self, timeout_s: float, doing: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self._from_child, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.close()
                    raise RewardError(
                        f"the reward {self.spec} did not answer within {timeout_s:g} s while "
                        f"{doing}: it was stopped (raise the limit with --reward-timeout)"
                    )
                data = os.read(self._from_child, 1 << 20)
                if not data:
                    status = self._proc.poll() if self._proc is not None else None
                    self.close()
                    raise RewardError(
                        f"the reward {self.spec} exited (status {status}) while {doing}"
                    )
                self._buffer += data
                if len(self._buffer) > MAX_ANSWER_BYTES:
                    self.close()
                    raise RewardError(f"the reward {self.spec} answered more than 256 MiB")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def score(
        self, prompts: list[str], completions: list[str], fields: dict[str, list[Any]]
    ) -> list[float]:
        """One reward per completion (prompts[i] is completion i's prompt)."""
        if self._proc is None:
            self._start()
        request = {"prompts": prompts, "completions": completions, "fields": fields}
        try:
            self._to_child.write((json.dumps(request) + "\n").encode())
            self._to_child.flush()
        except (BrokenPipeError, TypeError, ValueError) as exc:
            self.close()
            raise RewardError(f"the reward {self.spec} cannot be sent the chunk: {exc}") from None
        answer = self._read(self.timeout_s, f"scoring {len(completions)} completions")
        if "error" in answer:
            raise RewardError(answer["error"])
        return [float(v) for v in answer["rewards"]]

    def close(self) -> None:
        """Stop the child and whatever it started (its process group)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            self._proc = None
        for f in (self._to_child,):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        if isinstance(self._from_child, int):
            os.close(self._from_child)
        self._to_child = self._from_child = None

    def __del__(self) -> None:
        self.close()


class InProcessRunner:
    """A reward given as a Python function (worker/api.py): called in this process, its
    answers checked as the child's are. Only a one-process run has one."""

    def __init__(self, function: Callable[..., Any], spec: str) -> None:
        self.function, self.spec = function, spec

    def start(self) -> None:
        pass

    def score(
        self, prompts: list[str], completions: list[str], fields: dict[str, list[Any]]
    ) -> list[float]:
        try:
            return _score([(self.function, self.spec, None)], prompts, completions, fields)
        except GoalError as exc:
            raise RewardError(str(exc)) from None

    def close(self) -> None:
        pass

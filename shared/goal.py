"""The reward objective: the files a goal is made of, the prompts each step continues, and
the ternary fitness of a pair from its members' rewards.

With `fitness.objective = "reward"` a member is not scored on the data's windows: it
continues the step's prompts (shared/sample.py's exact integer sampling, seeded by step and
prompt, so both members of a pair and every member of the population read the same prompts
with the same randomness), a reward function scores each completion, and

    F_k = sign(R(2k) - R(2k+1)),   R(m) = fsum of member m's rewards over the step's prompts

+1 when the + member (even id) earned more, 0 on a tie. fsum is exactly rounded, so R is
the same number on every machine. The rewards are floats and never enter the replica: only
the ternary fitness does, as with the loss.

A goal's files are pinned by the run config: the reward's source (`fitness.reward =
"score.py:function"`, or "builtin:NAME" for the functions in `BUILTIN_REWARDS`), the prompts
(`fitness.prompts`, a file, or "data" for the beginnings of the data's documents), the
replica a run starts from (`model.init_from`) and a Hugging Face model's directory
(`model.path`: its files' digests and chosen matrices, shared/hf_dir.py). `pin` records
their digests when a config is loaded, so the config digest covers them; a worker reads its
own copies (relative to its --goal-dir) and `check_files` refuses a copy that differs,
naming the file.

Prompts file: one prompt per line (`\\n` escapes a newline, `\\\\` a backslash), or JSON lines
`{"prompt": "...", "answer": 42, ...}` whose other fields the batched reward receives. Every
8th prompt (index 7, 15, ...) is held out: never trained on, the unperturbed model's mean
reward on the first `fitness.held_out_prompts` of them is reported at every validation. With
`prompts = "data"`, train prompts begin the train split's documents and held-out ones the
valid split's.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .config import RunConfig
from .data import Dataset
from .fitness import MAX_REWARD, REWARD_UNIT
from .hf_dir import ModelDirError, check_model_dir, pinned_files, pinned_matrices
from .noise import DOMAIN_PROMPT, combine_array, hash_key
from .replica import CheckpointError, ReplicaState, checkpoint_bytes, load_checkpoint
from .sample import SampleSettings
from .vocab import VocabError, decode, encode

BUILTIN = "builtin:"
DATA_PROMPTS = "data"
HELD_OUT_EVERY = 8  # prompt i is held out when i % 8 == 7
MAX_PROMPTS_FILE_BYTES = 64 << 20
MAX_PROMPTS = 1 << 20
DATA_PROMPT_TOKENS = 16  # the beginning of a document that a "data" prompt keeps


class GoalError(ValueError):
    """A goal file that is missing, differs from the run's, or does not read; one line."""


# --- built-in rewards: for demos and tests ---------------------------------------------


def letter_e(text: str) -> float:
    """The share of the letter e among the completion's characters (0 for an empty one)."""
    return text.lower().count("e") / len(text) if text else 0.0


def brackets(text: str) -> float:
    """1 for a completion that opens at least one bracket and closes every one it opens, in
    order; otherwise the share of its brackets that are matched."""
    pairs, stack, matched, total = {")": "(", "]": "[", "}": "{"}, [], 0, 0
    for ch in text:
        if ch in "([{":
            stack.append(ch)
            total += 1
        elif ch in pairs:
            total += 1
            if stack and stack[-1] == pairs[ch]:
                stack.pop()
                matched += 2
    if total == 0:
        return 0.0
    return 1.0 if matched == total else matched / total


BUILTIN_REWARDS: dict[str, Callable[[str], float]] = {"letter_e": letter_e, "brackets": brackets}


# --- files and their digests ---------------------------------------------------------------


def reward_target(spec: str) -> tuple[str, str]:
    """'score.py:function' -> ('score.py', 'function'); 'builtin:NAME' -> ('', NAME)."""
    if spec.startswith(BUILTIN):
        name = spec[len(BUILTIN) :]
        if name not in BUILTIN_REWARDS:
            known = ", ".join(BUILTIN + n for n in BUILTIN_REWARDS)
            raise GoalError(f"fitness.reward={spec!r} is not a built-in reward (known: {known})")
        return "", name
    path, sep, function = spec.rpartition(":")
    if not sep or not path or not function.isidentifier() or not path.endswith(".py"):
        raise GoalError(
            f"fitness.reward={spec!r} must be 'file.py:function' or one of "
            f"{', '.join(BUILTIN + n for n in BUILTIN_REWARDS)}"
        )
    return path, function


def resolve(path: str, base: Path) -> Path:
    """A goal file's path: absolute as given, else relative to `base`."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def file_sha256(path: Path, what: str) -> str:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        raise GoalError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise GoalError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise GoalError(f"{what} {path} cannot be read: {exc.strerror}") from None


def _files(cfg: RunConfig) -> list[tuple[str, str, str, str]]:
    """(section.key, path, pinned digest field, what) of every goal file the config names."""
    out = []
    f = cfg.fitness
    if f.objective == "reward":
        path, _ = reward_target(f.reward)
        if path:
            out.append(("fitness.reward_sha256", path, f.reward_sha256, "reward file"))
        if f.prompts != DATA_PROMPTS:
            out.append(("fitness.prompts_sha256", f.prompts, f.prompts_sha256, "prompts file"))
    return out


def init_digest(path: Path) -> str:
    """The replica digest of a checkpoint or snapshot, as 16 hex digits."""
    return _read_init(path).digest_hex()


def _read_init(path: Path) -> ReplicaState:
    if not path.is_file():
        raise GoalError(f"model.init_from {path} does not exist (a checkpoint or snapshot file)")
    try:
        return load_checkpoint(path)
    except CheckpointError as exc:
        raise GoalError(f"model.init_from {path}: {exc}") from None
    except OSError as exc:
        raise GoalError(f"model.init_from {path} cannot be read: {exc.strerror}") from None


def pin(cfg: RunConfig, base: Path) -> RunConfig:
    """The config with the digests of its goal files filled in (from files under `base`,
    the config file's folder); the reward, prompts and start are checked to load."""
    f = cfg.fitness
    digests: dict[str, str] = {}
    for key, path, _, what in _files(cfg):
        digests[key.split(".")[1]] = file_sha256(resolve(path, base), what)
    if digests:
        cfg = cfg.replace(fitness=replace(f, **digests))
    if cfg.model.init_from:
        start = _read_init(resolve(cfg.model.init_from, base))
        _check_start(cfg, start, cfg.model.init_from)
        cfg = cfg.replace(model=replace(cfg.model, init_digest=start.digest_hex()))
    if cfg.model.arch == "hf":
        m, path = cfg.model, resolve(cfg.model.path, base)
        try:
            matrices, files = pinned_matrices(path, m.targets, m.rank), pinned_files(path)
        except ModelDirError as exc:
            raise GoalError(str(exc)) from None
        cfg = cfg.replace(model=replace(m, files=files, matrices=matrices))
    return cfg


def model_dir(cfg: RunConfig, base: Path | None, confined: bool = True) -> Path:
    """Where an hf run's model directory is: `model.path` under `base` (the config's folder,
    or a worker's --goal-dir). A worker's is `confined`: GoalError when it has no --goal-dir,
    or the path is absolute or climbs out of it (`..`; links inside it are followed)."""
    if base is None:
        raise GoalError(
            f"the run fine-tunes the model in {cfg.model.path}: start this worker with "
            "--goal-dir DIR, the folder that holds the run's model directory"
        )
    given = Path(cfg.model.path)
    if confined and (given.is_absolute() or ".." in given.parts):
        raise GoalError(
            f"the run's model directory {cfg.model.path} is not inside this worker's goal "
            f"directory {base}: a worker reads goal files only under --goal-dir (give the "
            "run a model path relative to its config's folder)"
        )
    return resolve(cfg.model.path, base)


def check_model(cfg: RunConfig, path: Path) -> None:
    """GoalError unless the model directory at `path` is the run's: every file's sha256,
    and the target matrices its model has (listed on the meta device, nothing allocated)."""
    m = cfg.model
    try:
        check_model_dir(path, m.files)
        mine = pinned_matrices(path, m.targets, m.rank)
    except ModelDirError as exc:
        raise GoalError(str(exc)) from None
    if mine != m.matrices:
        raise GoalError(
            f"the model in {path} has other target matrices than the run's ({len(mine)} "
            f"against {len(m.matrices)}; a different transformers release?)"
        )


def check_files(cfg: RunConfig, base: Path | None) -> None:
    """Raise GoalError naming the first goal file under `base` that is not the run's. A
    worker checks a config it was sent: its goal files (reward, prompts, starting replica)
    must lie inside `base`, its --goal-dir (None: it was given none, so it reads no goal
    file), so that a coordinator can never point it at other code or files on the machine,
    however it pins them."""
    files = _files(cfg)
    if cfg.model.init_from:
        files.append(("model.init_digest", cfg.model.init_from, "", "model.init_from"))
    if cfg.model.arch == "hf":
        model_dir(cfg, base)  # where; its files are hashed off the event loop (`check_model`)
    if files and base is None:
        raise GoalError(
            f"the run reads {files[0][3]} {files[0][1]}: start this worker with --goal-dir "
            "DIR, the folder that holds the run's goal files"
        )
    for key, path, pinned, what in files:
        inside = resolve(path, base).resolve()
        if not inside.is_relative_to(base.resolve()):
            raise GoalError(
                f"the run's {what} {path} is outside this worker's goal directory {base}: a "
                "worker reads goal files only under --goal-dir"
            )
        if key == "model.init_digest":
            continue  # its replica digest is checked as it loads, below
        if not pinned:
            raise GoalError(f"the run config names {what} {path} but not its digest ({key})")
        mine = file_sha256(resolve(path, base), what)
        if mine != pinned:
            raise GoalError(
                f"{what} {resolve(path, base)} (sha256 {mine[:16]}...) is not the run's "
                f"(sha256 {pinned[:16]}...): use the same file everywhere"
            )
    if cfg.model.init_from:
        path = resolve(cfg.model.init_from, base)
        limit = 4 * checkpoint_bytes(cfg) + (1 << 20)  # read whole: bounded first
        if path.is_file() and path.stat().st_size > limit:
            raise GoalError(
                f"model.init_from {path} is {path.stat().st_size:,} bytes, more than a "
                f"checkpoint of this model can be ({limit:,})"
            )
        initial_state(cfg, base)


def _check_start(cfg: RunConfig, start: ReplicaState, where: str) -> None:
    mine, theirs = cfg.model, start.config.model
    for key in ("arch", "vocab_size", "n_layer", "d_model", "n_head", "head_bias"):
        if getattr(mine, key) != getattr(theirs, key):
            raise GoalError(
                f"model.init_from {where} has model.{key}={getattr(theirs, key)!r}, this run "
                f"{getattr(mine, key)!r}: a run starts only from a replica of the same model"
            )


def initial_state(
    cfg: RunConfig, base: Path | None = None, path: Path | None = None
) -> ReplicaState:
    """The replica at step 0: init_seed's weights, or the weights of `model.init_from`
    (under `base`, or at `path`: a save directory's copy) when its replica digest is the one
    the config pins."""
    if not cfg.model.init_from:
        return ReplicaState.initial(cfg)
    if not cfg.model.init_digest:
        raise GoalError("the run config names model.init_from but not its model.init_digest")
    path = path or resolve(cfg.model.init_from, base or Path("."))
    start = _read_init(path)
    if start.digest_hex() != cfg.model.init_digest:
        raise GoalError(
            f"model.init_from {path} holds replica {start.digest_hex()}, the run started from "
            f"{cfg.model.init_digest}: use the same file everywhere"
        )
    _check_start(cfg, start, str(path))
    fresh = ReplicaState.initial(cfg)
    return ReplicaState(cfg, 0, {k: v.copy() for k, v in start.params.items()}, fresh.opt)


# --- prompts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One prompt: its number in the prompt set (the sampling seed's), text and tokens, and
    the fields a batched reward receives beside it."""

    index: int
    text: str
    tokens: tuple[int, ...]
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Prompts:
    train: list[Prompt]
    held_out: list[Prompt]


def _unescape(line: str) -> str:
    out, i = [], 0
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line) and line[i + 1] in "n\\":
            out.append("\n" if line[i + 1] == "n" else "\\")
            i += 2
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def read_prompts(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(text, fields) of every prompt in a prompts file; GoalError naming the line of the
    first that does not read."""
    try:
        size = path.stat().st_size
        if size > MAX_PROMPTS_FILE_BYTES:
            raise GoalError(
                f"prompts file {path} is {size:,} bytes; the limit is {MAX_PROMPTS_FILE_BYTES:,}"
            )
        raw = path.read_bytes()
    except FileNotFoundError:
        raise GoalError(f"prompts file {path} does not exist") from None
    except OSError as exc:
        raise GoalError(f"prompts file {path} cannot be read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GoalError(f"prompts file {path} is not UTF-8 (byte {exc.start})") from None
    out: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(out) == MAX_PROMPTS:
            raise GoalError(f"prompts file {path} holds more than {MAX_PROMPTS:,} prompts")
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # ValueError: also a 5,000-digit number
                raise GoalError(f"{path} line {number} is not valid JSON") from None
            prompt = record.pop("prompt", None) if isinstance(record, dict) else None
            if not isinstance(prompt, str):
                raise GoalError(f'{path} line {number} has no "prompt" string')
            out.append((prompt, record))
        else:
            out.append((_unescape(line), {}))
    if len(out) < HELD_OUT_EVERY:
        raise GoalError(
            f"prompts file {path} holds {len(out)} prompts; at least {HELD_OUT_EVERY} are needed "
            f"(every {HELD_OUT_EVERY}th is held out)"
        )
    return out


@dataclass(frozen=True)
class TextCodec:
    """A model's own tokenizer (a Hugging Face model's; the data's vocabulary otherwise):
    prompts are encoded with it, completions decoded, and a prompt longer than `context`
    tokens is refused."""

    encode: Callable[[str], Sequence[int]]
    decode: Callable[[Sequence[int]], str]
    context: int
    what: str = "es.seq_len"  # the setting that limits the context, for the error line


def data_codec(cfg: RunConfig, dataset: Dataset) -> TextCodec:
    """The data's vocabulary as a codec (the int8 models')."""
    pieces = dataset.decoding
    return TextCodec(
        lambda text: encode(text.encode("utf-8"), pieces),
        lambda tokens: decode(tokens, pieces),
        cfg.es.seq_len,
    )


def _tokens(text: str, where: str, codec: TextCodec) -> tuple[int, ...]:
    try:
        ids = codec.encode(text)
    except VocabError as exc:
        raise GoalError(f"{where}: {exc}") from None
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        raise GoalError(f"{where} is not valid Unicode text") from None
    if len(ids) > codec.context:
        raise GoalError(
            f"{where} is {len(ids)} tokens, longer than the model's context of "
            f"{codec.context} ({codec.what}): shorten it"
        )
    return tuple(int(t) for t in ids)


def _document_starts(tokens: np.ndarray, limit: int) -> list[tuple[int, ...]]:
    """The first `limit` tokens of up to MAX_PROMPTS documents (token 0 separates them)."""
    starts = np.flatnonzero(tokens == 0) + 1
    starts = np.concatenate([[0], starts])[:MAX_PROMPTS]
    out = []
    for s in starts:
        window = tokens[s : s + limit]
        end = np.flatnonzero(window == 0)
        kept = window[: end[0]] if len(end) else window
        if len(kept):
            out.append(tuple(int(t) for t in kept))
    return out


def load_prompts(
    cfg: RunConfig, base: Path, dataset: Dataset, codec: TextCodec | None = None
) -> Prompts:
    """The run's prompts, tokenized with `codec` (default: the data's vocabulary); a prompt
    longer than the model's context is refused, naming it."""
    codec = codec or data_codec(cfg, dataset)
    if cfg.fitness.prompts == DATA_PROMPTS:
        limit = min(DATA_PROMPT_TOKENS, codec.context)
        pieces = dataset.decoding
        made = []
        for split, tokens in ((0, dataset.train), (1, dataset.valid)):
            made.append(
                [
                    Prompt(
                        (split << 32) + i,
                        b"".join(pieces[t] for t in ids).decode("utf-8", "replace"),
                        ids,
                    )
                    for i, ids in enumerate(_document_starts(tokens, limit))
                ]
            )
        if not made[0] or not made[1]:
            raise GoalError("fitness.prompts='data' found no documents in a split of the data")
        return Prompts(made[0], made[1])
    path = resolve(cfg.fitness.prompts, base)
    train, held = [], []
    for i, (text, fields) in enumerate(read_prompts(path)):
        prompt = Prompt(i, text, _tokens(text, f"{path} prompt {i + 1}", codec), fields)
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(prompt)
    return Prompts(train, held)


def step_prompts(cfg: RunConfig, prompts: Prompts, step: int) -> list[Prompt]:
    """The prompts step `step` continues: key(PROMPT, data_seed, step, i) mod the train
    prompts, for i < prompts_per_step (drawn with replacement)."""
    base = hash_key(DOMAIN_PROMPT, cfg.data.data_seed, step)
    keys = combine_array(base, np.arange(cfg.fitness.prompts_per_step, dtype=np.uint64))
    picks = (keys % np.uint64(len(prompts.train))).astype(np.int64)
    return [prompts.train[int(i)] for i in picks]


def held_out(cfg: RunConfig, prompts: Prompts) -> list[Prompt]:
    return prompts.held_out[: cfg.fitness.held_out_prompts]


def generation_seed(cfg: RunConfig, step: int) -> int:
    """The sampling seed of step `step`'s completions (a held-out score uses its step's)."""
    return hash_key(DOMAIN_PROMPT, cfg.es.run_seed, step, 1)


def settings(cfg: RunConfig) -> SampleSettings:
    f = cfg.fitness
    return SampleSettings(
        temperature=f.temperature, min_p=f.min_p, top_k=0, presence_penalty=0, frequency_penalty=0
    )


# --- fitness from rewards -------------------------------------------------------------------


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


def reward_fitness(rewards: np.ndarray) -> np.ndarray:
    """Ternary fitness (int8, one per pair) from rewards (members, prompts), members in
    pairs (+, -): sign of the difference of the pair's exactly summed rewards."""
    totals = [math.fsum(row) for row in np.asarray(rewards, dtype=np.float64).tolist()]
    plus, minus = totals[0::2], totals[1::2]
    return np.array([(p > m) - (p < m) for p, m in zip(plus, minus, strict=True)], dtype=np.int8)


def reward_units(rewards: np.ndarray) -> int:
    """A chunk's reward sum in millionths, the integer RESULT carries for reporting."""
    return round(math.fsum(np.asarray(rewards, dtype=np.float64).ravel().tolist()) / REWARD_UNIT)

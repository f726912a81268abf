"""The files a run config names besides its data, and the one rule about them.

A goal's files are pinned by the run config: the objective's (a reward's source and its
prompts: `files` of shared/objectives/), the replica a run starts from (`model.init_from`)
and a Hugging Face model's directory (`model.path`: its files' digests and chosen matrices,
shared/hf_dir.py). `pin` records their digests when a config is loaded, so the config digest
covers them. A worker reads its own copies only under its --goal-dir, and `check_files`
refuses a copy that differs, naming the file: a coordinator can never point a worker at
other code or files on its machine, however it pins them.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from .config import RunConfig
from .hf_dir import ModelDirError, check_model_dir, pinned_files, pinned_matrices, target_dtype
from .objectives import GoalFile, objective_of
from .replica import CheckpointError, ReplicaState, checkpoint_bytes, load_checkpoint


class GoalError(ValueError):
    """A goal file that is missing, differs from the run's, or does not read; one line."""


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


def _files(cfg: RunConfig) -> list[GoalFile]:
    """Every file the objective reads, whose digest the config pins."""
    try:
        return objective_of(cfg).files(cfg)
    except ValueError as exc:  # a reward spec not checked yet (a config not validated)
        raise GoalError(str(exc)) from None


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


def read_start(cfg: RunConfig, path: Path) -> ReplicaState:
    """The replica of `model.init_from` at `path`, when its digest is the one the config
    pins and its model the run's; GoalError otherwise."""
    if not cfg.model.init_digest:
        raise GoalError("the run config names model.init_from but not its model.init_digest")
    start = _read_init(path)
    if start.digest_hex() != cfg.model.init_digest:
        raise GoalError(
            f"model.init_from {path} holds replica {start.digest_hex()}, the run started from "
            f"{cfg.model.init_digest}: use the same file everywhere"
        )
    _check_start(cfg, start, str(path))
    return start


def pin(cfg: RunConfig, base: Path) -> RunConfig:
    """The config with the digests of its goal files filled in (from files under `base`,
    the config file's folder); the reward, prompts and start are checked to load."""
    f = cfg.fitness
    digests: dict[str, str | tuple[str, ...]] = {}
    for key, path, _, what in _files(cfg):
        name, digest = key.split(".")[1], file_sha256(resolve(path, base), what)
        # a tuple setting pins one digest per file, in the order the objective lists them
        many = isinstance(getattr(f, name), tuple)
        digests[name] = (*digests.get(name, ()), digest) if many else digest
    if digests:
        cfg = cfg.replace(fitness=replace(f, **digests))
    if cfg.model.init_from:
        start = _read_init(resolve(cfg.model.init_from, base))
        _check_start(cfg, start, cfg.model.init_from)
        cfg = cfg.replace(model=replace(cfg.model, init_digest=start.digest_hex()))
    if cfg.model.path:  # a model directory (shared/hf.py)
        m, path = cfg.model, resolve(cfg.model.path, base)
        try:
            matrices, files = pinned_matrices(path, m.targets, m.rank), pinned_files(path)
            dtype = target_dtype(path, matrices)
        except ModelDirError as exc:
            raise GoalError(str(exc)) from None
        cfg = cfg.replace(model=replace(m, files=files, matrices=matrices, weight_dtype=dtype))
    return cfg


def model_dir(cfg: RunConfig, base: Path | None, confined: bool = True) -> Path:
    """Where an hf run's model directory is: `model.path` under `base` (the config's folder,
    or a worker's --goal-dir). A worker's is `confined`: GoalError when it has no --goal-dir,
    or the path is absolute, a home directory's (`~`, which `resolve` would expand), or
    climbs out of it (`..`); links inside it are followed."""
    if base is None:
        raise GoalError(
            f"the run fine-tunes the model in {cfg.model.path}: start this worker with "
            "--goal-dir DIR, the folder that holds the run's model directory"
        )
    given = Path(cfg.model.path)
    home = bool(given.parts) and given.parts[0].startswith("~")
    if confined and (given.is_absolute() or home or ".." in given.parts):
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
    code = objective_of(cfg).inline_code(cfg)
    if code is not None:  # the coordinator's text, not a file this machine holds
        shown = code if len(code) <= 60 else code[:60] + "..."
        raise GoalError(
            f"the run's reward {shown!r} is code in its config: a worker runs only reward "
            "files it holds under --goal-dir, never code a coordinator sends (give the run a "
            "reward file)"
        )
    files = _files(cfg)
    if cfg.model.init_from:
        files.append(GoalFile("model.init_digest", cfg.model.init_from, "", "model.init_from"))
    if cfg.model.path:
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
        read_start(cfg, path)


def _check_start(cfg: RunConfig, start: ReplicaState, where: str) -> None:
    mine, theirs = cfg.model, start.config.model
    for key in ("arch", "vocab_size", "n_layer", "d_model", "n_head", "head_bias"):
        if getattr(mine, key) != getattr(theirs, key):
            raise GoalError(
                f"model.init_from {where} has model.{key}={getattr(theirs, key)!r}, this run "
                f"{getattr(mine, key)!r}: a run starts only from a replica of the same model"
            )

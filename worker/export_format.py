"""The export format of `eggroll-export`: a replica as safetensors and JSON, for tools
outside this project.

Checkpoints (shared/replica.py) stay the project's own format; an export is for reading a
model elsewhere. An export directory holds:

    model.safetensors  every weight (int8), named by parameter (`emb`, `layers.0.wf`, ...),
                       then the update rule's state (`momentum.emb`, `adamw.v.emb`, ...:
                       int32 or int64) where the rule has state; header metadata: format,
                       step, replica_digest
    config.json        format, step, replica digest, config digest, the run config, the
                       architecture, the vocabulary, the data digest, and which tensors are
                       weights and which optimizer state; written last
    tokenizer.json     for a BPE vocabulary: the tokenizer of the run's data directory

`load_export` reads one back and checks that it gives the replica digest it names, so an
export round trip is exact. The tensors are those of the replica digest, in its order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from ..shared.atomic_file import write_atomic
from ..shared.config import ConfigError, from_dict
from ..shared.data import BYTE_VOCAB_SIZE, TOKENIZER_FILE
from ..shared.model import param_specs
from ..shared.replica import ReplicaState
from ..shared.update import state_specs

EXPORT_FORMAT = "eggroll-export/1"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ExportError(Exception):
    """An export directory that cannot be read or does not give its replica; one line."""


def export_tensors(state: ReplicaState) -> dict[str, np.ndarray]:
    """Every tensor of the replica by name: the weights, then the update rule's state."""
    tensors = {s.name: state.params[s.name] for s in param_specs(state.config.model)}
    tensors |= {s.name: state.opt[s.name] for s in state_specs(state.config)}
    return {
        name: np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("<"))
        for name, t in tensors.items()
    }


def export_config(state: ReplicaState, data_digest: str | None, tokenizer: bool) -> dict[str, Any]:
    """config.json of an export of `state`."""
    cfg = state.config
    vocab = cfg.model.vocab_size
    return {
        "format": EXPORT_FORMAT,
        "step": state.step,
        "replica_digest": state.digest_hex(),
        "config_digest": cfg.digest().hex(),
        "architecture": cfg.model.arch,
        "vocab": {
            "size": vocab,
            "kind": "bytes" if vocab == BYTE_VOCAB_SIZE else "bpe",
            "tokenizer": TOKENIZER_FILE if tokenizer else None,
        },
        "data_digest": data_digest,
        "update_rule": cfg.update.rule,
        "weights": [s.name for s in param_specs(cfg.model)],
        "optimizer_state": [s.name for s in state_specs(cfg)],
        "config": cfg.to_dict(),
    }


def write_export(
    out: Path, state: ReplicaState, data_digest: str | None, tokenizer: Path | None
) -> list[str]:
    """Write an export of `state` into `out` (created if needed); the files written. The old
    config.json goes first and the new one comes last, so a failed write (OSError, naming
    its file) never leaves a directory that reads as a whole export."""
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).unlink(missing_ok=True)
    metadata = {
        "format": EXPORT_FORMAT,
        "step": str(state.step),
        "replica_digest": state.digest_hex(),
    }
    write_atomic(out / MODEL_FILE, safetensors.numpy.save(export_tensors(state), metadata))
    files = [MODEL_FILE]
    if tokenizer is not None:
        write_atomic(out / TOKENIZER_FILE, tokenizer.read_bytes())
        files.append(TOKENIZER_FILE)
    else:
        (out / TOKENIZER_FILE).unlink(missing_ok=True)  # from an older export
    record = export_config(state, data_digest, tokenizer is not None)
    write_atomic(out / CONFIG_FILE, (json.dumps(record, indent=2) + "\n").encode())
    return [*files, CONFIG_FILE]


def is_export(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / MODEL_FILE).is_file()


def read_export_record(path: Path) -> dict[str, Any]:
    """config.json of the export in `path`."""
    try:
        record = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path / CONFIG_FILE} is unreadable ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path / CONFIG_FILE} is not an {EXPORT_FORMAT} config")
    return record


def load_export(path: str | Path) -> ReplicaState:
    """The replica of the export in `path`, checked against the digest its config.json
    names."""
    path = Path(path)
    record = read_export_record(path)
    try:
        config = from_dict(record["config"])
        step = int(record["step"])
        with safetensors.safe_open(str(path / MODEL_FILE), framework="np") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise ExportError(f"{path} is not a readable export ({exc})") from None
    except (OSError, safetensors.SafetensorError) as exc:
        raise ExportError(f"{path / MODEL_FILE} is unreadable ({exc})") from None
    specs = [(s.name, s.shape, np.int8) for s in param_specs(config.model)]
    specs += [(s.name, s.shape, s.dtype) for s in state_specs(config)]
    if sorted(tensors) != sorted(name for name, _, _ in specs):
        raise ExportError(f"{path / MODEL_FILE} does not hold the tensors its config needs")
    for name, shape, dtype in specs:
        t = tensors[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != np.dtype(dtype):
            raise ExportError(f"{path / MODEL_FILE}: tensor {name!r} does not fit the config")
    params = {s.name: tensors[s.name] for s in param_specs(config.model)}
    opt = {s.name: tensors[s.name] for s in state_specs(config)}
    state = ReplicaState(config, step, params, opt)
    if state.digest_hex() != record.get("replica_digest"):
        raise ExportError(
            f"{path} gives replica {state.digest_hex()}, its {CONFIG_FILE} names "
            f"{record.get('replica_digest')}: the files are not of one export"
        )
    return state

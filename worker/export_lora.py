"""`eggroll-export --lora R`: the change a Hugging Face run made to its target matrices, as a
PEFT LoRA adapter for the run's base model.

A target's change is dW = W - W_0, the state's weights less the base model's (shared/hf.py:
both exact in float64), (out, in) in nn.Linear's convention.
Its SVD dW = U S V^T truncated to rank r gives B = U_r sqrt(S_r) (out, r) and
A = sqrt(S_r) V_r^T (r, in): B A is the closest rank-r matrix to dW (Eckart-Young). PEFT
adds lora_B @ lora_A * lora_alpha / r, and lora_alpha = r makes that scale 1. GPT-2's
Conv1D stores its weight (in, out); PEFT's fan_in_fan_out transposes B A for it, so the
factors are the same for both kinds of layer. An adapter directory holds:

    adapter_model.safetensors  per target, float32 `base_model.model.<module>.lora_A.weight`
                               (r, in) and `...lora_B.weight` (out, r); header metadata:
                               format "pt" and `eggroll_lora`, the record below as JSON
    eggroll_lora.json          the record: step, replica digest, rank, and per target its
                               shape, the Frobenius norm of dW and the truncation's relative
                               error ||dW - B A||_F / ||dW||_F (0 for dW = 0)
    adapter_config.json        PEFT's LoRA config; written last

`PeftModel.from_pretrained(base, DIR)` loads it on the base model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from ..shared import hf
from ..shared.atomic_file import write_atomic
from ..shared.replica import ReplicaState

LORA_FORMAT = "eggroll-lora/1"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MODEL = "adapter_model.safetensors"
LORA_RECORD = "eggroll_lora.json"


class LoraError(ValueError):
    """A LoRA export that cannot be made (a rank too large, another model); one line."""


def check_rank(state: ReplicaState, rank: int) -> None:
    """LoraError unless `rank` fits every target (at most min(out, in))."""
    for t in hf.targets(state.config.model):
        if rank > min(t.shape):
            raise LoraError(
                f"--lora {rank} is above the size of target {t.name} "
                f"({t.shape[0]} x {t.shape[1]}): use at most {min(t.shape)}"
            )


def lora_factors(delta: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, float]:
    """float32 B (out, r) and A (r, in) with B A the rank-r truncated SVD of `delta`, and
    the relative error of the factors as stored (float32 included)."""
    delta = np.asarray(delta, dtype=np.float64)
    u, s, vt = np.linalg.svd(delta, full_matrices=False)
    root = np.sqrt(s[:rank])
    b = (u[:, :rank] * root).astype(np.float32)
    a = (root[:, None] * vt[:rank]).astype(np.float32)
    norm = float(np.linalg.norm(delta))
    if norm == 0.0:
        return b, a, 0.0
    rest = delta - b.astype(np.float64) @ a.astype(np.float64)
    return b, a, float(np.linalg.norm(rest)) / norm


def conv1d_targets(model_dir: Path, state: ReplicaState) -> set[str]:
    """The targets that are GPT-2 Conv1D layers, from the model directory's config.json
    (the run's, by its pinned digest), built on the meta device: no weights are read."""
    from ..shared.hf_dir import linear_layers, read_config, require_hf

    torch, transformers = require_hf()
    config_file = Path(model_dir) / "config.json"
    pinned = {name: digest for digest, name in (e.split(" ", 1) for e in state.config.model.files)}
    try:
        digest = hashlib.sha256(config_file.read_bytes()).hexdigest()
    except OSError as exc:
        raise LoraError(f"cannot read {config_file}: {exc.strerror}") from None
    if pinned.get("config.json", digest) != digest:
        raise LoraError(f"model file {config_file} differs from the run's")
    config = read_config(Path(model_dir))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = {name: (shape, transposed) for name, _, shape, transposed in linear_layers(model)}
    for t in hf.targets(state.config.model):
        if layers.get(t.name, (None,))[0] != t.shape:
            raise LoraError(f"{model_dir} has no {t.shape[0]} x {t.shape[1]} layer {t.name}")
    return {t.name for t in hf.targets(state.config.model) if layers[t.name][1]}


def adapter_config(state: ReplicaState, rank: int, fan_in_fan_out: bool) -> dict[str, Any]:
    """PEFT's adapter_config.json: only keys every peft release since 0.12 reads."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": state.config.model.path,
        "revision": None,
        "r": rank,
        "lora_alpha": rank,  # scaling lora_alpha / r = 1: B A is the change itself
        "lora_dropout": 0.0,
        "target_modules": [t.name for t in hf.targets(state.config.model)],
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def write_lora(
    out: Path,
    state: ReplicaState,
    base: ReplicaState,
    rank: int,
    conv1d: set[str],
    say: Callable[[str], None],
) -> dict[str, float]:
    """Write the adapter of `state`'s change from `base` (the run's step 0) at `rank` into
    `out` (created if needed), saying each target's relative error as it is factored;
    {target: relative error}. The old
    adapter_config.json goes first and the new one comes last, so a failed write (OSError)
    never leaves a directory that PEFT reads as a whole adapter."""
    check_rank(state, rank)
    names = {entry.split(" ")[0] for entry in state.config.model.matrices}
    if conv1d and conv1d != names:  # PEFT's config has one fan_in_fan_out for every target
        raise LoraError(
            f"the run's targets mix GPT-2 Conv1D layers ({len(conv1d)}) and linear layers "
            f"({len(names - conv1d)}): one LoRA adapter cannot hold both; export the merged model"
        )
    if base.config.digest() != state.config.digest() or base.step != 0:
        raise LoraError("the base state is not step 0 of the run")
    dtype = state.config.model.weight_dtype
    tensors: dict[str, np.ndarray] = {}
    targets: dict[str, dict[str, Any]] = {}
    for t in hf.targets(state.config.model):
        now, then = (hf.widen(s.params[t.name], dtype) for s in (state, base))
        delta = now.astype(np.float64) - then.astype(np.float64)
        b, a, error = lora_factors(delta, rank)
        tensors[f"base_model.model.{t.name}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"base_model.model.{t.name}.lora_B.weight"] = np.ascontiguousarray(b)
        norm = float(np.linalg.norm(delta))
        targets[t.name] = {"shape": list(t.shape), "norm": norm, "relative_error": error}
        say(f"{t.name} ({t.shape[0]} x {t.shape[1]}): relative error {error:.3g}")
    record = {
        "format": LORA_FORMAT,
        "step": state.step,
        "replica_digest": state.digest_hex(),
        "config_digest": state.config.digest().hex(),
        "base_model_name_or_path": state.config.model.path,
        "rank": rank,
        "targets": targets,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).unlink(missing_ok=True)
    text = json.dumps(record, indent=2) + "\n"
    metadata = {"format": "pt", "eggroll_lora": json.dumps(record, separators=(",", ":"))}
    write_atomic(out / ADAPTER_MODEL, safetensors.numpy.save(tensors, metadata))
    write_atomic(out / LORA_RECORD, text.encode())
    config = adapter_config(state, rank, bool(conv1d))
    write_atomic(out / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return {name: entry["relative_error"] for name, entry in targets.items()}

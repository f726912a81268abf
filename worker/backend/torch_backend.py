"""The PyTorch backend: a Hugging Face causal LM's population (the `hf` family), on a CUDA GPU
or the CPU.

The replica is `shared.hf`'s: the target weights' bit patterns in the dtype of the model's
files, updated by an exact elementwise rule (worker/hf_update.py, equal bit for bit to the
NumPy reference). The model evaluates members in floating point (worker/hf_model.py:
bfloat16 on a GPU, float32 on a CPU), which changes which fitness this worker proposes, never
the state. Where the evaluation dtype is the state's (a bfloat16 model on a GPU, a float32
model on a CPU), the model's target weights are the state: a step updates them in place on
the device, and the host copy (`state`) is pulled back a tensor at a time when the digest or
a snapshot asks for it. Otherwise (a float32 model evaluated in bfloat16, a bfloat16 model
in float32) the host copy is the state, and each step's targets go to the device and back.

Text is the model's own: the objective's prompts are encoded and its completions decoded
with the tokenizer saved beside the model (`codec`), and the next-token objective scores the
data directory's documents re-tokenized with it (their text, each followed by the end-of-text
token), a pure function of the data and the pinned tokenizer files. Pair k's two members
score the same window of es.seq_len + 1 tokens (`shared.window.pair_windows`); a member's
integer loss is its summed negative log-likelihood in 1/16 bit, rounded, so the pair fitness
is `shared.fitness.pair_fitness` of the int8 models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from ...shared.config import RunConfig
from ...shared.data import Dataset
from ...shared.fitness import pair_fitness
from ...shared.hf import Target
from ...shared.objectives import objective_of
from ...shared.pinned import check_model, model_dir
from ...shared.replica import ReplicaState
from ...shared.sample import Completions, SampleRequest
from ...shared.text_codec import TextCodec
from ...shared.window import pair_windows, validation_windows
from ..hf_claims import claim_distances
from ..hf_model import HFModelError, PopulationLM, load_causal_lm, load_tokenizer
from ..hf_update import apply_update
from . import FAMILIES, BackendFactory, ChunkResult, HeldOut, HostReplica, Validation, check_chunk

log = structlog.get_logger("eggroll.worker")

LOSS_UNITS = 16 / math.log(2)  # nats -> 1/16 bit, the int8 models' loss unit


def retokenize(tokens: np.ndarray, pieces: Sequence[bytes], tokenizer: Any) -> np.ndarray:
    """A data split's documents (token 0 separates them) as the model's tokens, each followed
    by its end-of-text token (int64)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    text = b"".join(pieces[t] for t in tokens.tolist())
    zero = pieces[0] if len(pieces[0]) else b"\x00"
    for document in text.split(zero):
        if document:
            ids += tokenizer.encode(document.decode("utf-8", "replace"), add_special_tokens=False)
            if eos is not None:
                ids.append(eos)
    return np.array(ids, dtype=np.int64)


class TorchBackend(HostReplica):
    """Holds one hf replica (the target weights), its model on a device, and the data's text
    (None: a reward run without data, which scores no text)."""

    name = "torch"

    def __init__(
        self,
        dataset: Dataset | None,
        state: ReplicaState,
        path: Path,
        device: str,
        dtype: str,
        batch_members: int = 64,
    ) -> None:
        self.dataset, self.path, self.device = dataset, path, device
        self.batch_members = max(2, batch_members - batch_members % 2)
        self.tokenizer = load_tokenizer(path)
        self.lm = PopulationLM(load_causal_lm(path, dtype, device), state.config, state)
        self._take(state)
        cfg = state.config
        limit = getattr(self.lm.model.config, "max_position_embeddings", None) or 1 << 16
        windows = objective_of(cfg).WINDOWS  # members read the train split's windows
        self.codec = TextCodec(
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self._decode,
            max(1, limit - cfg.fitness.completion_tokens),
            "the model's max_position_embeddings less fitness.completion_tokens",
        )
        if windows and cfg.es.seq_len + 1 > limit:
            raise HFModelError(
                f"es.seq_len={cfg.es.seq_len} reads {cfg.es.seq_len + 1} positions; the model "
                f"in {path} has {limit}"
            )
        # The data in the model's tokens, made now so that data too short for the run stops
        # it here with one line, not in the middle of a step.
        self._splits: dict[str, np.ndarray] = {}
        if dataset is not None:
            self.split("valid")
        if windows:
            self.split("train")

    def _decode(self, ids: Sequence[int]) -> str:
        """A completion's text: up to its first end-of-text token (what follows it is not
        part of the answer), without special tokens."""
        eos = self.tokenizer.eos_token_id
        ids = list(ids)
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def parallel_chunks(self) -> int:
        return 1

    # --- the replica ---------------------------------------------------------------------

    def _take(self, state: ReplicaState) -> None:
        self._config, self._step, self._opt = state.config, state.step, state.opt
        # the host copy of the target weights; None while the model's weights are newer
        self._host: dict[str, np.ndarray] | None = dict(state.params)

    @property
    def config(self) -> RunConfig:
        return self._config

    @property
    def step(self) -> int:
        return self._step

    @property
    def state(self) -> ReplicaState:
        """The replica on the host (its weights pulled from the device, a tensor at a time,
        when a step changed them there)."""
        if self._host is None:
            self._host = {}  # the old copy is gone: one copy at a time
            for name in self.lm.modules:  # a copy: on a CPU the bits may be the weights
                self._host[name] = self.lm.bits(name).to("cpu", copy=True).numpy()
        return ReplicaState(self._config, self._step, dict(self._host), self._opt)

    def load_state(self, state: ReplicaState) -> None:
        self.lm.load_state(state)
        self._take(state)

    def digest(self) -> int:
        return self.state.digest()

    def apply_step(self, fitness: np.ndarray) -> int:
        """The committed fitness's update, on the device: in place in the model's weights
        where they hold the state, else on the host copy's targets one at a time."""
        lm = self.lm
        if lm.holds_state:
            self._host = None

            def read(t: Target) -> Any:
                return lm.bits(t.name)

            def write(t: Target, bits: Any) -> None:
                lm.write_bits(t.name, bits)

        else:
            host = self._host
            assert host is not None  # the host copy is the state

            def read(t: Target) -> Any:
                return lm.torch.from_numpy(host[t.name]).to(lm.device)

            def write(t: Target, bits: Any) -> None:
                host[t.name] = bits.cpu().numpy()
                lm.write_bits(t.name, bits)

        changed = apply_update(self._config, self._step, np.asarray(fitness), read, write)
        self._step += 1
        return changed

    # --- the next-token objective ----------------------------------------------------------

    def split(self, name: str) -> np.ndarray:
        """The train or valid split in the model's tokens (made once, on first use)."""
        if self.dataset is None:
            raise HFModelError(f"the run has no data directory: it has no {name} text")
        if name not in self._splits:
            tokens = self.dataset.train if name == "train" else self.dataset.valid
            ids = retokenize(tokens, self.dataset.decoding, self.tokenizer)
            if len(ids) <= self.config.es.seq_len + 1:
                raise HFModelError(
                    f"the data's {name} split is {len(ids)} tokens of this model, too few for "
                    f"windows of es.seq_len {self.config.es.seq_len}: prepare more text"
                )
            self._splits[name] = ids
        return self._splits[name]

    def evaluate_chunk(self, step: int, first_member: int, count: int) -> ChunkResult:
        """Members [first, first + count): each pair scores its own window of the train split."""
        check_chunk(self.config, self.step, step, first_member, count)
        torch = self.lm.torch
        train = self.split("train")
        losses = []
        for lo in range(first_member, first_member + count, self.batch_members):
            n = min(self.batch_members, first_member + count - lo)
            pairs = np.arange(lo // 2, (lo + n) // 2, dtype=np.int64)
            windows = pair_windows(self.config, train, step, pairs)  # (P, T + 1)
            rows = torch.from_numpy(np.repeat(windows, 2, axis=0))  # member-major
            nll = self.lm.nll((lo, n), step, rows[:, None, :])  # (n, 1, T)
            losses.append(np.rint(nll.sum(axis=(1, 2)) * LOSS_UNITS).astype(np.int64))
        loss = np.concatenate(losses)
        return ChunkResult(pair_fitness(loss, self.config.fitness), int(loss.sum()))

    def evaluate_chunks(self, step: int, chunks: Sequence[tuple[int, int]]) -> list[ChunkResult]:
        return [self.evaluate_chunk(step, first, count) for first, count in chunks]

    def validate(self, rows_per_batch: int = 64) -> Validation:
        """The unperturbed model's bits per token (and per byte of their text) on the
        held-out windows of the valid split in the model's tokens (none without data)."""
        if self.dataset is None:
            return Validation(None, None)
        torch = self.lm.torch
        windows = validation_windows(self.config, self.split("valid"))
        nats = []
        for lo in range(0, len(windows), rows_per_batch):
            rows = torch.from_numpy(windows[lo : lo + rows_per_batch])
            nats.append(self.lm.nll(None, self.step, rows[None]).reshape(-1))
        values = np.concatenate(nats)
        n = len(values)
        text = self.tokenizer.decode(windows[:, 1:].reshape(-1).tolist())
        bits = math.fsum(values) / math.log(2) / n
        return Validation(HeldOut(n, len(text.encode("utf-8")), bits * 16, bits), None)

    # --- the reward objective ------------------------------------------------------------

    def _pad_id(self) -> int:
        """The id the prompts' left padding reads (the pad token, else end-of-text, else 0)."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def complete(
        self, step: int, members: tuple[int, int] | None, request: Completions
    ) -> np.ndarray:
        """Tokens (count, P, N) that members write after the request's prompts."""
        s = request.settings
        args = (
            request.prompts,
            request.new_tokens,
            s.temperature / 1000,
            request.seed,
            self._pad_id(),
            request.samples,
            s.min_p / 1000,
        )
        if members is None:
            return self.lm.complete(step, None, *args)
        first, count = members
        parts = []
        for lo in range(first, first + count, self.batch_members):
            n = min(self.batch_members, first + count - lo)
            parts.append(self.lm.complete(step, (lo, n), *args))
        return np.concatenate(parts)

    def claim_distances(
        self, step: int, members: tuple[int, int], request: Completions, tokens: np.ndarray
    ) -> np.ndarray:
        """Distances (count, P, N) in [0, 1] of tokens (count, P, N) claimed as what members
        (first, count) wrote for the request: how far each is from the token this model
        would choose (worker/hf_claims.py; `hf_claims.plausible` judges them)."""
        s = request.settings
        args = (s.temperature / 1000, request.seed, self._pad_id(), request.samples, s.min_p / 1000)
        first, count = members
        tokens = np.asarray(tokens)
        parts = []
        for lo in range(first, first + count, self.batch_members):
            n = min(self.batch_members, first + count - lo)
            part = tokens[lo - first : lo - first + n]
            parts.append(claim_distances(self.lm, step, (lo, n), request.prompts, part, *args))
        return np.concatenate(parts)

    def write_sample(self, request: SampleRequest) -> tuple[bytes, bytes]:
        """The unperturbed model continues the first `prompt_tokens` tokens of held-out
        document `prompt_index` (modulo their number; temperature and min_p in thousandths;
        the int8 models' penalties and top-k do not apply)."""
        valid, eos = self.split("valid"), self.tokenizer.eos_token_id
        starts = np.concatenate([[0], np.flatnonzero(valid == eos) + 1])
        starts = starts[starts < len(valid)]
        document = request.prompt_index
        first = int(starts[document % len(starts)])
        window = valid[first : first + max(1, min(request.prompt_tokens, self.codec.context))]
        cut = np.flatnonzero(window == eos)
        prompt = window[: cut[0]] if len(cut) and cut[0] > 0 else window
        out = self.lm.complete(
            self.step,
            None,
            [prompt.tolist()],
            request.new_tokens,
            request.temperature / 1000,
            request.seed,
            0,
            [document],
            request.min_p / 1000,
        )
        texts = self.codec.decode(prompt.tolist()), self.codec.decode(out[0, 0].tolist())
        return texts[0].encode(), texts[1].encode()


def factory(
    batch_members: int = 64,
    threads: int | None = None,
    goal_dir: Path | None = None,
    confined: bool = True,
) -> BackendFactory:
    """The PyTorch backend for hf runs: CUDA when torch sees a GPU (bfloat16), else the CPU
    (float32, `threads` intra-op threads). The model directory is the run's `model.path`
    under `goal_dir`: a worker's --goal-dir (`confined`, and checked file by file against
    the run), or the folder of a local command's config (which it has just pinned)."""
    from ...shared.hf_dir import require_hf

    torch, _ = require_hf()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    dtype = "bfloat16" if device == "cuda" else "float32"

    def build(dataset: Dataset | None, state: ReplicaState) -> TorchBackend:
        path = model_dir(state.config, goal_dir, confined)
        if confined:  # hashing a large model takes a while: off the event loop, here
            check_model(state.config, path)
        log.info("loading model", path=str(path), device=device, dtype=dtype)
        return TorchBackend(dataset, state, path, device, dtype, batch_members)

    cpu_threads = (threads or torch.get_num_threads()) if device == "cpu" else None
    return BackendFactory(TorchBackend.name, device, build, cpu_threads, FAMILIES["torch"])

"""The NumPy reference backend: evaluates chunks and applies committed steps on the CPU.

Every other backend must produce the same bytes as this one.
"""

from __future__ import annotations

import numpy as np

from ...shared.config import RunConfig
from ...shared.data import Dataset
from ...shared.fitness import pair_fitness
from ...shared.model import EggModel, member_noise, pair_noise
from ...shared.replica import ReplicaState
from ...shared.update import apply_update
from ...shared.window import pair_windows, validation_windows
from . import BackendFactory, ChunkResult, Validation


class NumpyBackend:
    """Holds one replica (weights) and the data, evaluates chunks, applies steps."""

    name = "numpy"
    device = "cpu"

    def __init__(self, dataset: Dataset, state: ReplicaState, batch_members: int = 1024) -> None:
        self.dataset = dataset
        self.batch_members = max(2, batch_members - batch_members % 2)
        self.load_state(state)

    @property
    def config(self) -> RunConfig:
        return self.state.config

    @property
    def step(self) -> int:
        return self.state.step

    def load_state(self, state: ReplicaState) -> None:
        self.state = state
        self.model = EggModel(state.config, state.params)

    def digest(self) -> int:
        return self.state.digest()

    def evaluate_chunk(self, step: int, first_member: int, count: int) -> ChunkResult:
        """Score members [first_member, first_member + count) of the population at `step`."""
        cfg = self.config
        if step != self.step:
            raise ValueError(f"replica is at step {self.step}, chunk is for step {step}")
        if (
            first_member % 2
            or count % 2
            or not 0 <= first_member < first_member + count <= (cfg.es.population)
        ):
            raise ValueError(f"bad member range [{first_member}, {first_member + count})")
        losses = []
        for lo in range(first_member, first_member + count, self.batch_members):
            hi = min(lo + self.batch_members, first_member + count)
            pairs = np.arange(lo // 2, hi // 2)
            noise = member_noise(
                pair_noise(cfg, step, pairs), self.state.params, cfg.es.sigma_shift
            )
            tokens = np.repeat(pair_windows(cfg, self.dataset.train, step, pairs), 2, axis=0)
            loss, _ = self.model.forward(tokens, noise)
            losses.append(loss)
        loss = np.concatenate(losses)
        return ChunkResult(pair_fitness(loss, cfg.fitness), int(loss.sum()))

    def apply_step(self, fitness: np.ndarray) -> int:
        """Apply the committed fitness of step `self.step` (all pairs); returns weights changed."""
        cfg = self.config
        params, changed = apply_update(cfg, self.step, self.state.params, np.asarray(fitness))
        self.load_state(ReplicaState(cfg, self.step + 1, params))
        return changed

    def validate(self, rows_per_batch: int = 512) -> Validation:
        """Unperturbed model over windows of valid.bin (seq_len + 1 tokens, stride seq_len)."""
        cfg = self.config
        t = cfg.es.seq_len
        windows = validation_windows(cfg, self.dataset.valid)
        rows = len(windows)
        loss_sum, bits_sum = 0, 0.0
        for lo in range(0, rows, rows_per_batch):
            loss, bits = self.model.forward(windows[lo : lo + rows_per_batch], float_bits=True)
            loss_sum += int(loss.sum())
            bits_sum += float(bits.sum())
        tokens = rows * t
        return Validation(tokens, loss_sum / tokens, bits_sum / tokens)


def factory(batch_members: int = 1024) -> BackendFactory:
    """The NumPy reference backend, `batch_members` members per forward sub-batch."""
    return BackendFactory(
        NumpyBackend.name,
        NumpyBackend.device,
        lambda dataset, state: NumpyBackend(dataset, state, batch_members),
    )

"""Claimed completions of a Hugging Face population (worker/hf_claims.py): a member's own
completions are plausible, in its dtype and across float32 and bfloat16, and a liar's
(another member's, random, or one token changed per row) are not. Tiny GPT-2 and Llama
models (tests/hf_models.py) trained here for a moment, so that their next-token
distributions are peaked as a real model's are; skipped without the `hf` extra."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import save_model, trained  # noqa: E402

from eggroll_dist.shared.config import ESConfig, FitnessConfig, ModelConfig, RunConfig  # noqa: E402
from eggroll_dist.shared.pinned import pin  # noqa: E402
from eggroll_dist.shared.sample import Completions, SampleSettings  # noqa: E402
from eggroll_dist.shared.start import initial_state  # noqa: E402
from eggroll_dist.worker import hf_claims as hc  # noqa: E402
from eggroll_dist.worker.backend.torch_backend import TorchBackend  # noqa: E402
from eggroll_dist.worker.hf_model import HFModelError  # noqa: E402

STEP, MEMBERS, NEW, SIGMA = 5, 8, 16, 0.05
PROMPTS = ["the quick brown", "a bird in the hand is", "every", "fudge, and eggs are"]
MODES = {  # (temperature, min_p) in thousandths
    "greedy": (0, 0),
    "sampled": (1000, 0),
    "min_p": (700, 50),
}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TorchBackend]:
    """A float32 and a bfloat16 worker of one reward run on a trained tiny model."""
    folder = tmp_path_factory.mktemp(request.param)
    path = trained(save_model(folder / "model", request.param))
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = RunConfig(
        model=ModelConfig(arch="hf", path=str(path), rank=2),
        es=ESConfig(population=MEMBERS, chunk_size=MEMBERS, sigma=SIGMA, run_seed=11),
        fitness=FitnessConfig(objective="reward", reward="builtin:letter_e", prompts="prompts.txt"),
    )
    cfg = pin(cfg, folder)
    return {
        dtype: TorchBackend(None, initial_state(cfg, folder), path, "cpu", dtype, 4)
        for dtype in ("float32", "bfloat16")
    }


def _request(worker: TorchBackend, mode: str, seed: int = 3) -> Completions:
    temperature, min_p = MODES[mode]
    prompts = tuple(tuple(worker.tokenizer.encode(p)) for p in PROMPTS)
    settings = SampleSettings(temperature=temperature, min_p=min_p)
    return Completions(prompts, (7, 9, 2, 4), seed, settings, NEW)


def _rows_caught(distances: np.ndarray) -> np.ndarray:
    """(count, P): whether each row has a token beyond the tolerance."""
    return distances.max(axis=2) > hc.CLAIM_TOLERANCE


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_own_completions_are_plausible(
    workers: dict[str, TorchBackend], dtype: str, mode: str
) -> None:
    worker = workers[dtype]
    request = _request(worker, mode)
    tokens = worker.complete(STEP, (0, MEMBERS), request)  # two batches of 4 members
    distances = worker.claim_distances(STEP, (0, MEMBERS), request, tokens)
    assert distances.shape == tokens.shape and distances.dtype == np.float64
    assert hc.plausible(distances)
    # the same arithmetic, but one full forward against a decode step per token: float32
    # agrees to rounding, bfloat16 rounds the two differently now and then
    assert np.mean(distances == 0) > (0.98 if dtype == "float32" else 0.9)
    assert distances.max() < (1e-3 if dtype == "float32" else 0.05)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("writer", "checker"), [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_completions_of_the_other_dtype_are_plausible(
    workers: dict[str, TorchBackend], writer: str, checker: str, mode: str
) -> None:
    request = _request(workers[writer], mode)
    tokens = workers[writer].complete(STEP, (0, MEMBERS), request)
    distances = workers[checker].claim_distances(STEP, (0, MEMBERS), request, tokens)
    assert hc.plausible(distances), distances.max()


@pytest.mark.parametrize("mode", list(MODES))
def test_liars_are_caught(workers: dict[str, TorchBackend], mode: str) -> None:
    writer, checker = workers["bfloat16"], workers["float32"]
    request = _request(writer, mode, seed=8)
    tokens = writer.complete(STEP, (0, MEMBERS), request)
    rng = np.random.default_rng(1)
    vocab = checker.lm.model.get_output_embeddings().weight.shape[0]

    def check(claim: np.ndarray) -> np.ndarray:
        return checker.claim_distances(STEP, (0, MEMBERS), request, claim)

    # member m + 2's completions claimed as m's: rows the two wrote alike are no lie
    other = np.roll(tokens, -2, axis=0)
    differ = np.any(other != tokens, axis=2)
    assert differ.mean() > 0.5
    assert not hc.plausible(check(other))
    assert _rows_caught(check(other))[differ].mean() > 0.75  # here 0.84-1.0
    # random tokens: a greedy row can slip through where the model, reading nonsense, is
    # nearly uniform (every probability within the tolerance of the likeliest)
    fabricated = rng.integers(0, vocab, tokens.shape)
    assert _rows_caught(check(fabricated)).mean() > 0.9  # here 0.97-1.0
    changed = tokens.copy()  # one token per row replaced by another
    rows = np.arange(MEMBERS)[:, None], np.arange(len(PROMPTS))[None, :]
    at = rng.integers(0, NEW, changed.shape[:2])
    changed[(*rows, at)] = (changed[(*rows, at)] + rng.integers(1, vocab, at.shape)) % vocab
    caught = _rows_caught(check(changed))
    assert caught.mean() > 0.75, caught.mean()  # here 0.81-1.0


def test_an_id_outside_the_vocabulary_is_at_distance_one(
    workers: dict[str, TorchBackend],
) -> None:
    worker = workers["float32"]
    vocab = worker.lm.model.get_output_embeddings().weight.shape[0]
    for mode in ("greedy", "sampled"):
        request = _request(worker, mode)
        tokens = worker.complete(STEP, (0, 4), request)
        tokens[0, 1, 5], tokens[2, 3, 0], tokens[3, 0, NEW - 1] = vocab, -1, 1 << 40
        distances = worker.claim_distances(STEP, (0, 4), request, tokens)
        assert distances[0, 1, 5] == distances[2, 3, 0] == distances[3, 0, NEW - 1] == 1.0
        assert distances[0, 1, :5].max() < 1e-3  # what precedes it is the member's
        assert not hc.plausible(distances)
    with pytest.raises(HFModelError, match="claimed tokens"):
        worker.claim_distances(STEP, (0, 4), request, tokens[:, :2])


def test_the_models_own_logits_give_the_same_distances(
    workers: dict[str, TorchBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head applied to the base model's states (the default for these models) and the
    model's own forward (for models that scale or cap their logits) agree, and so do one
    call over every member and the worker's batches of them."""
    worker = workers["float32"]
    request = _request(worker, "min_p")
    tokens = np.roll(worker.complete(STEP, (0, MEMBERS), request), 1, axis=0)  # not all 0
    lm = worker.lm
    args = (request.prompts, tokens, 0.7, request.seed, worker._pad_id(), request.samples, 0.05)
    assert hc._HEAD_ONLY.get(lm.model) is True
    head = hc.claim_distances(lm, STEP, (0, MEMBERS), *args)
    batched = worker.claim_distances(STEP, (0, MEMBERS), request, tokens)
    monkeypatch.setitem(hc._HEAD_ONLY, lm.model, False)
    full = hc.claim_distances(lm, STEP, (0, MEMBERS), *args)
    assert head.max() > hc.CLAIM_TOLERANCE
    np.testing.assert_allclose(full, head, atol=1e-6)
    np.testing.assert_allclose(batched, head, atol=1e-6)


def test_dynamic_cache_decoding_is_read_with_its_own_masks(
    workers: dict[str, TorchBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Models the static plan does not fit decode with 2D masks: their claims are read so."""
    worker = workers["float32"]
    monkeypatch.setattr(worker.lm.engine, "static", False)
    for mode in MODES:
        request = _request(worker, mode)
        tokens = worker.complete(STEP, (0, MEMBERS), request)
        distances = worker.claim_distances(STEP, (0, MEMBERS), request, tokens)
        assert hc.plausible(distances) and distances.max() < 1e-3, mode


def test_a_perturbed_head_is_read_inside_the_members(tmp_path: Path) -> None:
    """With the LM head among the targets, the head applied outside the members would read
    the unperturbed weights: the checker then reads the model's own forward instead, and
    a member's own completions stay plausible."""
    path = trained(save_model(tmp_path / "model", "llama"))
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = RunConfig(
        model=ModelConfig(arch="hf", path=str(path), rank=2, targets=("*q_proj", "lm_head")),
        es=ESConfig(population=4, chunk_size=4, sigma=0.5, run_seed=11),
        fitness=FitnessConfig(objective="reward", reward="builtin:letter_e", prompts="prompts.txt"),
    )
    worker = TorchBackend(None, initial_state(pin(cfg, tmp_path), tmp_path), path, "cpu", "float32")
    for mode in ("greedy", "sampled"):
        request = _request(worker, mode)
        tokens = worker.complete(STEP, (0, 4), request)
        distances = worker.claim_distances(STEP, (0, 4), request, tokens)
        assert distances.max() < 1e-3, (mode, distances.max())
    assert hc._HEAD_ONLY.get(worker.lm.model) is False

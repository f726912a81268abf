"""The population engine of Hugging Face models (worker/hf_engine.py, worker/torch_noise.py):
factors made by torch equal shared/hf.py's bit for bit; the fused pass and the static-cache
decode equal a model with each member's weights written in. Tiny GPT-2 and Llama models
built here (tests/hf_models.py); skipped where the `hf` extra is not installed."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import CORPUS, save_model  # noqa: E402

from eggroll_dist.shared import hf  # noqa: E402
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig  # noqa: E402
from eggroll_dist.shared.noise import DOMAIN_SAMPLE, combine_array, hash_key  # noqa: E402
from eggroll_dist.shared.pinned import pin  # noqa: E402
from eggroll_dist.worker import hf_engine  # noqa: E402
from eggroll_dist.worker import hf_model as hm  # noqa: E402
from eggroll_dist.worker import torch_noise as tn  # noqa: E402

STEP = 3


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp(request.param), request.param)


def _config(model_dir: Path, pairs: int = 2, sigma: float = 0.02) -> RunConfig:
    cfg = RunConfig(
        model=ModelConfig(arch="hf", path=str(model_dir), rank=2),
        es=ESConfig(population=2 * pairs, chunk_size=2 * pairs, sigma=sigma, run_seed=11),
    )
    return pin(cfg, Path("."))


def _population(model_dir: Path, **kw: Any) -> hm.PopulationLM:
    return hm.PopulationLM(hm.load_causal_lm(model_dir), _config(model_dir, **kw))


class _Materialised:
    """Member `member`'s perturbed weights written into the targets, restored on exit."""

    def __init__(self, lm: hm.PopulationLM, member: int) -> None:
        self.lm, self.member = lm, member

    def __enter__(self) -> None:
        lm = self.lm
        self.saved = {name: lm._weight(name).detach().clone() for name in lm.modules}
        with torch.no_grad():
            for name in lm.modules:
                lm._weight(name).copy_(lm.member_weight(name, STEP, self.member))

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for name, w in self.saved.items():
                self.lm._weight(name).copy_(w)


def _old_complete(
    model: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    samples: Sequence[int] | None = None,
    min_p: float = 0.0,
) -> np.ndarray:
    """The previous release's completion loop for one model: a dynamic cache grown token by
    token with 2D masks, the same counter-based choice (P, new_tokens)."""
    samples = list(range(len(prompts))) if samples is None else list(samples)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p))
        mask[i, width - len(p) :] = 1
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    out = np.zeros((len(prompts), new_tokens), dtype=np.int64)
    forward = inspect.signature(model.forward).parameters
    arg = "cache" if "cache" in forward else "past_key_values"  # transformers 5, or 4
    past = None
    with torch.no_grad():
        for t in range(new_tokens):
            result = model(input_ids=ids, attention_mask=mask, position_ids=position, **{arg: past})
            past = getattr(result, arg)
            logits = result.logits[:, -1, :]
            if temperature <= 0:
                chosen = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits.double() / temperature, dim=-1)
                if min_p > 0:
                    floor = min_p * probs.max(dim=-1, keepdim=True).values
                    probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
                cdf = probs.cumsum(dim=-1)
                keys = combine_array(hash_key(DOMAIN_SAMPLE, seed), np.array(samples, np.uint64))
                keys = combine_array(keys, np.full(len(samples), t, dtype=np.uint64))
                u = torch.from_numpy((keys >> np.uint64(11)).astype(np.float64) * 2.0**-53)
                chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
                chosen = chosen.clamp(max=logits.shape[-1] - 1)
            out[:, t] = chosen.numpy()
            ids = chosen.reshape(-1, 1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            position = position[:, -1:] + 1
    return out


def lm_tokens(model_dir: Path) -> list[int]:
    return hm.load_tokenizer(model_dir).encode(" ".join(CORPUS[:3]))


# --- factors on the device ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
@pytest.mark.parametrize(("rank", "seed"), [(1, 0), (3, 5), (8, 2**40 + 7)])
def test_device_factors_equal_the_shared_ones(
    kind: str, rank: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    matrices = ("m.0.q 48 32", "m.0.k 16 32", "m.0.up 64 32", "m.1.down 32 64")
    cfg = RunConfig(
        model=ModelConfig(
            arch="hf", path="tiny", rank=rank, matrices=matrices, weight_dtype="float32"
        ),
        es=ESConfig(population=12, chunk_size=12, sigma=0.01, run_seed=seed, noise=kind),
    )
    targets = hf.targets(cfg.model)
    for chunk in (tn.CHUNK, 700):  # all targets at once; a run of targets per chunk
        monkeypatch.setattr(tn, "CHUNK", chunk)
        pairs = np.array([0, 3, 5])
        made = tn.pair_factors(cfg, 9, targets, pairs, "cpu", host=False)  # torch's code
        for t, (a, b) in zip(targets, made, strict=True):
            want_a, want_b = hf.pair_factors(cfg, 9, t, pairs)
            assert a.dtype == torch.int8
            assert np.array_equal(a.numpy(), want_a) and np.array_equal(b.numpy(), want_b)
        for first, count in ((0, 12), (3, 6), (11, 1)):
            made = tn.member_factors(cfg, 9, targets, first, count, "cpu", host=False)
            for t, (a, b) in zip(targets, made, strict=True):
                want_a, want_b = hf.member_factors(cfg, 9, t, first, count)
                assert np.array_equal(a.numpy(), want_a) and np.array_equal(b.numpy(), want_b)
    host = tn.member_factors(cfg, 9, targets, 3, 6, "cpu")  # NumPy's, on a CPU device
    for t, (a, b) in zip(targets, host, strict=True):
        want_a, want_b = hf.member_factors(cfg, 9, t, 3, 6)
        assert np.array_equal(a.numpy(), want_a) and np.array_equal(b.numpy(), want_b)
    with pytest.raises(hf.HFError, match="outside the population"):
        tn.member_factors(cfg, 9, targets, 10, 4, "cpu")


# --- the fused pass ----------------------------------------------------------------------


def test_fused_pass_equals_materialised_weights(model_dir: Path) -> None:
    lm = _population(model_dir, pairs=3)
    first, count = 1, 4  # both signs, pairs 0..2
    rows = torch.tensor([lm_tokens(model_dir)[:12], lm_tokens(model_dir)[5:17]])
    tokens = rows[None].expand(count, -1, -1)
    nll = lm.nll((first, count), STEP, tokens)
    logits = lm.logits(STEP, first, count, rows)
    plain = lm.nll(None, STEP, rows[None])[0]
    for i in range(count):
        with _Materialised(lm, first + i):
            want = lm.nll(None, STEP, rows[None])[0]
            with torch.no_grad():
                want_logits = lm.model(input_ids=rows).logits
        np.testing.assert_allclose(nll[i], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[i], want_logits, rtol=1e-4, atol=1e-4)
        assert np.abs(nll[i] - plain).max() > 1e-3  # the corrections are not dropped
    groups = lm.engine.groups
    assert groups is not None and sorted(n for g in groups for n in g) == sorted(lm.modules)
    if "llama" in model_dir.name:  # q, k, v read one tensor, and gate, up another
        layer = "model.layers.0"
        qkv = tuple(f"{layer}.self_attn.{p}_proj" for p in "qkv")
        assert qkv in groups and (f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj") in groups
    else:  # GPT-2's projections read four different tensors
        assert all(len(g) == 1 for g in groups)


def test_a_wrong_grouping_still_gives_each_member_its_corrections(model_dir: Path) -> None:
    lm = _population(model_dir)
    rows = torch.tensor([lm_tokens(model_dir)[:10]])
    want = lm.nll((0, 4), STEP, rows[None].expand(4, -1, -1))
    wrong = _population(model_dir)
    # one group of the targets of the model's width, few of which read the first one's input
    width = lm.model.config.hidden_size
    names = [name for name, t in wrong.targets.items() if t.shape[1] == width]
    others = [(name,) for name in wrong.targets if name not in names]
    wrong.engine.groups = [tuple(names), *others]
    wrong.engine._place = {
        name: (g, i) for g, n in enumerate(wrong.engine.groups) for i, name in enumerate(n)
    }
    got = wrong.nll((0, 4), STEP, rows[None].expand(4, -1, -1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert wrong.engine._noticed  # the followers that read another input said so


# --- completions -------------------------------------------------------------------------


def test_completions_equal_materialised_members(model_dir: Path) -> None:
    lm = _population(model_dir)
    tokenizer = hm.load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p) for p in ["the quick", "a bird in the hand is", "every"]]
    cases = [
        {},
        {"temperature": 1.0, "seed": 3, "samples": [7, 9, 2]},
        {"temperature": 0.7, "seed": 5, "samples": [1, 2, 3], "min_p": 0.05},
    ]
    plain = lm.complete(STEP, None, prompts, 6)
    assert np.array_equal(plain[0], _old_complete(lm.model, prompts, 6))
    for kw in cases:
        got = lm.complete(STEP, (0, 4), prompts, 6, **kw)
        assert got.shape == (4, 3, 6)
        for member in range(4):
            with _Materialised(lm, member):
                want = _old_complete(lm.model, prompts, 6, **kw)
            assert np.array_equal(got[member], want), (kw, member)
    greedy = lm.complete(STEP, (0, 4), prompts, 6)
    assert any(not np.array_equal(greedy[m], plain[0]) for m in range(4))  # noise matters
    # the dynamic-cache fallback gives the same tokens
    lm.engine.static = False
    assert np.array_equal(lm.complete(STEP, (0, 4), prompts, 6), greedy)


def test_decode_plans_are_reused_without_leaking_between_calls(model_dir: Path) -> None:
    lm = _population(model_dir)
    tokenizer = hm.load_tokenizer(model_dir)
    long = [tokenizer.encode("a bird in the hand is worth")]
    short = [tokenizer.encode("the")]
    first = lm.complete(STEP, (0, 4), long, 4)
    lm.complete(STEP, (2, 2), short, 4)  # another member count and width, same cache length
    lm.complete(STEP - 1, (0, 4), short, 4, temperature=1.0)
    again = lm.complete(STEP, (0, 4), long, 4)
    assert np.array_equal(first, again)
    assert len(lm.engine._plans) <= hf_engine.PLANS
    assert np.array_equal(lm.complete(STEP, (0, 4), long, 0), np.zeros((4, 1, 0), np.int64))


def test_eager_attention_decodes_the_same_tokens(tmp_path: Path) -> None:
    path = save_model(tmp_path / "gpt2", "gpt2")
    sdpa = _population(path)
    model = hm.load_causal_lm(path)
    model.set_attn_implementation("eager")
    eager = hm.PopulationLM(model, _config(path))
    prompts = [hm.load_tokenizer(path).encode(p) for p in ["the quick", "a bird in the"]]
    assert not eager.engine._bool_mask
    want = sdpa.complete(STEP, (0, 4), prompts, 5, temperature=1.0, seed=1)
    assert np.array_equal(eager.complete(STEP, (0, 4), prompts, 5, temperature=1.0, seed=1), want)


def test_close_unwraps_and_bad_calls_say_one_line(model_dir: Path) -> None:
    lm = _population(model_dir)
    module = next(iter(lm.modules.values()))
    assert "forward" in module.__dict__
    with pytest.raises(hm.HFModelError, match="graph=True needs a CUDA device"):
        lm.complete(0, (0, 2), [[5, 6]], 2, graph=True)
    with pytest.raises(hm.HFModelError, match="2 sample numbers for 1 prompts"):
        lm.complete(0, (0, 2), [[5, 6]], 2, temperature=1.0, samples=[1, 2])
    lm.close()
    assert "forward" not in module.__dict__


class _RecordedGraph:
    """A CUDA graph on the CPU: capturing records each decode step with the arguments it
    was given, and a replay runs those again (a real graph replays its recorded kernels,
    with their scalars, on the same buffers)."""

    capturing: _RecordedGraph | None = None

    def __init__(self) -> None:
        self.steps: list[tuple[Any, ...]] = []

    def replay(self) -> None:
        for args in self.steps:
            _EAGER_STEP(*args)


_EAGER_STEP = hf_engine.Engine._step


def _recording_step(engine: Any, plan: Any, temperature: float, min_p: float) -> None:
    graph = _RecordedGraph.capturing
    if graph is None:
        _EAGER_STEP(engine, plan, temperature, min_p)
    else:
        graph.steps.append((engine, plan, temperature, min_p))


@contextlib.contextmanager
def _capture(graph: _RecordedGraph, **_: Any) -> Iterator[None]:
    _RecordedGraph.capturing = graph
    try:
        yield
    finally:
        _RecordedGraph.capturing = None


@pytest.fixture
def recorded_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(hf_engine.Engine, "_step", _recording_step)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)


def test_graph_replays_follow_the_sampling_and_the_weights(
    model_dir: Path, recorded_graphs: None
) -> None:
    lm = _population(model_dir)
    tokenizer = hm.load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p) for p in ["the quick", "a bird in the hand is"]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1

    def both(temperature: float, min_p: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        u = hf_engine.uniforms(4, [0, 1], 8) if temperature > 0 else None
        args = (ids, mask, 8, temperature, min_p, u)
        replayed = lm.engine.complete((STEP, 0, 4), *args, graph=True)
        return replayed, lm.engine.complete((STEP, 0, 4), *args, graph=False)

    for temperature, min_p in [(0.0, 0.0), (1.0, 0.0), (0.8, 0.2)]:  # one shape, three ways
        replayed, eager = both(temperature, min_p)
        assert np.array_equal(replayed, eager), (temperature, min_p)
    # the update writes the weights in place: a graph captured before reads the new ones
    with torch.no_grad():
        for name in lm.modules:
            lm._weight(name).mul_(-1.5)
    replayed, eager = both(0.0)
    assert np.array_equal(replayed, eager)

"""Hugging Face causal LMs on PyTorch (worker/hf_model.py), on tiny GPT-2 and Llama models
built from configs here (random weights, saved to a temporary directory; nothing is
downloaded). Skipped where the `hf` extra is not installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import CORPUS, save_model  # noqa: E402

from eggroll_dist.shared import hf  # noqa: E402
from eggroll_dist.shared import hf_dir as hd  # noqa: E402
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig  # noqa: E402
from eggroll_dist.shared.pinned import GoalError, pin  # noqa: E402
from eggroll_dist.shared.replica import replay  # noqa: E402
from eggroll_dist.worker import hf_model as hm  # noqa: E402


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp(request.param), request.param)


def hf_config(
    model_dir: Path,
    pairs: int = 3,
    rank: int = 2,
    sigma: float = 0.02,
    lr: float = 1.0,
    targets: tuple[str, ...] = (),
) -> RunConfig:
    """A pinned hf run config of the model in `model_dir`."""
    cfg = RunConfig(
        model=ModelConfig(arch="hf", path=str(model_dir), rank=rank, targets=targets),
        es=ESConfig(population=2 * pairs, chunk_size=2 * pairs, sigma=sigma, run_seed=11),
        update=UpdateConfig(lr=lr),
    )
    return pin(cfg, Path("."))


def _population(model_dir: Path, dtype: str = "float32", **kw: object) -> hm.PopulationLM:
    return hm.PopulationLM(hm.load_causal_lm(model_dir, dtype), hf_config(model_dir, **kw))


def test_targets_are_the_blocks_linear_layers(model_dir: Path) -> None:
    cfg = hf_config(model_dir)
    targets = hf.targets(cfg.model)
    names = [t.name for t in targets]
    assert "lm_head" not in names
    if "gpt2" in model_dir.name:  # Conv1D layers, (in, out) weights
        assert names[:4] == [
            "transformer.h.0.attn.c_attn",
            "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc",
            "transformer.h.0.mlp.c_proj",
        ]
        assert targets[0].shape == (96, 32)
    else:
        assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer
        assert targets[1].shape == (16, 32)  # k_proj of two kv heads
    # the pinned files are the directory's
    assert cfg.model.files[0].endswith(" config.json")


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("float64", 1e-10)])
def test_hooked_members_equal_materialised_weights(model_dir: Path, dtype: str, tol: float) -> None:
    lm = _population(model_dir, dtype=dtype)
    step, first, count = 4, 1, 4  # members 1..4: both signs, pairs 0, 1, 2
    ids = torch.randint(
        3, lm.model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    batched = lm.logits(step, first, count, ids)
    with torch.no_grad():
        base = lm.model(input_ids=ids).logits
    for i in range(count):
        saved = {name: lm._weight(name).detach().clone() for name in lm.modules}
        with torch.no_grad():
            for name in lm.modules:
                lm._weight(name).copy_(lm.member_weight(name, step, first + i))
            explicit = lm.model(input_ids=ids).logits
            for name, w in saved.items():
                lm._weight(name).copy_(w)
        torch.testing.assert_close(batched[i], explicit, rtol=tol, atol=tol)
        assert not torch.allclose(batched[i], base, atol=1e-4)  # the noise matters
    # with small noise, a pair's members move the logits in opposite directions
    small = _population(model_dir, sigma=1e-5, dtype=dtype)
    near = small.logits(step, first, count, ids)
    d_plus, d_minus = near[1] - base, near[2] - base  # members 2 and 3: pair 1
    assert torch.nn.functional.cosine_similarity(d_plus.ravel(), -d_minus.ravel(), dim=0) > 0.9


def test_state_weights_and_replay(model_dir: Path) -> None:
    lm = _population(model_dir, lr=4.0)
    rng = np.random.default_rng(0)
    log = [rng.integers(-1, 2, size=lm.cfg.pairs).astype(np.int8) for _ in range(3)]
    base = hd.base_state(lm.cfg, model_dir)
    for name in lm.modules:  # the files' weights are the model's as loaded
        assert torch.equal(lm.bits(name), torch.from_numpy(base.params[name]))
    state = replay(base, log)
    lm.load_state(state)
    for name in lm.modules:  # the state's weights, exactly
        bits = torch.from_numpy(state.params[name])
        assert torch.equal(lm._weight(name).detach(), bits.view(torch.float32))
        assert not torch.equal(bits, torch.from_numpy(base.params[name]))
    assert replay(hd.base_state(lm.cfg, model_dir), log).digest() == state.digest()


def test_completions_and_losses(model_dir: Path) -> None:
    lm = _population(model_dir, pairs=2)
    tokenizer = hm.load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p) for p in ["the quick", "a bird in the hand is"]]
    greedy = lm.complete(0, (0, 4), prompts, 5)
    assert greedy.shape == (4, 2, 5)
    # left padding does not change a prompt's continuation
    alone = lm.complete(0, (0, 4), prompts[:1], 5)
    assert np.array_equal(alone[:, 0], greedy[:, 0])
    sampled = lm.complete(0, (0, 4), prompts, 5, 1.0, seed=3, samples=[7, 9])
    assert np.array_equal(sampled, lm.complete(0, (0, 4), prompts, 5, 1.0, seed=3, samples=[7, 9]))
    # a prompt's randomness is its sample number's, wherever it stands in the request
    swapped = lm.complete(0, (0, 4), prompts[::-1], 5, 1.0, seed=3, samples=[9, 7])
    assert np.array_equal(swapped[:, ::-1], sampled)
    # min_p = 1 keeps only the likeliest token: greedy
    assert np.array_equal(lm.complete(0, (0, 4), prompts, 5, 1.0, seed=3, min_p=1.0), greedy)
    rows = torch.tensor([tokenizer.encode(CORPUS[0])])
    nll = lm.nll((0, 4), 0, rows.expand(4, 1, -1))
    assert nll.shape == (4, 1, rows.shape[1] - 1) and np.all(np.isfinite(nll))
    base = lm.nll(None, 0, rows[None])
    assert base.shape == (1, 1, rows.shape[1] - 1)


def test_bad_inputs_say_one_line(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(hd.ModelDirError, match=r"no config\.json"):
        hm.load_causal_lm(tmp_path)
    with pytest.raises(hd.ModelDirError, match="not a directory"):
        hm.load_causal_lm(tmp_path / "missing")
    bert = tmp_path / "bert"
    transformers.BertModel(
        transformers.BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    ).save_pretrained(bert)
    with pytest.raises(hd.ModelDirError, match="not a causal LM") as info:
        hm.load_causal_lm(bert)
    assert "\n" not in str(info.value)
    with pytest.raises(hm.HFModelError, match="no usable tokenizer"):
        hm.load_tokenizer(bert)
    model = hm.load_causal_lm(model_dir)
    weights = sum(w.numel() for w in model.state_dict().values())
    assert hd.parameter_count(model_dir) in (weights, weights - model.lm_head.weight.numel())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hm, "_free_bytes", lambda torch, device: 1000)
        with pytest.raises(hm.HFModelError, match=r"more than the 0\.00 GiB free on cpu"):
            hm.load_causal_lm(model_dir)
    with pytest.raises(GoalError, match="matches no linear layer"):
        hf_config(model_dir, targets=("*.nothing",))
    with pytest.raises(GoalError, match="above the size"):
        hf_config(model_dir, rank=1000)
    with pytest.raises(GoalError, match="not a causal LM"):
        hf_config(bert)
    if "gpt2" in model_dir.name:  # its LM head is the token embedding, tied
        with pytest.raises(GoalError, match=r"shares its weight with transformer\.wte"):
            hf_config(model_dir, targets=("lm_head",))


def test_export_loads_in_transformers_and_generates(model_dir: Path, tmp_path: Path) -> None:
    lm = _population(model_dir, lr=8.0)
    log = [np.array([1, -1, 1], dtype=np.int8), np.array([0, 1, 1], dtype=np.int8)]
    base = hd.base_state(lm.cfg, model_dir)
    state = replay(base, log)
    out = hm.export_merged(model_dir, state, tmp_path / "merged")
    assert (out / "model.safetensors").is_file()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    merged_layers = {name: m for name, m, _, _ in hd.linear_layers(merged)}
    for name in lm.modules:
        w = merged_layers[name].weight
        w = (w.T if lm.transposed[name] else w).detach().float().contiguous()
        assert torch.equal(w.view(torch.int32), torch.from_numpy(state.params[name]))
        assert not np.array_equal(state.params[name], base.params[name])  # the state moved
    # the files it wrote are the state's: its base is the state
    again = hd.base_state(state.config, out)
    assert all(np.array_equal(again.params[n], state.params[n]) for n in state.params)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([tokenizer.encode("the quick")])
    text = merged.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert text.shape == (1, ids.shape[1] + 4)

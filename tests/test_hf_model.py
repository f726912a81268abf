"""Hugging Face causal LMs on PyTorch (worker/hf_model.py), on tiny GPT-2 and Llama models
built from configs here (random weights, saved to a temporary directory; nothing is
downloaded). Skipped where the `hf` extra is not installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from eggroll_dist.shared import hf_dir as hd  # noqa: E402
from eggroll_dist.shared import hf_state as hs  # noqa: E402
from eggroll_dist.shared.goal import letter_e  # noqa: E402
from eggroll_dist.worker import hf_model as hm  # noqa: E402

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a bird in the hand is worth two in the bush",
    "every good boy deserves fudge, and eggs are evolved",
] * 20


def _tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


def _config(family: str, vocab: int) -> object:
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=2,
            eos_token_id=2,
        )
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    config = _config(request.param, len(tokenizer))
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _population(
    model_dir: Path,
    pairs: int = 3,
    rank: int = 2,
    sigma_: float = 0.02,
    dtype: str = "float32",
    **kw: object,
) -> hm.PopulationLM:
    model = hm.load_causal_lm(model_dir, dtype)
    spec = hm.spec_for(model, rank=rank, seed=11, pairs=pairs, sigma=sigma_, **kw)
    return hm.PopulationLM(model, spec)


def test_targets_are_the_blocks_linear_layers(model_dir: Path) -> None:
    model = hm.load_causal_lm(model_dir)
    spec = hm.spec_for(model, rank=2, seed=0, pairs=1)
    names = [t.name for t in spec.targets]
    assert "lm_head" not in names
    if "gpt2" in model_dir.name:  # Conv1D layers, (in, out) weights
        assert names[:4] == [
            "transformer.h.0.attn.c_attn",
            "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc",
            "transformer.h.0.mlp.c_proj",
        ]
        assert spec.targets[0].shape == (96, 32)
    else:
        assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer
        assert spec.targets[1].shape == (16, 32)  # k_proj of two kv heads


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
    small = _population(model_dir, sigma_=1e-6, dtype=dtype)  # noise entries are ~100
    near = small.logits(step, first, count, ids)
    d_plus, d_minus = near[1] - base, near[2] - base  # members 2 and 3: pair 1
    assert torch.nn.functional.cosine_similarity(d_plus.ravel(), -d_minus.ravel(), dim=0) > 0.9


def test_state_weights_and_replay(model_dir: Path) -> None:
    lm = _population(model_dir, alpha=1e-4)
    rng = np.random.default_rng(0)
    log = [rng.integers(-1, 2, size=lm.spec.pairs).astype(np.int8) for _ in range(3)]
    state = hs.replay(hs.HFState.initial(lm.spec), log)
    lm.load_state(state)
    t = lm.spec.targets[0]
    want = lm._base[t.name].double() + 1e-4 * torch.from_numpy(state.acc[t.name]).double()
    torch.testing.assert_close(lm._weight(t.name).detach().double(), want, rtol=0, atol=1e-6)
    assert hs.replay(hs.HFState.initial(lm.spec), log).digest() == state.digest()


def test_reward_chunk_and_completions(model_dir: Path) -> None:
    lm = _population(model_dir, pairs=2)
    tokenizer = hm.load_tokenizer(model_dir)
    prompts = ["the quick", "a bird in the hand is"]
    greedy = lm.complete(0, (0, 4), [tokenizer.encode(p) for p in prompts], 5)
    assert greedy.shape == (4, 2, 5)
    # left padding does not change a prompt's continuation
    alone = lm.complete(0, (0, 4), [tokenizer.encode(prompts[0])], 5)
    assert np.array_equal(alone[:, 0], greedy[:, 0])
    sampled = lm.complete(0, (0, 4), [tokenizer.encode(p) for p in prompts], 5, 1.0, seed=3)
    again = lm.complete(0, (0, 4), [tokenizer.encode(p) for p in prompts], 5, 1.0, seed=3)
    assert np.array_equal(sampled, again)
    result = lm.reward_chunk(0, 0, 4, prompts, tokenizer, letter_e, 6, temperature=1.0, seed=3)
    assert result.fitness.shape == (2,) and result.fitness.dtype == np.int8
    assert set(result.fitness.tolist()) <= {-1, 0, 1}
    nll = lm.member_nll(0, 0, 4, torch.tensor([tokenizer.encode(CORPUS[0])]))
    assert nll.shape == (4,) and np.all(np.isfinite(nll))


def test_bad_inputs_say_one_line(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(hm.HFModelError, match=r"no config\.json"):
        hm.load_causal_lm(tmp_path)
    with pytest.raises(hm.HFModelError, match="not a directory"):
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
    with pytest.raises(hm.HFModelError, match="not a causal LM") as info:
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
    with pytest.raises(hs.HFStateError, match="matches no linear layer"):
        hm.spec_for(model, rank=1, seed=0, pairs=1, patterns=["*.nothing"])
    with pytest.raises(hs.HFStateError, match="above the size"):
        hm.spec_for(model, rank=1000, seed=0, pairs=1)
    if "gpt2" in model_dir.name:  # its LM head is the token embedding, tied
        spec = hm.spec_for(model, rank=1, seed=0, pairs=1, patterns=["lm_head"])
        with pytest.raises(hm.HFModelError, match=r"shares its weight with transformer\.wte"):
            hm.PopulationLM(model, spec)


def _mean_reward(lm: hm.PopulationLM, tokenizer: object, prompts: list[str]) -> float:
    encoded = [tokenizer.encode(p) for p in prompts]  # type: ignore[attr-defined]
    tokens = lm.complete(0, None, encoded, 8, temperature=1.0, seed=999)
    texts = [tokenizer.decode(row) for row in tokens.reshape(-1, 8).tolist()]  # type: ignore[attr-defined]
    return float(np.mean([letter_e(t) for t in texts]))


def test_a_reward_moves_within_a_few_dozen_steps(tmp_path: Path) -> None:
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    config = _config("gpt2", len(tokenizer))
    config.initializer_range = 0.3  # a random model whose choices the blocks can move
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = hm.load_causal_lm(tmp_path)
    spec = hm.spec_for(model, rank=2, seed=5, pairs=16, sigma=3e-3, alpha=1e-3)
    lm = hm.PopulationLM(model, spec)
    tokenizer = hm.load_tokenizer(tmp_path)
    prompts = ["the quick", "a bird", "every good", "worth two"]
    held = [p + s for p in prompts for s in ("", " in", " the", " is")]
    before = _mean_reward(lm, tokenizer, held)
    state = hs.HFState.initial(spec)
    log = []
    for step in range(24):
        result = lm.reward_chunk(step, 0, 32, prompts, tokenizer, letter_e, 8, 1.0, seed=step)
        log.append(result.fitness)
        state = hs.apply_step(state, result.fitness)
        lm.load_state(state)
    after = _mean_reward(lm, tokenizer, held)
    assert after > before + 0.1, (before, after)
    # the state is the fitness log's: a replay reaches the same digest
    assert hs.replay(hs.HFState.initial(spec), log).digest() == state.digest()


def test_export_loads_in_transformers_and_generates(model_dir: Path, tmp_path: Path) -> None:
    lm = _population(model_dir, alpha=1e-3)
    log = [np.array([1, -1, 1], dtype=np.int8), np.array([0, 1, 1], dtype=np.int8)]
    state = hs.replay(hs.HFState.initial(lm.spec), log)
    lm.load_state(state)
    out = hm.export_merged(model_dir, state, tmp_path / "merged")
    assert (out / "model.safetensors").is_file()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    merged_layers = {name: m for name, m, _, _ in hm.linear_layers(merged)}
    for t in lm.spec.targets:
        w = merged_layers[t.name].weight
        w = w.T if lm.transposed[t.name] else w
        torch.testing.assert_close(w.float(), lm._weight(t.name).float(), rtol=0, atol=1e-6)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([tokenizer.encode("the quick")])
    text = merged.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert text.shape == (1, ids.shape[1] + 4)

"""Tiny Hugging Face causal LMs built from configs (random weights, a BPE tokenizer trained
here; nothing is downloaded), saved as model directories for the hf family's tests."""

from __future__ import annotations

from pathlib import Path

import transformers

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a bird in the hand is worth two in the bush",
    "every good boy deserves fudge, and eggs are evolved",
] * 20


def tokenizer() -> object:
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


def model_config(family: str, vocab: int) -> object:
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


def save_model(
    path: Path, family: str, initializer_range: float | None = None, dtype: str = "float32"
) -> Path:
    """A tiny `family` ("gpt2" or "llama") model and its tokenizer saved in `path`, its
    weights in `dtype` ("float32", "bfloat16" or "float16")."""
    import torch

    tok = tokenizer()
    torch.manual_seed(0)
    config = model_config(family, len(tok))
    if initializer_range is not None:
        config.initializer_range = initializer_range
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def trained(path: Path, steps: int = 100) -> Path:
    """The model in `path` fitted to the corpus's sentences (peaked distributions, and the
    small float32-bfloat16 differences of trained weights), saved in place."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rows = [[*tokenizer.encode(line), tokenizer.eos_token_id] for line in CORPUS[:3]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path

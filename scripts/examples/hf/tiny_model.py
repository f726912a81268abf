"""A small random GPT-2 and its tokenizer, made on this machine (nothing is downloaded):
a model directory to try eggroll-tune on before a real one.

    python scripts/examples/hf/tiny_model.py runs/tiny-gpt2

Its weights are random, so its text is noise; a reward it can move at once is the share of
a letter in what it writes (builtin:letter_e). Needs the hf extra (torch, transformers).
"""

from __future__ import annotations

import argparse
from pathlib import Path

WORDS = (
    "the quick brown fox jumps over the lazy dog; a bird in the hand is worth two in the "
    "bush; every good boy deserves fudge, and eggs are evolved by strategies"
).split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    config = transformers.GPT2Config(
        vocab_size=len(fast),
        n_positions=128,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=2,
        bos_token_id=2,
        eos_token_id=2,
        initializer_range=0.3,  # large random weights: members' texts differ from the start
    )
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(args.out)
    fast.save_pretrained(args.out)
    print(f"wrote a random GPT-2 ({args.layers} x {args.width}) and its tokenizer to {args.out}")


if __name__ == "__main__":
    main()

"""`eggroll-sample`: see what a model writes, from a save directory or a checkpoint file.

The replica is the newest snapshot of a save directory, or the state at `--step N`: the
newest readable snapshot at or before N with the fitness log replayed up to N (from the
initial weights when there is no snapshot); or a checkpoint file or an export (source.py).
The data directory (`data` by default) supplies the vocabulary, and the held-out prompts
when no prompt is given; it must hold the data the run records.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from ..shared.cli import command, data_dir_option
from ..shared.data import (
    DECODING_FILE,
    META_FILE,
    VALID_FILE,
    DataError,
    read_decoding,
    read_meta,
    read_tokens,
)
from ..shared.logs import echo, os_error_text
from ..shared.model import Generator, build_generator
from ..shared.replica import ReplicaState
from ..shared.sample import (
    NEW_TOKENS,
    PROMPT_TOKENS,
    SampleError,
    SampleSettings,
    fit_prompt,
    generate,
    milli_text,
    parse_milli,
)
from ..shared.vocab import Detokenizer, VocabError, decode, encode
from ..shared.vocab import escape as escape_text
from ..shared.window import held_out_prompt
from .source import SourceError, check_data_dir, load_source, replay_progress

MAX_PROMPT_FILE_BYTES = 1 << 20  # only the last `context` tokens are used anyway


# ------------------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class Vocabulary:
    pieces: list[bytes]
    vocab_size: int
    valid_path: Path


def load_vocabulary(data_dir: Path, model_vocab: int, data_digest: str | None) -> Vocabulary:
    """decoding.bin and meta.json of `data_dir`, checked against the model's vocabulary and
    the data digest of its run (hex; None: not recorded)."""
    meta = read_meta(data_dir / META_FILE)
    check_data_dir(data_dir, meta, model_vocab, data_digest)
    pieces = read_decoding(data_dir / DECODING_FILE)
    if len(pieces) != meta.vocab_size:
        raise DataError(f"{data_dir / DECODING_FILE} does not match {data_dir / META_FILE}")
    return Vocabulary(pieces, meta.vocab_size, data_dir / VALID_FILE)


# --------------------------------------------------------------------------- generation


def _terminal_styles() -> tuple[str, str]:
    if sys.stdout.isatty() and "NO_COLOR" not in os.environ:
        return "\x1b[2m", "\x1b[0m"  # the prompt dim, the model's words plain
    return "", ""


@command()
@click.argument("source", type=click.Path(path_type=Path))
@data_dir_option(
    Path("data"),
    "Data directory of the run: its vocabulary (and held-out prompts); checked against "
    "the data digest the run records.",
)
@click.option(
    "--step", type=int, default=None, help="Step to sample at (default: the newest snapshot)."
)
@click.option("--prompt", default=None, help="Prompt text (default: a held-out document).")
@click.option(
    "--prompt-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the prompt from this file (raw bytes).",
)
@click.option(
    "--held-out",
    "held_out",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Without a prompt: start from held-out document N (its first --prompt-tokens).",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=0),
    default=PROMPT_TOKENS,
    show_default=True,
    help="Length of a held-out prompt.",
)
@click.option(
    "--tokens",
    type=click.IntRange(0, 1 << 16),
    default=NEW_TOKENS,
    show_default=True,
    help="Tokens to generate per sample.",
)
@click.option("--temperature", default="0.6", show_default=True, help="0 = greedy.")
@click.option("--min-p", default="0.08", show_default=True, help="Drop tokens below min-p * p_max.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option(
    "--presence-penalty",
    default="0.2",
    show_default=True,
    help="Bits off every token already present, once.",
)
@click.option(
    "--frequency-penalty",
    default="0",
    show_default=True,
    help="Bits off every token per occurrence so far.",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**64 - 1),
    default=0,
    show_default=True,
    help="Seed of the sampling: the same seed, prompt and settings write the same text.",
)
@click.option(
    "--count",
    type=click.IntRange(1, 1000),
    default=1,
    show_default=True,
    help="Samples to write from the prompt, each with its own draw.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample on stdout.")
def main(
    source: Path,
    data_dir: Path,
    step: int | None,
    prompt: str | None,
    prompt_file: Path | None,
    held_out: int,
    prompt_tokens: int,
    tokens: int,
    temperature: str,
    min_p: str,
    top_k: int,
    presence_penalty: str,
    frequency_penalty: str,
    seed: int,
    count: int,
    as_json: bool,
) -> None:
    """Generate text from the model in SOURCE (a save directory, a checkpoint file or an
    export directory)."""
    try:
        settings = _parse_settings(temperature, min_p, top_k, presence_penalty, frequency_penalty)
        loaded = _load(source, data_dir, step, prompt, prompt_file, held_out, prompt_tokens)
    except (SourceError, DataError, SampleError, VocabError) as exc:
        raise click.ClickException(str(exc)) from None
    _announce(loaded, settings, seed, tokens)
    _write_samples(loaded, settings, seed, tokens, count, as_json)


@dataclass(frozen=True)
class _Loaded:
    """What the samples come from: the replica, its vocabulary and model, the prompt."""

    state: ReplicaState
    origin: str
    vocab: Vocabulary
    model: Generator
    prompt_ids: list[int]
    kept: list[int]  # the prompt tokens the model conditions on (the last `context`)


def _parse_settings(
    temperature: str, min_p: str, top_k: int, presence_penalty: str, frequency_penalty: str
) -> SampleSettings:
    return SampleSettings(
        temperature=parse_milli(temperature, "--temperature"),
        min_p=parse_milli(min_p, "--min-p"),
        top_k=top_k,
        presence_penalty=parse_milli(presence_penalty, "--presence-penalty"),
        frequency_penalty=parse_milli(frequency_penalty, "--frequency-penalty"),
    )


def _load(
    source: Path,
    data_dir: Path,
    step: int | None,
    prompt: str | None,
    prompt_file: Path | None,
    held_out: int,
    prompt_tokens: int,
) -> _Loaded:
    if prompt is not None and prompt_file is not None:
        raise SampleError("give --prompt or --prompt-file, not both")
    found = load_source(
        source,
        step,
        on_replay=replay_progress(lambda text: echo(text, err=True)),
        warn=lambda text: echo(f"warning: {text}", err=True),
    )
    state = found.state
    if state.config.model.arch == "hf":
        raise SampleError(
            f"{source} is a Hugging Face model's run: write it out with `eggroll-export "
            f"{source} --out DIR` and generate with transformers"
        )
    vocab = load_vocabulary(data_dir, state.config.model.vocab_size, found.data_digest)
    if prompt is not None:
        prompt_ids = encode(prompt.encode("utf-8", errors="surrogateescape"), vocab.pieces)
    elif prompt_file is not None:
        prompt_ids = encode(_read_prompt_file(prompt_file), vocab.pieces)
    else:
        valid = read_tokens(vocab.valid_path, vocab.vocab_size)
        # From the document's start: no longer than the model's context.
        length = min(prompt_tokens, state.config.es.seq_len)
        prompt_ids = held_out_prompt(valid, held_out, length)
    model = build_generator(state.config, state.params)
    kept = fit_prompt(prompt_ids, model.context, model.vocab_size)
    return _Loaded(state, found.origin, vocab, model, prompt_ids, kept)


def _announce(loaded: _Loaded, settings: SampleSettings, seed: int, tokens: int) -> None:
    """The line on stderr that says what the samples come from."""
    kept, prompt_ids, state = loaded.kept, loaded.prompt_ids, loaded.state
    note = ""
    if len(kept) < len(prompt_ids):
        note = f"; prompt cut to its last {len(kept)} of {len(prompt_ids)} tokens (the context)"
    echo(
        f"step {state.step} ({loaded.origin}), replica {state.digest_hex()}; "
        f"{settings.describe()}, seed {seed}, {tokens} tokens{note}",
        err=True,
    )


def _write_samples(
    loaded: _Loaded, settings: SampleSettings, seed: int, tokens: int, count: int, as_json: bool
) -> None:
    kept, pieces = loaded.kept, loaded.vocab.pieces
    dim, plain = _terminal_styles()
    prompt_text = escape_text(decode(kept, pieces))
    try:
        for k in range(count):
            if as_json:
                out = list(generate(loaded.model, kept, tokens, settings, seed, k))
                record = _json_record(loaded, settings, seed, k, out)
                click.echo(json.dumps(record, ensure_ascii=True))
                continue
            if count > 1:
                click.echo(f"=== sample {k + 1} of {count} ===")
            click.echo(f"{dim}{prompt_text}{plain}", nl=False)
            text = Detokenizer(pieces)
            for tok in generate(loaded.model, kept, tokens, settings, seed, k):
                click.echo(escape_text(text.feed(tok)), nl=False)
                sys.stdout.flush()
            click.echo(escape_text(text.flush()))
        sys.stdout.flush()  # a failure to write the last of it is this command's too
    except OSError as exc:
        # The samples are the command's output: a stdout that cannot take them (a full disk
        # under `> file`, EIO) fails the command, in one line.
        _silence_stdout()
        if isinstance(exc, BrokenPipeError):  # the reader has all it wanted (`| head`)
            sys.exit(1)
        raise click.ClickException(f"cannot write stdout: {os_error_text(exc)}") from None


def _json_record(
    loaded: _Loaded, settings: SampleSettings, seed: int, sample: int, out: list[int]
) -> dict[str, object]:
    """One sample as the JSON object `--json` writes."""
    pieces = loaded.vocab.pieces
    return {
        "step": loaded.state.step,
        "replica_digest": loaded.state.digest_hex(),
        "sample": sample,
        "seed": seed,
        "settings": {
            "temperature": milli_text(settings.temperature),
            "min_p": milli_text(settings.min_p),
            "top_k": settings.top_k,
            "presence_penalty": milli_text(settings.presence_penalty),
            "frequency_penalty": milli_text(settings.frequency_penalty),
        },
        "prompt_tokens": loaded.kept,
        "tokens": out,
        "prompt": decode(loaded.kept, pieces),
        "text": decode(out, pieces),
    }


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what its buffer still holds must not fail again when
    Python flushes it at exit (a traceback and exit status 120 after our one line)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _read_prompt_file(path: Path) -> bytes:
    try:
        if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
            raise SampleError(f"--prompt-file {path} is over {MAX_PROMPT_FILE_BYTES} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise SampleError(f"cannot read --prompt-file {path}: {exc.strerror}") from None

"""`eggroll-export`: the replica of a save directory or checkpoint as safetensors and JSON
(the files: export_format.py), for tools outside this project. The last step by default.
A Hugging Face run's: the merged model, or with --lora a PEFT adapter (export_lora.py).
A non-empty --out is refused without --force: files of the export's names are replaced."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import click

from ..shared.cli import cannot_write, command, data_dir_option
from ..shared.data import BYTE_VOCAB_SIZE, TOKENIZER_FILE, DataError, read_meta
from ..shared.hf_dir import ModelDirError, base_state, check_model_dir, require_hf
from ..shared.logs import echo
from ..shared.replica import ReplicaState
from .export_format import write_export
from .export_lora import LoraError, check_rank, conv1d_targets, write_lora
from .source import SourceError, check_data_dir, load_source, replay_progress


def _tokenizer(data_dir: Path, state: ReplicaState, data_digest: str | None) -> Path | None:
    """The tokenizer file a BPE model needs, from the run's data directory."""
    vocab = state.config.model.vocab_size
    if vocab == BYTE_VOCAB_SIZE:
        return None
    try:
        meta = read_meta(data_dir / "meta.json")
    except DataError as exc:
        raise SourceError(
            f"the model reads a {vocab}-token vocabulary, so its export needs the tokenizer of "
            f"its data directory: {exc}"
        ) from None
    check_data_dir(data_dir, meta, vocab, data_digest)
    path = data_dir / TOKENIZER_FILE
    if not path.is_file():
        raise SourceError(
            f"{data_dir} has no {TOKENIZER_FILE}: give the run's BPE data with --data-dir"
        )
    return path


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' loading and saving bars off: on a terminal each one left a blank line
    behind, and an export says what it wrote in one line."""
    logging = require_hf()[1].utils.logging  # one line when transformers is missing
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def _export_hf(
    state: ReplicaState, model_dir: Path | None, out: Path, origin: str, lora: int | None
) -> None:
    """The merged model (the state's target weights in the base model) of a Hugging Face
    run, from its base model directory, which must be the run's (its pinned file digests);
    with `lora`, the change from the base alone as a PEFT LoRA adapter of that rank."""
    path = model_dir or Path(state.config.model.path)
    check_model_dir(path, state.config.model.files)
    if lora is not None:
        check_rank(state, lora)
        conv1d = conv1d_targets(path, state)
        base = base_state(state.config, path)
        try:
            errors = write_lora(out, state, base, lora, conv1d, click.echo)
        except OSError as exc:
            raise cannot_write(exc, out) from None
        click.echo(
            f"wrote {out}: step {state.step} ({origin}), replica {state.digest_hex()}; a "
            f"rank-{lora} LoRA adapter of {len(errors)} targets, largest relative error "
            f"{max(errors.values(), default=0.0):.3g} (peft.PeftModel.from_pretrained)"
        )
        return
    from .hf_model import export_merged  # torch and transformers: the hf extra

    try:
        with _no_progress_bars():
            export_merged(path, state, out)
    except OSError as exc:
        raise cannot_write(exc, out) from None
    click.echo(
        f"wrote {out}: step {state.step} ({origin}), replica {state.digest_hex()}; a "
        "Hugging Face model directory (AutoModelForCausalLM.from_pretrained)"
    )


def _check_out(out: Path, source: Path, force: bool) -> None:
    """Refuse an --out that is the source, or a non-empty one without --force: an export
    replaces files of its names there, which may be someone's."""
    if out.resolve() == source.resolve():
        raise click.ClickException("--out must be a directory of its own, not the source")
    if not force and out.is_dir() and any(out.iterdir()):
        raise click.ClickException(
            f"--out {out} is not empty: name a new or empty directory, or add --force to "
            "write over files of the same names"
        )


@command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write the export into, new or empty (unless --force): "
    "model.safetensors, config.json (and tokenizer.json), or an hf run's model or adapter.",
)
@click.option("--step", type=int, default=None, help="Step to export (default: the last).")
@data_dir_option(
    Path("data"), "The run's data directory: its tokenizer.json, for a BPE vocabulary."
)
@click.option(
    "--model-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="A Hugging Face run's base model directory [default: the run's model.path].",
)
@click.option(
    "--lora",
    type=click.IntRange(min=1),
    default=None,
    metavar="RANK",
    help="A Hugging Face run's change of each target matrix as a PEFT LoRA adapter of this "
    "rank (truncated SVD; each target's relative error is printed), not the merged model.",
)
@click.option(
    "--force", is_flag=True, help="Write into a non-empty --out, replacing files of the same names."
)
def main(
    source: Path,
    out: Path,
    step: int | None,
    data_dir: Path,
    model_dir: Path | None,
    lora: int | None,
    force: bool,
) -> None:
    """Export the replica in SOURCE (a save directory or a checkpoint file) as safetensors;
    a Hugging Face run's as the merged model, a directory transformers loads, or with
    --lora as a PEFT LoRA adapter."""
    _check_out(out, source, force)
    try:
        found = load_source(
            source,
            step,
            newest_snapshot=False,
            on_replay=replay_progress(lambda text: echo(text, err=True)),
            warn=lambda text: echo(f"warning: {text}", err=True),
            model_dir=model_dir,  # a Hugging Face run's step 0
        )
        arch = found.state.config.model.arch
        if arch == "hf":
            _export_hf(found.state, model_dir, out, found.origin, lora)
            return
        if lora is not None:
            raise click.ClickException(
                f"--lora exports a Hugging Face run (model.arch='hf'), and {source} is a "
                f"model.arch={arch!r} run: export it without --lora"
            )
        tokenizer = _tokenizer(data_dir, found.state, found.data_digest)
    except (SourceError, DataError, ModelDirError, LoraError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        files = write_export(out, found.state, found.data_digest, tokenizer)
    except OSError as exc:
        raise cannot_write(exc, out) from None
    state = found.state
    click.echo(
        f"wrote {out}: step {state.step} ({found.origin}), replica {state.digest_hex()}; "
        f"{', '.join(files)}"
    )

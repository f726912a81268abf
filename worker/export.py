"""`eggroll-export`: the replica of a save directory or checkpoint as safetensors and JSON
(the files: export_format.py), for tools outside this project. The last step by default."""

from __future__ import annotations

from pathlib import Path

import click

from ..shared.cli import cannot_write, command
from ..shared.data import BYTE_VOCAB_SIZE, TOKENIZER_FILE, DataError, read_meta
from ..shared.hf_dir import ModelDirError, check_model_dir
from ..shared.logs import echo
from ..shared.replica import ReplicaState
from .export_format import write_export
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


def _export_hf(state: ReplicaState, model_dir: Path | None, out: Path, origin: str) -> None:
    """The merged model (base + the accumulators' updates) of a Hugging Face run, from its
    base model directory, which must be the run's (its pinned file digests)."""
    from .hf_model import export_merged  # torch and transformers: the hf extra

    path = model_dir or Path(state.config.model.path)
    check_model_dir(path, state.config.model.files)
    try:
        export_merged(path, state, out)
    except OSError as exc:
        raise cannot_write(exc, out) from None
    click.echo(
        f"wrote {out}: step {state.step} ({origin}), replica {state.digest_hex()}; a "
        "Hugging Face model directory (AutoModelForCausalLM.from_pretrained)"
    )


@command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write model.safetensors, config.json (and tokenizer.json) into.",
)
@click.option("--step", type=int, default=None, help="Step to export (default: the last).")
@click.option(
    "--data-dir",
    default=Path("data"),
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The run's data directory: its tokenizer.json, for a BPE vocabulary.",
)
@click.option(
    "--model-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="A Hugging Face run's base model directory [default: the run's model.path].",
)
def main(source: Path, out: Path, step: int | None, data_dir: Path, model_dir: Path | None) -> None:
    """Export the replica in SOURCE (a save directory or a checkpoint file) as safetensors;
    a Hugging Face run's as the merged model, a directory transformers loads."""
    if out.resolve() == source.resolve():
        raise click.ClickException("--out must be a directory of its own, not the source")
    try:
        found = load_source(
            source,
            step,
            newest_snapshot=False,
            on_replay=replay_progress(lambda text: echo(text, err=True)),
            warn=lambda text: echo(f"warning: {text}", err=True),
        )
        if found.state.config.model.arch == "hf":
            _export_hf(found.state, model_dir, out, found.origin)
            return
        tokenizer = _tokenizer(data_dir, found.state, found.data_digest)
    except (SourceError, DataError, ModelDirError) as exc:
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

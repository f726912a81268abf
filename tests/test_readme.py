"""The user's documents stay true to the code: README.md, deploy/README.md, scripts/RESULTS.md.

- Every `eggroll-*` command they name is a console script of pyproject.toml.
- Every `--flag` shown after a command exists on that click command (a group's subcommand
  too: `eggroll-data prepare --out`). Each table row, code-block command and inline code
  span is read on its own; a flag that no command precedes must exist on some command.
- Every repository path they name, in backticks, code blocks or links, exists. URLs,
  placeholders (`shared/rules/<name>.py`), globs and user paths (`./checkpoints/local`,
  `data/mine`) are not repository paths.
- Links to a section (`#presets`, `scripts/RESULTS.md#threads`) name a heading there.
- The README stays a guide: at most 300 lines.
- Its drawing of `shared/` in layers is the import graph: every module once, each on the
  lowest line above everything it imports when it runs.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, ROOT / "deploy" / "README.md", ROOT / "scripts" / "RESULTS.md"]
COMMAND_DOCUMENTS = [README, ROOT / "deploy" / "README.md"]
MAX_README_LINES = 300

# The repository's top level; a path names the repository when it starts with one of these.
ROOTS = (".ci", "coordinator", "worker", "protocol", "shared", "deploy", "scripts", "tests")
ROOT_FILES = ("pyproject.toml", "README.md")
# The project's name is not a command, nor are the systemd units named after commands.
NOT_COMMANDS = {"eggroll-distributed"}

COMMAND = re.compile(r"(?<![\w./@=-])eggroll-[a-z]+(?![\w@-]|\.service)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
PATH = re.compile(
    r"(?<![\w./~$-])((?:" + "|".join(re.escape(r) for r in ROOTS) + r")(?:/[^\s`'\"()\[\],;|]*)?"
    r"|(?:" + "|".join(re.escape(f) for f in ROOT_FILES) + r"))(?![\w/-])"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^\s*```")
# Programs whose flags are not ours: a script of the repository, or one of these.
OTHER_PROGRAM = re.compile(r".*\.(py|sh|sbatch)|python3?|pip|pytest|prometheus|openssl|sbatch|srun")


def scripts() -> dict[str, click.Command]:
    """The console scripts of pyproject.toml, as their click objects."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    found = {}
    for name, target in table.items():
        module, attr = target.split(":")
        found[name] = getattr(importlib.import_module(module), attr)
    return found


def flags_of(cmd: click.Command) -> set[str]:
    names = {"--help"}
    for param in cmd.params:
        names.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
    return names


def blocks(text: str) -> tuple[list[str], list[str]]:
    """(code-block lines, prose lines) of a markdown text; continued shell lines joined."""
    code, prose, inside, pending = [], [], False, ""
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            prose.append(line)
        elif line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            code.append(pending + line)
            pending = ""
    return code, prose


def units(prose: list[str]) -> list[str]:
    """Table rows and headings one by one; other prose as paragraphs, lines joined (a code
    span may wrap)."""
    found, paragraph = [], []
    for line in [*prose, ""]:
        if line.strip() and not line.lstrip().startswith(("|", "#")):
            paragraph.append(line.strip())
            continue
        if paragraph:
            found.append(" ".join(paragraph))
            paragraph = []
        if line.strip():
            found.append(line)
    return found


def segments(text: str) -> list[tuple[str, bool]]:
    """(piece, is_code): the pieces whose flags belong to the command named first in them."""
    code, prose = blocks(text)
    pieces = []
    for line in code:
        # one shell command at a time, its comment left out
        for part in re.split(r"&&|\|\||;|\|", line.split(" # ")[0]):
            pieces.append((part, True))
    for line in units(prose):
        if line.lstrip().startswith("|"):
            pieces.append((" ".join(SPAN.findall(line)), False))  # a table row: one context
        else:
            pieces.extend((span, False) for span in SPAN.findall(line))
    return pieces


def bad_flags(text: str, commands: dict[str, click.Command]) -> list[str]:
    everywhere = set().union(*(flags_of(c) for c in all_commands(commands)))
    bad = []
    for piece, is_code in segments(text):
        current: click.Command | None = None
        other = False  # flags of another program follow
        words = piece.replace("[", " ").replace("]", " ").replace("|", " ").split()
        for i, word in enumerate(words):
            name = word.strip(".,:;()")
            if word == "--" and current is commands.get("eggroll-ray"):
                current = commands["eggroll-worker"]  # its workers' flags follow
                continue
            if name in commands:
                current, other = commands[name], False
                if isinstance(current, click.Group) and i + 1 < len(words):
                    current = current.commands.get(words[i + 1].strip(".,:;()"), current)
                continue
            if OTHER_PROGRAM.fullmatch(name):
                current, other = None, True
                continue
            if other or (current is None and is_code):
                continue  # another program's flags
            for flag in FLAG.findall(word):
                known = flags_of(current) if current is not None else everywhere
                if flag not in known:
                    owner = current.name if current is not None else "any command"
                    bad.append(f"{flag} ({owner}) in: {piece.strip()}")
    return bad


def all_commands(commands: dict[str, click.Command]) -> list[click.Command]:
    found = []
    for cmd in commands.values():
        found.append(cmd)
        if isinstance(cmd, click.Group):
            found.extend(cmd.commands.values())
    return found


def named_paths(doc: Path) -> set[str]:
    """Repository paths a document names, relative to the root (links: to the document)."""
    text = doc.read_text()
    code, prose = blocks(text)
    spans = [s for unit in units(prose) for s in SPAN.findall(unit)]
    found = set()
    for chunk in [*spans, *code]:
        for match in PATH.finditer(chunk):
            found.add(match.group(1).split("::")[0].rstrip(".:"))
    for target in LINK.findall("\n".join(prose)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        found.add(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else f"outside:{target}")
    return {p for p in found if not re.search(r"[<>*{}$]|\.\.\.", p)}


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@pytest.fixture(scope="module")
def commands() -> dict[str, click.Command]:
    return scripts()


def test_readme_is_a_guide_not_a_notebook() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("doc", COMMAND_DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_named_is_a_console_script(
    doc: Path, commands: dict[str, click.Command]
) -> None:
    named = set(COMMAND.findall(doc.read_text())) - NOT_COMMANDS
    assert named, f"{doc.name} names no command"
    assert sorted(named - set(commands)) == []


@pytest.mark.parametrize("doc", COMMAND_DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_shown_exists_on_its_command(
    doc: Path, commands: dict[str, click.Command]
) -> None:
    assert bad_flags(doc.read_text(), commands) == []


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(doc: Path) -> None:
    paths = named_paths(doc)
    assert paths, f"{doc.name} names no repository path"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []


def headings(doc: Path) -> set[str]:
    _, prose = blocks(doc.read_text())
    return {slug(line.lstrip("#")) for line in prose if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_to_a_section_name_a_heading(doc: Path) -> None:
    """`#presets` in the same file, or `scripts/RESULTS.md#threads` in another one."""
    _, prose = blocks(doc.read_text())
    bad = []
    for target in LINK.findall("\n".join(prose)):
        path, _, anchor = target.partition("#")
        if not anchor or re.match(r"[a-z]+:", target):
            continue
        other = (doc.parent / path).resolve() if path else doc
        if other.suffix == ".md" and other.exists() and anchor not in headings(other):
            bad.append(target)
    assert bad == []


def test_the_checks_catch_what_they_should(commands: dict[str, click.Command]) -> None:
    """The readers above are not vacuous: a wrong flag, command or path is seen."""
    assert bad_flags("`eggroll-train --workers 2`", commands)
    assert bad_flags("| `eggroll-data prepare` | `--no-such-flag` |", commands)
    assert bad_flags("see `eggroll-sample D --step S\n--workers 2` there", commands)
    assert not bad_flags("| `eggroll-data prepare` | `--out D --builtin` |", commands)
    assert not bad_flags(
        "```sh\nprometheus --config.file=x && eggroll-train --steps 5\n```", commands
    )
    assert not bad_flags("`python scripts/sweep.py --base egg-paper`", commands)
    assert bad_flags("```sh\neggroll-local \\\n  --steps 5 --nope\n```", commands)
    # After eggroll-ray's `--` come its workers' flags, and only there.
    assert not bad_flags("`eggroll-ray h --workers 2 -- --data-dir d`", commands)
    assert bad_flags("`eggroll-ray h --data-dir d`", commands)
    assert bad_flags("`eggroll-ray h -- --workers 2`", commands)
    assert COMMAND.findall("`eggroll-worker@0`, eggroll-distributed, `eggroll-local`") == [
        "eggroll-distributed",
        "eggroll-local",
    ]
    assert (
        slug("Scaling with workers: the update's cost") == "scaling-with-workers-the-updates-cost"
    )
    found = {m.group(1) for m in PATH.finditer("`./checkpoints/local` `shared/x.py` data/mine")}
    assert found == {"shared/x.py"}


def _drawn_layers() -> list[list[str]]:
    """The README's `shared/` layers, top line first: the ```text block after its title."""
    text = README.read_text()
    start = text.index("**`shared/` in layers**")
    begin = text.index("```text\n", start) + 8
    block = text[begin : text.index("\n```", begin)]
    return [line.split("#")[0].split() for line in block.splitlines()]


def _unit(module: str) -> str:
    """A module of shared/ as the drawing names it: a package as one (`objectives/`)."""
    name = module.removeprefix("shared.")
    return name.split(".")[0] + "/" if "." in name or name in ("objectives", "rules") else name


def test_the_drawn_layers_of_shared_are_its_import_graph() -> None:
    from test_import_graph import graph

    deps: dict[str, set[str]] = {}
    for module, imported in graph(ROOT, "shared").items():
        if module == "shared":
            continue
        unit = _unit(module)
        deps.setdefault(unit, set()).update(_unit(m) for m in imported if _unit(m) != unit)
    layers = _drawn_layers()
    drawn = [name for layer in layers for name in layer]
    assert sorted(drawn) == sorted(deps), "every module of shared/ is drawn once"
    level = {name: len(layers) - 1 - i for i, layer in enumerate(layers) for name in layer}
    for name, needs in deps.items():
        lowest = 1 + max((level[n] for n in needs), default=-1)
        assert level[name] == lowest, (
            f"shared/{name} belongs on the line {lowest} from the bottom (it imports "
            f"{sorted(needs)}), not on {level[name]}"
        )

"""Any TOML config file gives a RunConfig or one ConfigError line, never another exception."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from eggroll_dist.shared.config import (
    _SECTIONS,
    PRESETS,
    ConfigError,
    RunConfig,
    from_canonical_bytes,
    load_config,
)

# Text without surrogates or control characters: each one a valid TOML basic string once
# quoted by json.dumps.
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=8)
SCALARS = st.one_of(
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.integers(-4, 70_000),  # near the bounds the config checks
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    TEXT,
    st.sampled_from([*PRESETS, "egg", "ztest", "uniform", "gaussian"]),
    st.dates(),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)


def toml_value(value: Any) -> str:
    """`value` as a TOML inline value (tomllib reads, it does not write)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def section_keys(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_SECTIONS[name])]


def key_values(default: Any) -> st.SearchStrategy[Any]:
    """Any TOML value, or one of the key's own type near its default (so that many files
    are valid and the range checks are reached)."""
    if isinstance(default, bool):
        typed: st.SearchStrategy[Any] = st.booleans()
    elif isinstance(default, int):
        typed = st.integers(-2, 2 * default + 2) | st.sampled_from([2, 4, 16, 64, 256])
    elif isinstance(default, float):
        typed = st.floats(-1, 40) | st.integers(-1, 40).map(float)
    elif isinstance(default, tuple):  # the hf family's lists of names
        typed = st.lists(TEXT, max_size=3)
    else:
        typed = st.sampled_from(
            ["egg", "former", "ztest", "uniform", "gaussian", "none", "zero", "zipf", ""]
        )
    return st.one_of(st.just(default), typed, VALUES)


# True about one time in twenty (Hypothesis leans towards small integers, so not "== 0").
RARELY = st.integers(0, 19).map(lambda n: n == 19)
NAMES = st.sampled_from(list(PRESETS))


@st.composite
def config_files(draw: st.DrawFn) -> str:
    """A TOML document: every key of every table may appear, with any TOML value."""
    lines = []
    if draw(st.booleans()):
        lines.append(f"preset = {toml_value(draw(st.one_of(NAMES, NAMES, VALUES)))}")
    if draw(st.booleans()):
        lines.append(f"steps = {toml_value(draw(key_values(RunConfig().steps)))}")
    if draw(RARELY):
        lines.append(f"format = {toml_value(draw(st.just(1) | VALUES))}")
    if draw(RARELY):
        lines.append(f"{toml_value(draw(TEXT))} = {toml_value(draw(VALUES))}")
    for name, cls in _SECTIONS.items():
        if draw(RARELY):  # a section that is not a table
            lines.insert(0, f"{name} = {toml_value(draw(VALUES))}")
            continue
        keys = draw(st.lists(st.sampled_from(section_keys(name)), unique=True))
        if not keys:
            continue
        lines.append(f"[{name}]")
        defaults = cls()
        lines += [f"{key} = {toml_value(draw(key_values(getattr(defaults, key))))}" for key in keys]
        if draw(RARELY):
            lines.append(f"{toml_value(draw(TEXT))} = {toml_value(draw(VALUES))}")
    return "\n".join(lines) + "\n"


@settings(max_examples=400, deadline=None)
@given(body=config_files())
def test_any_config_file_is_a_config_or_one_line(body: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(body, encoding="utf-8")
        try:
            cfg = load_config(path)
        except ConfigError as exc:
            message = str(exc)
            assert message and "\n" not in message, repr(message)
            return
    assert isinstance(cfg, RunConfig)
    # What a coordinator accepts, every worker can rebuild from WELCOME's bytes.
    assert from_canonical_bytes(cfg.canonical_bytes()) == cfg


@settings(max_examples=200, deadline=None)
@given(value=VALUES)
def test_any_canonical_bytes_are_a_config_or_one_line(value: Any) -> None:
    """The same for run config bytes from a peer (JSON instead of TOML)."""
    base = json.loads(RunConfig().canonical_bytes())
    for key in [
        "steps",
        "format",
        *(f"{name}.{k}" for name in _SECTIONS for k in section_keys(name)),
    ]:
        section, _, field = key.rpartition(".")
        data = json.loads(json.dumps(base))
        (data[section] if section else data)[field] = value
        try:
            raw = json.dumps(data, default=str).encode()
        except ValueError:  # nan and inf are not JSON
            continue
        try:
            from_canonical_bytes(raw)
        except ConfigError as exc:
            assert "\n" not in str(exc)


def test_preset_that_is_not_a_name_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('preset = ["tiny"]\n')
    try:
        load_config(path)
    except ConfigError as exc:
        names = ", ".join(PRESETS)
        assert str(exc) == f"'preset' must be a preset name ({names}), got list ['tiny']"
    else:
        raise AssertionError("a list as preset was accepted")
    # The command line shows it as one line, no traceback.
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("eggroll-train")),
            "--data-dir",
            str(tmp_path),
            "--config",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        f"Error: 'preset' must be a preset name ({', '.join(PRESETS)}), got list ['tiny']"
    ], done.stderr

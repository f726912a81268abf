"""A run's curve as its save directory records it: train loss and step time per committed
step, the held-out scores, and the data's baselines.

Every writer keeps history.log (shared/save_dir.py): the coordinator, so eggroll-local and a
hand-started one alike, and eggroll-train. Runs from before it have eggroll-local's copy of
the coordinator's log (logs/coordinator.log, the same records as log lines) or summary.json
(eggroll-train's last session: its held-out scores and step times). Read only, so it is
safe on a live run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..shared.logs import HELD_OUT_FIELDS, STEP, VALIDATION
from ..shared.save_dir import BASELINES, Layout, read_history

# history.log's record of a rewind to `step` steps: the points of later steps before it
# (committed steps, held-out scores and samples of replicas past it) were undone.
REWOUND = "rewound"


@dataclass
class Curve:
    """STEP and VALIDATION records (shared/logs.py's fields), one per step, by step; the
    baselines per token and per byte ({} when unknown); what was read."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)
    baselines: dict[str, float] = field(default_factory=dict)
    baselines_per_byte: dict[str, float] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None  # summary.json, if any

    @property
    def last_step(self) -> int:
        return max((r["step"] for r in [*self.steps, *self.validations]), default=0)


def _log_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a log that parse (a log may end in a torn line)."""
    records = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _by_step(records: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    """The records of `event`, the last one of each step, by step; a REWOUND record drops
    those of later steps written before it (a STEP's step counts the steps committed, a
    VALIDATION's is its replica's: either past the rewind's is undone)."""
    found: dict[int, dict[str, Any]] = {}
    for r in records:
        if not _is_step(r.get("step")):
            continue
        if r.get("event") == REWOUND:
            found = {s: kept for s, kept in found.items() if s <= r["step"]}
        elif r.get("event") == event:
            found[r["step"]] = r
    return [found[s] for s in sorted(found)]


def _summary_validation(step: int, scores: dict[str, Any]) -> dict[str, Any]:
    """A VALIDATION record from summary.json's names (`valid_bits_per_token`, or a `curve`
    entry's `bits_per_token`)."""
    names = ("bits_per_token", "bits_per_byte", "stream_bits_per_token", "stream_bits_per_byte")
    values = (scores.get(n, scores.get(f"valid_{n}")) for n in names)
    return {"event": VALIDATION, "step": step, **dict(zip(HELD_OUT_FIELDS, values, strict=True))}


def read_curve(save_dir: Path) -> Curve:
    """The curve of the run in `save_dir` (empty where it records none). OSError or
    ValueError when a file is unreadable."""
    layout = Layout(save_dir)
    curve = Curve()
    if layout.history.is_file():
        records = read_history(layout.history)
        curve.sources.append(layout.history.name)
    elif layout.coordinator_log.is_file():
        records = _log_lines(layout.coordinator_log)
        curve.sources.append(layout.coordinator_log.relative_to(save_dir).as_posix())
    else:
        records = []
    curve.steps = _by_step(records, STEP)
    curve.validations = _by_step(records, VALIDATION)
    for record in records:
        if record.get("event") == BASELINES:  # the last start's
            curve.baselines = dict(record.get("per_token") or {})
            curve.baselines_per_byte = dict(record.get("per_byte") or {})
    if layout.summary.is_file():  # eggroll-train's, or eggroll-local's final held-out score
        summary = curve.summary = json.loads(layout.summary.read_text())
        curve.sources.append(layout.summary.name)
        if not curve.baselines:
            curve.baselines = dict(summary.get("baselines") or {})
            curve.baselines_per_byte = dict(summary.get("baselines_per_byte") or {})
        seen = {r["step"] for r in curve.validations}
        found = [
            _summary_validation(entry["step"], entry)
            for entry in summary.get("curve", [])
            if entry.get("step") not in seen
        ]
        if summary.get("valid_bits_per_token") is not None and summary.get("steps") not in seen:
            found.append(_summary_validation(summary["steps"], summary))
        curve.validations = _by_step([*curve.validations, *found], VALIDATION)
    return curve

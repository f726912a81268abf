"""A file a run reads besides its data, as an objective names it for pinning."""

from __future__ import annotations

from typing import NamedTuple


class GoalFile(NamedTuple):
    """The config key of its pinned digest, its path (relative to the config's folder or a
    worker's --goal-dir), the digest pinned ("" before the config is loaded) and what it
    is, for error lines."""

    key: str
    path: str
    pinned: str
    what: str

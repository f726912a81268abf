"""Crash-safe file replacement: a crash leaves the old version or the new one, never a mix.
Also the directory fsync that makes a new name durable."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError raised inside names `path` as its file: a write that fails on a full disk
    (f.write, os.fsync) names none, and an operator needs to know which file it was. A
    temporary file's name is replaced by `path`, the name that means something."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None or Path(exc.filename).name.startswith("."):
            exc.filename = str(path)
        raise


def write_atomic(path: str | Path, data: bytes | memoryview) -> None:
    """Write a temporary file beside `path`, fsync it, rename it over `path`, fsync the
    directory (so the rename itself survives a crash)."""
    path = Path(path)
    # open(..., "xb") rather than mkstemp: the file gets the usual umask permissions; the
    # random part keeps concurrent writers of the same path apart.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with naming(path):
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make the directory's entries (a created, renamed or removed name) survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

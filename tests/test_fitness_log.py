"""The append-only fitness log: durable records, CRCs, torn-tail repair."""

from __future__ import annotations

from pathlib import Path

import pytest

from eggroll_dist.shared.fitness_log import FitnessLog, FitnessLogError, packed_size

DIGEST = bytes(range(32))


def _log(tmp_path: Path, steps: int, pairs: int = 23) -> tuple[FitnessLog, list[bytes]]:
    log = FitnessLog.create(tmp_path / "fitness.log", pairs, DIGEST)
    records = [bytes([(s * 7 + i) % 243 for i in range(packed_size(pairs))]) for s in range(steps)]
    for s, rec in enumerate(records):
        log.append(s, rec)
    return log, records


def test_append_reopen_read(tmp_path: Path) -> None:
    log, records = _log(tmp_path, 6)
    again = FitnessLog.open(log.path)
    assert again.steps == 6 and again.pairs == 23 and again.config_digest == DIGEST
    assert again.read(0, 6) == records
    assert again.read(2, 3) == records[2:5]
    with pytest.raises(FitnessLogError, match="not all in the log"):
        again.read(4, 3)


def test_append_checks_step_and_size(tmp_path: Path) -> None:
    log, _ = _log(tmp_path, 2)
    with pytest.raises(FitnessLogError, match="holds 2 steps"):
        log.append(5, bytes(packed_size(23)))
    with pytest.raises(FitnessLogError, match="expected 5"):
        log.append(2, b"\x00")


def test_torn_tail_is_cut_off(tmp_path: Path) -> None:
    log, records = _log(tmp_path, 4)
    with open(log.path, "ab") as f:
        f.write(b"\x00\x00\x00\x00\x00\x00\x00\x04\x00")  # a crash mid-append
    with pytest.raises(FitnessLogError, match="torn"):
        FitnessLog.open(log.path, repair=False)
    again = FitnessLog.open(log.path)
    assert again.steps == 4 and again.repaired_bytes == 9
    again.append(4, records[0])
    assert FitnessLog.open(log.path).steps == 5


def test_corruption_in_the_middle_is_an_error(tmp_path: Path) -> None:
    log, _ = _log(tmp_path, 4)
    data = bytearray(log.path.read_bytes())
    data[60 + log.record_size] ^= 1
    log.path.write_bytes(bytes(data))
    with pytest.raises(FitnessLogError, match="record 1"):
        FitnessLog.open(log.path)


def test_not_a_log(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(b"hello world" * 10)
    with pytest.raises(FitnessLogError, match="not a fitness log"):
        FitnessLog.open(path)

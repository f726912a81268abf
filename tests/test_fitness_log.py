"""The append-only fitness log: durable records, CRCs, torn-tail repair."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eggroll_dist.shared.fitness_log import SECTOR, FitnessLog, FitnessLogError, packed_size

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


@pytest.mark.parametrize("zeros", ["whole", "tail"])
def test_zero_filled_last_record_is_torn(tmp_path: Path, zeros: str) -> None:
    # A crash where the file's new size reached the disk but (part of) the data did not.
    log, records = _log(tmp_path, 3, pairs=5000)  # 1016-byte records: span sectors
    log.append(3, records[0])
    data = bytearray(log.path.read_bytes())
    last = len(data) - log.record_size
    cut = last if zeros == "whole" else (last // SECTOR + 1) * SECTOR
    data[cut:] = bytes(len(data) - cut)
    log.path.write_bytes(bytes(data))
    again = FitnessLog.open(log.path)
    assert again.steps == 3 and again.repaired_bytes == log.record_size
    assert again.read(0, 3) == records
    assert log.path.stat().st_size == last


def test_other_corruption_of_the_last_record_says_what_to_do(tmp_path: Path) -> None:
    log, _ = _log(tmp_path, 3)
    data = bytearray(log.path.read_bytes())
    data[-3] ^= 0x40  # bit rot, no zero sector: not a torn write
    log.path.write_bytes(bytes(data))
    keep = len(data) - log.record_size
    with pytest.raises(FitnessLogError, match=f"record 2 is corrupt.*truncate -s {keep} "):
        FitnessLog.open(log.path)
    assert log.path.stat().st_size == len(data)  # nothing cut without the operator


def test_a_failed_append_refuses_more_appends(tmp_path: Path) -> None:
    log, records = _log(tmp_path, 2, pairs=5000)
    script = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from eggroll_dist.shared.fitness_log import FitnessLog\n"
        "path = Path(sys.argv[1])\n"
        "log = FitnessLog.open(path)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 100,) * 2)\n"
        "try:\n"
        "    log.append(2, bytes(log.record_size - 16))\n"
        "except OSError as exc:\n"
        "    print('append failed', exc.errno)\n"
        "try:\n"
        "    log.append(2, bytes(log.record_size - 16))\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(log.path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
    )
    assert out.returncode == 0, out.stderr
    assert "append failed 27" in out.stdout  # EFBIG
    assert "an earlier append failed" in out.stdout
    again = FitnessLog.open(log.path)  # the torn 100 bytes are cut off at the next open
    assert again.steps == 2 and again.repaired_bytes == 100
    assert again.read(0, 2) == records

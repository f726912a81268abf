"""Protocol micro-benchmarks: ternary packing, framing throughput, RESULT/STEP codecs.

Run: python scripts/bench_protocol.py   (about 10 s)

Every figure is a median over many repetitions, next to a reference measured in the same
run on the same data (np.packbits for ternary packing, bare zlib.crc32 for framing), so
ratios stay comparable across machines.
"""

from __future__ import annotations

import statistics
import time
import zlib
from collections.abc import Callable

import numpy as np

from eggroll_dist.protocol import (
    FrameDecoder,
    Result,
    Step,
    decode_message,
    encode_frame,
    encode_message,
    pack_ternary,
    unpack_ternary,
)

PAIRS = 163_840  # fitness values per step in the reference configuration
TERNARY_TARGET_MS = 2.0


def median_s(fn: Callable[[], object], reps: int, budget_s: float = 1.5) -> float:
    """Median seconds per call over up to `reps` calls, stopping early after `budget_s`."""
    fn()  # warm-up
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if time.perf_counter() > deadline and len(times) >= 5:
            break
    return statistics.median(times)


def bench_ternary() -> None:
    values = np.random.default_rng(0).integers(-1, 2, size=PAIRS, dtype=np.int8)
    packed = pack_ternary(values)
    assert np.array_equal(unpack_ternary(packed, PAIRS), values)

    pack_s = median_s(lambda: pack_ternary(values), 500)
    unpack_s = median_s(lambda: unpack_ternary(packed, PAIRS), 500)
    both_s = median_s(lambda: unpack_ternary(pack_ternary(values), PAIRS), 500)
    bits = (values & 1).view(np.uint8)
    bits_packed = np.packbits(bits)
    ref_s = median_s(
        lambda: np.unpackbits(np.frombuffer(np.packbits(bits).tobytes(), np.uint8))[:PAIRS],
        500,
    )
    verdict = "PASS" if both_s * 1e3 < TERNARY_TARGET_MS else "FAIL"
    print(f"ternary, {PAIRS:,} values -> {len(packed):,} bytes")
    print(f"  pack            {pack_s * 1e3:8.3f} ms")
    print(f"  unpack          {unpack_s * 1e3:8.3f} ms")
    print(f"  pack+unpack     {both_s * 1e3:8.3f} ms   target < {TERNARY_TARGET_MS} ms: {verdict}")
    print(
        f"  reference np.packbits+unpackbits of the same count ({len(bits_packed):,} bytes): "
        f"{ref_s * 1e3:.3f} ms, ratio {both_s / ref_s:.1f}x"
    )


def bench_frames() -> None:
    print("frames (MB/s of payload; reference = zlib.crc32 alone on the same payload)")
    print(f"  {'payload':>9} {'encode':>10} {'decode':>10} {'crc32':>10} {'dec/crc':>8}")
    rng = np.random.default_rng(1)
    for size, label in ((64, "64 B"), (32 * 1024, "32 KiB"), (1 << 20, "1 MiB")):
        payload = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
        batch = max(1, (4 << 20) // size)  # about 4 MiB of payload per repetition
        stream = encode_frame(8, payload) * batch

        def encode(payload: bytes = payload, batch: int = batch) -> None:
            for _ in range(batch):
                encode_frame(8, payload)

        def decode(stream: bytes = stream, batch: int = batch) -> None:
            decoder = FrameDecoder()
            # Feed in 64 KiB reads, as a socket would deliver them.
            count = 0
            for start in range(0, len(stream), 65536):
                decoder.feed(stream[start : start + 65536])
                for _ in decoder:
                    count += 1
            assert count == batch

        def crc(payload: bytes = payload, batch: int = batch) -> None:
            for _ in range(batch):
                zlib.crc32(payload)

        megabytes = size * batch / 1e6
        enc = megabytes / median_s(encode, 30)
        dec = megabytes / median_s(decode, 30)
        ref = megabytes / median_s(crc, 30)
        print(f"  {label:>9} {enc:10.0f} {dec:10.0f} {ref:10.0f} {dec / ref:8.2f}")


def bench_messages() -> None:
    values = np.random.default_rng(2).integers(-1, 2, size=PAIRS, dtype=np.int8)

    def result_round_trip() -> None:
        result = Result.from_values(
            step=7, chunk=3, loss_sum=-123456, weights_changed=99, replica_digest=42, fitness=values
        )
        frame = encode_message(result)
        decoder = FrameDecoder()
        decoder.feed(frame)
        got = decoder.next_frame()
        assert got is not None
        decoded = decode_message(got.msg_type, got.payload)
        assert isinstance(decoded, Result)
        decoded.fitness_values()

    def step_round_trip() -> None:
        frame = encode_message(Step.from_values(7, values))
        decoder = FrameDecoder()
        decoder.feed(frame)
        got = decoder.next_frame()
        assert got is not None
        decoded = decode_message(got.msg_type, got.payload)
        assert isinstance(decoded, Step)
        decoded.fitness_values()

    step = Step.from_values(7, values)
    frame = encode_message(step)
    encode_s = median_s(lambda: encode_message(Step.from_values(7, values)), 300)
    decode_s = median_s(lambda: decode_message(9, frame[16:]), 300)
    print(f"messages, {PAIRS:,} fitness values (frame of {len(frame):,} bytes)")
    print(
        f"  RESULT pack+encode+frame+decode+unpack {median_s(result_round_trip, 300) * 1e3:7.3f} ms"
    )
    print(
        f"  STEP   pack+encode+frame+decode+unpack {median_s(step_round_trip, 300) * 1e3:7.3f} ms"
    )
    print(f"  STEP   from_values+encode_message       {encode_s * 1e3:7.3f} ms")
    print(f"  STEP   decode_message (validates trits) {decode_s * 1e3:7.3f} ms")


def main() -> None:
    start = time.perf_counter()
    bench_ternary()
    print()
    bench_frames()
    print()
    bench_messages()
    print(f"\n(total {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()

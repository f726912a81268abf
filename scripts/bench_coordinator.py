"""Benchmark a real coordinator process against simulated workers on loopback.

The simulated workers speak the real protocol but return instant fake fitness (all zero),
so the numbers are the coordinator's own cost: steps/s, coordinator CPU per step (from
/proc), and bytes per step per worker against the ternary payload P/10.

    python scripts/bench_coordinator.py [--steps 30] [--quick]

Target: 327,680 members in 40,960-member chunks with 64 workers: coordinator CPU per step
under 50 ms, and bytes per step per worker within 10% of P/10 plus headers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eggroll_dist.protocol import (
    HEADER_SIZE,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Connection,
    Hello,
    Job,
    JobRequest,
    Result,
    Role,
    Step,
    Wait,
    Welcome,
    auth_mac,
    packed_size,
)

FAKE_DIGEST = 0x5EED
CLK_TCK = os.sysconf("SC_CLK_TCK")


class SimWorker:
    """A protocol-level worker that answers every job at once with zero fitness."""

    def __init__(self, name: str, port: int, target_steps: int):
        self.name, self.port, self.target = name, port, target_steps
        self.conn = Connection(Role.WORKER, max_payload_bytes=64 << 20)
        self.step = 0
        self.bytes_in = self.bytes_out = 0
        self.done = asyncio.Event()

    async def run(self) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.send(Hello(PROTOCOL_VERSION, self.name, "sim", "none", bytes(32)))
        zero_chunk: bytes | None = None
        while not self.done.is_set():
            data = await reader.read(1 << 16)
            if not data:
                break
            self.bytes_in += len(data)
            self.conn.receive_data(data)
            while (msg := self.conn.next_event()) is not None:
                match msg:
                    case Challenge():
                        self.send(Auth(auth_mac(b"", msg.nonce)))
                    case Welcome():
                        self.step = msg.current_step
                        self.request()
                    case Job():
                        if zero_chunk is None:
                            zero_chunk = bytes(packed_size(msg.pair_count))
                        self.send(
                            Result(
                                msg.step, msg.chunk, 0, 0, FAKE_DIGEST, msg.pair_count, zero_chunk
                            )
                        )
                        self.request()
                    case Step():
                        self.step = msg.step + 1
                        if self.step >= self.target:
                            self.done.set()
                        self.request()
                    case Wait():
                        pass  # the next STEP (or a pushed JOB) wakes us
            await self.writer.drain()
        self.writer.close()

    def send(self, msg) -> None:
        data = self.conn.send(msg)
        self.bytes_out += len(data)
        self.writer.write(data)

    def request(self) -> None:
        self.send(JobRequest(self.step, FAKE_DIGEST, 0))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


async def bench_one(workers: int, population: int, chunk: int, steps: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-coord-"))
    (tmp / "run.toml").write_text(
        f'preset = "tiny"\n[es]\npopulation = {population}\nchunk_size = {chunk}\n'
    )
    exe = Path(sys.executable).with_name("eggroll-coordinator")
    proc = subprocess.Popen(
        [
            str(exe),
            "--save-dir",
            str(tmp / "run"),
            "--config",
            str(tmp / "run.toml"),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--snapshot-every",
            "0",
            "--max-connections-per-address",
            "1024",
            "--log-format",
            "json",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        port = None
        while port is None:
            line = proc.stderr.readline()
            if not line:
                raise RuntimeError("coordinator exited before listening")
            if '"listening"' in line:
                port = json.loads(line)["port"]
        warm = 3
        sims = [SimWorker(f"sim-{i}", port, warm + steps) for i in range(workers)]
        tasks = [asyncio.create_task(s.run()) for s in sims]
        while min(s.step for s in sims) < warm:  # connections up, buffers warm
            await asyncio.sleep(0.01)
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        bytes0 = sum(s.bytes_in + s.bytes_out for s in sims)
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sims)), 600)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(proc.pid) - cpu0
        moved = sum(s.bytes_in + s.bytes_out for s in sims) - bytes0
        for t in tasks:
            t.cancel()
        payload = packed_size(population // 2)
        return {
            "workers": workers,
            "population": population,
            "chunk": chunk,
            "steps_per_s": steps / wall,
            "cpu_ms_per_step": 1000 * cpu / steps,
            "bytes_per_step_per_worker": moved / steps / workers,
            "ternary_payload": payload,
            "step_frame": payload + 12 + HEADER_SIZE,
        }
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="only the target configuration")
    args = parser.parse_args()
    grid = [
        (1, 327680, 40960),
        (8, 327680, 40960),
        (64, 327680, 40960),
        (8, 1 << 20, 131072),
        (64, 1 << 20, 131072),
        (64, 16384, 2048),
    ]
    if args.quick:
        grid = [(64, 327680, 40960)]
    print(
        f"{'workers':>7} {'population':>10} {'chunk':>7} {'steps/s':>8} {'cpu ms/step':>11} "
        f"{'bytes/step/worker':>17} {'vs P/10':>8}"
    )
    for workers, population, chunk in grid:
        r = asyncio.run(bench_one(workers, population, chunk, args.steps))
        ratio = r["bytes_per_step_per_worker"] / r["ternary_payload"]
        print(
            f"{workers:>7} {population:>10,} {chunk:>7,} {r['steps_per_s']:>8.1f} "
            f"{r['cpu_ms_per_step']:>11.1f} {r['bytes_per_step_per_worker']:>17,.0f} "
            f"{ratio:>8.3f}"
        )
        if (workers, population, chunk) == (64, 327680, 40960):
            ok_cpu = r["cpu_ms_per_step"] < 50
            ok_bytes = r["bytes_per_step_per_worker"] <= 1.1 * r["ternary_payload"] + 200
            print(
                f"target: cpu/step < 50 ms {'PASS' if ok_cpu else 'FAIL'}; bytes/step/worker "
                f"<= 1.1 x P/10 + headers {'PASS' if ok_bytes else 'FAIL'}"
            )


if __name__ == "__main__":
    main()

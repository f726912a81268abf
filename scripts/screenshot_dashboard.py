"""Take a PNG of the Prometheus console page (deploy/prometheus/consoles/eggroll.html).

With no --prometheus, it runs a short demo first: a coordinator and workers on loopback
(built-in corpus, a small config), a Prometheus server with deploy/prometheus/prometheus.yml
pointed at them, all in a temporary directory and all stopped at the end:

    python scripts/screenshot_dashboard.py   # 90 s run -> deploy/prometheus/dashboard.png
    python scripts/screenshot_dashboard.py --seconds 30 --out /tmp/page.png
    python scripts/screenshot_dashboard.py --prometheus http://localhost:9090   # a live one

Needs the `prometheus` binary (Debian: apt-get install prometheus) and headless Chromium
(apt-get install chromium).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"

# Steps of about a second on one CPU core per worker; held-out bits every 10 steps.
DEMO_CONFIG = """
preset = "tiny"
[es]
population = 512
chunk_size = 128
seq_len = 32
[validation]
every_steps = 10
max_tokens = 4096
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else name


def wait(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise SystemExit(f"error: no {what} within {timeout_s:.0f} s")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def listening_port(log: Path) -> int | None:
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "listening":
            return int(event["port"])
    return None


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("error: no Chromium found (Debian: apt-get install chromium)")


def screenshot(url: str, out: Path, window: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eggroll-chromium-") as profile:
        subprocess.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={window}",
                "--virtual-time-budget=10000",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )
    if shutil.which("optipng"):
        subprocess.run(["optipng", "-quiet", "-o2", str(out)], check=False, timeout=300)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB) from {url}")


class Processes:
    """The demo's background processes, each logging to a file in `tmp`; all stopped by
    `stop`, newest first."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log_name: str) -> subprocess.Popen:
        with open(self.tmp / log_name, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def demo_data(args: argparse.Namespace, tmp: Path) -> Path:
    """--data-dir, or the built-in corpus prepared in `tmp`."""
    data = args.data_dir or tmp / "data"
    if not (data / "meta.json").exists():
        subprocess.run(
            [console_script("eggroll-data"), "prepare", "--builtin", "--out", str(data)],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=600,
        )
    return data


def start_coordinator(procs: Processes, config: Path, metrics_port: int) -> int:
    """Start the coordinator on a free loopback port; the port, once it listens."""
    tmp = procs.tmp
    coord = procs.start(
        [
            console_script("eggroll-coordinator"),
            "--save-dir",
            str(tmp / "run"),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            str(metrics_port),
            "--log-format",
            "json",
        ],
        "coordinator.log",
    )
    wait(
        lambda: coord.poll() is None and listening_port(tmp / "coordinator.log"),
        60,
        "coordinator",
    )
    port = listening_port(tmp / "coordinator.log")
    assert port is not None  # what wait() waited for
    return port


def start_prometheus(procs: Processes, metrics_port: int, prom_port: int) -> str:
    """Start Prometheus scraping the coordinator every 2 s; its URL, once it is ready."""
    tmp = procs.tmp
    text = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    text = text.replace("localhost:12346", f"127.0.0.1:{metrics_port}")
    text = re.sub(r"scrape_interval: \S+", "scrape_interval: 2s", text)
    text = re.sub(r"scrape_timeout: \S+", "scrape_timeout: 2s", text)
    (tmp / "prometheus.yml").write_text(text)
    procs.start(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            f"--web.console.templates={PROMETHEUS_DIR / 'consoles'}",
            f"--web.console.libraries={PROMETHEUS_DIR / 'console_libraries'}",
        ],
        "prometheus.log",
    )
    prom_url = f"http://127.0.0.1:{prom_port}"
    wait(lambda: http_ok(prom_url + "/-/ready"), 60, "ready Prometheus")
    return prom_url


def train(procs: Processes, args: argparse.Namespace, port: int, data: Path, prom_url: str) -> None:
    """Run workers against the coordinator for --seconds."""

    def worker(name: str) -> subprocess.Popen:
        cmd = [console_script("eggroll-worker"), f"127.0.0.1:{port}", "--data-dir", str(data)]
        return procs.start([*cmd, "--name", name, "--log-format", "json"], f"{name}.log")

    first = worker("worker-1")
    for i in range(1, args.workers):
        worker(f"worker-{i + 1}")
    print(f"training for {args.seconds:.0f} s (Prometheus at {prom_url}) ...")
    # The run itself: the graphs need this much history. With churn, a worker joins a
    # third of the way in and the first one is killed (its chunk is re-queued) at two
    # thirds, so the worker and re-queue graphs have something to show.
    third = args.seconds / 3
    time.sleep(third)
    if args.churn:
        worker(f"worker-{args.workers + 1}")
    time.sleep(third)
    if args.churn:
        first.kill()
    time.sleep(third)


def demo(args: argparse.Namespace, tmp: Path) -> None:
    procs = Processes(tmp)
    try:
        data = demo_data(args, tmp)
        config = tmp / "demo.toml"
        config.write_text(DEMO_CONFIG)
        metrics_port, prom_port = free_port(), free_port()
        port = start_coordinator(procs, config, metrics_port)
        prom_url = start_prometheus(procs, metrics_port, prom_port)
        train(procs, args, port, data, prom_url)
        screenshot(
            f"{prom_url}/consoles/eggroll.html?range={args.range}&refresh=off",
            args.out,
            args.window,
        )
    finally:
        procs.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "deploy" / "prometheus" / "dashboard.png"
    )
    parser.add_argument(
        "--prometheus", metavar="URL", help="screenshot this Prometheus instead of a demo run"
    )
    parser.add_argument("--seconds", type=float, default=90.0, help="length of the demo run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--no-churn",
        dest="churn",
        action="store_false",
        help="keep the same workers (default: one joins, one is killed)",
    )
    parser.add_argument("--data-dir", type=Path, help="data for the demo (default: built-in)")
    parser.add_argument("--range", default="5m", help="time range of the graphs")
    parser.add_argument("--window", default="1400,1480", help="browser window WIDTH,HEIGHT")
    args = parser.parse_args()
    if args.prometheus:
        url = args.prometheus.rstrip("/") + f"/consoles/eggroll.html?range={args.range}"
        screenshot(url + "&refresh=off", args.out, args.window)
        return
    if shutil.which("prometheus") is None:
        raise SystemExit("error: no prometheus binary (Debian: apt-get install prometheus)")
    with tempfile.TemporaryDirectory(prefix="eggroll-dashboard-") as tmp:
        demo(args, Path(tmp))


if __name__ == "__main__":
    main()

"""deploy/prometheus and deploy/grafana against the real thing: a Prometheus server scrapes a
live coordinator (two workers) with the shipped config and serves the console page."""

from __future__ import annotations

import html
import json
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
CONSOLES = DEPLOY / "prometheus" / "consoles"
CONSOLE_LIBRARIES = DEPLOY / "prometheus" / "console_libraries"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "eggroll.json"

# Steps of a few milliseconds; held-out bits every 2 steps.
SMALL = """
[model]
n_layer = 1
d_model = 16
[es]
population = 64
chunk_size = 16
seq_len = 8
[validation]
every_steps = 2
max_tokens = 200
"""

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the prometheus binary is not installed (Debian: apt-get install prometheus)",
)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def poll(
    check: Callable[[], Any],
    timeout: float,
    what: str,
    seen: Callable[[], Any] | None = None,
) -> Any:
    """The first truthy result of `check`, calling it until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.25)
    raise AssertionError(f"no {what} within {timeout} s" + (f" (seen: {seen()})" if seen else ""))


class Prometheus:
    """A Prometheus server on a free loopback port, scraping one target every second."""

    def __init__(self, tmp: Path, target: str):
        text = PROM_CONFIG.read_text()
        assert "localhost:12346" in text, "the shipped target should be localhost:12346"
        text = text.replace("localhost:12346", target)
        text = re.sub(r"scrape_interval: \S+", "scrape_interval: 1s", text)
        text = re.sub(r"scrape_timeout: \S+", "scrape_timeout: 1s", text)
        config = tmp / "prometheus.yml"
        config.write_text(text)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    shutil.which("prometheus") or "prometheus",
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    f"--web.console.templates={CONSOLES}",
                    f"--web.console.libraries={CONSOLE_LIBRARIES}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        poll(self._ready, 60, "ready Prometheus")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            return http_get(self.url + "/-/ready", timeout=2)[0] == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, body = http_get(
            self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        )
        data = json.loads(body)
        assert status == 200 and data["status"] == "success", f"{expr}: {body}"
        return data["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    servers: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        server = Prometheus(tmp_path / "prometheus", target)
        servers.append(server)
        return server

    (tmp_path / "prometheus").mkdir()
    yield start
    for server in servers:
        server.stop()


def grafana_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def console_exprs(page: str) -> list[str]:
    """Every PromQL expression of a rendered console page (stat boxes and graphs)."""
    stats = re.findall(r'data-egg-expr="([^"]*)"', page)
    graphs = re.findall(r'expr: "([^"]*)"', page)
    return [html.unescape(e) for e in stats] + graphs


def served_names(exposition: str) -> set[str]:
    """Series names of every metric family the coordinator exports, with or without samples."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M):
        names.add(name)
        if kind == "histogram":
            names |= {name + "_bucket", name + "_sum", name + "_count"}
    return names


def rendered(name: str, page: str) -> str:
    match = re.search(rf'id="egg-{name}"[^>]*>([^<]*)<', page)
    assert match, f"no egg-{name} value on the console page"
    return match.group(1)


@needs_prometheus
def test_prometheus_scrapes_a_live_run_and_serves_the_console(
    spawn, prometheus, words_data: Path, tmp_path: Path
) -> None:
    config = tmp_path / "small.toml"
    config.write_text(SMALL)
    metrics_port = free_port()
    coord = spawn(
        "eggroll-coordinator",
        "--save-dir",
        tmp_path / "run",
        "--config",
        config,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        str(metrics_port),
        "--log-format",
        "json",
    )
    port = coord.wait_for(lambda e: e.get("event") == "listening", 30, "listening line")["port"]
    prom = prometheus(f"127.0.0.1:{metrics_port}")
    poll(lambda: prom.value('up{job="eggroll"}') == 1, 30, "first scrape of the coordinator")
    workers = [
        spawn(
            "eggroll-worker",
            f"127.0.0.1:{port}",
            "--data-dir",
            words_data,
            "--name",
            f"w{i}",
            "--log-format",
            "json",
        )
        for i in range(2)
    ]
    coord.wait_for(
        lambda e: e.get("event") == "step" and e["step"] >= 6 and e["workers"] == 2,
        120,
        "step 6 committed with both workers connected",
    )
    coord.wait_for(lambda e: e.get("event") == "validation", 60, "a held-out score")
    for w in workers:
        w.proc.send_signal(signal.SIGSTOP)  # progress stops; the connections stay up
    try:

        def last(event: str) -> dict[str, Any]:
            return [e for e in coord.events if e.get("event") == event][-1]

        def last_step() -> int:
            return max(e["step"] for e in coord.events if e.get("event") == "step")

        observed: list[tuple] = []  # (logged step, committed, eggroll_step, workers)

        def settled() -> int | None:
            """The committed step once Prometheus has scraped it (and no commit came since)."""
            step = last_step()
            seen = (
                prom.value("eggroll_steps_committed_total"),
                prom.value("eggroll_step"),
                prom.value("eggroll_workers_connected"),
            )
            observed.append((step, *seen))
            return step if seen == (step, step, 2) and last_step() == step else None

        steps = poll(
            settled, 60, "scrape of the committed step with 2 workers", lambda: observed[-1:]
        )
        assert steps >= 6
        assert prom.value('up{job="eggroll"}') == 1
        # A held-out score in flight at the SIGSTOP may land after the last commit.
        poll(
            lambda: prom.value("eggroll_valid_step") == last("validation")["step"],
            30,
            "scrape of the last held-out score",
        )
        validation, step_event = last("validation"), last("step")
        valid_bits = prom.value("eggroll_valid_bits_per_token")
        assert valid_bits == pytest.approx(validation["valid_bits"], abs=1e-4)
        stream_bits = prom.value("eggroll_valid_stream_bits_per_token")
        assert stream_bits == pytest.approx(validation["stream_bits"], abs=1e-4)
        per_byte = prom.value("eggroll_valid_bits_per_byte")
        assert per_byte == pytest.approx(validation["valid_bits_per_byte"], abs=1e-4)
        stream_per_byte = prom.value("eggroll_valid_stream_bits_per_byte")
        assert stream_per_byte == pytest.approx(validation["stream_bits_per_byte"], abs=1e-4)
        loss_bits = prom.value("eggroll_train_loss_bits")
        assert loss_bits == pytest.approx(step_event["loss_bits"], abs=1e-4)
        assert prom.value("eggroll_member_tokens_total") == steps * 64 * 8
        workers_seen = {r["metric"]["worker"] for r in prom.query("eggroll_worker_chunk_seconds")}
        assert workers_seen == {"w0", "w1"}

        # The console page: rendered by Prometheus from our templates, with the run's numbers.
        status, page = http_get(prom.url + "/consoles/eggroll.html")
        assert status == 200, page[:2000]
        assert rendered("step", page) == str(steps)
        assert rendered("committed", page) == str(steps)
        assert rendered("workers", page) == "2"
        assert rendered("valid-bits", page) == f"{valid_bits:.3f}"
        assert rendered("stream-bits", page) == f"{stream_bits:.3f}"
        assert rendered("valid-bits-per-byte", page) == f"{per_byte:.3f}"
        assert rendered("valid-step", page) == str(validation["step"])
        assert rendered("train-loss", page) == f"{loss_bits:.3f}"
        assert "Egg.start()" in page and 'id="g-loss"' in page
        assert http_get(prom.url + "/consoles/eggroll.html?range=5m&refresh=off")[0] == 200

        # Every query of the console page and of the Grafana dashboard is valid PromQL for
        # this Prometheus, names only metrics the coordinator serves, and has data once rates
        # have two scrapes (except the errors and drops this clean run never had).
        served = served_names(http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1])
        exprs = console_exprs(page)
        assert len(exprs) >= 20
        for expr in exprs + [
            e.replace("$__rate_interval", "1m").replace("$instance", ".*") for e in grafana_exprs()
        ]:
            names = set(re.findall(r"\beggroll_\w+", expr))
            assert names and names <= served, f"{expr}: {names - served} not served"
            if "protocol_errors" in expr or "results_dropped" in expr:
                prom.query(expr)
            else:
                poll(lambda e=expr: prom.query(e), 30, f"data for {expr}")
    finally:
        for w in workers:
            w.proc.send_signal(signal.SIGCONT)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_scrape_config() -> None:
    done = subprocess.run(
        ["promtool", "check", "config", str(PROM_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


ALERTS_TEST = """\
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{{job="eggroll",instance="a"}}'
        values: '1 1 0 0 0 0'
      - series: 'eggroll_save_dir_write_failures_total{{job="eggroll",instance="a",file="run"}}'
        values: '0 0 1 1 1 1'
      - series: 'eggroll_replica_digest_mismatches_total{{job="eggroll",instance="a"}}'
        values: '0 0 0 2 2 2'
      - series: 'eggroll_workers_stalled_total{{job="eggroll",instance="a"}}'
        values: '0 0 0 0 1 1'
      - series: 'eggroll_workers_connected{{job="eggroll",instance="a"}}'
        values: '2x45'
      - series: 'eggroll_last_commit_timestamp_seconds{{job="eggroll",instance="a"}}'
        values: '60x45'
      - series: 'eggroll_workers_connected{{job="eggroll",instance="b"}}'
        values: '1 0x20'
      - series: 'eggroll_last_commit_timestamp_seconds{{job="eggroll",instance="b"}}'
        values: '0x45'
    alert_rule_test:
{cases}
"""


def alert_case(name: str, minute: int, summary: str | None = None, **labels: str) -> str:
    """One alert_rule_test entry: `name` at `minute`, firing on instance a (or `labels`)
    with this summary, or not firing (no summary)."""
    case = f"      - eval_time: {minute}m\n        alertname: {name}\n        exp_alerts:"
    if summary is None:
        return case + " []"
    labels = {"job": "eggroll", "instance": "a", "severity": "warning", **labels}
    return (
        f"{case}\n          - exp_labels: {json.dumps(labels)}\n"
        f"            exp_annotations: {{summary: {json.dumps(summary)}}}"
    )


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_alerts_fire_when_and_only_when_they_should(tmp_path: Path) -> None:
    """The shipped alerting rules through `promtool test rules`: each fires on the series
    that should raise it, after its `for`, and not before (instance b: no worker; a: the
    rest, its last commit at 1 minute)."""
    down = "The coordinator at a does not answer scrapes."
    write = (
        "Writes of run to the save directory fail on a: free space before the fitness "
        "log runs out of room."
    )
    diverged = (
        "A worker's replica digest differed from the agreed one on a (the worker resyncs; a "
        "repeat points at its host)."
    )
    stalled = (
        "A worker of a has done no work for 5 minutes while connected (a hung GPU?): see "
        "the coordinator's log for which, and restart it."
    )
    idle = "No worker has been connected to b for 10 minutes."
    stale = "No step committed on a for over 30 minutes while workers are connected."
    cases = [
        alert_case("EggrollCoordinatorDown", 3),  # down from 2m, for 2m
        alert_case("EggrollCoordinatorDown", 5, down, severity="critical"),
        alert_case("EggrollSaveDirWriteFailing", 1),
        alert_case("EggrollSaveDirWriteFailing", 3, write, file="run"),
        alert_case("EggrollReplicaDiverged", 4, diverged),
        alert_case("EggrollWorkerStalled", 3),
        alert_case("EggrollWorkerStalled", 5, stalled),
        alert_case("EggrollNoWorkers", 10),  # none from 1m, for 10m
        alert_case("EggrollNoWorkers", 12, idle, instance="b"),
        alert_case("EggrollNoCommit", 33),  # stale from 31m, for 5m; b never committed
        alert_case("EggrollNoCommit", 37, stale),
    ]
    test_file = tmp_path / "alerts_test.yml"
    rules = PROM_CONFIG.parent / "alerts.yml"
    test_file.write_text(ALERTS_TEST.format(rules=json.dumps(str(rules)), cases="\n".join(cases)))
    done = subprocess.run(
        ["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_dashboard_uses_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    want = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["instance"]["datasource"] == want
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["datasource"] == want, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == want, p["title"]
            assert '{instance=~"$instance"}' in t["expr"], t["expr"]
    # Panels tile the 24-column grid without overlapping.
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, p["title"]
        cells |= area
    titles = " ".join(p["title"] for p in panels).lower()
    for word in ("loss", "member-tokens", "step time", "workers", "re-queued", "network", "errors"):
        assert word in titles

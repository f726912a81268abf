"""deploy/slurm/eggroll.sbatch on a real one-node SLURM cluster started here (munged,
slurmctld and slurmd in temporary directories): the job runs the coordinator and
run-workers.sh with NumPy workers, reaches the replica digest of eggroll-train, and never
shows the token on a command line.

Needs Debian's slurm-wlm and munge and root (slurmd starts jobs as their user); .ci/run
installs them. By hand: `apt-get install slurm-wlm munge`, then
`pytest -q tests/test_slurm.py`."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH_SCRIPT = ROOT / "deploy" / "slurm" / "eggroll.sbatch"
BIN = Path(sys.executable).parent
# Debian puts the daemons in /usr/sbin, which a non-login PATH may lack.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "scancel")
MISSING = [name for name in DAEMONS + CLIENTS if not shutil.which(name, path=SEARCH_PATH)]

pytestmark = [
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"SLURM not installed ({', '.join(MISSING)} missing): "
        "apt-get install slurm-wlm munge",
    ),
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a one-node SLURM cluster needs root (slurmd runs jobs)"
    ),
]

# Eight small chunks a step: a few seconds for the whole run.
CONFIG = """
[model]
n_layer = 1
d_model = 32
[es]
population = 512
chunk_size = 64
seq_len = 48
[validation]
every_steps = 0
max_tokens = 480
"""
STEPS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def which(name: str) -> str:
    path = shutil.which(name, path=SEARCH_PATH)
    assert path, name
    return path


@dataclass
class Cluster:
    conf: Path
    node: str
    logs: Path

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment for the SLURM commands and the jobs they submit."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EGGROLL_", "SLURM_"))}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["PATH"] = os.pathsep.join([str(BIN), SEARCH_PATH])
        env["SLURM_CONF"] = str(self.conf)
        return {**env, **extra}

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [which(args[0]), *args[1:]],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
            for path in sorted(self.logs.glob("*.log"))
        )


def node_line() -> tuple[str, str]:
    """This machine as slurmd sees it: its name and its NodeName= line (real CPUs, memory)."""
    done = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith("NodeName="), done.stdout
    return line.split()[0].removeprefix("NodeName="), line


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    # A short path: munged's socket path must fit in a sockaddr_un.
    top = Path(tempfile.mkdtemp(prefix="slurm-"))
    logs = top / "logs"
    for sub in ("munge", "ctld", "spool", "logs"):
        (top / sub).mkdir(mode=0o700)
    key = top / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(128))
    key.chmod(0o600)
    socket_path = top / "munge" / "socket"
    node, line = node_line()
    conf = top / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=eggtest",
                f"SlurmctldHost={node}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={socket_path}",
                f"StateSaveLocation={top / 'ctld'}",
                f"SlurmdSpoolDir={top / 'spool'}",
                f"SlurmctldPidFile={top / 'slurmctld.pid'}",
                f"SlurmdPidFile={top / 'slurmd.pid'}",
                "MailProg=/bin/true",
                # No cgroups: a container may not delegate them; the test needs no limits.
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                f"{line} NodeAddr=127.0.0.1 State=UNKNOWN",
                f"PartitionName=eggtest Nodes={node} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    c = Cluster(conf, node, logs)
    daemons: list[subprocess.Popen] = []

    def start(name: str, *args: str | Path) -> None:
        with open(logs / f"{name}.log", "w") as out:
            daemons.append(
                subprocess.Popen(
                    [which(name), *map(str, args)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=c.env(),
                )
            )

    try:
        start(
            "munged",
            "--foreground",
            "--force",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={top / 'munge' / 'munged.pid'}",
            f"--seed-file={top / 'munge' / 'seed'}",
            f"--log-file={logs / 'munged-file.log'}",
        )
        wait_until(lambda: socket_path.exists(), 20, "munged's socket", c)
        start("slurmctld", "-D", "-f", conf)
        start("slurmd", "-D", "-f", conf, "-N", node)

        def idle() -> bool:
            done = c.run("sinfo", "--noheader", "--format=%t", f"--nodes={node}")
            return done.returncode == 0 and done.stdout.strip() == "idle"

        wait_until(idle, 60, "the node to be idle", c)
        yield c
    finally:
        c.run("scancel", "--full", f"--nodelist={node}")  # nothing left to run
        for proc in reversed(daemons):
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(top, ignore_errors=True)


def wait_until(ready, timeout: float, what: str, c: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s\n{c.log_tail()}")
        time.sleep(0.2)


class ProcessWatch:
    """Polls every process while a job runs: which saw the token on their command line, and
    which eggroll commands had it in their environment."""

    def __init__(self, token: str):
        self.token = token.encode()
        self.on_command_line: list[str] = []
        self.with_token: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    argv = (proc / "cmdline").read_bytes()
                    environ = (proc / "environ").read_bytes()
                except OSError:  # gone meanwhile
                    continue
                if self.token in argv:
                    self.on_command_line.append(argv.replace(b"\0", b" ").decode(errors="replace"))
                for name in ("eggroll-coordinator", "eggroll-worker"):
                    if name.encode() in argv and b"EGGROLL_TOKEN=" + self.token + b"\0" in environ:
                        self.with_token.add(name)
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def eggroll_train_digest(data_dir: Path, config: Path, tmp_path: Path) -> str:
    summary = tmp_path / "train.json"
    done = subprocess.run(
        [
            str(BIN / "eggroll-train"),
            "--data-dir",
            str(data_dir),
            "--config",
            str(config),
            "--steps",
            str(STEPS),
            "--summary-json",
            str(summary),
            "--log-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(summary.read_text())["replica_digest"]


def test_sbatch_run_reaches_the_digest_of_eggroll_train(
    cluster: Cluster, words_data: Path, tmp_path: Path
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    token = secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    save_dir = tmp_path / "shared" / "run"
    job_log = tmp_path / "job.log"
    env = cluster.env(
        EGGROLL_TOKEN_FILE=str(token_file),
        EGGROLL_SAVE_DIR=str(save_dir),
        EGGROLL_DATA_DIR=str(words_data),
        EGGROLL_CONFIG=str(config),
        EGGROLL_MAX_STEPS=str(STEPS),
        EGGROLL_PORT=str(free_port()),
        EGGROLL_METRICS_PORT="0",
        EGGROLL_LOG_FORMAT="json",
        EGGROLL_MAX_RETRY_S="1",
        # Two workers on this one node, as run-workers.sh starts them for two GPUs.
        CUDA_VISIBLE_DEVICES="0,1",
    )
    watch = ProcessWatch(token)
    try:
        # --wait: sbatch returns once the job has ended, with its exit status.
        done = subprocess.run(
            [
                which("sbatch"),
                "--wait",
                "--parsable",
                "--nodes=1",
                "--time=10",
                f"--output={job_log}",
                str(SBATCH_SCRIPT),
                "--backend",
                "numpy",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            "job did not end within 300 s\n"
            + (job_log.read_text() if job_log.exists() else "")
            + cluster.log_tail()
        ) from None
    finally:
        watch.stop()
    log = job_log.read_text() if job_log.exists() else "(no job log)"
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{log}\n{cluster.log_tail()}"

    # The coordinator ran on this node; a worker for each "GPU" joined it.
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    joined = {e["worker"] for e in events if e.get("event") == "worker joined"}
    assert joined == {f"{cluster.node}-gpu0", f"{cluster.node}-gpu1"}, log
    # The run ended at --max-steps; then the workers were stopped with SIGTERM, cleanly.
    assert "coordinator exited with status 0; stopping the workers" in log
    assert "run-workers.sh: all workers stopped (SIGTERM); exit status 0" in log
    for gpu in ("gpu0", "gpu1"):
        assert any(
            line.startswith(f"0: [{gpu}] ") and '"event": "stopped"' in line
            for line in log.splitlines()
        ), log

    # The token was in both commands' environment, on no command line, in no output.
    assert watch.with_token == {"eggroll-coordinator", "eggroll-worker"}
    assert watch.on_command_line == []
    assert token not in log

    inspect = subprocess.run(
        [str(BIN / "eggroll-inspect"), str(save_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    info = json.loads(inspect.stdout)
    assert info["step"] == STEPS and info["log_ok"]
    assert info["replica_digest"] == eggroll_train_digest(words_data, config, tmp_path)

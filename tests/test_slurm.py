"""deploy/slurm/eggroll.sbatch on a real one-node SLURM cluster started here (munged,
slurmctld and slurmd in temporary directories): the job runs the coordinator and
run-workers.sh with NumPy workers, stops cleanly on the signal that precedes the time
limit (the coordinator first, so that it keeps a final snapshot), resumes when submitted
again, reaches the replica digest of eggroll-train, and never shows the token on a command
line.

Needs Debian's slurm-wlm and munge and root (slurmd starts jobs as their user); .ci/run
installs them. By hand: `apt-get install slurm-wlm munge`, then
`pytest -q tests/test_slurm.py`."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import SMALL_RUN, free_port, inspect_run

from eggroll_dist.protocol.ternary import unpack_ternary
from eggroll_dist.shared.save_dir import SaveDir

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

# Eight small chunks a step: well under a second a step here; steps enough that a stop
# early in a step lands before the last.
STEPS = 16
CHUNKS_PER_STEP = 8


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
    """The replica digest at step STEPS of the same run made by eggroll-train in one process,
    read back from the save directory it leaves."""
    save_dir = tmp_path / "train"
    done = subprocess.run(
        [
            str(BIN / "eggroll-train"),
            "--data-dir",
            str(data_dir),
            "--config",
            str(config),
            "--steps",
            str(STEPS),
            "--save-dir",
            str(save_dir),
            "--log-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return SaveDir.open(save_dir).state_at(STEPS, unpack_ternary).digest_hex()


class Job:
    """One submission of the batch script: its id, its log, and its end."""

    ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

    def __init__(self, cluster: Cluster, env: dict[str, str], log: Path):
        self.cluster, self.log = cluster, log
        done = subprocess.run(
            [
                which("sbatch"),
                "--parsable",
                "--nodes=1",
                "--time=10",
                f"--output={log}",
                str(SBATCH_SCRIPT),
                "--backend",
                "numpy",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        self.id = done.stdout.strip().split(";")[0]

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else "(no job log)"

    def events(self, workers: bool = False) -> list[dict]:
        """The coordinator's JSON lines, or with `workers` the workers' (`0: [gpu1] {...}`,
        with the GPU added as "gpu"). The job log interleaves several processes, and a line
        can run into another's: take the object each line starts with."""
        decoder, events = json.JSONDecoder(), []
        for line in self.text().splitlines():
            gpu = ""
            if workers:
                prefix, _, line = line.partition("] ")
                gpu = prefix.removeprefix("0: [") if prefix.startswith("0: [gpu") else ""
                line = line if gpu else ""
            if line[:1] == "{":
                with contextlib.suppress(ValueError):  # cut short by another process's line
                    event = decoder.raw_decode(line)[0]
                    events.append({**event, "gpu": gpu} if workers else event)
        return events

    def state(self) -> tuple[str, str]:
        """JobState and ExitCode ("status:signal") as scontrol shows them."""
        done = self.cluster.run("scontrol", "show", "job", "--oneliner", self.id)
        assert done.returncode == 0, done.stderr
        fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
        return fields["JobState"], fields["ExitCode"]

    def ended(self) -> bool:
        return self.state()[0] in self.ENDED

    def wait(self, timeout: float = 300) -> tuple[str, str]:
        """Poll (sbatch --wait polls too, but seconds apart) until the job has ended."""
        deadline = time.monotonic() + timeout
        while not self.ended():
            if time.monotonic() > deadline:
                self.cluster.run("scancel", self.id)
                raise AssertionError(
                    f"job {self.id} did not end within {timeout} s\n{self.text()}\n"
                    + self.cluster.log_tail()
                )
            time.sleep(0.2)
        return self.state()

    def batch_shell_pid(self) -> int:
        """The job's batch shell alone (what --signal=B:... signals; scancel --batch would
        signal its children too)."""
        script = f"/job{int(self.id):05d}/slurm_script".encode()
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if proc.name.isdigit() and len(argv) > 1 and argv[1].endswith(script):
                return int(proc.name)
        raise AssertionError(f"no batch shell for job {self.id}")

    def joined(self) -> set[str]:
        return {e["worker"] for e in self.events() if e.get("event") == "worker joined"}

    def committed(self) -> int:
        return max((e["step"] for e in self.events() if e.get("event") == "step"), default=0)

    def early_in_step(self) -> bool:
        """Both workers have begun the open step, and most of its chunks are still to do.
        Right after a commit the workers are not yet at the new step, and a coordinator
        stopped then has no worker to take its final snapshot from."""
        step = self.committed()
        done = [
            e["gpu"]
            for e in self.events(workers=True)
            if e.get("event") == "chunk done" and e.get("step") == step
        ]
        return set(done) == {"gpu0", "gpu1"} and len(done) <= CHUNKS_PER_STEP // 2


def workers_stopped_cleanly(job: Job, node: str) -> None:
    """Both workers ran (one may join too late for a short run) and stopped on SIGTERM."""
    log = job.text()
    assert job.joined() and job.joined() <= {f"{node}-gpu0", f"{node}-gpu1"}, log
    assert "run-workers.sh: all workers stopped (SIGTERM); exit status 0" in log
    for gpu in ("gpu0", "gpu1"):
        assert any(
            line.startswith(f"0: [{gpu}] ") and '"event": "stopped"' in line
            for line in log.splitlines()
        ), log


def workers_finished_with_the_run(job: Job, node: str) -> None:
    """The run reached its last step: each worker stopped by itself, or on the SIGTERM the
    batch script sends once the coordinator has exited (whichever came first), all with 0."""
    log = job.text()
    assert job.joined() and job.joined() <= {f"{node}-gpu0", f"{node}-gpu1"}, log
    assert "exit status 143" not in log and "exit code" not in log, log
    assert (
        "coordinator exited with status 0" in log  # the workers then end by themselves
        or "every worker exited with status 0" in log
    ), log
    for gpu in ("gpu0", "gpu1"):
        assert any(
            line.startswith(f"0: [{gpu}] ") and '"event": "stopped"' in line
            for line in log.splitlines()
        ), log


def test_sbatch_run_stops_on_the_time_limit_signal_and_resumes_to_the_digest_of_eggroll_train(
    cluster: Cluster, words_data: Path, tmp_path: Path
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(SMALL_RUN)
    token = secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    save_dir = tmp_path / "shared" / "run"
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
        # First job: SIGTERM to the batch shell mid-run, as --signal=B:TERM@120 sends it
        # before the time limit. Everything stops cleanly and the job succeeds.
        first = Job(cluster, env, tmp_path / "job1.log")
        deadline = time.monotonic() + 180
        while first.committed() < 2 and not first.ended():
            assert time.monotonic() < deadline, first.text() + cluster.log_tail()
            time.sleep(0.2)
        shell = first.batch_shell_pid()
        while not first.early_in_step() and not first.ended():
            assert time.monotonic() < deadline, first.text() + cluster.log_tail()
            time.sleep(0.02)
        assert not first.ended(), "the run ended before the signal\n" + first.text()
        os.kill(shell, signal.SIGTERM)
        assert first.wait() == ("COMPLETED", "0:0"), first.text() + cluster.log_tail()
        # Second job, the same command: resumes from the last committed step, ends the run.
        second = Job(cluster, env, tmp_path / "job2.log")
        assert second.wait() == ("COMPLETED", "0:0"), second.text() + cluster.log_tail()
    finally:
        watch.stop()

    assert "SIGTERM (time limit or scancel): stopping the coordinator, then the workers" in (
        first.text()
    )
    stopped_at = first.committed()
    assert 2 <= stopped_at < STEPS, first.text()
    # The coordinator was stopped while the workers were still connected, so one of them
    # sent it the final snapshot of the step it stopped at.
    stopped = [e for e in first.events() if e.get("event") == "stopped"]
    assert stopped and stopped[0]["latest_snapshot"] == stopped_at, first.text()
    assert first.joined() == {f"{cluster.node}-gpu0", f"{cluster.node}-gpu1"}
    workers_stopped_cleanly(first, cluster.node)
    resumed = [e for e in second.events() if e.get("event") == "listening"]
    assert resumed and resumed[0]["step"] == stopped_at, second.text()
    workers_finished_with_the_run(second, cluster.node)

    # The token was in both commands' environment, on no command line, in no output.
    assert watch.with_token == {"eggroll-coordinator", "eggroll-worker"}
    assert watch.on_command_line == []
    assert token not in first.text() + second.text()

    info = inspect_run(save_dir)
    assert info["step"] == STEPS and info["log_ok"]
    assert info["replica_digest"] == eggroll_train_digest(words_data, config, tmp_path)

"""eggroll-ray: workers placed by a real Ray cluster (`ray start --head` on loopback, with
two GPUs declared so that Ray's GPU accounting is exercised; the workers compute with NumPy)
train a real coordinator's run to the digest of the same run trained alone, stop cleanly on
SIGTERM, and stop together when one cannot start. The exit policy is tested without Ray."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from helpers import (
    TINY_RUN,
    command,
    digest_at,
    free_port,
    start_coordinator,
    trained_digest,
)

from eggroll_dist.worker import ray_launch
from eggroll_dist.worker.ray_launch import (
    LOST,
    Ended,
    Loss,
    Replacements,
    Tally,
    _Stop,
    _supervise,
    ended,
    loss,
    replacement_name,
    worker_names,
    workers_on_node,
)
from eggroll_dist.worker.session_types import FINISHED

SHORT_HOST = socket.gethostname().split(".")[0]

# Ray's token authentication on (its default for a new cluster; a client must say so too),
# with a token of the test's own: `ray start --head` (Ray 2.60) refuses to start without one.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
}

CONFIG = TINY_RUN


def test_exit_policy() -> None:
    done = f"stopped: the run at h:7000 {FINISHED}"  # eggroll-worker's last line then
    assert ended("w", 0, done) == Ended("w stopped: the run is complete", False, 0)
    assert ended("w", 0) == Ended("w stopped", False, 0)  # a signal not ours, not replaced
    # Statuses every worker would share stop the others, and say why.
    told = ended("w", 2, "Error: wrong token")
    assert (
        told.stop_all and told.code == 2 and "(its last line: Error: wrong token)" in told.message
    )
    # One worker's own trouble ends it alone.
    faulty, lost = ended("w", 3), ended("w", LOST)
    assert (faulty.stop_all, faulty.code) == (False, 3) and "computes differently" in faulty.message
    assert (lost.stop_all, lost.code) == (False, 1) and "w was lost" in lost.message
    assert ended("w", -9) == Ended("w was killed by SIGKILL", False, 137)
    # Stopped by this command: SIGTERM before its handlers is a clean stop too; a kill
    # after the stop timeout is not.
    assert ended("w", -15, asked=True) == Ended("w stopped", False, 0)
    assert ended("w", -9, asked=True).code == 137
    assert not ended("w", 1, asked=True).stop_all


def test_exit_status_is_the_cause_else_the_first_failure() -> None:
    tally = Tally()
    for end in (ended("a", 0), ended("b", LOST), ended("c", 2), ended("d", -15, asked=True)):
        tally.add(end)
    assert tally.status == 2  # c stopped the others; b's loss came first
    tally = Tally()
    for end in (ended("a", 0), ended("b", 3), ended("c", LOST)):
        tally.add(end)
    assert tally.status == 3
    tally = Tally()
    tally.add(ended("a", 0))
    tally.add(ended("b", -15, asked=True))
    assert tally.status == 0


@pytest.mark.parametrize(
    ("status", "asked", "said_finished", "lines_read", "complete", "can_replace", "expected"),
    [
        (LOST, False, False, True, False, True, Loss.REPLACED),
        (LOST, True, False, False, False, True, Loss.REPLACED),  # lost whatever was asked
        (LOST, False, False, True, False, False, Loss.FINAL),  # no replacement left
        (LOST, False, False, True, True, True, Loss.FORGOTTEN),  # after the run's end
        (0, False, False, True, False, True, Loss.REPLACED),  # a signal not ours
        (0, True, False, True, False, True, Loss.NONE),  # our own stop
        (0, False, True, True, False, True, Loss.NONE),  # it said the run is complete
        (0, False, False, False, False, True, Loss.NONE),  # its last lines unknown
        (0, False, False, True, False, False, Loss.FINAL),
        (2, False, False, True, False, True, Loss.NONE),  # `ended` judges the rest
        (3, False, False, True, False, True, Loss.NONE),
        (-9, False, False, True, False, True, Loss.NONE),
    ],
)
def test_replacement_policy(
    status: int | None,
    asked: bool,
    said_finished: bool,
    lines_read: bool,
    complete: bool,
    can_replace: bool,
    expected: Loss,
) -> None:
    fate = loss(
        status,
        asked=asked,
        said_finished=said_finished,
        lines_read=lines_read,
        complete=complete,
        can_replace=can_replace,
    )
    assert fate is expected


class _FakeRef:
    def __init__(self, value: object = None, ready: bool = False) -> None:
        self.value, self.ready = value, ready


SIGNALLED = "signalled"  # a script's status: exit 0 on a signal not ours (a node's end)


class _FakeActor:
    """A worker whose exit status the test sets; `stop` makes it exit with 0."""

    def __init__(self, fake: _FakeRay, placed: bool = True) -> None:
        self.fake, self.waiting, self.stopped = fake, _FakeRef(), False
        self.killed, self.args, self.lines = False, None, []
        self.take_fails = False
        self.wait = _Method(lambda: self.waiting)
        self.take = _Method(self._take)
        self.stop = _Method(self._stop)
        self.place = _Method(lambda: _FakeRef(("n1", "h", ["0"]), placed))

    def _stop(self, timeout_s: float) -> _FakeRef:
        self.stopped = True
        self.end(0)
        return _FakeRef(None, True)

    def _take(self) -> _FakeRef:
        if self.take_fails:
            return _FakeRef(RuntimeError("the actor did not answer"), True)
        lines, self.lines = self.lines, []
        return _FakeRef((lines, 0), True)

    def end(self, status: object) -> None:
        if not self.waiting.ready:
            signalled = status == SIGNALLED
            self.waiting.value, self.waiting.ready = 0 if signalled else status, True
            if signalled:
                self.lines = ["stopped"]
            elif status == 0 and not self.stopped:  # what eggroll-worker says at the run's end
                self.lines = [f"stopped: the run at h:7000 {FINISHED}"]


class _Method:
    def __init__(self, call) -> None:
        self.remote = call


class _FakeRay:
    """What _supervise uses of Ray: wait, get, kill; `script` ends workers as time goes."""

    class exceptions:  # Ray's spelling
        RayError = RuntimeError

    def __init__(self, script: list[tuple[int | None, object]]) -> None:
        self.actors = [_FakeActor(self), _FakeActor(self)]
        self.script = script  # (worker or None, status), one per wait of the workers
        self.events: list[tuple[str, int]] = []  # ("kill" | "make", actor index), in order

    def wait(self, refs, num_returns, timeout):
        if timeout and not self.script:  # the workers' wait (not a replacement's placing)
            assert any(r.ready for r in refs), "the script ended with workers still running"
        elif timeout:
            i, status = self.script.pop(0)
            if i is None:  # a wait in which nothing ends
                time.sleep(0.05)
            else:
                self.actors[i].end(status)
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    def get(self, ref, timeout=None):
        assert ref.ready, "a get that would block the supervisor"
        if isinstance(ref.value, Exception):
            raise ref.value
        return ref.value

    def kill(self, actor) -> None:
        actor.killed = True
        self.events.append(("kill", self.actors.index(actor)))


def _supervised(
    script: list[tuple[int, object]], spare: Replacements | None = None
) -> tuple[int, _FakeRay]:
    fake = _FakeRay(script)
    status = _supervise(fake, list(fake.actors), ["a", "b"], _Stop(), 5.0, spare)
    return status, fake


def _spare(
    fake_box: list,
    left: int,
    placed: bool = True,
    timeout_s: float = 5.0,
    fail_start: bool = False,
    started: bool = True,
):
    """Replacements whose actors join the fake (made when asked: the fake is made later)."""

    def make() -> _FakeActor:
        fake = fake_box[0]
        actor = _FakeActor(fake, placed)
        fake.actors.append(actor)
        fake.events.append(("make", len(fake.actors) - 1))
        return actor

    def start(actor: _FakeActor, name: str, on_node: int) -> _FakeRef:
        actor.args = (name, on_node)
        return _FakeRef(RuntimeError("no eggroll-worker") if fail_start else None, started)

    return Replacements(left, make, start, timeout_s, "w", ["n2", "n1"])  # a on n2, b on n1


def _replaced(
    script: list[tuple[int, object]],
    left: int,
    stop: _Stop | None = None,
    prepare: Callable[[_FakeRay], object] | None = None,
    **kw,
) -> tuple[int, _FakeRay]:
    """Workers a and b supervised with `left` replacements; `prepare` sets the fake up."""
    box: list = []
    spare = _spare(box, left, **kw)
    fake = _FakeRay(script)
    box.append(fake)
    if prepare is not None:
        prepare(fake)
    status = _supervise(fake, list(fake.actors), ["a", "b"], stop or _Stop(), 5.0, spare)
    return status, fake


LOST_ACTOR = RuntimeError("actor died")  # what ray.get raises for a lost actor (fake's error)


def test_a_lost_worker_is_started_again_and_its_loss_is_forgiven() -> None:
    """b (on n1) is lost and killed for good; a worker starts in its place (named after
    where Ray put it, n1's GPU 0, numbered as a replacement, told it is alone on n1), and
    when all finish the status is 0: the loss was made good."""
    status, fake = _replaced([(1, LOST_ACTOR), (0, 0), (2, 0)], left=1)
    assert status == 0, status
    assert fake.events[:2] == [("kill", 1), ("make", 2)]  # the lost one goes first
    assert len(fake.actors) == 3 and fake.actors[2].args == ("w-gpu0-r1", 1)


def test_a_worker_stopped_by_a_signal_not_ours_is_replaced() -> None:
    """A clean stop this command did not ask for, before the run's end (a preempted
    node's SIGTERM, ahead of Ray seeing the node lost): its actor (holding a GPU) is
    killed and another worker starts; a finished run's clean stops are not replaced."""
    status, fake = _replaced([(1, SIGNALLED), (0, 0), (2, 0)], left=1)
    assert status == 0, status
    assert fake.events[:2] == [("kill", 1), ("make", 2)]
    assert len(fake.actors) == 3 and fake.actors[2].args == ("w-gpu0-r1", 1)
    status, fake = _replaced([(0, 0), (1, SIGNALLED)], left=1)  # after the run's end
    assert status == 0 and len(fake.actors) == 2
    status, fake = _replaced([(1, SIGNALLED), (0, 0)], left=0)  # none left: a clean end
    assert status == 0 and len(fake.actors) == 2


def test_a_clean_stop_whose_lines_were_not_read_is_not_replaced() -> None:
    """Its last lines may have said the run is complete: a replacement could wait forever
    on a coordinator that has gone."""
    status, fake = _replaced(
        [(1, SIGNALLED), (0, 0)], 1, prepare=lambda f: setattr(f.actors[1], "take_fails", True)
    )
    assert status == 0 and ("make", 2) not in fake.events


def _stopped_when(fake: _FakeRay, stop: _Stop, ending: int | None = None) -> None:
    """SIGTERM arrives, as a handler would set it, in the wait after the script's last;
    with `ending`, that worker stops on it in the same wait (one process group)."""
    scripted = fake.wait

    def wait(refs, num_returns, timeout):
        if timeout and not fake.script:
            if ending is not None and stop.asked is None:
                fake.actors[ending].end(SIGNALLED)
            stop.asked = "SIGTERM"
            return [r for r in refs if r.ready], [r for r in refs if not r.ready]
        return scripted(refs, num_returns, timeout)

    fake.wait = wait  # type: ignore[method-assign]


def test_a_stop_seen_with_a_signalled_worker_starts_no_replacement() -> None:
    """Our own SIGTERM reached a worker too (a process group): its clean stop, seen in the
    wait in which the handler ran, is not replaced, and the status stays 0."""
    stop = _Stop()
    status, fake = _replaced([(None, None)], 3, stop, partial(_stopped_when, stop=stop, ending=1))
    assert status == 0 and ("make", 2) not in fake.events and fake.actors[0].stopped


def test_replacement_names_and_counts() -> None:
    assert replacement_name(("n", "host", ["3"]), None, 2, 1) == "host-gpu3-r1"
    assert replacement_name(("n", "host", []), "lo", 2, 4) == "lo-cpu1-r4"
    assert workers_on_node(["a", "b", "a", "a"], [0, 1, 3], "a") == 3  # 2 live there, + 1


def test_a_replacement_that_cannot_start_counts_as_lost() -> None:
    status, fake = _replaced([(1, LOST_ACTOR), (0, 0)], left=1, fail_start=True)
    assert status == 1 and fake.actors[2].killed


def test_a_start_that_hangs_gives_up_without_holding_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replacement's start is polled, not waited on: the others' ends are seen meanwhile,
    and one that never starts counts as lost after START_S."""
    monkeypatch.setattr(ray_launch, "START_S", 0.2)
    script = [(1, LOST_ACTOR), *[(None, None)] * 8, (0, 0)]  # a ends 0.4 s later
    status, fake = _replaced(script, left=3, started=False)
    assert status == 1 and len(fake.actors) == 3 and fake.actors[2].killed


@pytest.mark.parametrize("how, code", [(LOST_ACTOR, 1), (SIGNALLED, 0)])
def test_a_stop_drops_the_replacements_being_placed(how: object, code: int) -> None:
    """A loss not made good counts as the worker ended: lost 1, a clean stop 0."""
    stop = _Stop()
    once_lost = partial(_stopped_when, stop=stop)  # SIGTERM once the loss is seen
    status, fake = _replaced([(1, how), (None, None)], 3, stop, once_lost, placed=False)
    assert status == code and fake.actors[2].killed and fake.actors[0].stopped


def test_a_failing_worker_stops_a_replacement_on_its_way(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """a's status 2 would end every worker alike: the replacement still starting for the
    lost b is dropped too, not left to run alone."""
    status, fake = _replaced([(1, LOST_ACTOR), (None, None), (0, 2)], left=3, started=False)
    err = capsys.readouterr().err
    assert status == 2 and fake.actors[2].killed
    assert "a exited with status 2; stopping the others" in err
    assert "no worker in place of b: a stop was asked" in err


def test_losses_past_the_budget_end_alone() -> None:
    status, fake = _replaced([(1, LOST_ACTOR), (2, LOST_ACTOR), (0, 0)], left=1)
    assert status == 1 and len(fake.actors) == 3  # one replacement, then the budget is spent
    assert not fake.actors[0].stopped  # the others went on


def test_a_replacement_ray_finds_no_room_for_gives_up_in_time() -> None:
    script = [(1, LOST_ACTOR), *[(None, None)] * 6, (0, 0)]  # a ends 0.3 s later
    status, fake = _replaced(script, left=3, placed=False, timeout_s=0.1)
    assert status == 1 and len(fake.actors) == 3 and fake.actors[2].killed


def test_a_replacement_still_placed_when_the_run_completes_is_dropped() -> None:
    status, fake = _replaced([(1, LOST_ACTOR), (0, 0)], left=3, placed=False)
    assert status == 0 and fake.actors[2].killed


def test_a_failing_worker_stops_the_others_and_gives_its_status() -> None:
    status, fake = _supervised([(0, 2)])
    assert status == 2 and fake.actors[1].stopped and not fake.actors[0].stopped


def test_a_faulty_worker_ends_alone() -> None:
    status, fake = _supervised([(0, 3), (1, 0)])
    assert status == 3 and not fake.actors[1].stopped


def test_worker_names() -> None:
    places = [("n1", "a", ["0"]), ("n2", "b", ["0"]), ("n1", "a", ["1"])]
    assert worker_names(places, None) == ["a-gpu0", "b-gpu0", "a-gpu1"]
    cpus = [("n1", "a", []), ("n1", "a", []), ("n2", "b", [])]
    assert worker_names(cpus, None) == ["a-cpu0", "a-cpu1", "b-cpu0"]
    # One --name for two nodes: names stay apart.
    assert worker_names(places, "x") == ["x-gpu0-0", "x-gpu0-1", "x-gpu1-2"]


def test_refuses_worker_flags_it_owns() -> None:
    for flag in ("--name", "--token-file=/t"):
        done = subprocess.run(
            [command("eggroll-ray"), "h", "--", flag, "x"], capture_output=True, text=True
        )
        assert done.returncode == 2, done.stderr
        assert f"give {flag.split('=')[0]} to eggroll-ray itself" in done.stderr


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-node Ray cluster on loopback, two CPUs and two declared GPUs; its address."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    ray_bin = command("ray")
    port = free_port()
    # Ray's switch for killing a worker process's children off: a worker must go with its
    # actor whatever it says (Ray ends the actor's process group).
    env = {**os.environ, **RAY_ENV, "RAY_kill_child_processes_on_worker_exit": "0"}
    temp = tmp_path_factory.mktemp("ray")
    start = [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port)]
    start += ["--num-cpus", "2", "--num-gpus", "2", "--include-dashboard", "false"]
    # Ray's socket paths must stay short (AF_UNIX): a short folder of its own.
    short = Path("/tmp") / f"ray{os.getpid()}"
    start += ["--temp-dir", str(short)]
    done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120, cwd=temp)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=60)


class Launch:
    """eggroll-ray as a subprocess, its lines collected as they come."""

    def __init__(self, *args: str | Path, **settings: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGGROLL_")}
        env.update(RAY_ENV, **settings)
        self.proc = subprocess.Popen(
            [command("eggroll-ray"), *map(str, args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"eggroll-ray still running after {timeout} s:\n" + self.tail()
            ) from None
        finally:
            # the reader takes the last lines (Ray's own processes may hold the pipe: bounded)
            self._reader.join(10)

    def tail(self) -> str:
        with self._cond:
            return "\n".join(s for s in self.lines[-60:] if '"chunk done"' not in s)

    def worker_events(self, name: str) -> list[dict]:
        """The JSON events of worker `name` (eggroll-ray prefixes its lines with [name])."""
        events = []
        with self._cond:
            for line in self.lines:
                _, found, rest = line.partition(f"[{name}] ")
                if found:
                    try:
                        events.append(json.loads(rest))
                    except ValueError:
                        pass
        return events

    def wait_event(self, name: str, event: str, timeout: float) -> dict:
        """Worker `name`'s first `event`, waited for (eggroll-ray polls its workers' lines)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.worker_events(name) if e.get("event") == event]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no {event!r} from {name} within {timeout} s:\n" + self.tail())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _workers_of(data_dir: Path) -> list[int]:
    """Live eggroll-worker processes reading `data_dir`."""
    pids = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if b"eggroll-worker" in cmdline and str(data_dir).encode() in cmdline:
            pids.append(int(p.name))
    return pids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _no_workers_left(data_dir: Path, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while _workers_of(data_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _workers_of(data_dir)


def test_gpu_workers_train_the_run_to_its_digest(
    spawn, ray_cluster: str, words_data: Path, tmp_path: Path
) -> None:
    config = tmp_path / "run.toml"
    # 32 chunks a step, so that the run outlasts a worker's wait between two tries.
    config.write_text(CONFIG.replace("population = 32", "population = 256"))
    steps = 4
    save_dir = tmp_path / "run"
    port = free_port()
    flags = ["--backend", "numpy", "--data-dir", words_data, "--log-format", "json"]
    launch = Launch(
        f"127.0.0.1:{port}", "--ray-address", ray_cluster, "--", *flags, "--max-retry-s", "0.2"
    )
    try:
        # The coordinator comes once both workers are up and trying it, so that both take
        # part in the run however slowly Ray starts them (a worker that first connects
        # after the run is complete would wait for it forever).
        for name in (f"{SHORT_HOST}-gpu0", f"{SHORT_HOST}-gpu1"):
            launch.wait_event(name, "reconnecting", 120)
        coord, _ = start_coordinator(spawn, save_dir, config, "--max-steps", str(steps), port=port)
        # The run completes: every worker ends with 0, and so does eggroll-ray.
        assert launch.finish(240) == 0, launch.tail() + "\n" + "\n".join(coord.lines[-20:])
    finally:
        launch.stop()
    assert coord.wait(60) == 0
    names = {f"{SHORT_HOST}-gpu0", f"{SHORT_HOST}-gpu1"}  # one per declared GPU, as Ray gave
    joined = {e["worker"] for e in coord.events if e.get("event") == "worker joined"}
    assert joined == names
    for name in names:
        assert launch.wait_event(name, "worker starting", 10)["name"] == name
    assert digest_at(save_dir, steps) == trained_digest(words_data, config, steps)
    assert any("started 2 workers" in line for line in launch.lines)
    assert _no_workers_left(words_data)


def test_sigterm_stops_every_worker_cleanly(
    spawn, ray_cluster: str, words_data: Path, tmp_path: Path
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    coord, port = start_coordinator(spawn, tmp_path / "run", config)
    flags = ["--data-dir", words_data, "--max-retry-s", "1"]
    launch = Launch(
        f"127.0.0.1:{port}",
        *("--ray-address", ray_cluster, "--device", "cpu", "--name", "rk"),
        *("--", *flags),
        EGGROLL_LOG_FORMAT="json",  # the workers get the EGGROLL_* settings given here
    )
    try:
        for name in ("rk-cpu0", "rk-cpu1"):
            coord.wait_for(
                lambda e, name=name: e.get("event") == "worker joined" and e["worker"] == name,
                120,
                f"{name} joining",
            )
        # CPU workers: NumPy, one thread each (--cpus-per-worker 1).
        starting = launch.wait_event("rk-cpu0", "worker starting", 30)
        assert starting["backend"] == "numpy" and starting["threads"] == 1
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.finish(60) == 0, launch.tail()
    finally:
        launch.stop()
    for name in ("rk-cpu0", "rk-cpu1"):
        launch.wait_event(name, "stopped", 10)
        coord.wait_for(
            lambda e, name=name: e.get("event") == "worker left" and e.get("worker") == name,
            20,
            f"{name} leaving",
        )
    assert any("SIGTERM: stopping 2 workers" in line for line in launch.lines)
    assert _no_workers_left(words_data)


def _two_cpu_workers(spawn, ray_cluster: str, words_data: Path, tmp_path: Path, *extra: str):
    """A coordinator, and eggroll-ray's two NumPy workers lo-cpu0 and lo-cpu1 started for
    it (`extra`: eggroll-ray's own flags): (coordinator, launch)."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    coord, port = start_coordinator(spawn, tmp_path / "run", config)
    flags = ["--data-dir", words_data, "--log-format", "json", "--max-retry-s", "1"]
    launch = Launch(
        f"127.0.0.1:{port}",
        *("--ray-address", ray_cluster, "--device", "cpu", "--name", "lo", *extra),
        *("--", *flags),
    )
    try:
        for name in ("lo-cpu0", "lo-cpu1"):
            launch.wait_event(name, "worker starting", 120)
    except BaseException:
        launch.stop()
        raise
    return coord, launch


def _kill_actor_of(words_data: Path, name: str) -> None:
    """SIGKILL the Ray actor (the parent process) of worker `name`, as a lost node's."""
    (worker,) = [p for p in _workers_of(words_data) if name.encode() in _cmdline(p)]
    actor = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert len(_workers_of(words_data)) == 2
    os.kill(actor, signal.SIGKILL)


def test_a_lost_actor_ends_only_its_worker(
    spawn, ray_cluster: str, words_data: Path, tmp_path: Path
) -> None:
    """An actor killed as a lost node's would be, with no replacements allowed: its worker
    goes with it (not left orphaned), the other works on, and the launch then ends with
    status 1."""
    coord, launch = _two_cpu_workers(
        spawn, ray_cluster, words_data, tmp_path, "--replace-lost", "0"
    )
    try:
        _kill_actor_of(words_data, "lo-cpu1")
        deadline = time.monotonic() + 30
        while not any("lo-cpu1 was lost" in line for line in launch.lines):
            assert time.monotonic() < deadline, launch.tail()
            time.sleep(0.2)
        assert _no_workers_left(words_data, within=0) is False  # lo-cpu0 works on
        deadline = time.monotonic() + 15
        while len(_workers_of(words_data)) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_workers_of(words_data)) == 1  # lo-cpu1's worker died with its actor
        coord.wait_for(
            lambda e: e.get("event") == "worker left" and e.get("worker") == "lo-cpu1",
            30,
            "lo-cpu1 leaving",
        )
        assert launch.proc.poll() is None
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.finish(60) == 1, launch.tail()
    finally:
        launch.stop()
    launch.wait_event("lo-cpu0", "stopped", 10)
    assert _no_workers_left(words_data)


def test_a_lost_worker_is_started_again_where_ray_finds_room(
    spawn, ray_cluster: str, words_data: Path, tmp_path: Path
) -> None:
    """A lost actor's worker is started again (the default allows 3): a new actor on the
    CPU the lost one freed, its worker joining the coordinator under a replacement's name;
    a clean stop then ends with status 0, the loss made good."""
    coord, launch = _two_cpu_workers(spawn, ray_cluster, words_data, tmp_path)
    try:
        _kill_actor_of(words_data, "lo-cpu1")
        launch.wait_event("lo-cpu1-r1", "worker starting", 60)
        assert any("lo-cpu1-r1 started in place of lo-cpu1" in line for line in launch.lines)
        coord.wait_for(
            lambda e: e.get("event") == "worker joined" and e.get("worker") == "lo-cpu1-r1",
            60,
            "the replacement joining",
        )
        assert len(_workers_of(words_data)) == 2
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.finish(60) == 0, launch.tail()
    finally:
        launch.stop()
    assert _no_workers_left(words_data)


def test_a_quiet_worker_dies_with_its_actor(ray_cluster: str, words_data: Path) -> None:
    """A worker that prints nothing (it waits 10 s for a silent peer's answer to HELLO)
    still goes at once when its actor is killed: a broken pipe would not stop it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    port = silent.getsockname()[1]
    launch = Launch(
        f"127.0.0.1:{port}",
        *("--ray-address", ray_cluster, "--device", "cpu", "--workers", "1", "--name", "q"),
        *("--", "--data-dir", words_data, "--log-format", "json"),
    )
    try:
        launch.wait_event("q-cpu0", "worker starting", 120)
        deadline = time.monotonic() + 10
        while not held:
            assert time.monotonic() < deadline, "the worker did not connect"
            time.sleep(0.1)
        (worker,) = [p for p in _workers_of(words_data) if b"q-cpu0" in _cmdline(p)]
        actor = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(actor, signal.SIGKILL)
        assert _no_workers_left(words_data, within=4)  # well before its HELLO times out
    finally:
        launch.stop()
        silent.close()
        for conn in held:
            conn.close()


def test_a_worker_that_cannot_start_stops_the_launch(
    spawn, ray_cluster: str, words_data: Path, tmp_path: Path
) -> None:
    """One worker refused for good (another data digest than the run's): the other is
    stopped, and the refused one's status and reason are the command's."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    _, port = start_coordinator(spawn, tmp_path / "run", config, "--data-digest", "00" * 32)
    launch = Launch(
        f"127.0.0.1:{port}",
        *("--ray-address", ray_cluster, "--device", "cpu", "--name", "bad"),
        *("--", "--data-dir", words_data, "--log-format", "json", "--max-retry-s", "1"),
    )
    try:
        assert launch.finish(120) == 2, launch.tail()
    finally:
        launch.stop()
    said = [line for line in launch.lines if "exited with status 2 (its last line: " in line]
    assert said and "data" in said[0] and "stopping the others" in said[0], launch.tail()
    assert _no_workers_left(words_data)


def test_workers_the_cluster_cannot_place_are_one_line(ray_cluster: str) -> None:
    launch = Launch(
        "127.0.0.1:9", "--ray-address", ray_cluster, "--workers", "3", "--start-timeout-s", "3"
    )
    try:
        assert launch.finish(60) == 1, launch.tail()
    finally:
        launch.stop()
    assert any(
        "Error: Ray placed fewer than 3 workers within 3 s" in line for line in launch.lines
    ), launch.tail()
    assert not any("Traceback" in line for line in launch.lines)


def test_no_cluster_is_one_line() -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    launch = Launch("127.0.0.1:9", "--ray-address", f"127.0.0.1:{free_port()}")
    try:
        assert launch.finish(120) == 1, launch.tail()
    finally:
        launch.stop()
    assert any("cannot join the Ray cluster" in line for line in launch.lines), launch.tail()
    assert not any("Traceback" in line for line in launch.lines), launch.tail()

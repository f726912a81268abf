"""A stop signal that lands while the main thread is inside the logger never hangs.

The signal is sent from within the logger's own write, under structlog's output lock, so
it is handled exactly where a handler that logged would wait on itself for ever. It runs
in a child process: a hang fails the test at its timeout instead of hanging pytest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import structlog
    from eggroll_dist.worker.stop_signal import stop_on_signals

    class SignalledOut:
        # The log's output: the first line written sends the signal from under the lock.
        def __init__(self):
            self.sent = False
        def write(self, text):
            if not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.{sig})
                sum(range(1000))  # bytecodes for the handler to run between
            sys.stdout.write(text)
        def flush(self):
            sys.stdout.flush()

    structlog.configure(
        processors=[structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(SignalledOut()),
    )
    log = structlog.get_logger()
    with stop_on_signals(log, "after the chunk") as stop:
        log.info("step", step=1)
        asked = stop()
    print("asked", asked, flush=True)
    with stop_on_signals(log, "after the chunk") as stop:
        pass
    print("untouched", repr(stop()), flush=True)
    """
)


def _child(sig: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD.replace("{sig}", sig)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_signal_inside_a_log_write_is_said_after_it_and_asks_to_stop() -> None:
    for sig in ("SIGTERM", "SIGINT"):
        lines = _child(sig)
        assert lines[0] == '{"step": 1, "event": "step"}', lines
        assert '"event": "stopping"' in lines[1] and f'"signal": "{sig}"' in lines[1]
        assert '"hint": "after the chunk"' in lines[1]
        assert lines[2:] == [f"asked {sig}", "untouched ''"]

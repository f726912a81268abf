"""A stop asked by SIGINT or SIGTERM while a command works in its main thread.

A Python signal handler runs in the main thread between two bytecodes of whatever it
interrupted, and that may be the logger holding its output lock: a handler that logs there
waits for ever on a lock its own thread holds. So the handler here takes no lock at all: it
records the signal and writes one byte to a pipe. A daemon thread waits on that pipe and
says "stopping" through the logger, taking its turn for the lock like any other thread.

A second signal raises KeyboardInterrupt in the main thread (stop at once), which takes no
lock either; `with` blocks release theirs as it passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

import structlog

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAID_WITHIN_S = 5.0  # how long leaving waits for "stopping" to be said, so it comes first


@contextlib.contextmanager
def stop_on_signals(
    log: structlog.typing.FilteringBoundLogger, hint: str
) -> Iterator[Callable[[], str]]:
    """While the block runs: the first SIGINT or SIGTERM asks to stop (the yielded callable
    returns its name, "" before), and `log` warns "stopping" with `hint`; a second one raises
    KeyboardInterrupt. Outside the main thread no handler can be set: nothing is asked."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: ""
        return
    got: list[str] = []
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a handler must never block

    def handle(signum: int, frame: object) -> None:
        if got:
            raise KeyboardInterrupt
        got.append(signal.Signals(signum).name)
        with contextlib.suppress(OSError):
            os.write(write_end, b"!")

    def say() -> None:
        with contextlib.suppress(OSError):
            if os.read(read_end, 1):  # b"" once the block is left without a signal
                log.warning("stopping", signal=got[0], hint=hint)

    speaker = threading.Thread(target=say, name="stop-signal", daemon=True)
    speaker.start()
    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield lambda: got[0] if got else ""
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(write_end)
        speaker.join(SAID_WITHIN_S)
        if not speaker.is_alive():
            os.close(read_end)  # else the thread still reads it; it ends with the process

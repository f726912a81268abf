"""The sans-I/O wire protocol (SPEC.md): frames, ternary fitness packing, messages and the
connection state machine.

Bytes in, messages out, and the reverse; it says what is legal in each connection state,
never what a peer should do next (that is the session flow of SPEC §8, in
`coordinator/run.py` and `worker/session.py`). No sockets, no asyncio, nothing of ours
outside this folder.
"""

from . import connection, errors, frames, messages, security, ternary

# Every public name of each module, re-exported: `from eggroll_dist.protocol import Hello`.
from .connection import *  # noqa: F403
from .errors import *  # noqa: F403
from .frames import *  # noqa: F403
from .messages import *  # noqa: F403
from .security import *  # noqa: F403
from .ternary import *  # noqa: F403

__all__ = [
    *connection.__all__,
    *errors.__all__,
    *frames.__all__,
    *messages.__all__,
    *security.__all__,
    *ternary.__all__,
]

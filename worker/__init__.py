"""The worker side: a replica that evaluates chunks and applies every committed step, and
the one-machine commands built on it (eggroll-data in `data/`, eggroll-train,
eggroll-sample, eggroll-local).

The session flow is pure code (`session.py`, with what it shares with its shell in
`session_types.py`); `client.py` is the asyncio shell that dials
and reconnects, `link.py` one connection that reads frames and carries out the session's
commands; `replica.py` runs the compute backend (`backend/`) on its own thread. It never
imports `coordinator/`.
"""

"""The coordinator: serves one run to any number of workers, and owns its save directory.

It leases chunks of the population, collects their fitness, commits each step durably to
the fitness log and broadcasts it. It holds no model and no data: it never evaluates or
applies anything. The session flow is pure code (`run.py`, with the chunk queue in
`jobs.py` and the trust rules in `trust.py`); `server.py` is only the asyncio lifecycle and
sockets around it, `record.py` how its events are measured and logged. It never imports
`worker/`.
"""

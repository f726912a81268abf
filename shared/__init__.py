"""What every replica agrees on, bit for bit: the run config, the counter-based noise, the
model, fitness shaping, the update, the data and fitness-log formats, replica state and
checkpoints (`replay` in `replica.py` states that the fitness log is the run), the save
directory's layout and the state at a step (`save_dir.py`), samples (`sample.py`), plus the
command-line and logging conventions every command shares (`cli.py`, `logs.py`).

Pure and deterministic: no sockets, no asyncio, nothing of `protocol/`, `coordinator/`
or `worker/`. Not the place for anything only one side uses.
"""

"""What every replica agrees on, bit for bit: the run config, the counter-based noise, the
architectures (`model.py`'s `ARCHS`), the objectives (`objectives/`), fitness shaping, the
update and its rules (`rules/`), the data and fitness-log formats, replica state and
checkpoints (`replay` in `replica.py` states that the fitness log is the run), the goal
files a run pins (`pinned.py`), the save directory's layout and its one writer
(`save_dir.py`, `run_writer.py`), samples and prompts, plus the command-line, logging and
tracking conventions every command shares (`cli.py`, `logs.py`, `tracking.py`).

Its rule, as tests/test_layers.py enforces it: no sockets, no asyncio, nothing of
`protocol/`, `coordinator/` or `worker/`. It reads and writes the files both sides share
(data, fitness log, checkpoints, the save directory); the numbers every replica agrees on
are computed deterministically. Not the place for anything only one side uses.
"""

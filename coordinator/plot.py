"""`eggroll-inspect SAVE_DIR --plot FILE`: a run's curve as a PNG.

Train loss per committed step and the held-out scores (windows and long streams), in bits
per token, against the data's unigram, bigram and gzip -9 baselines, and a reward run's
mean reward (train and held-out prompts) on a second axis: what the save directory records
(coordinator/curve.py). `lines` is the picture as data, pure; `draw`
renders it with matplotlib's Agg backend (no display needed), an optional extra.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .curve import Curve

INSTALL = "pip install 'eggroll-distributed[plot]'"
WIDTH, HEIGHT, DPI = 10.0, 6.0, 100  # inches, so 1000 x 600 pixels

# A line's label -> its steps and values.
Lines = dict[str, tuple[list[int], list[float]]]

_BASELINES = (("unigram", "unigram"), ("bigram", "bigram"), ("gzip9", "gzip -9"))
_STYLES: dict[str, dict[str, object]] = {
    "train loss": {"color": "tab:blue", "linewidth": 0.8, "alpha": 0.6},
    "held-out": {"color": "tab:red", "marker": "o", "markersize": 4, "linewidth": 2},
    "held-out, long streams": {"color": "tab:purple", "marker": "s", "markersize": 2},
    "unigram": {"color": "tab:green", "linestyle": "--"},
    "bigram": {"color": "tab:orange", "linestyle": "-."},
    "gzip -9": {"color": "tab:brown", "linestyle": ":"},
    "train reward": {"color": "tab:cyan", "linewidth": 0.8, "alpha": 0.8},
    "held-out reward": {"color": "tab:olive", "marker": "D", "markersize": 4, "linewidth": 2},
}
REWARDS = ("train reward", "held-out reward")  # drawn on the right-hand axis


class PlotError(Exception):
    """The plot cannot be drawn (matplotlib missing, nothing recorded): one line."""


def check_available() -> None:
    """Raise PlotError at once when matplotlib cannot be imported."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise PlotError(f"--plot needs the matplotlib package: {INSTALL}") from None


def lines(curve: Curve) -> Lines:
    """What the plot draws: the train loss, the held-out scores, and each baseline as a
    flat line over the steps (labelled with its value)."""
    out: Lines = {}
    series = (
        (curve.steps, "loss_bits", "train loss"),
        (curve.validations, "valid_bits", "held-out"),
        (curve.validations, "stream_bits", "held-out, long streams"),
        (curve.steps, "reward", "train reward"),
        (curve.validations, "held_out_reward", "held-out reward"),
    )
    for records, key, label in series:
        points = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
        if points:
            out[label] = ([s for s, _ in points], [v for _, v in points])
    span = [0, max(curve.last_step, 1)]
    for name, label in _BASELINES:
        if name in curve.baselines:
            value = float(curve.baselines[name])
            out[f"{label} {value:.3f}"] = (span, [value, value])
    return out


def draw(curve: Curve, path: Path, title: str) -> Lines:
    """Render `lines(curve)` into a PNG at `path`; returns the lines as the figure holds
    them, read back from matplotlib. PlotError when the curve has no point."""
    check_available()
    drawn = lines(curve)
    if not any(label in drawn for label in ("train loss", "held-out", *REWARDS)):
        raise PlotError("nothing to plot: the save directory records no step of its curve")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # a figure of its own: no pyplot state, no display
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI)
    ax = fig.subplots()
    axes = [ax]
    if any(label in drawn for label in REWARDS):
        axes.append(ax.twinx())
        axes[1].set_ylabel("mean reward")
    for label, (x, y) in drawn.items():
        name = label if label in _STYLES else label.rsplit(" ", 1)[0]  # "unigram 4.694"
        on = axes[-1] if label in REWARDS else ax
        on.plot(x, y, label=label, **{"linewidth": 1.2, **_STYLES[name]})
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("bits per token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles = [line for a in axes for line in a.get_lines()]
    ax.legend(handles=handles, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    held: Lines = {}
    for line in handles:
        xs, ys = line.get_xdata(), line.get_ydata()
        held[str(line.get_label())] = ([int(x) for x in xs], [float(y) for y in ys])
    return held

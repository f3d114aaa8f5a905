"""PNG plots of a run directory: reward against time and step, the staleness histogram of the
trained data, and a timeline of the head buffer's entries and state.

matplotlib (the ``obs`` extra) is imported when a plot is drawn, and only its object-oriented
Agg canvas is used, so plotting never changes the caller's pyplot backend or state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from stalebound.obs.records import RunData, load_run

__all__ = [
    "BUFFER_TIMELINE_PNG",
    "REWARD_VS_STEP_PNG",
    "REWARD_VS_TIME_PNG",
    "STALENESS_PNG",
    "plot_buffer_timeline",
    "plot_reward",
    "plot_run",
    "plot_staleness",
]

log = logging.getLogger(__name__)

REWARD_VS_TIME_PNG = "reward_vs_time.png"
REWARD_VS_STEP_PNG = "reward_vs_step.png"
STALENESS_PNG = "staleness_hist.png"
BUFFER_TIMELINE_PNG = "buffer_timeline.png"

_STATE_COLOURS = {
    "PENDING": "#f2c14e",
    "STUCK": "#d1495b",
    "READY_WITH_CAPACITY": "#66a5ad",
    "READY": "#2e8b57",
}
_MAX_STEP_MARKS = 150
_ENTRY_COLOURS = {"occupied": "#2e8b57", "reserved": "#f2c14e", "empty": "#d9d9d9"}


def plot_run(
    run_dir: str | Path, out_dir: str | Path | None = None, *, reward_key: str = "reward_mean"
) -> list[Path]:
    """Draw every plot the run's files allow into ``out_dir`` (default: ``run_dir``).

    Returns the files written. A plot whose data the run lacks (no ``reward_key`` metric, no
    staleness counts, no buffer samples) is skipped, with a log message saying why.
    """
    data = load_run(run_dir)
    out = Path(run_dir) if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    written += plot_reward(data, out, reward_key=reward_key)
    written += plot_staleness(data, out)
    written += plot_buffer_timeline(data, out)
    return written


def plot_reward(data: RunData, out_dir: Path, *, reward_key: str = "reward_mean") -> list[Path]:
    """``reward_vs_time.png`` and ``reward_vs_step.png``; nothing without the metric."""
    steps, times, values = data.series(reward_key)
    if not values:
        log.info("no %r values in metrics.jsonl: reward plots skipped", reward_key)
        return []
    written = []
    for name, xs, xlabel in (
        (REWARD_VS_TIME_PNG, times, "wall time (s)"),
        (REWARD_VS_STEP_PNG, steps, "training step"),
    ):
        fig, ax = _figure()
        ax.plot(xs, values, marker="o" if len(values) < 40 else None, markersize=3, lw=1.5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(reward_key)
        ax.set_title(f"{reward_key} against {xlabel.split(' (')[0]}")
        ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / name))
    return written


def plot_staleness(data: RunData, out_dir: Path) -> list[Path]:
    """``staleness_hist.png``: trained items by staleness over the run; nothing without counts."""
    hist = data.staleness_histogram()
    if not hist:
        log.info("no staleness counts in staleness.jsonl: staleness histogram skipped")
        return []
    counts = hist.counts
    top = max(counts)
    xs = list(range(top + 1))
    fig, ax = _figure()
    ax.bar(xs, [counts.get(k, 0) for k in xs], color="#3b6ea5", width=0.8)
    ax.set_xticks(xs)
    ax.set_xlabel("staleness (trained version − generating version)")
    ax.set_ylabel("trained items")
    mean = hist.mean or 0.0
    ax.set_title(f"staleness of trained data (n = {hist.total}, mean {mean:.2f}, max {top})")
    ax.grid(axis="y", alpha=0.3)
    return [_save(fig, out_dir / STALENESS_PNG)]


def plot_buffer_timeline(data: RunData, out_dir: Path) -> list[Path]:
    """``buffer_timeline.png``: the head buffer's occupied / reserved / empty entries over time as
    stacked steps, with a band below coloured by its state; nothing without buffer samples."""
    samples = [s for s in data.buffers if s.head is not None]
    if not samples:
        log.info("no buffer samples in buffers.jsonl: buffer timeline skipped")
        return []
    times = [s.wall_time for s in samples]
    heads = [s.head for s in samples if s.head is not None]
    occ = [h.occupied for h in heads]
    res = [h.reserved for h in heads]
    emp = [h.empty for h in heads]
    fig, (ax, band) = _figure(rows=2, height_ratios=(5, 1), sharex=True)
    ax.stackplot(
        times,
        occ,
        res,
        emp,
        labels=["occupied", "reserved", "empty"],
        colors=[_ENTRY_COLOURS[k] for k in ("occupied", "reserved", "empty")],
        step="post",
    )
    consumed = [s.wall_time for prev, s in pairwise(samples) if s.version != prev.version]
    if len(consumed) <= _MAX_STEP_MARKS:  # beyond that the marks would paint the plot solid
        for t in consumed:
            ax.axvline(t, color="black", lw=0.6, alpha=0.35)
    ax.set_ylabel("head buffer entries")
    ax.set_title("head buffer (the one trained next) over time; lines: a step consumed it")
    ax.legend(loc="upper right", fontsize="small")
    ax.margins(x=0)
    _state_band(band, times, [h.state for h in heads])
    band.set_xlabel("wall time (s)")
    return [_save(fig, out_dir / BUFFER_TIMELINE_PNG)]


def _state_band(ax: Any, times: Sequence[float], states: Sequence[str]) -> None:
    from matplotlib.patches import Patch

    ends = [*times[1:], times[-1] + _last_gap(times)]
    # One span per run of equal states: long runs have many samples but few state changes.
    span_start = 0
    for i in range(1, len(states) + 1):
        if i == len(states) or states[i] != states[span_start]:
            colour = _STATE_COLOURS.get(states[span_start], "#999999")
            ax.axvspan(times[span_start], ends[i - 1], color=colour, lw=0)
            span_start = i
    ax.set_yticks([])
    ax.set_ylabel("state", rotation=0, ha="right", va="center")
    seen = [s for s in _STATE_COLOURS if s in set(states)]
    ax.legend(
        handles=[Patch(color=_STATE_COLOURS[s], label=s) for s in seen],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.9),
        ncol=len(seen) or 1,
        fontsize="small",
        frameon=False,
    )


def _last_gap(times: Sequence[float]) -> float:
    if len(times) < 2:
        return 1.0
    return (times[-1] - times[0]) / (len(times) - 1)


def _figure(
    rows: int = 1, *, height_ratios: Sequence[int] | None = None, sharex: bool = False
) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5 if rows == 1 else 5.5), layout="constrained")
    if rows == 1:
        return fig, fig.add_subplot()
    axes = fig.subplots(
        rows, 1, sharex=sharex, gridspec_kw={"height_ratios": list(height_ratios or [1] * rows)}
    )
    return fig, tuple(axes)


def _save(fig: Any, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path

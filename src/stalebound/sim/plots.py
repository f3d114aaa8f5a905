"""Plots of simulation results (matplotlib, Agg backend, imported only when plotting)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

from stalebound.core.errors import ConfigError
from stalebound.sim.simulator import SimResult

__all__ = ["write_all"]

_STATES = ["READY", "READY_WITH_CAPACITY", "PENDING", "STUCK"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "plot: matplotlib is not installed; pip install 'stalebound[obs]' or drop --plot"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_all(results: list[SimResult], folder: Path) -> list[Path]:
    """Write every plot for ``results`` into ``folder``; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    return [
        _eta(plt, results, folder / "throughput_vs_staleness.png"),
        _pareto(plt, results, folder / "pareto.png"),
        _histogram(plt, results, folder / "staleness_histogram.png"),
        _timeline(plt, results, folder / "buffer_state_timeline.png"),
    ]


def _eta(plt: Any, results: list[SimResult], path: Path) -> Path:
    by_policy: dict[str, list[SimResult]] = defaultdict(list)
    for r in results:
        by_policy[r.policy].append(r)
    etas = sorted({r.staleness for r in results})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy, rs in by_policy.items():
        rs.sort(key=lambda r: r.staleness)
        if policy == "sync" and len(rs) == 1 and len(etas) > 1:
            ax1.axhline(rs[0].throughput, ls=":", color="grey", label="sync (η = 0)")
            ax2.axhline(rs[0].efficiency, ls=":", color="grey", label="sync (η = 0)")
            continue
        xs = [r.staleness for r in rs]
        ax1.plot(xs, [r.throughput for r in rs], marker="o", label=policy)
        ax2.plot(xs, [r.efficiency for r in rs], marker="o", label=policy)
    if results:
        ax1.axhline(results[0].bound.value, color="black", lw=1, label="bound")
    ax2.axhline(1.0, color="black", lw=1)
    ax1.set(
        xlabel="hard staleness bound η_h", ylabel="trajectories trained / s", title="throughput"
    )
    ax2.set(xlabel="hard staleness bound η_h", ylabel="throughput ÷ bound", title="efficiency")
    for ax in (ax1, ax2):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(etas)
        ax.set_xticklabels([str(e) for e in etas])
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pareto(plt: Any, results: list[SimResult], path: Path) -> Path:
    """Throughput against the staleness it was bought with, mean (left) and max (right): one
    line per policy through its η values, each point labelled with its η. Up and to the left
    is better; a policy whose line lies above another's is faster at the same staleness."""
    by_policy: dict[str, list[SimResult]] = defaultdict(list)
    for r in results:
        by_policy[r.policy].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for policy, rs in by_policy.items():
        rs.sort(key=lambda r: r.staleness)
        ys = [r.throughput for r in rs]
        for ax, xs in zip(
            axes,
            ([r.staleness_mean for r in rs], [float(r.staleness_max) for r in rs]),
            strict=True,
        ):
            (line,) = ax.plot(xs, ys, marker="o", label=policy)
            for x, y, r in zip(xs, ys, rs, strict=True):
                ax.annotate(
                    f"η_h={r.staleness}", (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, color=line.get_color(),
                )  # fmt: skip
    axes[0].set(xlabel="mean staleness of trained trajectories", ylabel="trajectories trained / s")
    axes[1].set(xlabel="max staleness of any trained trajectory")
    fig.suptitle("throughput against staleness (up and left is better)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    return _save(plt, fig, path)


def _histogram(plt: Any, results: list[SimResult], path: Path) -> Path:
    top = max((r.staleness for r in results), default=0)
    chosen = [r for r in results if r.staleness == top] or results
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(chosen))
    for i, r in enumerate(chosen):
        total = sum(r.staleness_histogram.values()) or 1
        xs = sorted(r.staleness_histogram)
        ax.bar(
            [x + i * width for x in xs],
            [r.staleness_histogram[x] / total for x in xs],
            width=width,
            label=f"{r.policy} (η_h={r.staleness})",
        )
    ax.axvline(top + 0.9, color="red", ls="--", lw=1, label=f"η_h = {top}")
    ax.set(xlabel="staleness of trained trajectories", ylabel="fraction", title="staleness")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _timeline(plt: Any, results: list[SimResult], path: Path) -> Path:
    # one row per buffer policy at the largest η, over the first fifth of the shortest run
    with_timeline = [r for r in results if r.timeline]
    top = max((r.staleness for r in with_timeline), default=0)
    chosen = [r for r in with_timeline if r.staleness == top or r.policy == "sync"]
    end = min((r.sim_time for r in chosen), default=0.0) / 5
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * max(1, len(chosen))))
    colors = {
        "READY": "tab:green",
        "READY_WITH_CAPACITY": "tab:olive",
        "PENDING": "tab:blue",
        "STUCK": "tab:red",
    }
    for row, r in enumerate(chosen):
        points = [p for p in r.timeline if p[0] < end] + [(end, "")]
        for (t0, state), (t1, _) in itertools.pairwise(points):
            if t1 > t0:
                ax.broken_barh([(t0, t1 - t0)], (row - 0.4, 0.8), color=colors[state])
    ax.set_yticks(range(len(chosen)))
    ax.set_yticklabels([f"{r.policy} η_h={r.staleness}" for r in chosen], fontsize=8)
    ax.set_xlim(0, end or 1)
    ax.set_xlabel("virtual time (s)")
    ax.set_title("head buffer state: " + ", ".join(f"{s} = {c[4:]}" for s, c in colors.items()))
    return _save(plt, fig, path)

"""``stalebound plot RUN_DIR``: draw a run directory's plots and print its summary table."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stalebound.core import ConfigError, StaleboundError
from stalebound.obs.records import (
    BUFFERS_FILE,
    METRICS_FILE,
    RESERVED_KEYS,
    STALENESS_FILE,
    RunData,
)

__all__ = ["register", "run_plot"]


def register(subparsers: Any) -> None:
    """Add the ``plot`` command to an ``argparse`` sub-parser collection."""
    parser = subparsers.add_parser(
        "plot",
        help="draw a run directory's PNG plots and print its summary",
        description=(
            "Draw reward against wall time and step, the staleness histogram of the trained "
            "data and the head buffer's timeline from RUN_DIR's metrics.jsonl, staleness.jsonl "
            "and buffers.jsonl, then print the run's summary table."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by a run")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")
    parser.add_argument(
        "--reward-key", default="reward_mean", help="the metric to plot as reward (reward_mean)"
    )
    parser.add_argument("--no-summary", action="store_true", help="do not print the summary table")
    parser.set_defaults(func=run_plot)


def _nothing_to_plot(data: RunData, run_dir: str, reward_key: str) -> str | None:
    """Why ``stalebound plot`` has nothing to draw from ``data`` (or the metric it was asked
    for is not there), as one message; ``None`` when it has."""
    if not (data.steps or data.staleness or data.buffers):
        return (
            f"run directory {run_dir!r} holds no records ({METRICS_FILE}, {STALENESS_FILE}, "
            f"{BUFFERS_FILE}); pass the directory a run wrote"
        )
    metrics = sorted({k for r in data.steps for k, v in r.items() if _number(v)} - RESERVED_KEYS)
    if data.steps and reward_key not in metrics:
        return (
            f"--reward-key={reward_key!r}: not a metric in {run_dir}/{METRICS_FILE}; its metrics "
            f"are {', '.join(metrics)}"
        )
    return None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def run_plot(args: argparse.Namespace) -> int:
    from rich.console import Console

    from stalebound.obs.live import summary_table
    from stalebound.obs.plots import plot_run
    from stalebound.obs.records import load_run, summarize

    console = Console()
    try:
        data = load_run(args.run_dir)
        problem = _nothing_to_plot(data, args.run_dir, args.reward_key)
        if problem:
            raise ConfigError(problem)
        written = plot_run(args.run_dir, args.out, reward_key=args.reward_key)
    except StaleboundError as exc:
        print(f"stalebound plot: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"stalebound plot: {exc}; install the plotting extra: pip install 'stalebound[obs]'",
            file=sys.stderr,
        )
        return 2
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    if not args.no_summary:
        console.print(summary_table(summarize(data)))
    return 0

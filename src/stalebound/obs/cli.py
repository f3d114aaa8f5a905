"""``stalebound plot RUN_DIR``: draw a run directory's plots and print its summary table."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stalebound.core import StaleboundError

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


def run_plot(args: argparse.Namespace) -> int:
    from rich.console import Console

    from stalebound.obs.live import summary_table
    from stalebound.obs.plots import plot_run
    from stalebound.obs.records import load_run, summarize

    console = Console()
    try:
        data = load_run(args.run_dir)
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
    if not written:
        console.print(f"no plots: {args.run_dir} has no metrics, staleness or buffer records")
    if not args.no_summary:
        console.print(summary_table(summarize(data)))
    return 0

"""The ``stalebound`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _walkthrough(_: argparse.Namespace) -> int:
    from stalebound import walkthrough

    walkthrough.run()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalebound", description="Bounded-staleness asynchronous RL for language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    walk = sub.add_parser("walkthrough", help="narrated walk through the staleness-buffer protocol")
    walk.set_defaults(func=_walkthrough)

    from stalebound.obs.cli import register as register_plot

    register_plot(sub)
    from stalebound.sim import cli as sim_cli

    sim_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

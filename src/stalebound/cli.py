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
    sub.add_parser("train", help="train on the embedded default (stalebound train --help)")
    sub.add_parser("bench", help="the same run at several η side by side (stalebound bench --help)")

    from stalebound.obs.cli import register as register_plot

    register_plot(sub)
    from stalebound.engines import vllm_server

    vllm_server.register(sub)
    from stalebound.sim import cli as sim_cli

    sim_cli.register(sub)
    return parser


def _train(argv: Sequence[str]) -> int:
    from stalebound.config import TRAIN_RECIPE, load_config, parse_cli_overrides
    from stalebound.core.errors import ConfigError

    if any(a in ("-h", "--help") for a in argv):
        print(TRAIN_HELP)
        return 0
    try:
        paths, overrides = parse_cli_overrides(argv)
        cfg = load_config([TRAIN_RECIPE, *paths], overrides)
    except ConfigError as e:
        print(f"stalebound train: {e}", file=sys.stderr)
        return 2
    from stalebound.train.job import run_training

    run_training(cfg)
    return 0


TRAIN_HELP = """usage: stalebound train [CONFIG.yaml ...] [key.path=value ...] [--flag VALUE ...]

Asynchronous GRPO on the embedded default: warm start, engines in worker processes, the
staleness buffer between them and the trainer. Every config key is an override (docs/config.md),
e.g. rollout.max_head_offpolicyness=2 run.steps=40; the seeds' spellings work too:
--max-head-offpolicyness 4 --max-concurrent-rollouts 64, psrl.staleness=2 psrl.rollout_n=8."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # free-form overrides and AReaL-style flags: not argparse's
        return _train(argv[1:])
    if argv and argv[0] == "bench":
        from stalebound.train import bench

        return bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

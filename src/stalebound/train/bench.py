"""``stalebound bench``: the same workload trained synchronously and asynchronously, side by side.

Every run uses the same config, seed, warm start and prompts; only η changes (η = 0 is synchronous
training: no rollout starts before the trainer has consumed the batch it belongs to). The config is
the train recipe, then ``configs/bench.yaml`` (a reward verifier with a heavy-tailed latency, the
long tail asynchronous training exists for), then the command line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from stalebound.config import (
    BENCH_RECIPE,
    TRAIN_RECIPE,
    StaleboundConfig,
    load_config,
    parse_cli_overrides,
)
from stalebound.core.errors import ConfigError

__all__ = ["main", "run_bench"]

HELP = """usage: stalebound bench [CONFIG.yaml ...] [key=value ...] [--staleness 0 1 2 4] [--json]

Trains the same workload once per staleness bound and prints time to the target reward
(run.target_reward), trajectories/s, trainer and engine idle fractions and final reward.
The workload is the train recipe plus configs/bench.yaml: rewards from a verifier with a
heavy-tailed latency (task.reward_latency.distribution=none turns it off)."""


def run_bench(
    base: StaleboundConfig, staleness: Sequence[int], out_dir: Path
) -> list[dict[str, object]]:
    from stalebound.train.job import run_training

    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the process
    runs: list[dict[str, object]] = []
    for eta in staleness:
        cfg = dataclasses.replace(
            base,
            rollout=dataclasses.replace(base.rollout, staleness=eta),
            run=dataclasses.replace(
                base.run, run_dir=str(out_dir / f"eta{eta}"), live=False, plots=False
            ),
        )
        r = run_training(cfg, console=quiet)
        runs.append(
            {
                "staleness": eta,
                "policy": r.policy,
                "time_to_target_s": r.time_to_target_s,
                "trajectories_per_s": r.trajectories_per_s,
                "final_reward": r.reward_last,
                "trainer_idle_fraction": r.trainer_idle_fraction,
                "engine_idle_fraction": r.engine_idle_fraction,
                "wall_s": r.wall_s,
                "eval_before": r.eval_before,
                "eval_after": r.eval_after,
                "max_staleness": r.max_staleness,
                "violations": r.violations,
            }
        )
    return runs


def _table(runs: list[dict[str, object]], target: float) -> Table:
    t = Table(title=f"stalebound bench: time to training reward ≥ {target}")
    for col in (
        "η",
        "policy",
        "time to target (s)",
        "speed-up",
        "traj/s",
        "trainer idle",
        "engine idle",
        "final reward",
        "greedy acc",
        "max staleness",
    ):
        t.add_column(col, justify="right")
    sync = next((r["time_to_target_s"] for r in runs if r["staleness"] == 0), None)
    for r in runs:
        ttt = r["time_to_target_s"]
        speed = f"{sync / ttt:.2f}×" if isinstance(sync, float) and isinstance(ttt, float) else "–"
        t.add_row(
            str(r["staleness"]),
            str(r["policy"]),
            f"{ttt:.1f}" if isinstance(ttt, float) else "not reached",
            speed,
            f"{r['trajectories_per_s']:.0f}",
            f"{r['trainer_idle_fraction']:.2f}",
            f"{r['engine_idle_fraction']:.2f}",
            f"{r['final_reward']:.3f}",
            f"{r['eval_before']:.2f} → {r['eval_after']:.2f}",
            str(r["max_staleness"]),
        )
    return t


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(HELP)
        return 0
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    staleness = [0, 1, 2, 4]
    if "--staleness" in args:
        i = args.index("--staleness")
        values = []
        j = i + 1
        while j < len(args) and args[j].isdigit():
            values.append(int(args[j]))
            j += 1
        if not values:
            print(
                "stalebound bench: --staleness needs integers, e.g. --staleness 0 2",
                file=sys.stderr,
            )
            return 2
        staleness, args = values, args[:i] + args[j:]
    try:
        paths, overrides = parse_cli_overrides(args)
        cfg = load_config([TRAIN_RECIPE, BENCH_RECIPE, *paths], overrides)
    except ConfigError as e:
        print(f"stalebound bench: {e}", file=sys.stderr)
        return 2
    from stalebound.train.job import default_run_dir

    out = (
        Path(cfg.run.run_dir)
        if cfg.run.run_dir
        else default_run_dir().with_name("bench-" + default_run_dir().name)
    )
    runs = run_bench(cfg, staleness, out)
    (out / "bench.json").write_text(json.dumps({"runs": runs}, indent=2))
    if as_json:
        print(json.dumps({"runs": runs}))
    else:
        Console(width=160).print(_table(runs, cfg.run.target_reward))
    return 0

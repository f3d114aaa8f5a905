"""Train at a poor setting, calibrate, take the recommendation, train it: predicted against measured.

One invocation trains `stalebound bench`'s workload (the train recipe plus configs/bench.yaml:
rewards from a verifier with a heavy-tailed latency) for a short run at a poor setting
(synchronous training, `rollout.staleness=0`), calibrates the simulator on it, sweeps the settings
(`stalebound.sim.recommend`, as `stalebound simulate --calibrate RUN --recommend`), trains the
recommended setting, and trains the bench's hand-picked rows on the same workload: the recipe's
deadline policy at η_h = 2 and 4, and `capacity` at η = 2. It prints each run's predicted and
measured trajectories/s (over the steps after the first 10 %, as calibration measures), the
error, and each run's speed against the fastest hand-picked row (a recommendation that is one of
those rows is trained once and stands for both, so its ratio compares settings, not two runs of
one setting). With `--invocations 3` it repeats all of it and prints the medians with their
ranges. Absolute figures depend on the machine's load; the ratios are taken within each
invocation.

    .venv/bin/python bench/recommend_check.py [--invocations 3] [--steps 60] [--max-staleness X]
                                              [--start KEY=VALUE ...] [--keep DIR]

``--keep DIR`` keeps each invocation's run directories under ``DIR/<invocation>/`` (``start``,
``recommended``, ``hand-picked-<i>`` for the rows the recommendation is not), so they can be
calibrated and compared again later.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

from stalebound.cli import main as stalebound
from stalebound.config import BENCH_RECIPE
from stalebound.sim.calibrate import calibrate, measure
from stalebound.sim.recommend import Setting, recommend, simulate_settings

POOR = ["rollout.staleness_policy=capacity", "rollout.staleness=0"]
"""Synchronous training: the setting the check starts from."""

HAND_PICKED = {
    "deadline η_h=2 (η_s=1)": Setting("deadline", 2, 1),
    "deadline η_h=4 (η_s=2), the recipe's": Setting("deadline", 4, 2),
    "capacity η=2": Setting("capacity", 2),
}
"""The bench's hand-picked rows (README: the η table and the policies side by side)."""

QUIET = [
    "run.live=false",
    "run.checkpoint=false",
    "run.plots=false",
    "run.tensorboard=false",
    "run.eval_prompts=8",
]


def train(run: Path, models: Path, steps: int, overrides: list[str]) -> float:
    """Train one run (its output into ``<run>.log``); its measured trajectories/s."""
    log = run.with_suffix(".log")
    with log.open("w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = stalebound(
            [
                "train",
                str(BENCH_RECIPE),
                *overrides,
                f"run.steps={steps}",
                f"run.run_dir={run}",
                f"engine.cache_dir={models}",
                *QUIET,
            ]
        )
    if code:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"recommend_check: training {run.name} failed (exit {code})")
    return measure(run).trajectories_per_s


def one_invocation(
    tmp: Path, steps: int, max_staleness: float | None, start: list[str]
) -> dict[str, tuple[float, float]]:
    """Each row's (predicted, measured) trajectories/s; the poor run's prediction is its own
    calibration's."""
    models = tmp / "models"
    rows: dict[str, tuple[float, float]] = {}
    poor = train(tmp / "start", models, steps, start)
    cal = calibrate(tmp / "start")
    rec = recommend(cal, max_staleness=max_staleness, objective="time-per-step")
    assert rec.recommended is not None
    rows[f"start: {' '.join(start)}"] = (rec.current.trajectories_per_s, poor)
    chosen = rec.recommended.setting
    overrides = chosen.overrides()
    print(f"recommended: {' '.join(overrides)}", flush=True)
    recommended = train(tmp / "recommended", models, steps, overrides)
    rows[f"recommended: {_name(chosen)}"] = (rec.recommended.trajectories_per_s, recommended)
    predicted = simulate_settings(cal, list(HAND_PICKED.values()))
    for i, ((name, setting), p) in enumerate(zip(HAND_PICKED.items(), predicted, strict=True)):
        if setting.overrides() == overrides:  # the recommendation is this row: one run for both
            print(f"{name}: the recommended run", flush=True)
            measured = recommended
        else:
            measured = train(tmp / f"hand-picked-{i}", models, steps, setting.overrides())
        rows[name] = (p.trajectories_per_s, measured)
    return rows


def _name(s: Setting) -> str:
    label = s.label()
    return " ".join(f"{k}={v}" for k, v in label.items() if v != "–")


def _cell(values: list[float], fmt: str) -> str:
    mid = format(statistics.median(values), fmt)
    if len(values) == 1:
        return mid
    return f"{mid} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--invocations", type=int, default=1, help="repeat it all (1)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (60)")
    parser.add_argument(
        "--max-staleness", type=float, default=None, help="the recommendation's limit (none)"
    )
    parser.add_argument(
        "--start",
        nargs="+",
        default=POOR,
        metavar="KEY=VALUE",
        help=f"the poor setting to start from (default: {' '.join(POOR)})",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, metavar="DIR", help="keep the run directories there"
    )
    args = parser.parse_args(argv)
    runs = []
    for number in range(args.invocations):
        with tempfile.TemporaryDirectory(prefix="recommend-check-") as tmp:
            work = Path(tmp) if args.keep is None else args.keep / str(number + 1)
            work.mkdir(parents=True, exist_ok=True)
            runs.append(one_invocation(work, args.steps, args.max_staleness, args.start))
    print(
        f"{args.invocations} invocation(s), {args.steps} steps per run; trajectories/s over the "
        "steps after the first 10 %; medians (ranges)"
    )
    print("| run | predicted traj/s | measured traj/s | error | measured ÷ best hand-picked |")
    print("|:--|--:|--:|--:|--:|")
    names = [list(r) for r in runs]
    for i, name in enumerate(names[0]):
        pairs = [list(r.values())[i] for r in runs]
        best = [max(m for n, (_, m) in r.items() if n in HAND_PICKED) for r in runs]
        errors = [p / m - 1 for p, m in pairs]
        ratio = [m / b for (_, m), b in zip(pairs, best, strict=True)]
        label = name if len({n[i] for n in names}) == 1 else name.split(":")[0]
        print(
            f"| {label} | {_cell([p for p, _ in pairs], '.0f')} | "
            f"{_cell([m for _, m in pairs], '.0f')} | {_cell(errors, '+.1%')} | "
            f"{_cell(ratio, '.2f')} |"
        )
    if len({n[1] for n in names}) > 1:
        print("recommended per invocation: " + "; ".join(n[1] for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())

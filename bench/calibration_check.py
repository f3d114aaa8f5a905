"""Train, calibrate, predict: how well the calibrated simulator predicts a run trained now.

Trains the run ``scripts/record_calibration_run.py`` records (the train recipe, 20 steps), fits
the simulator to it (``stalebound.sim.calibrate``), simulates it, and prints the measured and
predicted figures with their errors — the check ``tests/test_sim_calibrate.py`` makes on the
recorded run, made on a fresh one. Its figures depend on the machine and its load (the run and
the fit come from the same run, so load moves both); the test, on the recorded run, does not.

    .venv/bin/python bench/calibration_check.py [--runs 3] [--workload longtail]

``--workload longtail`` trains ``configs/bench-longtail.yaml`` (30 steps, the deadline recipe,
generation lengths with a long tail) instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

from stalebound.cli import main as stalebound
from stalebound.sim.calibrate import calibrate, measure, predict

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "record_calibration_run.py"


def _settings() -> list[str]:
    spec = importlib.util.spec_from_file_location("record_calibration_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.SETTINGS)


LONGTAIL = Path(__file__).resolve().parent.parent / "src/stalebound/configs/bench-longtail.yaml"


def one_run(tmp: Path, workload: str) -> dict[str, tuple[float, float]]:
    run = tmp / "run"
    settings = (
        [str(LONGTAIL), "run.live=false", "run.plots=false"]
        if workload == "longtail"
        else _settings()
    )
    code = stalebound(["train", f"run.run_dir={run}", f"engine.cache_dir={tmp}/models", *settings])
    if code:
        raise SystemExit(code)
    measured = measure(run)
    predicted = predict(calibrate(run), steps=measured.steps)
    return {
        "trajectories/s": (measured.trajectories_per_s, predicted.throughput),
        "trainer idle": (measured.trainer_idle, 1 - predicted.trainer_util),
        "engine idle": (measured.engine_idle, predicted.engine_idle),
        "staleness mean": (measured.staleness_mean, predicted.staleness_mean),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs to train and predict (1)")
    parser.add_argument("--workload", choices=["default", "longtail"], default="default")
    args = parser.parse_args(argv)
    rows = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(one_run(Path(tmp), args.workload))
    print("| run | figure | measured | predicted | error |")
    print("|--:|:--|--:|--:|--:|")
    for number, row in enumerate(rows, 1):
        for name, (got, said) in row.items():
            error = abs(said / got - 1) if name == "trajectories/s" else abs(said - got)
            kind = "relative" if name == "trajectories/s" else "absolute"
            print(f"| {number} | {name} | {got:.3f} | {said:.3f} | {error:.3f} ({kind}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

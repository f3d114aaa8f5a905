"""What freezing the set-up's heap (``run.gc_freeze``) does to a real run's throughput.

    python bench/gc_freeze.py [--rounds 3] [--steps 40] [--policy deadline|capacity|buffer|sync] [CONFIG]

Trains CONFIG (default: the built-in ``bench-longtail.yaml``) under one of the long-tail bench's
policies (``deadline`` at η_h = 4, η_s = 2; ``capacity`` and ``buffer`` at 2; sync) once with
``run.gc_freeze=true`` and once with ``false``, alternating, ``--rounds`` times, each in a fresh
process as ``stalebound train`` would run. Prints each run's trajectories/s, trainer idle fraction
and the full (oldest-generation) collections the process made with their total and longest pause,
then the median and range per setting and the ratio of the medians. Needs an otherwise idle
machine: it measures wall-clock throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from stalebound.config import TRAIN_RECIPE, dump_yaml, load_config
from stalebound.train.bench import POLICIES, SYNC, WORKLOADS, policy_config

# Runs `stalebound train` in this process with a collector callback that times every full
# collection; writes the totals to the file named by SB_GC_REPORT when the run ends.
PROBE = """
import gc, json, os, sys, time
pauses, start = [], [0.0]
def timed(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        start[0] = time.perf_counter()
    else:
        pauses.append(time.perf_counter() - start[0])
gc.callbacks.append(timed)
from stalebound.cli import main
try:
    code = main(sys.argv[1:])
finally:
    with open(os.environ["SB_GC_REPORT"], "w") as f:
        json.dump({"n": len(pauses), "total_s": sum(pauses), "max_s": max(pauses, default=0.0)}, f)
sys.exit(code)
"""


def one_run(config: Path, freeze: bool, where: Path, name: str) -> dict[str, float]:
    run_dir = where / name
    report = where / "gc.json"
    args = [
        sys.executable, "-c", PROBE, "train", str(config),
        f"run.gc_freeze={str(freeze).lower()}", f"run.run_dir={run_dir}",
        "run.tensorboard=false", "run.checkpoint=false",
    ]  # fmt: skip
    subprocess.run(
        args, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "SB_GC_REPORT": str(report)}
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    gc_stats = json.loads(report.read_text())
    return {
        "traj_s": summary["trajectories_per_s"],
        "trainer_idle": summary["trainer_idle_fraction"],
        "full_collections": gc_stats["n"],
        "pause_total_s": gc_stats["total_s"],
        "pause_max_s": gc_stats["max_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(WORKLOADS["longtail"]))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--policy", default="deadline", choices=[SYNC, *POLICIES])
    args = parser.parse_args()
    base = load_config(
        [TRAIN_RECIPE, args.config], ["rollout.deadline.target=2", f"run.steps={args.steps}"]
    )
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    print(f"{'round':>5} {'gc_freeze':>9} {'traj/s':>8} {'trainer idle':>12} "
          f"{'full GCs':>8} {'GC pause s':>10} {'longest s':>9}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        # the bench's row (`stalebound bench --staleness 4 --target 2 --same-admission`), written
        # out as the file each run trains; every run sets its own directory on top
        config = Path(tmp) / "config.yaml"
        row = policy_config(base, args.policy, 4, Path(tmp), same_admission=True)
        config.write_text(dump_yaml(row))
        for r in range(args.rounds):
            # alternate which setting goes first, so a drift in the machine's speed hits both
            for freeze in (True, False) if r % 2 == 0 else (False, True):
                res = one_run(config, freeze, Path(tmp), f"{r}-{freeze}")
                results[freeze].append(res)
                print(
                    f"{r + 1:>5} {str(freeze).lower():>9} {res['traj_s']:>8.1f} "
                    f"{res['trainer_idle']:>12.3f} {res['full_collections']:>8.0f} "
                    f"{res['pause_total_s']:>10.2f} {res['pause_max_s']:>9.3f}",
                    flush=True,
                )
    print()
    medians = {}
    for freeze, runs in results.items():
        rate = [r["traj_s"] for r in runs]
        pause = [r["pause_total_s"] for r in runs]
        medians[freeze] = statistics.median(rate)
        print(
            f"gc_freeze={str(freeze).lower():<5}: {medians[freeze]:.1f} traj/s "
            f"(range {min(rate):.1f}..{max(rate):.1f}), full-collection pauses "
            f"{statistics.median(pause):.2f} s (range {min(pause):.2f}..{max(pause):.2f})"
        )
    print(f"ratio on/off of the medians: {medians[True] / medians[False]:.3f}")


if __name__ == "__main__":
    main()

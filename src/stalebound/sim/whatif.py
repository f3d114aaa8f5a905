"""What a change of setting would gain, by the simulator calibrated on a run (what
``stalebound doctor --predict`` prints next to the largest cause of idle time)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stalebound.obs.doctor import Prediction
from stalebound.sim.calibrate import calibrate, predict

__all__ = ["predict_gain"]


def predict_gain(run_dir: str | Path, cause: str) -> Prediction | None:
    """Calibrate the simulator on ``run_dir`` (:mod:`stalebound.sim.calibrate`) and simulate
    the run with the setting that moves ``cause`` changed: one step more ``rollout.staleness``
    for the admission bound, rewards that take no time for the reward wait. ``None`` for the
    causes the simulator does not model a setting of; ``ConfigError`` when the run cannot be
    calibrated (fewer than 3 steps, say)."""
    if cause not in ("admission bound", "reward wait"):
        return None
    cal = calibrate(run_dir)
    baseline = predict(cal).throughput
    run = cal.run
    if cause == "admission bound":
        target = None if run.target is None else run.target + 1
        result = predict(cal, policy=run.policy, staleness=run.staleness + 1, target=target)
        change = f"rollout.staleness={run.staleness + 1}"
        if target is not None:
            change += f" rollout.deadline.target={target}"
    else:
        instant = tuple(1e-6 for _ in cal.reward_latencies)
        result = predict(dataclasses.replace(cal, reward_latencies=instant))
        change = "rewards that take no time (the most any reward setting gains)"
    return Prediction(change, result.throughput, baseline)

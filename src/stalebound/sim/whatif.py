"""What a change of setting would gain, by the simulator calibrated on a run (what
``stalebound doctor --predict`` prints next to each cause of idle time)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from stalebound.obs.doctor import Prediction
from stalebound.obs.records import load_run
from stalebound.sim.calibrate import Calibration, calibrate, predict

__all__ = ["UNMODELLED", "predict_gain", "predict_gains"]

UNMODELLED = {
    "checkpoint": "the simulator does not write checkpoints",
    "bookkeeping": "the simulator counts it in the trainer's step time, with no setting of it",
    "executor loop": "the calibration finds no hand-over time of its own (trainer.handoff 0)",
    "filtering and refills": "the calibrated workload has no filter",
    "aborts and retries": "the calibrated workload has no deadline action or retry of its own",
}
"""The causes with a setting but no simulated change of it, and why."""


def predict_gain(run_dir: str | Path, cause: str) -> Prediction | None:
    """The simulator's figure for the setting that moves ``cause`` (:func:`predict_gains`)."""
    return predict_gains(run_dir, [cause])[cause]


def predict_gains(run_dir: str | Path, causes: Iterable[str]) -> dict[str, Prediction | None]:
    """Calibrate the simulator on ``run_dir`` once (:mod:`stalebound.sim.calibrate`) and, for
    each of ``causes``, simulate the run with the setting that moves it changed:

    * ``admission bound``: one step more ``rollout.staleness`` (and deadline target);
    * ``reward wait``: rewards that take no time (the most ``task.reward_workers`` gains);
    * ``generation``: twice the ``engine.replicas``;
    * ``publication``: publications that take no time (the most ``engine.weight_transfer``
      gains);
    * ``CPU contention``: a trainer that runs all its step (its training at its CPU time,
      ``step_cpu_s``, and no slow-down while the engines generate).

    ``None`` for the others (:data:`UNMODELLED`); ``ConfigError`` when the run cannot be
    calibrated (fewer than 3 steps, say)."""
    wanted = list(causes)
    changes = {c: _CHANGES[c] for c in wanted if c in _CHANGES}
    out: dict[str, Prediction | None] = dict.fromkeys(wanted)
    if not changes:
        return out
    cal = calibrate(run_dir)
    baseline = predict(cal).throughput
    for cause, change in changes.items():
        made = change(cal, Path(run_dir))
        if made is not None:
            what, throughput = made
            out[cause] = Prediction(what, throughput, baseline)
    return out


def _staleness(cal: Calibration, run_dir: Path) -> tuple[str, float]:
    run = cal.run
    target = None if run.target is None else run.target + 1
    change = f"rollout.staleness={run.staleness + 1}"
    if target is not None:
        change += f" rollout.deadline.target={target}"
    result = predict(cal, policy=run.policy, staleness=run.staleness + 1, target=target)
    return change, result.throughput


def _instant_rewards(cal: Calibration, run_dir: Path) -> tuple[str, float]:
    instant = tuple(1e-6 for _ in cal.reward_latencies)
    result = predict(dataclasses.replace(cal, reward_latencies=instant))
    return "rewards that take no time (the most any reward setting gains)", result.throughput


def _with(cal: Calibration, **parts: Any) -> Calibration:
    return dataclasses.replace(cal, workload=dataclasses.replace(cal.workload, **parts))


def _more_engines(cal: Calibration, run_dir: Path) -> tuple[str, float]:
    engine = cal.workload.engine
    more = _with(cal, engine=dataclasses.replace(engine, replicas=2 * engine.replicas))
    return f"engine.replicas={2 * engine.replicas}", predict(more).throughput


def _instant_publication(cal: Calibration, run_dir: Path) -> tuple[str, float]:
    trainer = dataclasses.replace(cal.workload.trainer, publish=0.0, publish_per_start=0.0)
    return (
        "publications that take no time (the most any engine.weight_transfer gains)",
        predict(_with(cal, trainer=trainer)).throughput,
    )


def _own_core(cal: Calibration, run_dir: Path) -> tuple[str, float] | None:
    rows = load_run(run_dir).steps[1:]  # the first step's training is the calibration's too
    pairs = [
        (float(c), float(w))
        for c, w in ((r.get("step_cpu_s"), r.get("step_time_s")) for r in rows)
        if isinstance(c, int | float) and isinstance(w, int | float) and math.isfinite(c) and w
    ]
    if not pairs:
        return None  # the run did not measure its training thread's CPU time
    cpu, wall = (statistics.fmean(x) for x in zip(*pairs, strict=True))
    ratio = min(1.0, cpu / wall)
    t = cal.workload.trainer
    trainer = dataclasses.replace(
        t, step_time=t.step_time * ratio, per_token=t.per_token * ratio, contention=0.0
    )
    return (
        f"a trainer on a core of its own (training at {ratio:.0%} of its time)",
        predict(_with(cal, trainer=trainer)).throughput,
    )


_CHANGES: dict[str, Callable[[Calibration, Path], tuple[str, float] | None]] = {
    "admission bound": _staleness,
    "reward wait": _instant_rewards,
    "generation": _more_engines,
    "publication": _instant_publication,
    "CPU contention": _own_core,
}

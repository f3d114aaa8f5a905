"""A simulated run written as a run directory: ``metrics.jsonl`` and ``trace.jsonl`` in the
formats ``stalebound train`` writes, so ``stalebound doctor`` reads a simulated run as it reads a
real one (one cause injected into the workload at a time, on a clock free of the machine's load).
"""

from __future__ import annotations

import json
from pathlib import Path

from stalebound.core.errors import ConfigError
from stalebound.obs.trace import TRACE_FILE, TraceHeader, TraceRecorder
from stalebound.sim.config import WorkloadConfig
from stalebound.sim.results import SimResult
from stalebound.sim.simulator import Simulation

__all__ = ["write_run_dir"]


def write_run_dir(
    cfg: WorkloadConfig,
    policy: str,
    staleness: int,
    run_dir: str | Path,
    *,
    target: int | None = None,
    seed: int = 0,
    steps: int | None = None,
) -> SimResult:
    """Simulate ``cfg`` and write ``run_dir``: each step's timing as a real run's
    ``metrics.jsonl`` holds it (``step_cpu_s`` is the training's uncontended seconds) and every
    episode in ``trace.jsonl``. ``ConfigError`` when ``run_dir`` exists."""
    folder = Path(run_dir)
    if folder.exists():
        raise ConfigError(f"run_dir={str(folder)!r}: exists; give a new directory")
    folder.mkdir(parents=True)
    header = TraceHeader(source="simulator", group_size=cfg.batch.group_size)
    with TraceRecorder(folder / TRACE_FILE, header) as recorder:
        sim = Simulation(
            cfg, policy, staleness, target=target, seed=seed, steps=steps, recorder=recorder
        )
        result = sim.run()
    batch = cfg.batch.groups * cfg.batch.group_size
    with (folder / "metrics.jsonl").open("w", encoding="utf-8") as out:
        for number, s in enumerate(sim.trainer.log, start=1):
            row = {
                "step": number,
                "version": number,
                "wall_time": s.end,
                "timestamp": 0.0,
                "num_trajectories": batch,
                "wait_start_s": s.asked,
                "wait_s": s.start - s.asked,
                "step_and_publish_s": s.end - s.start,
                "publish_s": s.end - s.trained,
                "step_time_s": s.trained - s.start,
                "step_cpu_s": s.work,
                "checkpoint_s": 0.0,
            }
            out.write(json.dumps(row) + "\n")
    return result

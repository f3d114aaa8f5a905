"""Record the run the calibration tests calibrate: tests/data/calibration-run/.

It trains the embedded default for 20 steps (the settings below) and keeps what calibration
reads: config.yaml, trace.jsonl, staleness.jsonl, the engine's step log (engine-steps/), and
metrics.jsonl with only the fields calibration and its measurement read. The tests then fit and predict from these files, so their
result does not depend on the load of the machine they run on. Re-record after a change to what a
run writes or to what calibration reads:

    .venv/bin/python scripts/record_calibration_run.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalebound.cli import main

TARGET = Path(__file__).resolve().parent.parent / "tests" / "data" / "calibration-run"
SETTINGS = [
    "run.steps=20",
    "run.live=false",
    "run.eval_prompts=20",
    "run.checkpoint=false",
    "run.plots=false",
    "run.tensorboard=false",
    "train.warm_start_steps=10",
]
METRICS = (
    "step",
    "version",
    "wall_time",
    "engine_idle_fraction",
    "failed_members",
    "num_trained_tokens",
    "num_trajectories",
    "step_and_publish_s",
    "step_time_s",
    "trainer_idle_fraction",
    "trajectories_per_s",
    "wait_s",
)
"""The fields of metrics.jsonl that stalebound.sim.calibrate reads."""


EPISODE = ("type", "prompt_id", "start", "end", "tokens", "reward_latency")
"""The fields of a trace's episode that calibration reads (and the reader needs), beside
``tool_latencies``, ``complete`` and ``failed``, kept where they are not their defaults."""


def _keep(record: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: record[k] for k in keys if k in record}


def _episode(record: dict[str, Any]) -> dict[str, Any]:
    if record.get("type") != "trajectory":
        return record  # the header
    kept = _keep(record, EPISODE)
    for key, default in (("tool_latencies", []), ("complete", True), ("failed", False)):
        if record.get(key, default) != default:
            kept[key] = record[key]
    return kept


def _trimmed(src: Path, dst: Path, keep: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    with src.open() as lines, dst.open("w") as out:
        for line in lines:
            out.write(json.dumps(keep(json.loads(line)), separators=(",", ":")) + "\n")


def record() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        code = main(["train", f"run.run_dir={run}", f"engine.cache_dir={tmp}/models", *SETTINGS])
        if code:
            return code
        shutil.rmtree(TARGET, ignore_errors=True)
        TARGET.mkdir(parents=True)
        for name in ("config.yaml", "staleness.jsonl"):
            shutil.copy(run / name, TARGET / name)
        _trimmed(run / "metrics.jsonl", TARGET / "metrics.jsonl", lambda r: _keep(r, METRICS))
        _trimmed(run / "trace.jsonl", TARGET / "trace.jsonl", _episode)
        shutil.copytree(run / "engine-steps", TARGET / "engine-steps")
    print(f"recorded {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(record())

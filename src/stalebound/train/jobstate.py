"""What a checkpoint carries of the job itself: its running totals (:class:`Progress`), read back
field by field (:class:`SavedJob`), and the settings a resumed run must share with the run that
wrote it (:func:`resume_settings`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalebound.config import StaleboundConfig
from stalebound.train.checkpoint import JOB_STATE, Checkpoint

__all__ = ["Progress", "SavedJob", "resume_settings"]


# Settings a resumed run must share with the run that wrote the checkpoint: the executor's state
# and the data order depend on them.
_RESUME_KEYS = (
    "seed",
    "task",
    "data",
    "rollout.staleness_policy",
    "rollout.staleness",
    "rollout.consumer_batch_size",
    "rollout.max_concurrent_rollouts",
    "rollout.group_size",
    "rollout.buffer_size",
    "rollout.group_redundancy",
    "rollout.reject_stale_results",
)


def resume_settings(cfg: StaleboundConfig) -> dict[str, Any]:
    """The settings of ``cfg`` a checkpoint records, as the checkpoint holds them (JSON)."""
    out: dict[str, Any] = {}
    for key in _RESUME_KEYS:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        out[key] = value
    stored: dict[str, Any] = json.loads(json.dumps(out))  # as a checkpoint holds it (lists)
    return stored


@dataclass
class Progress:
    """The job's running totals, kept in every checkpoint so a resumed run continues them."""

    step: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)
    trained: int = 0
    waited: float = 0.0
    max_stale: int = 0
    violations: int = 0
    time_to_target: float | None = None
    wall: float = 0.0
    """RL-phase seconds spent before this process (the time series continues across resumes)."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _counter(value: Any) -> bool:
    return type(value) is int and value >= 0


_PROGRESS_FIELDS: dict[str, Callable[[Any], bool]] = {
    "step": _counter,
    "rewards": lambda v: isinstance(v, list) and all(_number(x) for x in v),
    "trained": _counter,
    "waited": _number,
    "max_stale": _counter,
    "violations": _counter,
    "time_to_target": lambda v: v is None or _number(v),
    "wall": _number,
}


@dataclass(frozen=True)
class SavedJob:
    """A checkpoint's ``job_state.json``, checked field by field."""

    progress: Progress
    eval_before: float
    warm_start_s: float
    settings: dict[str, Any]

    @classmethod
    def read(cls, checkpoint: Checkpoint) -> SavedJob:
        state = checkpoint.job_state()
        progress: Any = state.get("progress")
        problems = [
            f"{k}={state.get(k)!r}"
            for k in ("eval_before", "warm_start_s")
            if not _number(state.get(k))
        ]
        if not isinstance(state.get("settings"), dict):
            problems.append("settings missing")
        if not isinstance(progress, dict) or set(progress) != set(_PROGRESS_FIELDS):
            problems.append(f"progress has fields {sorted(progress or ())!r}")
        else:
            problems += [
                f"progress.{k}={progress[k]!r}"
                for k, ok in _PROGRESS_FIELDS.items()
                if not ok(progress[k])
            ]
            if not problems and progress["step"] != checkpoint.step:
                problems.append(
                    f"progress.step={progress['step']} but the checkpoint's is {checkpoint.step}"
                )
        if problems:
            raise checkpoint.unusable(JOB_STATE, f"not a job state ({'; '.join(problems)})")
        return cls(
            Progress(**progress),
            float(state["eval_before"]),
            float(state["warm_start_s"]),
            state["settings"],
        )

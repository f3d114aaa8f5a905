"""The main job: ``stalebound train`` — asynchronous GRPO on the embedded default, end to end.

:func:`run_training` runs :class:`~stalebound.train.recipe.TrainRecipe`, whose methods read top
to bottom:

1. ``setup``: checks the checkpoint to resume, the task and the paths before writing anything,
   takes the run directory, builds (or reuses) the policy and warm-starts it on the task's
   reference answers (so RL starts from a non-zero reward), starts the engines and the executor
   (the staleness policy of ``rollout.staleness_policy``) and the trainer;
2. ``load_checkpoint``: when resuming, the executor's groups, the optimizer and the job's totals;
3. ``train``: take the next consumed batch, train one step, publish the weights (version + 1) to
   the engines, log, draw, ``save_checkpoint`` when due; then evaluate and write the summary;
4. ``cleanup``: stop the engines, close the files, release the run directory.

This module holds what the recipe is made of: the episode workflow, the engine busy meter, the
job state a checkpoint carries, and the job's errors.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from stalebound.config import StaleboundConfig
from stalebound.core import StaleboundError, StalenessPolicy
from stalebound.core.policy import BufferBacked
from stalebound.engines.protocol import GenerateRequest, GenerateResponse, SamplingParams
from stalebound.obs.records import BufferRow, buffer_rows

if TYPE_CHECKING:
    from stalebound.runtime.executor import ExecutorStatistics

_log = logging.getLogger(__name__)

__all__ = [
    "EngineEpisode",
    "RunDirectoryError",
    "TrainResult",
    "TrainingFailed",
    "TrainingInterrupted",
    "run_training",
]


@dataclass(frozen=True)
class TrainResult:
    """What a run measured; ``run_training`` also writes it to ``RUN_DIR/summary.json``."""

    run_dir: str
    steps: int
    staleness: int
    policy: str
    eval_before: float
    """Greedy accuracy on the evaluation prompts after warm start, before RL."""
    eval_after: float
    """Greedy accuracy after RL."""
    reward_first: float
    """Mean training reward of the first 5 steps."""
    reward_last: float
    """Mean training reward of the last 5 steps."""
    max_staleness: int
    """The largest staleness of any trained token's trajectory (≤ η under the buffer policy)."""
    violations: int
    """Trained groups staler than η, as the staleness policy counts them (always 0 under the
    buffer policy)."""
    wall_s: float
    """Wall time of the RL phase (engines started to last step)."""
    trajectories_per_s: float
    trainer_idle_fraction: float
    engine_idle_fraction: float
    time_to_target_s: float | None
    warm_start_s: float


class EngineEpisode:
    """The executor's workflow: one episode of a task over an engine (``arun_episode``).

    Each model turn is one engine request, ids ``ep<N>/<turn>``, prioritised by the engine
    version at the start of the episode (older trajectories are served first by the router).
    """

    def __init__(
        self, task: Any, tokenizer: Any, sampling: SamplingParams, recorder: Any = None
    ) -> None:
        self._workflow = task.workflow(tokenizer)
        self._sampling = sampling
        self._ids = itertools.count()
        self._recorder = recorder
        self._built = time.monotonic()
        self._origin: float | None = None
        """The monotonic time the trace's ``start`` and ``end`` count from (:meth:`set_origin`);
        until it is set, finished episodes wait in ``_pending``, counted from 0."""
        self._pending: list[Any] = []
        self._trace_lock = threading.Lock()  # episodes end on the executor's loop thread

    def set_origin(self, origin: float) -> None:
        """Count the trace from the monotonic time ``origin``: the run's clock, which its step
        metrics' ``wall_time`` also counts from. Episodes that ended before (a resumed run's
        groups start again while it sets up) are written now; times before the clock started
        count as its start, so a resumed run's trace begins where its checkpoint left off."""
        with self._trace_lock:
            self._origin = origin
            pending, self._pending = self._pending, []
            for record in pending:
                self._write(record)

    def close_trace(self) -> None:
        """Write what still waits for the run's clock (a run that never trained counts from its
        setup) and close the trace."""
        if self._recorder is None:
            return
        if self._origin is None:
            self.set_origin(self._built)
        self._recorder.close()

    def _write(self, record: Any) -> None:
        """Write ``record`` (times counted from 0) on the trace's clock; hold the lock."""
        assert self._origin is not None and self._recorder is not None
        origin = self._origin
        start, end = (max(0.0, t - origin) for t in (record.start, record.end))
        self._recorder.record(dataclasses.replace(record, start=start, end=end))

    async def arun_episode(self, engine: Any, sample: Any) -> Any:
        number = next(self._ids)
        episode = f"ep{number}"
        turns = itertools.count()
        version = engine.get_version()
        started = time.monotonic()
        generated = [0]
        finish = ["stop"]
        # time outside the engine: between two turns (tool calls) and after the last (the reward)
        tools: list[float] = []
        returned: list[float] = []

        async def generate(
            input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]
        ) -> GenerateResponse:
            if returned:
                tools.append(time.monotonic() - returned[0])
            sampling = dataclasses.replace(
                self._sampling, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids)
            )
            request = GenerateRequest(
                f"{episode}/{next(turns)}", tuple(input_ids), sampling, priority_version=version
            )
            response: GenerateResponse = await engine.agenerate(request)
            generated[0] += response.num_output_tokens
            finish[0] = response.finish_reason
            returned[:] = [time.monotonic()]
            return response

        trajectory = await self._workflow.run(generate, sample)
        if self._recorder is not None:  # what `stalebound simulate --replay` re-times
            from stalebound.obs.trace import TrajectoryRecord

            ended = time.monotonic()
            record = TrajectoryRecord(
                prompt_id=sample.id,
                group_id=number,
                member=0,
                start=started,
                end=ended,
                tokens=generated[0],
                tool_latencies=tuple(tools),
                version=version,
                complete=finish[0] != "abort",
                reward_latency=ended - returned[0] if returned else 0.0,
            )
            with self._trace_lock:
                if self._origin is None:
                    self._pending.append(record)
                else:
                    self._write(record)
        return trajectory


class BusyMeter:
    """Wraps an engine and measures the fraction of wall time it had no request to work on."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._in_flight = 0
        self._idle_since: float | None = time.monotonic()
        self._idle = 0.0
        self._start = time.monotonic()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        with self._lock:
            if self._in_flight == 0 and self._idle_since is not None:
                self._idle += time.monotonic() - self._idle_since
                self._idle_since = None
            self._in_flight += 1
        try:
            response: GenerateResponse = await self._engine.agenerate(request)
            return response
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle_since = time.monotonic()

    def reset(self) -> None:
        with self._lock:
            now = time.monotonic()
            self._start = now
            self._idle = 0.0
            self._idle_since = now if self._in_flight == 0 else None

    def idle_fraction(self) -> float:
        with self._lock:
            now = time.monotonic()
            idle = self._idle + (now - self._idle_since if self._idle_since is not None else 0.0)
            total = now - self._start
        return idle / total if total > 0 else 0.0


def base_model_dir(cfg: StaleboundConfig) -> Path:
    """The checkpoint a new run starts from: ``engine.model_path``, or the default tiny model
    (built once into ``engine.cache_dir``)."""
    from stalebound.engines.models import build_default_model

    if cfg.engine.model_path:
        return Path(cfg.engine.model_path)
    return build_default_model(Path(cfg.engine.cache_dir) / f"default-seed{cfg.seed}")


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S-%f")


def executor_metrics(es: ExecutorStatistics) -> dict[str, float]:
    """The executor's counters a training step logs (typed fields, not getattr: a misspelt
    counter fails the type check instead of logging a silent zero)."""
    return {
        "filtered_groups": float(es.filtered_groups),
        "failed_groups": float(es.failed_groups),
        "failed_members": float(sum(es.member_failures.values())),
        "timed_out_members": float(es.member_failures.get("timeout", 0)),
        "retried_groups": float(es.retried_groups),
        "truncated_groups": float(es.truncated_groups),
        "truncated_trajectories": float(es.truncated_trajectories),
        "dropped_groups": float(es.dropped_groups),
        "surplus_groups": float(es.surplus_groups),
        "resumed_groups": float(es.resumed_groups),
        "aborted_tokens": float(sum(es.aborted_tokens.values())),
        "discarded_members": float(sum(es.discarded_members.values())),
        "deadline_groups": float(es.deadline_groups),
        "overdue_groups": float(es.overdue_groups),
        "stuck_seconds": es.stuck_seconds,
    }


def head_rows(policy: StalenessPolicy) -> tuple[int, list[BufferRow]]:
    if isinstance(policy, BufferBacked):  # the buffer and the deadline policies
        return policy.version, buffer_rows(policy.buffer)
    return policy.version, []


# Settings a resumed run must share with the run that wrote the checkpoint: the executor's state
# and the data order depend on them.
_RESUME_KEYS = (
    "seed",
    "task",
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


def _continue_hint(run_dir: Path, checkpoint: Path | None) -> str:
    if checkpoint is None:
        return (
            "no checkpoint was written yet, so start it again from the beginning with: "
            f"stalebound train resume={run_dir}"
        )
    return f"continue from {checkpoint} with: stalebound train resume={run_dir}"


class RunDirectoryError(StaleboundError, OSError):
    """The run directory could not be written (a full disk, say); the message names the last
    checkpoint to continue from."""


class TrainingFailed(StaleboundError, RuntimeError):
    """The run stopped on an error; the message ends with the checkpoint to continue from."""


class TrainingInterrupted(StaleboundError, RuntimeError):
    """SIGTERM or SIGINT stopped the run: after a step, with a checkpoint of that step, or — a
    second signal — at once (``at_once``), the newest checkpoint being the one to continue from."""

    def __init__(
        self,
        signum: int,
        step: int,
        run_dir: Path,
        checkpoint: Path | None,
        *,
        at_once: bool = False,
    ) -> None:
        self.signum = signum
        self.step = step
        self.run_dir = run_dir
        self.checkpoint = checkpoint
        self.at_once = at_once
        name = signal.Signals(signum).name
        how = "stopped at once" if at_once else "stopped"
        super().__init__(
            f"{name} received: {how} after step {step}; {_continue_hint(run_dir, checkpoint)}"
        )


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
    def read(cls, checkpoint: Any) -> SavedJob:
        from stalebound.train.checkpoint import JOB_STATE

        state = checkpoint.job_state()
        progress = state.get("progress")
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


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: stop at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received twice")
        self.signum = signum


class StopRequest:
    """The first SIGTERM/SIGINT asks the job to stop after the current step (with a
    checkpoint); a second one interrupts at once (:class:`StopNow`)."""

    def __init__(self, console: Console) -> None:
        self.signum: int | None = None
        self._console = console
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise StopNow(signum)
        self.signum = signum
        self._console.print(
            f"[yellow]{signal.Signals(signum).name}: stopping after this step, with a "
            "checkpoint (send it again to stop at once)[/]"
        )


@dataclass
class Where:
    """How far the run got: the last step trained and the newest checkpoint written (what a
    message about an interruption or a failure names)."""

    run_dir: Path
    step: int = 0
    checkpoint: Path | None = None

    def hint(self) -> str:
        return _continue_hint(self.run_dir, self.checkpoint)


def engine_death(engines: Sequence[Any]) -> str | None:
    """Why an engine of the job died (``None`` when none did): the cause the user needs, not
    the library's advice on the engine object."""
    for engine in engines:
        reason = getattr(engine, "death", None)
        if reason:
            return str(reason)
    return None


def clear_unfinished_start(run_dir: Path) -> None:
    """Files of a run that stopped before its first checkpoint that starting it again does not
    rewrite itself (the metrics and the ledger are cut back to nothing when they are opened)."""
    from stalebound.obs.trace import TRACE_FILE, run_traces

    for _, path in run_traces(run_dir):
        if path.name != TRACE_FILE:  # the first trace is written again from the start
            path.unlink(missing_ok=True)


def run_training(cfg: StaleboundConfig, *, console: Console | None = None) -> TrainResult:
    """Run the main job on ``cfg``: :class:`TrainRecipe` from setup to cleanup.

    ``cfg.run.resume`` continues a run from a checkpoint (a run directory means its newest), or
    starts again from the beginning a run that stopped before its first checkpoint. Resuming from
    a checkpoint older than the run's newest makes it the newest: the later ones move to
    ``RUN_DIR/abandoned/`` and the records are cut back to its step. One process at a time runs
    in a run directory (:class:`~stalebound.train.runlock.RunLock`)."""
    from stalebound.train.recipe import TrainRecipe

    return TrainRecipe(cfg, console=console).run()

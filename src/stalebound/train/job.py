"""The main job: ``stalebound train`` — asynchronous GRPO on the embedded default, end to end.

Top to bottom, :func:`run_training`:

1. builds (or reuses) the policy checkpoint and loads it for the trainer;
2. warm-starts it on the task's reference answers, so RL starts from a non-zero reward;
3. starts the engine replicas (worker processes) from the warm-started weights;
4. runs the executor (the staleness policy of ``rollout.staleness_policy``) over the task's prompts;
5. loops: take the next consumed batch, train one step, publish the weights (version + 1) to the
   engines, log, draw;
6. evaluates before and after, writes the run directory (config, metrics, TensorBoard, plots,
   checkpoint) and returns a :class:`TrainResult`.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from stalebound.config import StaleboundConfig, dump_yaml
from stalebound.core import BufferPolicy, ConfigError, StaleboundError, StalenessPolicy
from stalebound.engines.protocol import GenerateRequest, GenerateResponse, SamplingParams
from stalebound.obs.records import BufferRow, buffer_rows

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
    """Trained trajectories staler than η."""
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
        self._t0 = time.monotonic()

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
            self._recorder.record(
                TrajectoryRecord(
                    prompt_id=sample.id,
                    group_id=number,
                    member=0,
                    start=started - self._t0,
                    end=ended - self._t0,
                    tokens=generated[0],
                    tool_latencies=tuple(tools),
                    version=version,
                    complete=finish[0] != "abort",
                    reward_latency=ended - returned[0] if returned else 0.0,
                )
            )
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


def _make_http_engines(cfg: StaleboundConfig) -> list[Any]:
    """One client per server URL (``engine.kind`` vllm or sglang); started on the executor's loop."""
    from stalebound.engines.vllm import SGLangEngine, VLLMEngine

    e = cfg.engine
    if e.kind == "sglang":
        return [SGLangEngine(url, seed=cfg.seed + i) for i, url in enumerate(e.urls)]
    continue_ = e.interrupt_mode == "continue"
    return [
        VLLMEngine(
            url,
            api="generate" if continue_ else "completions",
            interrupt_mode=e.interrupt_mode,
            seed=cfg.seed + i,
            weight_transfer=e.weight_transfer,
        )
        for i, url in enumerate(e.urls)
    ]


def _make_engine(
    cfg: StaleboundConfig, model_dir: Path, version: int
) -> tuple[Any, Callable[[], None], list[Any]]:
    """The engine the workflows use, how to close it, and the local engines behind it (their
    ``death`` says why one died); local and Ray engines (HTTP ones: see above)."""
    e = cfg.engine
    if cfg.backend == "ray":
        from stalebound.distributed import make_ray_engine

        router = make_ray_engine(cfg, model_path=str(model_dir), version=version)
        return router, router.close, []
    from stalebound.engines.local import LocalEngine
    from stalebound.engines.router import Router

    engines: list[LocalEngine] = []

    def close() -> None:
        for engine in engines:
            engine.close()

    try:
        for i in range(e.replicas):
            engines.append(
                LocalEngine(
                    model_dir,
                    version=version,
                    seed=cfg.seed + i,
                    max_batch_size=e.max_batch_size,
                    interrupt_mode=e.interrupt_mode,
                    num_threads=e.num_threads,
                    name=f"local{i}",
                    device=e.device,
                    dtype=e.dtype,
                )
            )
        for engine in engines:
            engine.wait_ready(timeout=300)
    except BaseException:  # one failed to start (or a second Ctrl-C): stop those that did
        close()
        raise
    if len(engines) == 1:
        return engines[0], close, list(engines)
    spread = Router(engines, max_in_flight_per_engine=e.max_in_flight_per_engine)
    return spread, close, list(engines)


def _base_model_dir(cfg: StaleboundConfig) -> Path:
    """The checkpoint a new run starts from: ``engine.model_path``, or the default tiny model
    (built once into ``engine.cache_dir``)."""
    from stalebound.engines.models import build_default_model

    if cfg.engine.model_path:
        return Path(cfg.engine.model_path)
    return build_default_model(Path(cfg.engine.cache_dir) / f"default-seed{cfg.seed}")


def _default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S-%f")


def _head_rows(policy: StalenessPolicy) -> tuple[int, list[BufferRow]]:
    if isinstance(policy, BufferPolicy):
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


def _resume_settings(cfg: StaleboundConfig) -> dict[str, Any]:
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
class _Progress:
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
class _SavedJob:
    """A checkpoint's ``job_state.json``, checked field by field."""

    progress: _Progress
    eval_before: float
    warm_start_s: float
    settings: dict[str, Any]

    @classmethod
    def read(cls, checkpoint: Any) -> _SavedJob:
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
            _Progress(**progress),
            float(state["eval_before"]),
            float(state["warm_start_s"]),
            state["settings"],
        )


class _StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: stop at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received twice")
        self.signum = signum


class _StopRequest:
    """The first SIGTERM/SIGINT asks the job to stop after the current step (with a
    checkpoint); a second one interrupts at once (:class:`_StopNow`)."""

    def __init__(self, console: Console) -> None:
        self.signum: int | None = None
        self._console = console
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
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
            raise _StopNow(signum)
        self.signum = signum
        self._console.print(
            f"[yellow]{signal.Signals(signum).name}: stopping after this step, with a "
            "checkpoint (send it again to stop at once)[/]"
        )


@dataclass
class _Where:
    """How far the run got: the last step trained and the newest checkpoint written (what a
    message about an interruption or a failure names)."""

    run_dir: Path
    step: int = 0
    checkpoint: Path | None = None

    def hint(self) -> str:
        return _continue_hint(self.run_dir, self.checkpoint)


def _engine_death(engines: Sequence[Any]) -> str | None:
    """Why an engine of the job died (``None`` when none did): the cause the user needs, not
    the library's advice on the engine object."""
    for engine in engines:
        reason = getattr(engine, "death", None)
        if reason:
            return str(reason)
    return None


def _clear_unfinished_start(run_dir: Path) -> None:
    """Files of a run that stopped before its first checkpoint that starting it again does not
    rewrite itself (the metrics and the ledger are cut back to nothing when they are opened)."""
    for path in run_dir.glob("trace-from-step-*.jsonl"):
        path.unlink(missing_ok=True)


def run_training(cfg: StaleboundConfig, *, console: Console | None = None) -> TrainResult:
    """Run the main job on ``cfg``; see the module docstring.

    ``cfg.run.resume`` continues a run from a checkpoint (a run directory means its newest), or
    starts again from the beginning a run that stopped before its first checkpoint. Resuming from
    a checkpoint older than the run's newest makes it the newest: the later ones move to
    ``RUN_DIR/abandoned/`` and the records are cut back to its step. One process at a time runs
    in a run directory (:class:`~stalebound.train.runlock.RunLock`)."""
    from stalebound.engines.models import checkpoint_info, load_tokenizer
    from stalebound.tasks import make_task
    from stalebound.tasks.workflow import context_problems
    from stalebound.train.checkpoint import (
        abandon_after,
        atomic_write_text,
        find_checkpoint,
        run_dir_of,
    )
    from stalebound.train.runlock import RunLock
    from stalebound.userfiles import check_run_paths

    console = console or Console()
    # A resumed run checks its checkpoint (every file's checksum) before it starts anything.
    resume = find_checkpoint(cfg.run.resume) if cfg.run.resume else None
    restart = bool(cfg.run.resume) and resume is None
    saved = _SavedJob.read(resume) if resume is not None else None
    if restart:
        gone = run_dir_of(cfg.run.resume or "")
        if not (gone / "config.yaml").is_file():
            raise ConfigError(
                f"resume={cfg.run.resume!r}: neither a checkpoint nor the directory of a run; "
                "give a run directory written by stalebound train, or one of its checkpoints"
            )
        if (gone / "summary.json").is_file():  # starting it again would throw its results away
            raise ConfigError(
                f"resume={cfg.run.resume!r}: the run finished without a checkpoint "
                "(run.checkpoint=false), so there is nothing to continue from; start a new run "
                "in another directory"
            )
    if resume is not None and saved is not None:
        now = _resume_settings(cfg)
        changed = [
            f"{k}: {saved.settings.get(k)!r} → {now[k]!r}"
            for k in now
            if saved.settings.get(k) != now[k]
        ]
        if changed:
            raise ConfigError(
                f"resume={cfg.run.resume!r}: the checkpoint was written with other settings "
                f"({'; '.join(changed)}); resume with the run's own settings (its config.yaml) "
                "or start a new run"
            )
        if cfg.run.steps < resume.step:
            raise ConfigError(
                f"run.steps={cfg.run.steps}: the run is already at step {resume.step} "
                f"({resume.path}); give run.steps={resume.step} or more to continue it, or "
                "resume from an earlier checkpoint"
            )
    if cfg.run.run_dir:
        run_dir = Path(cfg.run.run_dir)
    elif cfg.run.resume:
        run_dir = run_dir_of(resume.path if resume is not None else cfg.run.resume)
    else:
        run_dir = _default_run_dir()
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
    # the task's own checks (and its prompt file) before the run directory is touched
    task = make_task(cfg.task)
    samples = list(task.samples())
    check_run_paths(cfg, run_dir, resuming=resume is not None)  # the paths it names, before writing
    # the checkpoint's own limits (context length, chat template) against the task's prompts
    base_dir = resume.path if resume is not None else _base_model_dir(cfg)
    too_long = context_problems(
        task, load_tokenizer(base_dir), samples, checkpoint_info(base_dir).max_positions
    )
    if too_long:
        raise ConfigError(too_long)
    lock = RunLock(run_dir)
    try:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            if resume is None and not restart:  # a run directory is never overwritten
                _refuse_a_held_run_dir(run_dir)
            moved = abandon_after(run_dir, resume) if resume is not None else []
            if moved and resume is not None:
                console.print(
                    f"{resume.path.name} is older than the run's newest checkpoint: the later "
                    f"{', '.join(p.name for p in moved)} moved to {moved[0].parent}, and the "
                    f"records are cut back to step {resume.step}"
                )
            if restart:
                console.print(
                    f"{run_dir}: no checkpoint yet (the run stopped before its first one); "
                    "starting it again from the beginning, warm start included"
                )
                _clear_unfinished_start(run_dir)
            atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
        except OSError as exc:
            raise ConfigError(
                f"run.run_dir={str(run_dir)!r}: cannot write there ({exc.strerror or exc}); "
                "choose a writable directory with free space"
            ) from exc
        where = _Where(run_dir)
        if resume is not None:
            where = _Where(run_dir, resume.step, resume.path)
        try:
            return _train(cfg, console, task, samples, resume, saved, restart, where)
        except KeyboardInterrupt as exc:  # a second signal, or one before the job could listen
            signum = exc.signum if isinstance(exc, _StopNow) else signal.SIGINT
            raise TrainingInterrupted(
                signum, where.step, run_dir, where.checkpoint, at_once=True
            ) from None
    finally:
        lock.release()


def _refuse_a_held_run_dir(run_dir: Path) -> None:
    from stalebound.train.checkpoint import CHECKPOINTS, checkpoint_dirs

    held = [n for n in ("metrics.jsonl", "ledger.jsonl", CHECKPOINTS) if (run_dir / n).exists()]
    if not held:
        return
    if checkpoint_dirs(run_dir / CHECKPOINTS):
        raise ConfigError(
            f"run.run_dir={str(run_dir)!r}: already holds a run ({', '.join(held)}); continue "
            f"it with resume={run_dir}, or choose a new directory"
        )
    raise ConfigError(
        f"run.run_dir={str(run_dir)!r}: already holds a run that stopped before its first "
        f"checkpoint ({', '.join(held)}); start it again from the beginning with "
        f"resume={run_dir}, or choose a new directory"
    )


def _train(
    cfg: StaleboundConfig,
    console: Console,
    task: Any,
    samples: list[Any],
    resume: Any,
    saved: _SavedJob | None,
    restart: bool,
    where: _Where,
) -> TrainResult:
    """The job itself, once the run directory is locked and its config written."""
    import torch
    import transformers

    from stalebound.engines.devices import resolve_device
    from stalebound.engines.models import load_model, load_tokenizer
    from stalebound.obs.live import LiveView, summary_table
    from stalebound.obs.metrics import RunLogger
    from stalebound.runtime import WorkflowExecutor
    from stalebound.train.checkpoint import (
        ROLLOUT_STATE,
        TRAINER_STATE,
        CheckpointError,
        CheckpointWriteError,
        atomic_write_text,
        write_checkpoint,
    )
    from stalebound.train.ledger import ItemLedger
    from stalebound.train.rollout import evaluate
    from stalebound.train.trainer import Trainer
    from stalebound.train.warmstart import warm_start

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    run_dir = where.run_dir
    train_device = resolve_device(cfg.train.device)
    threads = cfg.train.num_threads or 1
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    stop = _StopRequest(console)
    stop.__enter__()  # from here on a signal stops the job after its current step
    # what to stop whatever happens, in this order; what to close (the files), and what to close
    # here only when the run fails (otherwise after the final evaluation)
    stopping: list[Callable[[], None]] = []
    closers: list[tuple[str, Callable[[], None]]] = []
    on_failure: list[tuple[str, Callable[[], None]]] = []
    local_engines: list[Any] = []
    failing = True
    try:
        # 1-2. the policy, warm-started (or the checkpoint's)
        rng = random.Random(cfg.seed)
        eval_set = rng.sample(samples, min(cfg.run.eval_prompts, len(samples)))
        order = list(samples)
        rng.shuffle(order)
        progress = _Progress()
        if resume is not None and saved is not None:
            policy_dir = resume.path
            try:
                model = load_model(policy_dir, device=train_device)
                tokenizer = load_tokenizer(policy_dir)
            except (OSError, ValueError, RuntimeError, StaleboundError) as exc:
                raise resume.unusable(
                    "", f"the policy does not load ({type(exc).__name__}: {exc})"
                ) from None
            progress = saved.progress
            eval_before = saved.eval_before
            warm_start_s = saved.warm_start_s
            console.print(
                f"resuming {run_dir} from {resume.path.name}: step {resume.step}, version "
                f"{resume.version}"
            )
        else:
            base_dir = _base_model_dir(cfg)
            model = load_model(base_dir, device=train_device)
            tokenizer = load_tokenizer(base_dir)
            ws = warm_start(
                model,
                tokenizer,
                task,
                cfg.train.warm_start_steps,
                batch_size=cfg.train.warm_start_batch_size,
                lr=cfg.train.warm_start_lr,
                seed=cfg.train.seed,
            )
            eval_before = evaluate(model, tokenizer, task, eval_set)["acc"]
            warm_start_s = ws.seconds
            policy_dir = run_dir / "policy-v0"
            model.save_pretrained(policy_dir)
            tokenizer.save_pretrained(policy_dir)
            console.print(
                f"warm start: {ws.steps} steps in {ws.seconds:.1f}s, loss {ws.first_loss:.3f} → "
                f"{ws.last_loss:.3f}; greedy accuracy {eval_before:.3f}"
            )
        start_version = resume.version if resume is not None else 0

        # 3-4. engines and the executor
        http = cfg.engine.kind != "local"
        clients: list[Any] = []
        if http:
            from stalebound.engines.router import Router

            clients = _make_http_engines(cfg)
            raw_engine: Any = clients[0] if len(clients) == 1 else Router(clients)
        else:
            raw_engine, close_engines, local_engines = _make_engine(cfg, policy_dir, start_version)
            stopping.append(close_engines)
        engine = BusyMeter(raw_engine)
        executor = WorkflowExecutor(cfg.rollout, engine).initialize()
        stopping.insert(0, executor.destroy)  # before the engines close
        if http:
            for client in clients:
                executor.run_coroutine(client.start())

                def close_client(client: Any = client) -> None:
                    executor.run_coroutine(client.aclose())

                stopping.insert(0, close_client)
            # the servers serve engine.model_path; the job's weights replace them
            executor.run_coroutine(engine.update_weights(policy_dir, start_version))
        sampling = SamplingParams(temperature=cfg.engine.temperature, top_p=cfg.engine.top_p)
        recorder = None
        if cfg.run.trace:
            from stalebound.obs.trace import TraceHeader, TraceRecorder

            meta = {"task": cfg.task.name, "staleness": cfg.rollout.staleness}
            header = TraceHeader(source="runtime", group_size=cfg.rollout.group_size, meta=meta)
            name = "trace.jsonl" if resume is None else f"trace-from-step-{resume.step}.jsonl"
            recorder = TraceRecorder(run_dir / name, header)
        workflow = EngineEpisode(task, tokenizer, sampling, recorder)
        if resume is not None:
            rollout_state = resume.rollout_state()
            try:
                executor.load_state_dict(rollout_state, workflow)
            except StaleboundError as exc:
                raise resume.unusable(ROLLOUT_STATE, str(exc)) from None
        trainer: Any
        if cfg.backend == "ray":
            from stalebound.distributed import make_ray_trainer

            pad = tokenizer.pad_token_id
            pad = tokenizer.eos_token_id if pad is None else pad
            trainer = make_ray_trainer(cfg, policy_dir, pad_token_id=pad, version=start_version)
            on_failure.append(("the trainer ranks", trainer.close))
        else:
            trainer = Trainer(model, tokenizer, cfg.train, version=start_version)
        if resume is not None:
            state = resume.trainer_state()
            try:
                if state["optimizer"] is not None:
                    trainer.optimizer.load_state_dict(state["optimizer"])
                torch.set_rng_state(state["rng"]["torch"])
                random.setstate(state["rng"]["python"])
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                raise resume.unusable(
                    TRAINER_STATE, f"does not fit this run ({type(exc).__name__}: {exc})"
                ) from None

        def publish(state_dict: Any, version: int) -> None:
            source: Any = state_dict
            if http and cfg.engine.weight_transfer == "disk":
                # servers reload from a directory: write it atomically, keep the last two
                source = run_dir / "weights" / f"v{version}"
                tmp = source.with_name(source.name + ".tmp")
                model.save_pretrained(tmp)
                os.replace(tmp, source)
                shutil.rmtree(run_dir / "weights" / f"v{version - 2}", ignore_errors=True)
            executor.run_coroutine(engine.update_weights(source, version))
            executor.set_version(version)

        trainer.publish(publish)
        # a run started again from the beginning cuts its records back to nothing
        resume_step = resume.step if resume is not None else (0 if restart else None)
        logger = RunLogger(
            run_dir,
            tensorboard=cfg.run.tensorboard,
            resume=resume_step is not None,
            resume_step=resume_step,
        )
        on_failure.append(("the metrics", logger.close))
        ledger = ItemLedger(run_dir, resume_step=resume_step)
        closers.append(("the item ledger", ledger.close))
        if recorder is not None:
            closers.append(("the episode trace", recorder.close))
        view = LiveView(console, staleness=cfg.rollout.staleness, live=cfg.run.live)
        eta = cfg.rollout.staleness
        stop_sampling = threading.Event()

        # The executor's counters and buffers are sampled here, off the trainer's path: each read
        # is a hop onto the executor's busy loop, which would otherwise delay every step.
        sampled: list[Any] = [executor.statistics(), []]

        def sample_buffers() -> None:
            while not stop_sampling.wait(0.25):
                try:
                    version, rows = executor.inspect_policy(_head_rows)
                    sampled[:] = [executor.statistics(), rows]
                except StaleboundError:  # the executor stopped or is shutting down
                    return
                if rows:
                    try:
                        logger.log_buffers(None, version, rows)
                    except OSError as exc:  # the disk is full: the trainer's next write says so
                        _log.warning("buffer samples stopped: %s", exc)
                        return
                    view.update_buffers(rows, version=version)

        def checkpoint(step: int) -> Path:
            rollout_state = executor.state_dict()  # first: the executor keeps running meanwhile
            if cfg.backend == "ray":  # the ranks hold the trained weights
                model.load_state_dict(dict(trainer.state_dict_for_engines()))
            progress.wall = time.monotonic() - start
            trainer_state = {
                "optimizer": trainer.optimizer.state_dict(),
                "version": trainer.version,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            }
            job_state = {
                "progress": dataclasses.asdict(progress),
                "eval_before": eval_before,
                "warm_start_s": warm_start_s,
                "settings": _resume_settings(cfg),
            }

            def save_model(directory: Path) -> None:
                model.save_pretrained(directory)
                tokenizer.save_pretrained(directory)

            path = write_checkpoint(
                run_dir,
                step,
                trainer.version,
                save_model=save_model,
                trainer_state=trainer_state,
                rollout_state=rollout_state,
                job_state=job_state,
                keep=cfg.run.keep_checkpoints,
            )
            where.checkpoint = path
            return path

        every_steps, every_s = cfg.run.checkpoint_every_steps, cfg.run.checkpoint_every_s
        sampler = threading.Thread(target=sample_buffers, name="stalebound-buffers", daemon=True)
        start = time.monotonic() - progress.wall
        if cfg.run.checkpoint and resume is None:
            # step 0: a run killed before its first periodic checkpoint resumes from here, warm
            # start included, instead of starting again
            checkpoint(0)
        engine.reset()
        start = time.monotonic() - progress.wall
        last_checkpoint = time.monotonic()
        checkpoint_s = 0.0
        if progress.step >= cfg.run.steps:
            console.print(
                f"the run is already at step {progress.step} (run.steps={cfg.run.steps}): nothing "
                "to train; give a larger run.steps to train further"
            )
        stopping[:0] = [stop_sampling.set, view.stop]
        view.start()
        sampler.start()
        for step in range(progress.step + 1, cfg.run.steps + 1):
            if stop.requested():  # it came before this step began
                break
            t0 = time.monotonic()
            batch = executor.prepare_batch(order, workflow)
            progress.waited += time.monotonic() - t0
            groups: dict[int, list[Any]] = {}
            staleness: list[int] = []
            consumed_version = batch[0].consumed_version
            for t in batch:
                traj = t.data
                traj.version = t.version
                groups.setdefault(t.group_id, []).append(traj)
                staleness.append(t.staleness)
            t1 = time.monotonic()
            stats = trainer.step(list(groups.values()), batch_version=consumed_version)
            t2 = time.monotonic()
            progress.step = step
            progress.trained += len(batch)
            progress.max_stale = max(progress.max_stale, *staleness)
            progress.violations += sum(1 for s in staleness if s > eta)
            ledger.record(step, (t.sample_index for t in batch), executor.drain_outcomes())
            elapsed = time.monotonic() - start
            metrics = {k: v for k, v in stats.as_dict().items() if k not in ("version", "step")}
            rewards = progress.rewards
            rewards.append(metrics.get("reward_mean", 0.0))
            recent = rewards[-5:]
            reached = sum(recent) / len(recent) >= cfg.run.target_reward
            if progress.time_to_target is None and reached:
                progress.time_to_target = elapsed
            es, rows = sampled  # at most 0.25 s old
            metrics.update(
                trajectories_per_s=progress.trained / elapsed,
                trainer_idle_fraction=progress.waited / elapsed,
                wait_s=t1 - t0,
                step_and_publish_s=t2 - t1,
                checkpoint_s=checkpoint_s,
                engine_idle_fraction=engine.idle_fraction(),
                # typed fields, not getattr: a misspelt counter must fail the type check,
                # not log a silent zero
                filtered_groups=float(es.filtered_groups),
                failed_groups=float(es.failed_groups),
                failed_members=float(sum(es.member_failures.values())),
                timed_out_members=float(es.member_failures.get("timeout", 0)),
                retried_groups=float(es.retried_groups),
                truncated_groups=float(es.truncated_groups),
                dropped_groups=float(es.dropped_groups),
                surplus_groups=float(es.surplus_groups),
                resumed_groups=float(es.resumed_groups),
                aborted_tokens=float(sum(es.aborted_tokens.values())),
                stuck_seconds=es.stuck_seconds,
            )
            logger.log_step(metrics, version=trainer.version, staleness=staleness)
            where.step = step
            view.update_step(step, trainer.version, metrics, rows=rows or None)
            checkpoint_s = 0.0
            due = (
                step == cfg.run.steps
                or stop.requested()
                or (every_steps and step % every_steps == 0)
                or (every_s and time.monotonic() - last_checkpoint >= every_s)
            )
            if cfg.run.checkpoint and due:
                t3 = time.monotonic()
                written = checkpoint(step)
                last_checkpoint = time.monotonic()
                checkpoint_s = last_checkpoint - t3
                _log.info("checkpoint %s in %.2fs", written, checkpoint_s)
            if stop.requested():
                break
            _log.debug("step %d bookkeeping %.3fs", step, time.monotonic() - t2)
        failing = False
    except OSError as exc:  # the run directory's disk: full, gone read-only, ...
        file = f": {exc.filename}" if exc.filename else ""
        what = (
            f"the disk of the run directory {run_dir} is full ({exc.strerror}{file})"
            if exc.errno == errno.ENOSPC
            else f"writing to the run directory {run_dir} failed ({exc.strerror or exc}{file})"
        )
        raise RunDirectoryError(
            f"{what}; the run stopped after step {where.step}. Free space there, then "
            + where.hint()
        ) from exc
    except CheckpointWriteError as exc:
        raise TrainingFailed(
            f"{exc}; the run stopped after step {where.step}. Free space there, then "
            + where.hint()
        ) from exc
    except CheckpointError:  # the checkpoint resumed from: the message says what to use instead
        raise
    except StaleboundError as exc:  # the engines, the executor
        cause = _engine_death(local_engines) or str(exc)
        raise TrainingFailed(
            f"{cause}\nThe run stopped after step {where.step}; {where.hint()}"
        ) from exc
    finally:
        try:
            for halt in stopping:
                halt()
            for what_closes, close in closers + (on_failure if failing else []):
                try:
                    close()
                except OSError as exc:  # a full disk already reported; the checkpoint counts
                    if not failing:
                        raise
                    _log.debug("closing %s: %s", what_closes, exc)
        finally:
            stop.__exit__(None, None, None)
    if stop.signum is not None:
        logger.close()
        if cfg.backend == "ray":
            trainer.close()
        raise TrainingInterrupted(stop.signum, progress.step, run_dir, where.checkpoint)
    wall = time.monotonic() - start
    if cfg.backend == "ray":
        # the ranks trained the policy: bring it here for the evaluation
        model.load_state_dict(dict(trainer.state_dict_for_engines()))
        trainer.close()
    eval_after = evaluate(model, tokenizer, task, eval_set)["acc"]
    logger.close()
    if cfg.run.plots:
        from stalebound.obs.plots import plot_run

        plot_run(run_dir)
    console.print(summary_table(logger.summary()))
    rewards = progress.rewards
    first, last = rewards[:5], rewards[-5:]
    result = TrainResult(
        run_dir=str(run_dir),
        steps=len(rewards),
        staleness=eta,
        policy=cfg.rollout.staleness_policy,
        eval_before=eval_before,
        eval_after=eval_after,
        reward_first=sum(first) / max(1, len(first)),
        reward_last=sum(last) / max(1, len(last)),
        max_staleness=progress.max_stale,
        violations=progress.violations,
        wall_s=wall,
        trajectories_per_s=progress.trained / wall,
        trainer_idle_fraction=progress.waited / wall,
        engine_idle_fraction=engine.idle_fraction(),
        time_to_target_s=progress.time_to_target,
        warm_start_s=warm_start_s,
    )
    atomic_write_text(run_dir / "summary.json", json.dumps(dataclasses.asdict(result), indent=2))
    console.print(
        f"[bold]reward {result.reward_first:.3f} → {result.reward_last:.3f}[/], greedy accuracy "
        f"{eval_before:.3f} → {eval_after:.3f}; max staleness {progress.max_stale} (η = {eta}), "
        f"{progress.violations} violations; {result.trajectories_per_s:.0f} trajectories/s; "
        f"run directory {run_dir}"
    )
    return result

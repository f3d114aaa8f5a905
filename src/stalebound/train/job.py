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
import itertools
import json
import logging
import os
import random
import shutil
import signal
import sys
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

        async def generate(
            input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]
        ) -> GenerateResponse:
            sampling = dataclasses.replace(
                self._sampling, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids)
            )
            request = GenerateRequest(
                f"{episode}/{next(turns)}", tuple(input_ids), sampling, priority_version=version
            )
            response: GenerateResponse = await engine.agenerate(request)
            generated[0] += response.num_output_tokens
            finish[0] = response.finish_reason
            return response

        trajectory = await self._workflow.run(generate, sample)
        if self._recorder is not None:  # what `stalebound simulate --replay` re-times
            from stalebound.sim.trace import TrajectoryRecord

            self._recorder.record(
                TrajectoryRecord(
                    prompt_id=sample.id,
                    group_id=number,
                    member=0,
                    start=started - self._t0,
                    end=time.monotonic() - self._t0,
                    tokens=generated[0],
                    version=version,
                    complete=finish[0] != "abort",
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
) -> tuple[Any, Callable[[], None]]:
    """The engine the workflows use, and how to close it (local engines only; see above)."""
    e = cfg.engine
    if cfg.backend == "ray":
        from stalebound.distributed import make_ray_engine

        router = make_ray_engine(cfg, model_path=str(model_dir), version=version)
        return router, router.close
    from stalebound.engines.local import LocalEngine
    from stalebound.engines.router import Router

    engines = [
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
        for i in range(e.replicas)
    ]
    for engine in engines:
        engine.wait_ready(timeout=300)

    def close() -> None:
        for engine in engines:
            engine.close()

    if len(engines) == 1:
        return engines[0], close
    return Router(engines, max_in_flight_per_engine=e.max_in_flight_per_engine), close


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
    "rollout.max_head_offpolicyness",
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
        return "no checkpoint was written, so start a new run"
    return f"continue from {checkpoint} with: stalebound train resume={run_dir}"


class RunDirectoryError(StaleboundError, OSError):
    """The run directory could not be written (a full disk, say); the message names the last
    checkpoint to continue from."""


class TrainingFailed(StaleboundError, RuntimeError):
    """The run stopped on an error; the message ends with the checkpoint to continue from."""


class TrainingInterrupted(StaleboundError, RuntimeError):
    """SIGTERM or SIGINT stopped the run after a step; a checkpoint of that step was written."""

    def __init__(self, signum: int, step: int, run_dir: Path, checkpoint: Path | None) -> None:
        self.signum = signum
        self.step = step
        self.run_dir = run_dir
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        super().__init__(
            f"{name} received: stopped after step {step}; {_continue_hint(run_dir, checkpoint)}"
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


class _StopRequest:
    """The first SIGTERM/SIGINT asks the loop to stop after the current step (with a
    checkpoint); a second one interrupts at once."""

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

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received twice")
        self.signum = signum
        self._console.print(
            f"[yellow]{signal.Signals(signum).name}: stopping after this step, with a "
            "checkpoint (send it again to stop at once)[/]"
        )


def run_training(cfg: StaleboundConfig, *, console: Console | None = None) -> TrainResult:
    """Run the main job on ``cfg``; see the module docstring."""
    import torch
    import transformers

    from stalebound.engines.devices import resolve_device
    from stalebound.engines.models import (
        build_default_model,
        checkpoint_info,
        load_model,
        load_tokenizer,
    )
    from stalebound.obs.live import LiveView, summary_table
    from stalebound.obs.metrics import RunLogger
    from stalebound.runtime import WorkflowExecutor
    from stalebound.tasks import make_task
    from stalebound.tasks.workflow import context_problems
    from stalebound.train.checkpoint import (
        atomic_write_text,
        open_checkpoint,
        run_dir_of,
        write_checkpoint,
    )
    from stalebound.train.ledger import ItemLedger
    from stalebound.train.rollout import evaluate
    from stalebound.train.trainer import Trainer
    from stalebound.train.warmstart import warm_start
    from stalebound.userfiles import check_run_paths

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    console = console or Console()
    # A resumed run checks its checkpoint (every file's checksum) before it starts anything.
    resume = open_checkpoint(cfg.run.resume) if cfg.run.resume else None
    saved: dict[str, Any] = resume.job_state() if resume is not None else {}
    if resume is not None:
        now = _resume_settings(cfg)
        changed = [
            f"{k}: {saved['settings'].get(k)!r} → {now[k]!r}"
            for k in now
            if saved["settings"].get(k) != now[k]
        ]
        if changed:
            raise ConfigError(
                f"resume={cfg.run.resume!r}: the checkpoint was written with other settings "
                f"({'; '.join(changed)}); resume with the run's own settings (its config.yaml) "
                "or start a new run"
            )
    threads = cfg.train.num_threads or 1
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    if cfg.run.run_dir:
        run_dir = Path(cfg.run.run_dir)
    elif resume is not None:
        run_dir = run_dir_of(resume.path)
    else:
        run_dir = _default_run_dir()
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
    # the task's own checks (and its prompt file) before the run directory is touched
    task = make_task(cfg.task)
    samples = list(task.samples())
    check_run_paths(cfg, run_dir, resuming=resume is not None)  # the paths it names, before writing
    if resume is not None:
        base_dir = resume.path
    elif cfg.engine.model_path:
        base_dir = Path(cfg.engine.model_path)
    else:
        base_dir = build_default_model(Path(cfg.engine.cache_dir) / f"default-seed{cfg.seed}")
    # the checkpoint's own limits (context length, chat template) against the task's prompts
    tokenizer = load_tokenizer(base_dir)
    too_long = context_problems(task, tokenizer, samples, checkpoint_info(base_dir).max_positions)
    if too_long:
        raise ConfigError(too_long)
    train_device = resolve_device(cfg.train.device)
    if resume is None:  # before anything starts: a run directory is never overwritten
        held = [
            n for n in ("metrics.jsonl", "ledger.jsonl", "checkpoints") if (run_dir / n).exists()
        ]
        if held:
            raise ConfigError(
                f"run.run_dir={str(run_dir)!r}: already holds a run ({', '.join(held)}); continue "
                f"it with resume={run_dir}, or choose a new directory"
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
    except OSError as exc:
        raise ConfigError(
            f"run.run_dir={str(run_dir)!r}: cannot write there ({exc.strerror or exc}); choose a "
            "writable directory with free space"
        ) from exc

    # 1-2. the policy, warm-started (or the checkpoint's)
    rng = random.Random(cfg.seed)
    eval_set = rng.sample(samples, min(cfg.run.eval_prompts, len(samples)))
    order = list(samples)
    rng.shuffle(order)
    progress = _Progress()
    if resume is not None:
        policy_dir = resume.path
        model = load_model(policy_dir, device=train_device)
        progress = _Progress(**saved["progress"])
        eval_before = float(saved["eval_before"])
        warm_start_s = float(saved["warm_start_s"])
        console.print(
            f"resuming {run_dir} from {resume.path.name}: step {resume.step}, version "
            f"{resume.version}"
        )
    else:
        model = load_model(base_dir, device=train_device)
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
    if http:
        from stalebound.engines.router import Router

        clients = _make_http_engines(cfg)
        raw_engine: Any = clients[0] if len(clients) == 1 else Router(clients)
        close_engines: Callable[[], None] = lambda: None  # noqa: E731 - closed on the loop below
    else:
        raw_engine, close_engines = _make_engine(cfg, policy_dir, start_version)
    engine = BusyMeter(raw_engine)
    executor = WorkflowExecutor(cfg.rollout, engine).initialize()
    if http:
        for client in clients:
            executor.run_coroutine(client.start())
        # the servers serve engine.model_path; the job's weights replace them
        executor.run_coroutine(engine.update_weights(policy_dir, start_version))
    sampling = SamplingParams(temperature=cfg.engine.temperature, top_p=cfg.engine.top_p)
    recorder = None
    if cfg.run.trace:
        from stalebound.sim.trace import TraceHeader, TraceRecorder

        meta = {"task": cfg.task.name, "staleness": cfg.rollout.max_head_offpolicyness}
        header = TraceHeader(source="runtime", group_size=cfg.rollout.group_size, meta=meta)
        name = "trace.jsonl" if resume is None else f"trace-from-step-{resume.step}.jsonl"
        recorder = TraceRecorder(run_dir / name, header)
    workflow = EngineEpisode(task, tokenizer, sampling, recorder)
    if resume is not None:
        executor.load_state_dict(resume.rollout_state(), workflow)
    trainer: Any
    if cfg.backend == "ray":
        from stalebound.distributed import make_ray_trainer

        pad = tokenizer.pad_token_id
        pad = tokenizer.eos_token_id if pad is None else pad
        trainer = make_ray_trainer(cfg, policy_dir, pad_token_id=pad, version=start_version)
    else:
        trainer = Trainer(model, tokenizer, cfg.train, version=start_version)
    if resume is not None:
        state = resume.trainer_state()
        trainer.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

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
    resume_step = resume.step if resume is not None else None
    logger = RunLogger(
        run_dir,
        tensorboard=cfg.run.tensorboard,
        resume=resume is not None,
        resume_step=resume_step,
    )
    ledger = ItemLedger(run_dir, resume_step=resume_step)
    view = LiveView(console, staleness=cfg.rollout.max_head_offpolicyness, live=cfg.run.live)
    eta = cfg.rollout.max_head_offpolicyness
    stop_sampling = threading.Event()

    # The executor's counters and buffers are sampled here, off the trainer's path: each read is a
    # hop onto the executor's busy loop, which would otherwise delay every step.
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

        return write_checkpoint(
            run_dir,
            step,
            trainer.version,
            save_model=save_model,
            trainer_state=trainer_state,
            rollout_state=rollout_state,
            job_state=job_state,
            keep=cfg.run.keep_checkpoints,
        )

    every_steps, every_s = cfg.run.checkpoint_every_steps, cfg.run.checkpoint_every_s
    sampler = threading.Thread(target=sample_buffers, name="stalebound-buffers", daemon=True)
    engine.reset()
    start = time.monotonic() - progress.wall
    last_checkpoint = time.monotonic()
    checkpoint_s = 0.0
    written: Path | None = resume.path if resume is not None else None
    stop = _StopRequest(console)
    try:
        with stop:
            view.start()
            sampler.start()
            for step in range(progress.step + 1, cfg.run.steps + 1):
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
                view.update_step(step, trainer.version, metrics, rows=rows or None)
                checkpoint_s = 0.0
                due = (
                    step == cfg.run.steps
                    or stop.signum is not None
                    or (every_steps and step % every_steps == 0)
                    or (every_s and time.monotonic() - last_checkpoint >= every_s)
                )
                if cfg.run.checkpoint and due:
                    t3 = time.monotonic()
                    written = checkpoint(step)
                    last_checkpoint = time.monotonic()
                    checkpoint_s = last_checkpoint - t3
                    _log.info("checkpoint %s in %.2fs", written, checkpoint_s)
                if stop.signum is not None:
                    break
                _log.debug("step %d bookkeeping %.3fs", step, time.monotonic() - t2)
    except OSError as exc:  # the run directory's disk: full, gone read-only, ...
        raise RunDirectoryError(
            f"writing to the run directory {run_dir} failed at step {progress.step + 1}: "
            f"{exc.strerror or exc} ({exc.filename or run_dir}); free space there, then "
            + _continue_hint(run_dir, written)
        ) from exc
    except StaleboundError as exc:  # the engines, the executor, a checkpoint write
        raise TrainingFailed(
            f"{exc}\nthe run stopped at step {progress.step + 1}; "
            + _continue_hint(run_dir, written)
        ) from exc
    except BaseException:
        _log.error(
            "the run stopped at step %d; %s", progress.step + 1, _continue_hint(run_dir, written)
        )
        raise
    finally:
        failing = sys.exc_info()[0] is not None
        stop_sampling.set()
        view.stop()
        if http:
            for client in clients:
                executor.run_coroutine(client.aclose())
        executor.destroy()
        close_engines()
        closers = [ledger.close] + ([recorder.close] if recorder is not None else [])
        if failing:
            closers.append(logger.close)
            if cfg.backend == "ray":
                closers.append(trainer.close)
        for close in closers:
            try:
                close()
            except OSError as exc:  # a full disk already reported; the checkpoint is what counts
                if not failing:
                    raise
                _log.warning("closing %s: %s", close, exc)
    if stop.signum is not None:
        logger.close()
        if cfg.backend == "ray":
            trainer.close()
        raise TrainingInterrupted(stop.signum, progress.step, run_dir, written)
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

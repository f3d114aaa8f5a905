"""The main job as a recipe (the shape of torchtune's recipes): :class:`TrainRecipe`.

:func:`run_training` runs it. Its methods read top to bottom:

1. ``setup``: :func:`~stalebound.train.preflight.preflight` checks the checkpoint to resume, the
   task and the paths before anything is written; then the recipe takes the run directory, builds
   (or reuses) the policy and warm-starts it on the task's reference answers (so RL starts from a
   non-zero reward), starts the engines and the executor (the staleness policy of
   ``rollout.staleness_policy``) and the trainer;
2. ``load_checkpoint``: when resuming, the executor's groups, the optimizer and the job's totals;
3. ``train``: take the next consumed batch, train one step, publish the weights (version + 1) to
   the engines, log, draw, ``save_checkpoint`` when due; then evaluate and write the summary;
4. ``cleanup``: stop the engines, close the files, release the run directory.

Where the engines and the trainer run is chosen by the factories of
:mod:`stalebound.train.backends`. The pieces the recipe is made of: the episode workflow and the
busy meter (:mod:`~stalebound.train.episode`), the job's state in a checkpoint
(:mod:`~stalebound.train.jobstate`), and how a run ends (:mod:`~stalebound.train.outcome`).
torch, transformers and the torch parts of training load when the recipe runs, not when it is
imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console

from stalebound._heap import frozen_heap
from stalebound.config import StaleboundConfig, dump_yaml
from stalebound.core import ConfigError, DataExhausted, StaleboundError, StalenessPolicy
from stalebound.core.policy import BufferBacked
from stalebound.engines.devices import resolve_device
from stalebound.engines.models import load_model, load_tokenizer
from stalebound.engines.protocol import SamplingParams
from stalebound.engines.steplog import STEP_LOG_DIR
from stalebound.obs.audit import ItemLog, OfferedLoader, data_audit
from stalebound.obs.live import LiveView, phase, summary_table
from stalebound.obs.loggers import open_loggers
from stalebound.obs.metrics import RunLogger
from stalebound.obs.plots import plot_run
from stalebound.obs.records import BufferRow, buffer_rows, reached_target
from stalebound.obs.trace import (
    TRACE_FILE,
    TraceHeader,
    TraceRecorder,
    resumed_trace_name,
    run_traces,
)
from stalebound.runtime import WorkflowExecutor
from stalebound.runtime.executor import ExecutorStatistics
from stalebound.train.backends import EngineSet, make_backend, make_engines
from stalebound.train.checkpoint import (
    ROLLOUT_STATE,
    TRAINER_STATE,
    CheckpointError,
    CheckpointWriteError,
    abandon_after,
    atomic_write_text,
    write_checkpoint,
)
from stalebound.train.episode import BusyMeter, EngineEpisode
from stalebound.train.jobstate import Progress, SavedJob, resume_settings
from stalebound.train.ledger import ItemLedger
from stalebound.train.outcome import (
    RunDirectoryError,
    StopNow,
    StopRequest,
    TrainingFailed,
    TrainingInterrupted,
    TrainResult,
    Where,
)
from stalebound.train.preflight import Plan, preflight, refuse_a_held_run_dir
from stalebound.train.runlock import RunLock
from stalebound.typedconfig import to_plain

__all__ = ["TrainRecipe", "run_training"]

_log = logging.getLogger(__name__)


def run_training(cfg: StaleboundConfig, *, console: Console | None = None) -> TrainResult:
    """Run the main job on ``cfg``: :class:`TrainRecipe` from setup to cleanup.

    ``cfg.run.resume`` continues a run from a checkpoint (a run directory means its newest), or
    starts again from the beginning a run that stopped before its first checkpoint. Resuming from
    a checkpoint older than the run's newest makes it the newest: the later ones move to
    ``RUN_DIR/abandoned/`` and the records are cut back to its step. One process at a time runs
    in a run directory (:class:`~stalebound.train.runlock.RunLock`)."""
    return TrainRecipe(cfg, console=console).run()


class TrainRecipe:
    """The main job, read top to bottom: :meth:`setup`, :meth:`load_checkpoint`, :meth:`train`
    (which calls :meth:`save_checkpoint`), :meth:`cleanup`.

    Where the engines and the trainer run is decided by :func:`~stalebound.train.backends.
    make_backend` and :func:`~stalebound.train.backends.make_engines`; the recipe itself has no
    branch on the backend or the engine kind.

    Failures reach the caller as the job's errors: :class:`ConfigError` (before anything is
    written), :class:`TrainingInterrupted`, :class:`TrainingFailed`, :class:`RunDirectoryError`,
    or a :class:`~stalebound.train.checkpoint.CheckpointError` naming the checkpoint to use
    instead.
    """

    def __init__(self, cfg: StaleboundConfig, *, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console()
        self.backend = make_backend(cfg)
        self.progress = Progress()
        self.eval_before = 0.0
        self.warm_start_s = 0.0
        self.resume: Any = None
        """The checkpoint this run continues from, if any."""
        self.saved: SavedJob | None = None
        self.restart = False
        """The run stopped before its first checkpoint and starts again from the beginning."""
        self.where: Where | None = None
        self._lock: Any = None
        self._stop: StopRequest | None = None
        self._signum: int | None = None
        """The signal that asked the run to stop after a step, once it stopped listening."""
        # what to stop whatever happens, in this order; what to close (the files); and what to
        # close here only when the run fails (otherwise after the final evaluation)
        self._stopping: list[Callable[[], None]] = []
        self._closers: list[tuple[str, Callable[[], None]]] = []
        self._on_failure: list[tuple[str, Callable[[], None]]] = []
        self._failing = True
        self._engines: EngineSet | None = None
        self._sampled: list[Any] = []
        self._stop_sampling = threading.Event()
        self._start = 0.0
        self._saved_step = -1  # the step of the newest checkpoint this process wrote
        self._publish_s = 0.0  # seconds this step spent publishing its weights to the engines

    def run(self) -> TrainResult:
        """The whole job: :meth:`setup`, :meth:`load_checkpoint`, :meth:`train`, and
        :meth:`cleanup` whatever happens. Once the run has its directory, a second signal (or
        one before the job listens) anywhere in it is :class:`TrainingInterrupted` at once."""
        try:
            with self._interruptions():
                self.setup()
                self.load_checkpoint()
                return self.train()
        finally:
            self.cleanup()

    # -- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """Check everything that can be checked before writing (the checkpoint to resume, the
        task and its prompts, the paths), take the run directory, then build the policy, the
        engines, the executor, the trainer and the run's records."""
        self._plan()
        self._take_run_dir()
        self.console.print(f"run directory {self.run_dir}", highlight=False)
        with self._interruptions():
            train_device = self._prepare_torch()
        with self._failures():
            self._build(train_device)

    def _prepare_torch(self) -> Any:
        """Torch's threads and seed, and the trainer's device; then listen for signals."""
        import torch  # torch and transformers load when the job runs
        import transformers

        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        train_device = resolve_device(self.cfg.train.device)
        torch.set_num_threads(self.cfg.train.num_threads or 1)
        torch.manual_seed(self.cfg.seed)
        self._stop = StopRequest(self.console)
        self._stop.__enter__()  # from here on a signal stops the job after its current step
        return train_device

    def _plan(self) -> None:
        """Every check before the run directory is touched
        (:func:`~stalebound.train.preflight.preflight`); raises ConfigError (or a
        CheckpointError) with nothing written."""
        say = partial(self.console.print, markup=False, soft_wrap=True)
        with StopRequest(self.console) as stop, stop.at_once():  # a signal ends a wait here
            plan = preflight(self.cfg, on_wait=say)
        self.plan: Plan = plan
        self.cfg, self.run_dir, self.task, self.samples = (
            plan.cfg,
            plan.run_dir,
            plan.task,
            plan.samples,
        )
        self.resume, self.saved, self.restart = plan.resume, plan.saved, plan.restart

    def _take_run_dir(self) -> None:
        """Lock the run directory and write the run's config.yaml (ConfigError if it cannot)."""
        run_dir, resume = self.run_dir, self.resume
        self._lock = RunLock(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
            if resume is None and not self.restart:  # a run directory is never overwritten
                refuse_a_held_run_dir(run_dir)
            moved = abandon_after(run_dir, resume) if resume is not None else []
            if moved and resume is not None:
                self.console.print(
                    f"{resume.path.name} is older than the run's newest checkpoint: the later "
                    f"{', '.join(p.name for p in moved)} moved to {moved[0].parent}, and the "
                    f"records are cut back to step {resume.step}"
                )
            if self.restart:
                self.console.print(
                    f"{run_dir}: no checkpoint yet (the run stopped before its first one); "
                    "starting it again from the beginning, warm start included"
                )
                clear_unfinished_start(run_dir)
            atomic_write_text(run_dir / "config.yaml", dump_yaml(self.cfg))
        except OSError as exc:
            raise ConfigError(
                f"run.run_dir={str(run_dir)!r}: cannot write there ({exc.strerror or exc}); "
                "choose a writable directory with free space"
            ) from exc
        self.where = Where(run_dir) if resume is None else Where(run_dir, resume.step, resume.path)

    def _build(self, train_device: Any) -> None:
        from stalebound.train.rollout import evaluate  # these two load torch
        from stalebound.train.warmstart import warm_start

        cfg, console, run_dir, resume = self.cfg, self.console, self.run_dir, self.resume

        # 1-2. the policy, warm-started (or the checkpoint's)
        self.eval_set, self.order = self.task.data_plan(
            self.samples, cfg.run.eval_prompts, random.Random(cfg.seed)
        )
        policy_dir = self.plan.base_dir
        try:
            with phase(console, f"loading the model from {policy_dir} …"):
                self.model = load_model(policy_dir, device=train_device)
                self.tokenizer = load_tokenizer(policy_dir)
        except (OSError, ValueError, RuntimeError, StaleboundError) as exc:
            if resume is None:
                raise
            raise resume.unusable(
                "", f"the policy does not load ({type(exc).__name__}: {exc})"
            ) from None
        if resume is None:
            with phase(console, f"warm start: {cfg.train.warm_start_steps} supervised steps …"):
                ws = warm_start(
                    self.model,
                    self.tokenizer,
                    self.task,
                    cfg.train.warm_start_steps,
                    batch_size=cfg.train.warm_start_batch_size,
                    lr=cfg.train.warm_start_lr,
                    seed=cfg.train.seed,
                )
            self.eval_before = evaluate(self.model, self.tokenizer, self.task, self.eval_set)["acc"]
            self.warm_start_s = ws.seconds
            policy_dir = run_dir / "policy-v0"
            self.model.save_pretrained(policy_dir)
            self.tokenizer.save_pretrained(policy_dir)
            console.print(
                f"warm start: {ws.steps} steps in {ws.seconds:.1f}s, loss {ws.first_loss:.3f} → "
                f"{ws.last_loss:.3f}; greedy accuracy {self.eval_before:.3f}"
            )
        self.policy_dir = policy_dir
        version = resume.version if resume is not None else 0

        # 3-4. engines and the executor
        with phase(console, "starting the engines …"):
            step_logs = run_dir / STEP_LOG_DIR if cfg.run.trace else None  # for calibration
            engines = make_engines(cfg, self.backend, policy_dir, version, step_logs)
        self._engines = engines
        self._stopping.append(engines.close)
        self.engine = BusyMeter(engines.engine)
        self.executor = executor = WorkflowExecutor(cfg.rollout, self.engine).initialize()
        self._stopping.insert(0, executor.destroy)  # before the engines close
        assert self._stop is not None
        with self._stop.at_once():  # waits with no step to finish: a signal ends them
            for client in engines.clients:

                def close_client(client: Any = client) -> None:
                    executor.run_coroutine(client.aclose())

                self._stopping.insert(0, close_client)
                executor.run_coroutine(client.start())
            if engines.serves_other_weights:  # the job's weights replace the servers' own
                executor.run_coroutine(self.engine.update_weights(policy_dir, version))
        sampling = SamplingParams(temperature=cfg.engine.temperature, top_p=cfg.engine.top_p)
        recorder = None
        if cfg.run.trace:
            meta: dict[str, Any] = {"task": cfg.task.name, "staleness": cfg.rollout.staleness}
            if cfg.engine.kind == "local":  # where it decoded (calibration models a CPU's cohorts)
                meta["engine_device"] = resolve_device(cfg.engine.device)
            header = TraceHeader(source="runtime", group_size=cfg.rollout.group_size, meta=meta)
            name = TRACE_FILE if resume is None else resumed_trace_name(resume.step)
            recorder = TraceRecorder(run_dir / name, header)
        self.workflow = EngineEpisode(self.task, self.tokenizer, sampling, recorder)

        # the trainer, publishing each step's weights to the engines
        self.trainer = self.backend.trainer(
            cfg, self.model, self.tokenizer, policy_dir, version, base_dir=run_dir / "policy-v0"
        )
        self._on_failure.append(("the trainer", lambda: self.backend.close_trainer(self.trainer)))
        self.trainer.publish(self._publish)

        # the run's records; a run started again from the beginning cuts them back to nothing
        resume_step = resume.step if resume is not None else (0 if self.restart else None)
        loggers = open_loggers(cfg.obs, run_dir, to_plain(cfg), resume=resume is not None)
        try:
            self.logger = RunLogger(
                run_dir,
                tensorboard=cfg.run.tensorboard and "tensorboard" in cfg.obs.loggers,
                resume=resume_step is not None,
                resume_step=resume_step,
                loggers=loggers,
            )
        except BaseException:
            for logger in loggers:
                logger.close()
            raise
        self._on_failure.append(("the metrics", self.logger.close))
        self.ledger = ItemLedger(run_dir, resume_step=resume_step)
        self._closers.append(("the item ledger", self.ledger.close))
        self.items = ItemLog(run_dir, self.task.difficulty, append=bool(resume_step))
        self._closers.append(("the item log", self.items.close))
        self.offered = OfferedLoader(self.order, self.items)
        if recorder is not None:
            self._closers.append(("the episode trace", self.workflow.close_trace))
        self.view = LiveView(
            console,
            staleness=cfg.rollout.staleness,
            live=cfg.run.live,
            total_steps=cfg.run.steps,
            first_step=resume.step if resume is not None else 0,
        )

    def _publish(self, state_dict: Any, version: int) -> None:
        started = time.monotonic()
        try:
            self._send_weights(state_dict, version)
        finally:
            self._publish_s += time.monotonic() - started

    def _send_weights(self, state_dict: Any, version: int) -> None:
        source: Any = state_dict
        if self._engines is not None and self._engines.weights_on_disk:
            # servers reload from a directory: write it atomically, keep the last two
            weights = self.run_dir / "weights"
            source = weights / f"v{version}"
            tmp = source.with_name(source.name + ".tmp")
            self.model.save_pretrained(tmp)
            os.replace(tmp, source)
            shutil.rmtree(weights / f"v{version - 2}", ignore_errors=True)
        self.executor.run_coroutine(self.engine.update_weights(source, version))
        self.executor.set_version(version)

    # -- checkpoints ---------------------------------------------------------------------------

    def load_checkpoint(self) -> None:
        """Continue from the checkpoint found in :meth:`setup` (if any): the job's totals, the
        executor's groups and the trainer's optimizer and random state. (The policy's weights
        were loaded from it when the model was built.)"""
        import torch

        resume, saved, verified = self.resume, self.saved, self.plan.verified
        if resume is None or saved is None or verified is None:
            return
        with self._failures():
            self.progress = saved.progress
            self.eval_before = saved.eval_before
            self.warm_start_s = saved.warm_start_s
            self.console.print(
                f"resuming {self.run_dir} from {resume.path.name}: step {resume.step}, version "
                f"{resume.version}"
            )
            try:  # read and checked before anything was written (preflight)
                self.executor.load_state_dict(verified.rollout_state, self.workflow)
            except StaleboundError as exc:
                raise resume.unusable(ROLLOUT_STATE, str(exc)) from None
            state = verified.trainer_state
            try:
                self.trainer.load_optimizer(resume.path, state["optimizer"])
                torch.set_rng_state(state["rng"]["torch"])
                random.setstate(state["rng"]["python"])
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                raise resume.unusable(
                    TRAINER_STATE, f"does not fit this run ({type(exc).__name__}: {exc})"
                ) from None

    def save_checkpoint(self, step: int) -> Path:
        """Write the checkpoint of ``step``: the policy, the trainer's and the executor's state
        and the job's totals (the newest ``run.keep_checkpoints`` are kept)."""
        import torch

        executor, trainer, progress = self.executor, self.trainer, self.progress
        rollout_state = executor.state_dict()  # first: the executor keeps running meanwhile
        self.backend.gather(self.model, trainer)
        self._take_policy_counts()
        progress.wall = time.monotonic() - self._start
        trainer_state = {
            "optimizer": trainer.optimizer_state(),
            "version": trainer.version,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        job_state = {
            "progress": dataclasses.asdict(progress),
            "eval_before": self.eval_before,
            "warm_start_s": self.warm_start_s,
            "settings": resume_settings(self.cfg),
        }

        def save_model(directory: Path) -> None:
            self.model.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
            trainer.save_optimizer(directory)  # trainer ranks write their shards

        path = write_checkpoint(
            self.run_dir,
            step,
            trainer.version,
            save_model=save_model,
            trainer_state=trainer_state,
            rollout_state=rollout_state,
            job_state=job_state,
            keep=self.cfg.run.keep_checkpoints,
        )
        assert self.where is not None
        self.where.checkpoint = path
        self._saved_step = step
        return path

    def _take_policy_counts(self) -> None:
        """The staleness of what was trained, as the policy counted it (its counts are part of
        the executor's state, so they continue across resumes)."""
        policy = self.executor.statistics().policy
        self.progress.violations = policy.violations
        self.progress.max_stale = max(policy.staleness_histogram, default=0)

    # -- training ------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Train up to ``run.steps`` (checkpointing as ``run.checkpoint_*`` say), then evaluate
        and write the summary. A first SIGTERM/SIGINT stops after the current step with a
        checkpoint (:class:`TrainingInterrupted`)."""
        cfg = self.cfg
        with self._failures(), frozen_heap() if cfg.run.gc_freeze else contextlib.nullcontext():
            self._steps()
            self._failing = False
        self._release()
        assert self.where is not None
        if self._signum is not None:
            self.logger.close()
            self.backend.close_trainer(self.trainer)
            raise TrainingInterrupted(
                self._signum, self.progress.step, self.run_dir, self.where.checkpoint
            )
        return self._finish(time.monotonic() - self._start, cfg.rollout.staleness)

    def _steps(self) -> None:
        cfg, progress, executor, engine = self.cfg, self.progress, self.executor, self.engine
        stop, where, logger, view = self._stop, self.where, self.logger, self.view
        assert stop is not None and where is not None
        # The executor's counters and buffers are sampled here, off the trainer's path: each read
        # is a hop onto the executor's busy loop, which would otherwise delay every step.
        self._sampled = [executor.statistics(), []]
        every_steps, every_s = cfg.run.checkpoint_every_steps, cfg.run.checkpoint_every_s
        sampler = threading.Thread(
            target=self._sample_buffers, name="stalebound-buffers", daemon=True
        )
        self._start = time.monotonic() - progress.wall
        if cfg.run.checkpoint and self.resume is None:
            # step 0: a run killed before its first periodic checkpoint resumes from here, warm
            # start included, instead of starting again
            self.save_checkpoint(0)
        engine.reset()
        self._start = start = time.monotonic() - progress.wall
        self.workflow.set_origin(start)  # the trace counts on the run's clock, as the metrics do
        last_checkpoint = time.monotonic()
        checkpoint_s = 0.0
        if progress.step >= cfg.run.steps:
            self.console.print(
                f"the run is already at step {progress.step} (run.steps={cfg.run.steps}): nothing "
                "to train; give a larger run.steps to train further"
            )
        self._stopping[:0] = [self._stop_sampling.set, view.stop]
        view.start()
        sampler.start()
        for step in range(progress.step + 1, cfg.run.steps + 1):
            if stop.requested():  # it came before this step began
                break
            t0 = time.monotonic()
            try:
                batch = executor.prepare_batch(self.offered, self.workflow)
            except DataExhausted as exc:
                self._data_used_up(exc)
                break
            progress.waited += time.monotonic() - t0
            groups: dict[int, list[Any]] = {}
            staleness: list[int] = []
            consumed_version = batch[0].consumed_version
            for t in batch:
                traj = t.data
                traj.version = t.version
                groups.setdefault(t.group_id, []).append(traj)
                staleness.append(t.staleness)
            masked = sum(t.masked_tokens for t in batch)  # left the loss: staler than η_h
            t1 = time.monotonic()
            self._publish_s = 0.0
            stats = self.trainer.step(list(groups.values()), batch_version=consumed_version)
            t2 = time.monotonic()
            progress.step = step
            progress.trained += len(batch)
            self.ledger.record(step, (t.sample_index for t in batch), executor.drain_outcomes())
            self.items.trained(step, ((t.sample_index, t.data) for t in batch))
            elapsed = time.monotonic() - start
            metrics = {k: v for k, v in stats.as_dict().items() if k not in ("version", "step")}
            rewards = progress.rewards
            rewards.append(metrics.get("reward_mean", 0.0))
            reached = reached_target(rewards, cfg.run.target_reward)
            if progress.time_to_target is None and reached:
                progress.time_to_target = elapsed
            es, rows = self._sampled  # at most 0.25 s old
            if step == cfg.run.steps:  # the run's last line holds the final counts
                es = executor.statistics()
            metrics.update(
                tokens_masked_stale=float(masked),
                trajectories_per_s=progress.trained / elapsed,
                trainer_idle_fraction=progress.waited / elapsed,
                wait_start_s=t0 - start,
                wait_s=t1 - t0,
                step_and_publish_s=t2 - t1,
                publish_s=self._publish_s,
                checkpoint_s=checkpoint_s,
                engine_idle_fraction=engine.idle_fraction(),
                **executor_metrics(es),
                **reward_metrics(t.data for t in batch),
                **self.task.loader_metrics(self.order),
            )
            logger.log_step(metrics, version=self.trainer.version, staleness=staleness)
            where.step = step
            view.update_step(step, self.trainer.version, metrics, rows=rows or None)
            checkpoint_s = 0.0
            due = (
                step == cfg.run.steps
                or stop.requested()
                or (every_steps and step % every_steps == 0)
                or (every_s and time.monotonic() - last_checkpoint >= every_s)
            )
            if cfg.run.checkpoint and due:
                t3 = time.monotonic()
                written = self.save_checkpoint(step)
                last_checkpoint = time.monotonic()
                checkpoint_s = last_checkpoint - t3
                _log.info("checkpoint %s in %.2fs", written, checkpoint_s)
            if stop.requested():
                break
            _log.debug("step %d bookkeeping %.3fs", step, time.monotonic() - t2)
        self._take_policy_counts()

    def _data_used_up(self, exc: DataExhausted) -> None:
        """The loader's last item is trained: the run ends here, with a checkpoint of this step
        (what was drawn but not trained stays pending in it) unless one was just written."""
        step = self.progress.step
        self.console.print(f"{exc}; the run ends at step {step} of run.steps={self.cfg.run.steps}")
        if self.cfg.run.checkpoint and self._saved_step != step:
            self.save_checkpoint(step)

    def _sample_buffers(self) -> None:
        executor, logger, view = self.executor, self.logger, self.view
        while not self._stop_sampling.wait(0.25):
            try:
                version, rows = executor.inspect_policy(head_rows)
                self._sampled = [executor.statistics(), rows]
            except StaleboundError:  # the executor stopped or is shutting down
                return
            if rows:
                try:
                    logger.log_buffers(None, version, rows)
                except OSError as exc:  # the disk is full: the trainer's next write says so
                    _log.warning("buffer samples stopped: %s", exc)
                    return
                view.update_buffers(rows, version=version)

    def _finish(self, wall: float, eta: int) -> TrainResult:
        """The final evaluation, plots and summary, once the engines are stopped."""
        from stalebound.train.rollout import evaluate  # loads torch

        progress, run_dir = self.progress, self.run_dir
        self.backend.gather(self.model, self.trainer)  # the policy trained, here to evaluate
        self.backend.close_trainer(self.trainer)
        eval_after = evaluate(self.model, self.tokenizer, self.task, self.eval_set)["acc"]
        self.logger.close()
        if self.cfg.run.plots:
            plot_run(run_dir)
        self.console.print(summary_table(self.logger.summary()))
        rewards = progress.rewards
        first, last = rewards[:5], rewards[-5:]
        result = TrainResult(
            run_dir=str(run_dir),
            steps=len(rewards),
            staleness=eta,
            policy=self.cfg.rollout.staleness_policy,
            eval_before=self.eval_before,
            eval_after=eval_after,
            reward_first=sum(first) / max(1, len(first)),
            reward_last=sum(last) / max(1, len(last)),
            max_staleness=progress.max_stale,
            violations=progress.violations,
            wall_s=wall,
            trajectories_per_s=progress.trained / wall,
            trainer_idle_fraction=progress.waited / wall,
            engine_idle_fraction=self.engine.idle_fraction(),
            time_to_target_s=progress.time_to_target,
            warm_start_s=self.warm_start_s,
        )
        audit = data_audit(run_dir)
        summary = json.dumps(
            {**dataclasses.asdict(result), "data_audit": audit.to_json()}, indent=2
        )
        atomic_write_text(run_dir / "summary.json", summary)
        self.console.print(
            f"[bold]reward {result.reward_first:.3f} → {result.reward_last:.3f}[/], greedy "
            f"accuracy {self.eval_before:.3f} → {eval_after:.3f}; max staleness "
            f"{progress.max_stale} (η = {eta}), {progress.violations} violations; "
            f"{result.trajectories_per_s:.0f} trajectories/s; run directory {run_dir}"
        )
        return result

    # -- failures and cleanup ------------------------------------------------------------------

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """Turn what stops a run into the job's errors, each naming how to continue."""
        where = self.where
        assert where is not None
        run_dir = where.run_dir
        try:
            with self._interruptions():
                yield
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
        except (CheckpointError, TrainingInterrupted):  # they say how to continue themselves
            raise
        except StaleboundError as exc:  # the engines, the executor
            local = self._engines.local if self._engines is not None else []
            cause = engine_death(local) or str(exc)
            raise TrainingFailed(
                f"{cause}\nThe run stopped after step {where.step}; {where.hint()}"
            ) from exc

    @contextlib.contextmanager
    def _interruptions(self) -> Iterator[None]:
        """A second signal (or one before the job could listen) stops the run at once."""
        try:
            yield
        except KeyboardInterrupt as exc:
            where = self.where
            if where is None:  # before the run took its directory: nothing was written
                raise
            signum = exc.signum if isinstance(exc, StopNow) else signal.SIGINT
            raise TrainingInterrupted(
                signum, where.step, where.run_dir, where.checkpoint, at_once=True
            ) from None

    def _release(self) -> None:
        """Stop the sampler, the view, the executor and the engines; close the files (and, when
        the run failed, the metrics and the trainer). Each runs once."""
        stopping, self._stopping = self._stopping, []
        closers, self._closers = self._closers, []
        on_failure = self._on_failure if self._failing else []
        if self._failing:
            self._on_failure = []
        try:
            for halt in stopping:
                halt()
            for what_closes, close in closers + on_failure:
                try:
                    close()
                except OSError as exc:  # a full disk already reported; the checkpoint counts
                    if not self._failing:
                        raise
                    _log.debug("closing %s: %s", what_closes, exc)
        finally:
            if self._stop is not None:
                self._stop.__exit__(None, None, None)
                self._signum = self._stop.signum
                self._stop = None

    def cleanup(self) -> None:
        """Release everything :meth:`setup` took, the run directory's lock last."""
        try:
            if self.where is not None:
                with self._interruptions():
                    self._release()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None


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
        "continued_groups": float(es.continued_groups),
        "overdue_groups": float(es.overdue_groups),
        "stuck_seconds": es.stuck_seconds,
        **{f"failed_members/{cause}": float(n) for cause, n in es.member_failures.items()},
    }


def reward_metrics(trajectories: Iterable[Any]) -> dict[str, float]:
    """The batch's mean of every extra metric a reward function returned (``reward/<name>``)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for t in trajectories:
        for k, v in t.metrics.items():
            if k.startswith("reward/"):
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sorted(sums)}


def head_rows(policy: StalenessPolicy) -> tuple[int, list[BufferRow]]:
    """The policy's version and its buffers' rows (none for a policy without buffers)."""
    if isinstance(policy, BufferBacked):  # the buffer and the deadline policies
        return policy.version, buffer_rows(policy.buffer)
    return policy.version, []


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
    rewrite itself (the metrics and the ledger are cut back to nothing when they are opened):
    the traces of resumes and the engines' step logs, which are appended to."""
    for _, path in run_traces(run_dir):
        if path.name != TRACE_FILE:  # the first trace is written again from the start
            path.unlink(missing_ok=True)
    shutil.rmtree(run_dir / STEP_LOG_DIR, ignore_errors=True)

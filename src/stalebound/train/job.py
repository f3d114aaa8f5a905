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
from stalebound.core import BufferPolicy, StaleboundError, StalenessPolicy
from stalebound.engines.protocol import GenerateRequest, GenerateResponse, SamplingParams
from stalebound.obs.records import BufferRow, buffer_rows

_log = logging.getLogger(__name__)

__all__ = ["EngineEpisode", "TrainResult", "run_training"]


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
        )
        for i, url in enumerate(e.urls)
    ]


def _make_engine(cfg: StaleboundConfig, model_dir: Path) -> tuple[Any, Callable[[], None]]:
    """The engine the workflows use, and how to close it (local engines only; see above)."""
    e = cfg.engine
    if cfg.backend == "ray":
        from stalebound.distributed import make_ray_engine

        router = make_ray_engine(cfg, model_path=str(model_dir))
        return router, router.close
    from stalebound.engines.local import LocalEngine
    from stalebound.engines.router import Router

    engines = [
        LocalEngine(
            model_dir,
            seed=cfg.seed + i,
            max_batch_size=e.max_batch_size,
            interrupt_mode=e.interrupt_mode,
            num_threads=e.num_threads,
            name=f"local{i}",
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


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, model: Any, tokenizer: Any, trainer: Any) -> Path:
    """Model, tokenizer, optimizer and version, written to a temporary directory then renamed."""
    import torch

    final = run_dir / "checkpoint"
    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {"optimizer": trainer.optimizer.state_dict(), "version": trainer.version},
        tmp / "trainer_state.pt",
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def run_training(cfg: StaleboundConfig, *, console: Console | None = None) -> TrainResult:
    """Run the main job on ``cfg``; see the module docstring."""
    import torch
    import transformers

    from stalebound.engines.models import build_default_model, load_model, load_tokenizer
    from stalebound.obs.live import LiveView, summary_table
    from stalebound.obs.metrics import RunLogger
    from stalebound.runtime import WorkflowExecutor
    from stalebound.tasks import make_task
    from stalebound.train.rollout import evaluate
    from stalebound.train.trainer import Trainer
    from stalebound.train.warmstart import warm_start

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    console = console or Console()
    threads = cfg.train.num_threads or 1
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.run.run_dir) if cfg.run.run_dir else _default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))

    # 1-2. the policy, warm-started
    if cfg.engine.model_path:
        base_dir = Path(cfg.engine.model_path)
    else:
        base_dir = build_default_model(Path(cfg.engine.cache_dir) / f"default-seed{cfg.seed}")
    model = load_model(base_dir)
    tokenizer = load_tokenizer(base_dir)
    task = make_task(cfg.task)
    samples = list(task.samples())
    rng = random.Random(cfg.seed)
    eval_set = rng.sample(samples, min(cfg.run.eval_prompts, len(samples)))
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
    policy_dir = run_dir / "policy-v0"
    model.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    console.print(
        f"warm start: {ws.steps} steps in {ws.seconds:.1f}s, loss {ws.first_loss:.3f} → "
        f"{ws.last_loss:.3f}; greedy accuracy {eval_before:.3f}"
    )

    # 3-4. engines and the executor
    http = cfg.engine.kind != "local"
    if http:
        from stalebound.engines.router import Router

        clients = _make_http_engines(cfg)
        raw_engine: Any = clients[0] if len(clients) == 1 else Router(clients)
        close_engines: Callable[[], None] = lambda: None  # noqa: E731 - closed on the loop below
    else:
        raw_engine, close_engines = _make_engine(cfg, policy_dir)
    engine = BusyMeter(raw_engine)
    executor = WorkflowExecutor(cfg.rollout, engine).initialize()
    if http:
        for client in clients:
            executor.run_coroutine(client.start())
        # the servers serve engine.model_path; the warm-started weights replace them as version 0
        executor.run_coroutine(engine.update_weights(policy_dir, 0))
    trainer: Any
    if cfg.backend == "ray":
        from stalebound.distributed import make_ray_trainer

        pad = tokenizer.pad_token_id
        pad = tokenizer.eos_token_id if pad is None else pad
        trainer = make_ray_trainer(cfg, policy_dir, pad_token_id=pad)
    else:
        trainer = Trainer(model, tokenizer, cfg.train, version=0)
    sampling = SamplingParams(temperature=cfg.engine.temperature, top_p=cfg.engine.top_p)
    recorder = None
    if cfg.run.trace:
        from stalebound.sim.trace import TraceHeader, TraceRecorder

        meta = {"task": cfg.task.name, "staleness": cfg.rollout.max_head_offpolicyness}
        header = TraceHeader(source="runtime", group_size=cfg.rollout.group_size, meta=meta)
        recorder = TraceRecorder(run_dir / "trace.jsonl", header)
    workflow = EngineEpisode(task, tokenizer, sampling, recorder)
    order = list(samples)
    rng.shuffle(order)

    def publish(state_dict: Any, version: int) -> None:
        source: Any = state_dict
        if http:  # servers reload from a directory: write it atomically, keep the last two
            source = run_dir / "weights" / f"v{version}"
            tmp = source.with_name(source.name + ".tmp")
            model.save_pretrained(tmp)
            os.replace(tmp, source)
            shutil.rmtree(run_dir / "weights" / f"v{version - 2}", ignore_errors=True)
        executor.run_coroutine(engine.update_weights(source, version))
        executor.set_version(version)

    trainer.publish(publish)
    logger = RunLogger(run_dir, tensorboard=cfg.run.tensorboard)
    view = LiveView(console, staleness=cfg.rollout.max_head_offpolicyness, live=cfg.run.live)
    eta = cfg.rollout.max_head_offpolicyness
    stop_sampling = threading.Event()

    def sample_buffers() -> None:
        while not stop_sampling.wait(0.25):
            try:
                version, rows = executor.inspect_policy(_head_rows)
            except StaleboundError:  # the executor stopped or is shutting down
                return
            if rows:
                logger.log_buffers(None, version, rows)
                view.update_buffers(rows, version=version)

    rewards: list[float] = []
    trained = 0
    waited = 0.0
    max_stale = 0
    violations = 0
    time_to_target: float | None = None
    sampler = threading.Thread(target=sample_buffers, name="stalebound-buffers", daemon=True)
    engine.reset()
    start = time.monotonic()
    try:
        view.start()
        sampler.start()
        for step in range(1, cfg.run.steps + 1):
            t0 = time.monotonic()
            batch = executor.prepare_batch(order, workflow)
            waited += time.monotonic() - t0
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
            trained += len(batch)
            max_stale = max(max_stale, *staleness)
            violations += sum(1 for s in staleness if s > eta)
            elapsed = time.monotonic() - start
            metrics = {k: v for k, v in stats.as_dict().items() if k not in ("version", "step")}
            rewards.append(metrics.get("reward_mean", 0.0))
            recent = rewards[-5:]
            if time_to_target is None and sum(recent) / len(recent) >= cfg.run.target_reward:
                time_to_target = elapsed
            es = executor.statistics()
            metrics.update(
                trajectories_per_s=trained / elapsed,
                trainer_idle_fraction=waited / elapsed,
                wait_s=t1 - t0,
                step_and_publish_s=t2 - t1,
                engine_idle_fraction=engine.idle_fraction(),
                # typed fields, not getattr: a misspelt counter must fail the type check, not
                # log a silent zero
                filtered_groups=float(es.filtered_groups),
                failed_groups=float(es.failed_groups),
                retried_groups=float(es.retried_groups),
                truncated_groups=float(es.truncated_groups),
                dropped_groups=float(es.dropped_groups),
                surplus_groups=float(es.surplus_groups),
                aborted_tokens=float(sum(es.aborted_tokens.values())),
                stuck_seconds=es.stuck_seconds,
            )
            logger.log_step(metrics, version=trainer.version, staleness=staleness)
            rows = executor.inspect_policy(_head_rows)[1]
            view.update_step(step, trainer.version, metrics, rows=rows or None)
            _log.debug("step %d bookkeeping %.3fs", step, time.monotonic() - t2)
    finally:
        stop_sampling.set()
        view.stop()
        if http:
            for client in clients:
                executor.run_coroutine(client.aclose())
        executor.destroy()
        close_engines()
        if recorder is not None:
            recorder.close()
        if cfg.backend == "ray" and sys.exc_info()[0] is not None:
            trainer.close()
    wall = time.monotonic() - start
    if cfg.backend == "ray":
        # the ranks trained the policy: bring it here for the evaluation and the checkpoint
        model.load_state_dict(dict(trainer.state_dict_for_engines()))
    eval_after = evaluate(model, tokenizer, task, eval_set)["acc"]
    logger.close()
    if cfg.run.checkpoint:
        save_checkpoint(run_dir, model, tokenizer, trainer)
    if cfg.backend == "ray":
        trainer.close()
    if cfg.run.plots:
        from stalebound.obs.plots import plot_run

        plot_run(run_dir)
    console.print(summary_table(logger.summary()))
    first, last = rewards[:5], rewards[-5:]
    result = TrainResult(
        run_dir=str(run_dir),
        steps=len(rewards),
        staleness=eta,
        policy=cfg.rollout.staleness_policy,
        eval_before=eval_before,
        eval_after=eval_after,
        reward_first=sum(first) / len(first),
        reward_last=sum(last) / len(last),
        max_staleness=max_stale,
        violations=violations,
        wall_s=wall,
        trajectories_per_s=trained / wall,
        trainer_idle_fraction=waited / wall,
        engine_idle_fraction=engine.idle_fraction(),
        time_to_target_s=time_to_target,
        warm_start_s=ws.seconds,
    )
    _atomic_write_text(run_dir / "summary.json", json.dumps(dataclasses.asdict(result), indent=2))
    console.print(
        f"[bold]reward {result.reward_first:.3f} → {result.reward_last:.3f}[/], greedy accuracy "
        f"{eval_before:.3f} → {eval_after:.3f}; max staleness {max_stale} (η = {eta}), "
        f"{violations} violations; {result.trajectories_per_s:.0f} trajectories/s; "
        f"run directory {run_dir}"
    )
    return result

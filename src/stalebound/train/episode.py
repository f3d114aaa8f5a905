"""The main job's side of the engines: the executor's workflow (one episode of a task over an
engine, recorded into the run's trace) and the meter of how long the engines had nothing to do."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

from stalebound.engines.protocol import GenerateRequest, GenerateResponse, SamplingParams
from stalebound.obs.trace import TrajectoryRecord
from stalebound.runtime.cut import running_member
from stalebound.tasks.workflow import EpisodeEngine

__all__ = ["BusyMeter", "EngineEpisode"]


class EngineEpisode:
    """The executor's workflow: one episode of a task over an engine (``arun_episode``).

    Runs the task's workflow (``rollout.workflow`` when the run names one) with an
    :class:`~stalebound.tasks.workflow.EpisodeEngine` over the engine. Each model turn is one engine request, ids ``ep<N>/<turn>``, prioritised by the engine
    version at the start of the episode (older trajectories are served first by the router).
    """

    def __init__(
        self, task: Any, tokenizer: Any, sampling: SamplingParams, recorder: Any = None
    ) -> None:
        self._task = task
        self._tokenizer = tokenizer
        self._workflow = task.episode_workflow(tokenizer)
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
        # the executor's group and launch index, so a trace keeps a group's members together
        group_id, member = running_member() or (number, 0)
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

        episode_engine = EpisodeEngine(generate, self._tokenizer, self._task, engine.get_version)
        trajectory = await self._workflow.arun_episode(episode_engine, sample)
        if self._recorder is not None:  # what `stalebound simulate --replay` re-times
            ended = time.monotonic()
            record = TrajectoryRecord(
                prompt_id=sample.id,
                group_id=group_id,
                member=member,
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

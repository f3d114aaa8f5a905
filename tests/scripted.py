"""Scripted engines and the quiescence check shared by the executor's tests.

Every request waits until the test answers it, so completion order (and who straggles) is chosen by
the test. :func:`quiesce` then waits for the executor to have *nothing left to run* — it asks the
executor's own event loop, never a clock — so what a test checks next does not depend on how fast
a thread happens to run.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from stalebound.runtime import ExecutorStatistics, WorkflowExecutor


class Versioned:
    """An engine's policy version, which the test sets."""

    version: int

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version


# ---------------------------------------------------------------------------- data-in engine


@dataclass
class Call:
    index: int
    data: Any
    version: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    answered: bool = False
    cancelled: bool = False


@dataclass
class ScriptedEngine(Versioned):
    """Each ``agenerate`` waits until the test answers it (or answers at once with ``auto``).

    A result carries per-token versions: the version at the start and at the end of generation.
    """

    auto: bool = False
    version: int = 0
    calls: list[Call] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    async def agenerate(self, data: Any) -> Any:
        loop = asyncio.get_running_loop()
        with self.cond:
            call = Call(len(self.calls), data, self.version, loop, loop.create_future())
            self.calls.append(call)
            self.cond.notify_all()
        if self.auto:
            call.answered = True
            return {"data": data, "versions": [call.version, self.version]}
        try:
            outcome = await call.future
        except asyncio.CancelledError:
            with self.cond:
                call.cancelled = True
                self.cond.notify_all()
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome == "ok":
            return {"data": data, "versions": [call.version, self.version]}
        return outcome

    # --- used by the test thread
    def pending(self) -> list[Call]:
        with self.cond:
            return [c for c in self.calls if not c.answered and not c.cancelled]

    def wait_calls(self, n: int) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.calls) >= n, timeout=20)
        assert ok, f"only {len(self.calls)} of {n} engine calls arrived"

    def answer(self, call: Call, outcome: Any = "ok") -> None:
        with self.cond:
            assert not call.answered and not call.cancelled
            call.answered = True

        def settle() -> None:
            if not call.future.done():
                call.future.set_result(outcome)

        call.loop.call_soon_threadsafe(settle)


class Generate:
    """A workflow: one engine call per episode."""

    async def arun_episode(self, engine: ScriptedEngine, data: Any) -> Any:
        return await engine.agenerate(data)


# ---------------------------------------------------------------------------- protocol engine
# Speaks the inference-engine protocol: ``agenerate(GenerateRequest) -> GenerateResponse`` and
# ``abort(request_id)`` (the partial output: ``RequestCall.progress`` tokens, set by the test).


@dataclass
class GenerateRequest:
    request_id: str
    prompt: str


@dataclass
class GenerateResponse:
    request_id: str
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    score: float = 0.0


@dataclass
class RequestCall:
    request: GenerateRequest
    version: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    progress: int = 0
    """Tokens generated so far: what an abort returns."""
    done: bool = False

    @property
    def rid(self) -> str:
        return self.request.request_id


@dataclass
class ProtocolEngine(Versioned):
    version: int = 0
    auto: Callable[[RequestCall], tuple[int, float]] | None = None
    """Answer at once with ``(tokens, score)`` instead of waiting for the test."""
    calls: list[RequestCall] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def _response(
        self, call: RequestCall, tokens: int, reason: str, score: float
    ) -> GenerateResponse:
        return GenerateResponse(
            call.rid,
            list(range(tokens)),
            [-1.0] * tokens,
            [call.version] * tokens,
            reason,
            score,
        )

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        loop = asyncio.get_running_loop()
        with self.cond:
            call = RequestCall(request, self.version, loop, loop.create_future())
            self.calls.append(call)
            self.cond.notify_all()
        if self.auto is not None:
            tokens, score = self.auto(call)
            call.done = True
            return self._response(call, tokens, "stop", score)
        try:
            outcome = await call.future
        finally:
            with self.cond:
                call.done = True  # answered, aborted, or cancelled
                self.cond.notify_all()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome  # type: ignore[no-any-return]

    async def abort(self, request_id: str) -> GenerateResponse | None:
        with self.cond:
            self.aborts.append(request_id)
            call = next((c for c in self.calls if c.rid == request_id), None)
            if call is None or call.future.done():
                return None
        partial = self._response(call, call.progress, "abort", 0.0)
        call.future.set_result(partial)
        return partial

    async def tool(self, prompt: str) -> None:
        """A tool call of an agentic workflow: no engine request, waits like one."""
        loop = asyncio.get_running_loop()
        with self.cond:
            call = RequestCall(
                GenerateRequest(f"tool-{prompt}", prompt), self.version, loop, loop.create_future()
            )
            self.calls.append(call)
            self.cond.notify_all()
        try:
            await call.future
        finally:
            with self.cond:
                call.done = True
                self.cond.notify_all()

    # --- used by the test thread
    def pending(self) -> list[RequestCall]:
        with self.cond:
            return [c for c in self.calls if not c.done and not c.future.done()]

    def call(self, prompt: str) -> RequestCall:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(c.request.prompt == prompt and not c.done for c in self.calls), 20
            )
            assert ok, f"no pending call for {prompt!r}"
            return next(c for c in self.calls if c.request.prompt == prompt and not c.done)

    def answer(
        self,
        call: RequestCall,
        *,
        tokens: int = 4,
        score: float = 0.0,
        error: Exception | None = None,
    ) -> None:
        outcome: Any = error or self._response(call, tokens, "stop", score)

        def settle() -> None:
            if not call.future.done():
                call.future.set_result(outcome)

        call.loop.call_soon_threadsafe(settle)


_rids = itertools.count()


class Episode:
    """One engine request per episode; the trajectory carries its tokens, score and versions."""

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        response = await engine.agenerate(GenerateRequest(f"r{next(_rids)}", str(data)))
        return {
            "prompt": str(data),
            "score": response.score,
            "tokens": len(response.output_ids),
            "versions": response.output_versions,
            "finish_reason": response.finish_reason,
        }


# ---------------------------------------------------------------------------- quiescence


class _Engine(Protocol):
    def pending(self) -> list[Any]: ...


def _loop_idle(ex: WorkflowExecutor) -> bool:
    """On the loop thread: nothing but the caller itself is ready to run (asyncio's ready queue
    holds at most the wake-up reader of the loop's self-pipe, which every cross-thread call —
    this check's own included — leaves behind)."""
    loop: Any = ex._loop
    wake = loop._read_from_self
    return all(h.cancelled() or h._callback == wake for h in loop._ready)


_T = TypeVar("_T")


def _poll(ex: WorkflowExecutor, check: Callable[[], tuple[bool, _T]]) -> _T:
    """Run ``check`` on the loop thread until it says done; the deadline only turns a hang into a
    failure."""
    deadline = time.monotonic() + 120
    while True:
        done, value = ex._call(check)
        if done:
            return value
        assert time.monotonic() < deadline, f"the executor did not settle: {ex.statistics()}"
        time.sleep(0.0005)


def quiesce(
    ex: WorkflowExecutor,
    engine: _Engine,
    until: Callable[[], bool] | None = None,
) -> ExecutorStatistics:
    """Wait until the executor's loop has nothing left to run and every running member waits at
    the engine; ``until`` (run on the loop thread) adds a condition, e.g. that another thread is
    parked in ``prepare_batch``. Returns the statistics read at that moment.

    Every answer the test gave was queued on the loop before this check (``call_soon_threadsafe``
    keeps order), and everything it caused is queued behind it, so an empty ready queue means all
    of it has run."""

    def check() -> tuple[bool, ExecutorStatistics]:
        stats = ex._statistics()
        quiet = _loop_idle(ex) and stats.running_members == len(engine.pending())
        return quiet and (until is None or until()), stats

    return _poll(ex, check)


def settle(ex: WorkflowExecutor) -> None:
    """Wait until the loop has nothing left to run: call it between two calls a trainer thread
    makes (``set_version`` wakes the dispatcher through its own hop, which would otherwise race
    the next call)."""
    _poll(ex, lambda: (_loop_idle(ex), None))


def parked_in_wait(ex: WorkflowExecutor, thread: threading.Thread) -> Callable[[], bool]:
    """For :func:`quiesce`: ``thread`` has ended, or is blocked in ``wait``/``prepare_batch``."""
    return lambda: not thread.is_alive() or any(not w.done() for w in ex._waiters)


def armed_timers(ex: WorkflowExecutor) -> list[str]:
    """The names of the loop's pending timers other than the episode deadlines (which only ever
    expire a running episode): none means nothing wakes the executor but a new event."""

    def name(handle: Any) -> str:
        # the coordinator's timers (the watchdog, the STUCK timeout) by their names
        if handle._callback.__qualname__ == "NamedTimers._fired":
            return f"timer:{handle._args[0]}"
        return str(handle._callback.__qualname__)

    def read() -> list[str]:
        loop: Any = ex._loop
        names = [name(h) for h in loop._scheduled if not h.cancelled()]
        return [n for n in names if n != "EpisodeDeadlines._fire"]

    return ex._call(read)

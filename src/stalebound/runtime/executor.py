"""The workflow executor: a thin asyncio driver of the decision core.

:class:`WorkflowExecutor` has AReaL's surface (``initialize``, ``submit``, ``wait``,
``collect_results``, ``rollout_batch``, ``prepare_batch``, ``pause``, ``resume``, ``destroy``,
``get_capacity``) over either staleness policy (``rollout.staleness_policy``: ``buffer``, the
per-trajectory bound, or ``capacity``, AReaL's aggregate bound).

It decides nothing about staleness: every decision is the :class:`~stalebound.core.Coordinator`'s.
The executor turns what happens (a submitted item, an episode's return value or exception, a
timer, the trainer asking for a batch) into the coordinator's events and carries out the actions
it gets back, in order; ``action_log`` sees every ``(event, actions)`` pair. One event loop in a
background thread (:class:`~stalebound.runtime.loop.LoopThread`) owns the coordinator and the
episodes (:class:`~stalebound.runtime.episodes.Episodes`: engine requests of members stopped on
purpose are aborted on the engine, then their tasks cancelled); public methods hop onto it. The
loop thread serialises every call into the coordinator (under an AReaL manager's lock when the
policy shares its counters) and carries out the actions after it — user filters and the manager's
callbacks run outside that lock. The dispatcher sleeps on an :class:`asyncio.Event` and never
polls. ``docs/architecture.md`` draws it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from stalebound.core import (
    ConfigError,
    Coordinator,
    CoordinatorSettings,
    DataExhausted,
    MemberId,
    ProtocolError,
    StalenessPolicy,
    build_policy,
    resolve_settings,
)
from stalebound.core import events as ev
from stalebound.core.coordinator import OUTCOMES
from stalebound.core.filters import evaluate_group
from stalebound.runtime import reports
from stalebound.runtime.checkpoint import STATE_FORMAT, build_state, read_state
from stalebound.runtime.config import RolloutConfig
from stalebound.runtime.episodes import (
    Episodes,
    Item,
    ItemSource,
    MemberTask,
    ShouldAccept,
    WorkflowProtocol,
    need_workflow,
    outcome_event,
    token_versions,
)
from stalebound.runtime.loop import LoopThread, NamedTimers, settle
from stalebound.runtime.results import ExecutorStatistics, RolloutError, Trajectory
from stalebound.runtime.staleness_manager import StalenessManager
from stalebound.typedconfig import check

__all__ = [
    "OUTCOMES",
    "STATE_FORMAT",
    "ExecutorStatistics",
    "RolloutError",
    "Trajectory",
    "WorkflowExecutor",
    "WorkflowProtocol",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class WorkflowExecutor(LoopThread):
    """Runs rollout workflows concurrently, admitted and batched by a staleness policy.

    ``inference_engine`` is passed to every ``arun_episode`` call; its ``get_version()`` (when it
    has one) is the version new groups are generated with — it is called on the loop thread at
    every dispatch, so it must be cheap and must not block — and ``set_version(v)`` (when it has
    one) is forwarded from :meth:`set_version`. New groups start at ``min(engine version,
    training version)``: the trainer must call :meth:`set_version` after publishing weights, or
    admission stops once the engine lags the training version by more than the bound.
    ``staleness_manager`` replaces the one built from ``config`` (AReaL's custom-manager hook):
    with the capacity policy its counters and limits are the policy's; with the buffer policy it
    is an extra admission gate, driven through its lifecycle callbacks. ``action_log``, when
    given, is called on the loop thread with every event and the actions it produced.
    ``loop_factory`` builds its event loop, whose ``time()`` is its clock (:class:`LoopThread`).

    Call :meth:`initialize` first and :meth:`destroy` at the end (or use ``with``).
    """

    def __init__(
        self,
        config: RolloutConfig,
        inference_engine: Any,
        staleness_manager: StalenessManager | None = None,
        *,
        action_log: ev.ActionLog | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        self.config = config
        self.inference_engine = inference_engine
        self.staleness_manager: StalenessManager | None = staleness_manager
        self.action_log = action_log
        self._engine_version: Callable[[], int] | None = _method(inference_engine, "get_version")
        self._engine_set_version = _method(inference_engine, "set_version")
        super().__init__(loop_factory)
        self._published = 0
        self._settings: CoordinatorSettings | None = None
        self._coord: Coordinator | None = None
        # Touched by the loop thread only, except the intake (a deque: appends from any thread).
        self._intake: deque[Item] = deque()
        self._intake_lock = threading.Lock()  # sample indices are taken under it
        self._next_sample = 0
        self._items: dict[int, tuple[Any, WorkflowProtocol]] = {}  # sample → (data, workflow)
        self._source: ItemSource | None = None
        self._source_error: Exception | None = None
        self._exhausted: DataExhausted | None = None  # the loader is used up: end when drained
        self._resume_skip: int | None = None  # data-loader items to skip after load_state_dict
        self._output: deque[tuple[Trajectory, ...]] = deque()
        # Settled untrained, not yet drained: appended on the loop thread, drained from any.
        self._outcomes: deque[tuple[int, str]] = deque()
        self._timers = NamedTimers(self._timer_fired)  # the coordinator's, by name
        self._progress_handle: asyncio.TimerHandle | None = None
        self._stopped: RolloutError | None = None
        self._wakeups = 0
        self._episodes: Episodes  # built on the loop thread, when it starts
        # held around each call into the coordinator when it shares an AReaL manager's counters
        self._lock: AbstractContextManager[Any] = nullcontext()
        self._carry_out: dict[type, Callable[[Any], None]] = {
            ev.StartGroup: self._start_group,
            ev.AbortGroup: self._report,
            ev.Retry: self._report,
            ev.ArmTimer: lambda a: self._timers.arm(a.timer, a.at),
            ev.CancelTimer: lambda a: self._timers.cancel(a.timer),
            ev.HandOverBatch: self._hand_over,
            ev.ReportDrop: self._report_drop,
            ev.ReportFailure: self._report,
            ev.ReportStall: self._report,
            ev.EvaluateGroup: lambda a: self._handle(evaluate_group(a, self._now())),
            ev.NotifyGate: lambda a: getattr(self.staleness_manager, a.call)(),
            ev.Wake: self._woken,
            ev.Stop: self._stopped_by,
        }

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, train_data_parallel_size: int = 1) -> WorkflowExecutor:
        """Build the coordinator for this data-parallel rank and start the event loop thread.

        ``max_concurrent_rollouts``, ``consumer_batch_size`` (and ``buffer_size``) are divided by
        ``train_data_parallel_size``; the staleness bound is not.
        """
        if self._thread is not None or self._closed:
            raise ProtocolError(
                "initialize(): the executor is already initialized (or destroyed); build a new "
                "WorkflowExecutor to start again"
            )
        check(self.config, "rollout")  # built in Python or changed since it was loaded
        s = resolve_settings(self.config, train_data_parallel_size)
        cut = s.cuts_short()
        if cut and _method(self.inference_engine, "abort") is None:
            raise ConfigError(
                f"rollout.{cut[0]}='truncate': the inference engine "
                f"{type(self.inference_engine).__name__} has no abort(request_id), so running "
                f"generations cannot be cut short; use {cut[1]}, or an engine with abort"
            )
        start = self._engine_version() if self._engine_version is not None else 0
        self._published = start
        manager = self.staleness_manager
        if s.policy == "buffer":
            coord = Coordinator(build_policy(s, start), s, gated=manager is not None)
        else:
            if manager is None:
                manager = StalenessManager(
                    self, s.max_concurrent, s.batch_size, s.admission_staleness, strict=True
                )
                self.staleness_manager = manager
            with manager.lock:
                policy = build_policy(s, start, counter=manager.counter)
            # the manager's limits are the policy's: report what is actually enforced
            s = replace(s, batch_size=policy.batch_size, staleness=policy.staleness)
            s = replace(s, soft_staleness=getattr(policy, "soft_staleness", s.soft_staleness))
            coord = Coordinator(policy, s)
            self._lock = manager.lock  # the policy shares the manager's counters
        # its capacity bounds each dispatch (the deadline policy applies it itself)
        self._gate: StalenessManager | None = None if s.policy == "deadline" else manager
        self._settings, self._coord = s, coord
        self._start_thread("stalebound-executor")
        return self

    def destroy(self) -> None:
        """Cancel everything running, stop the loop and join its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_thread(self._shutdown())

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int:
        """The training version: the next batch handed out is consumed at this version."""
        return self._require_coord().policy.version

    def get_version(self) -> int:
        """The version new groups are generated with: ``min(engine version, training version)``.

        The engine's ``get_version()`` when it has one, else the last :meth:`set_version`. This is
        also the :class:`VersionProvider` of the manager built for the capacity policy.
        """
        ev_ = self._engine_version() if self._engine_version is not None else self._published
        coord = self._coord
        if coord is None or ev_ < (v := coord.policy.version):
            return ev_
        return v

    def set_version(self, version: int) -> None:
        """New weights of ``version`` are published: forward to the engine and wake the dispatcher.

        Call it after each weight update (the dispatcher cannot see an engine's version change
        otherwise until its next event).
        """
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ProtocolError(f"set_version({version!r}): the version must be an int ≥ 0")
        if self._engine_set_version is not None:
            self._engine_set_version(version)
        self._published = version
        self._soon(self._guarded, partial(ev.VersionPublished, version), f"set_version({version})")

    # ------------------------------------------------------------------ submission

    def get_capacity(self) -> int:
        """How many more :meth:`submit` calls would be admitted now (may be ≤ 0): the policy's
        capacity (and the manager's, when there is one) minus the items already queued."""
        return self._call(self._capacity)

    def submit(
        self, data: Any, workflow: WorkflowProtocol, should_accept_fn: ShouldAccept | None = None
    ) -> None:
        """Queue one item; it becomes one group of N′ ``arun_episode`` calls once admitted.

        Raises :class:`ProtocolError` when the input queue already holds ``queue_size`` items.
        """
        s = self._require_running()
        need_workflow("submit", workflow)
        if self._stopped is not None:
            raise self._stopped
        assert self._coord is not None
        if len(self._intake) + self._coord.queued >= s.queue_size:
            raise ProtocolError(
                f"submit(): the input queue is full ({s.queue_size} items waiting for admission, "
                f"rollout.queue_size={self.config.queue_size!r}); submit no more than "
                "get_capacity() allows, take results with wait()/prepare_batch(), or raise "
                "rollout.queue_size"
            )
        with self._intake_lock:
            self._intake.append((data, workflow, should_accept_fn, 0, self._next_sample))
            self._next_sample += 1
        self._kick_threadsafe()

    def wait(self, count: int, timeout: float | None = None) -> list[Trajectory]:
        """Block until ``count`` groups are trained-ready; return their trajectories.

        Batches are consumed in version order as needed (each consume advances the training
        version by one; leftovers wait for the next call, so ask for multiples of
        ``consumer_batch_size``). Raises :class:`TimeoutError` after ``timeout`` seconds (nothing
        is taken then) and :class:`RolloutError` if the executor has stopped.
        """
        self._require_running()
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ProtocolError(f"wait(count={count!r}): count must be an integer ≥ 0")
        return self._request(count, timeout, None, "wait()")

    def collect_results(self) -> list[Trajectory]:
        """Non-blocking: the next batch (``consumer_batch_size`` groups) if one is ready, else []."""
        return self._call(self._collect)

    def rollout_batch(
        self,
        data: Sequence[Any],
        workflow: WorkflowProtocol,
        should_accept_fn: ShouldAccept | None = None,
    ) -> list[Trajectory]:
        """Submit every item of ``data`` and wait for as many groups."""
        for item in data:
            self.submit(item, workflow, should_accept_fn)
        return self.wait(len(data))

    def prepare_batch(
        self,
        dataloader: Iterable[Any],
        workflow: WorkflowProtocol,
        should_accept_fn: ShouldAccept | None = None,
    ) -> list[Trajectory]:
        """Keep generating from ``dataloader`` (cycled) and return the next batch.

        Items are drawn whenever capacity opens, also while the caller trains, so the next batch
        is under way; the loader is iterated on the executor's thread. Each element it yields is a
        list/tuple of items (AReaL's loaders) or one item. Calling again with the same loader and
        workflow continues where it left off.
        """
        s = self._require_running()
        need_workflow("prepare_batch", workflow)
        source = ItemSource(dataloader, workflow, should_accept_fn)
        return self._request(s.batch_size, None, source, "prepare_batch()")

    def pause(self) -> None:
        """Stop admitting new groups (running ones go on). Returns once no admission can follow."""
        self._call(lambda: self._handle(ev.Paused(self._now())))

    def resume(self) -> None:
        """Admit again; wakes the dispatcher."""
        self._call(lambda: self._handle(ev.Resumed(self._now())))

    @property
    def paused(self) -> bool:
        return self._coord is not None and self._coord.paused

    def statistics(self) -> ExecutorStatistics:
        """A frozen snapshot of every counter, the policy's statistics and the manager's.

        Also works after :meth:`destroy` (the final counts)."""
        if self._closed and self._thread is not None and not self._thread.is_alive():
            return self._statistics()  # the loop is gone: nothing else touches the state
        return self._call(self._statistics)

    def inspect_policy(self, fn: Callable[[StalenessPolicy], _T]) -> _T:
        """Run a read-only ``fn(policy)`` on the loop thread (the only thread that touches the
        policy) and return its result: how a live view reads the buffers safely."""
        policy = self._require_coord().policy
        return self._call(lambda: self._locked(fn, policy))

    def drain_outcomes(self) -> list[tuple[int, str]]:
        """Items that ended without being trained since the last call, as ``(sample_index,
        outcome)`` with the outcome one of :data:`OUTCOMES`. With the sample indices of the
        trajectories handed out, every item taken in is accounted for once: trained, one of
        these, or still pending (in :meth:`state_dict`). Retried items are not ended."""
        self._require_running()
        out = []
        outcomes = self._outcomes
        while outcomes:
            out.append(outcomes.popleft())
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a restarted executor needs to continue exactly here (:meth:`load_state_dict`),
        taken in one hop on the loop thread; what it holds: :mod:`stalebound.runtime.checkpoint`.
        Running episodes are not interrupted."""
        return self._call(self._state_dict)

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        workflow: WorkflowProtocol,
        should_accept_fn: ShouldAccept | None = None,
    ) -> None:
        """Continue from :meth:`state_dict` output; call it after :meth:`initialize`, before
        anything is submitted. Re-dispatched items run ``workflow`` (and ``should_accept_fn``);
        how the rest resumes: :mod:`stalebound.runtime.checkpoint`. A state of another format or
        policy raises :class:`ProtocolError` and changes nothing."""
        self._require_running()
        need_workflow("load_state_dict", workflow)
        self._call(self._load_state, state, workflow, should_accept_fn)

    # ------------------------------------------------------------------ thread plumbing

    def _require_coord(self) -> Coordinator:
        if self._coord is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")
        return self._coord

    def _require_running(self) -> CoordinatorSettings:
        if self._closed:
            raise ProtocolError("the executor was destroyed; build a new WorkflowExecutor")
        if self._settings is None or self._loop is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")
        return self._settings

    def _request(
        self, count: int, timeout: float | None, source: ItemSource | None, op: str
    ) -> list[Trajectory]:
        """Answer at once when enough is ready, else wait on the loop — parked in the same hop, so
        no wake-up before the waiting task starts is lost and it need not ask again at once."""
        parked: list[asyncio.Future[None]] = []

        def now() -> list[Trajectory] | None:
            if source is not None:
                self._set_source(source)
            if self._fill(count):
                return self._pop(count)
            parked.append(self._park())
            return None

        return self._answer(op, now, lambda: self._take(count, timeout, parked))

    def _loop_started(self, loop: asyncio.AbstractEventLoop) -> None:
        timeout = self._settings.request_timeout if self._settings else None
        episodes = self._episodes = Episodes(
            loop, self.inference_engine, self._member_ended, self._progressed, timeout
        )
        self._carry_out[ev.LaunchMember] = episodes.launch
        self._carry_out[ev.AbortRequest] = episodes.stop
        self._carry_out[ev.TruncateMember] = episodes.truncate

    # ------------------------------------------------------------------ events in

    def _handle(self, event: ev.Event) -> None:
        """Hand one event to the coordinator (under the lock), then carry out its actions."""
        with self._lock:
            actions = self._coord.handle(event)  # type: ignore[union-attr]
        if self.action_log is not None:
            self.action_log(event, actions)
        if actions:
            carry_out = self._carry_out
            for action in actions:
                carry_out[type(action)](action)
        if self._exhausted is not None:  # a waiting trainer checks whether anything is left
            self._notify()

    def _locked(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` under the lock around the coordinator (a query of it)."""
        with self._lock:
            return fn(*args, **kwargs)

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _guarded(self, event: Callable[[float], ev.Event], what: str) -> None:
        """:meth:`_handle` of ``event(now)``; a failure stops the executor loudly."""
        try:
            self._handle(event(self._now()))
        except Exception as e:
            self._failed(what, e)

    def _failed(self, what: str, e: Exception) -> None:
        logger.exception("%s failed", what)
        self._handle(ev.StopRequested(f"{what} failed: {e!r}", self._now()))

    async def _dispatch_forever(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            self._wakeups += 1
            try:
                self._dispatch()
            except Exception as e:  # a bug of ours or a broken data loader: stop loudly
                logger.exception("dispatcher failed")
                self._handle(ev.StopRequested(f"the dispatcher failed: {e!r}", self._now()))

    def _dispatch(self) -> None:
        """Queue what was submitted, draw from the loader what admission takes, and admit."""
        coord = self._require_coord()
        if coord.paused or coord.stopped is not None or self._closed:
            return
        self._drain_intake()
        version = self.get_version()
        budget = self._gate.get_capacity() if self._gate is not None else None
        source = self._source
        if source is not None:
            want = self._locked(coord.items_wanted, version, budget)
            while coord.queued < want:
                try:
                    with self._intake_lock:
                        item = source.next_item(self._next_sample)
                        self._next_sample += 1
                except Exception as e:  # the loader failed (the trainer hears of it) or is
                    self._source = None  # used up (what was drawn is trained first)
                    if isinstance(e, DataExhausted):
                        self._exhausted = e
                    else:
                        self._source_error = e
                    self._notify()
                    break
                self._queue(item)
        if coord.queued:
            self._handle(ev.Dispatch(self._now(), version, budget))

    def _drain_intake(self) -> None:
        intake = self._intake
        while intake:
            self._queue(intake.popleft())

    def _queue(self, item: Item) -> None:
        data, workflow, accept, retries, sample = item
        self._items[sample] = (data, workflow)
        self._handle(ev.Submitted(sample, accept, retries))

    def _member_ended(
        self, m: MemberTask, result: Any, failure: BaseException | str | None
    ) -> None:
        """An episode ended by itself (or timed out): tell the coordinator, guarded (its group
        has let it go: a failure reading its versions or the engine's must not vanish)."""
        try:
            if failure is None and result is not None:  # the common case, without a call
                now = self._loop.time()  # type: ignore[union-attr]
                self._handle(ev.MemberFinished(m.mid, now, result, token_versions(result)))
            else:
                self._handle(outcome_event(m, result, failure, self._now(), self.get_version))
        except Exception as e:
            self._failed(f"handling the outcome of {m.mid}", e)

    def _progressed(self, member: MemberId) -> None:
        self._handle(ev.MemberProgress(member, self._now()))

    def _timer_fired(self, timer: str) -> None:
        self._guarded(partial(ev.TimerFired, timer), f"the {timer} timer")

    # ------------------------------------------------------------------ actions out

    def _start_group(self, a: ev.StartGroup) -> None:
        data, workflow = self._items[a.sample]
        self._episodes.start_group(a.group_id, data, workflow)
        s = self._settings
        assert s is not None and self._loop is not None
        if s.progress_log is not None and self._progress_handle is None:
            self._progress_handle = self._loop.call_later(s.progress_log, self._progress)

    def _hand_over(self, a: ev.HandOverBatch) -> None:
        try:
            handed = list(reports.trajectories(a))
        except ProtocolError as e:  # a batch that cannot be trained within the bound: stop
            why = f"handing over batch {a.version} failed: {e}"
            assert self._loop is not None  # after the actions under way are carried out
            self._loop.call_soon(self._guarded, partial(ev.StopRequested, why), "stopping")
            return
        for sample, group in handed:
            self._items.pop(sample, None)
            self._output.append(group)

    def _report_drop(self, a: ev.ReportDrop) -> None:
        self._items.pop(a.sample, None)
        self._outcomes.append((a.sample, a.outcome))

    def _report(self, a: ev.ReportFailure | ev.ReportStall | ev.Retry | ev.AbortGroup) -> None:
        requests = self._episodes.requests_in_flight(a.group_id)
        reports.log_report(a, self.inference_engine, requests)

    def _woken(self, a: ev.Wake) -> None:
        self._kick()
        self._notify()

    def _stopped_by(self, a: ev.Stop) -> None:
        self._stopped = RolloutError(f"the executor stopped: {a.reason}")
        logger.error("%s", self._stopped)

    def _progress(self) -> None:
        """One log line on the buffers' progress, then again in ``progress_log_s`` if busy."""
        self._progress_handle = None
        coord, s, loop = self._coord, self._settings, self._loop
        assert coord is not None and s is not None and s.progress_log is not None and loop
        line = self._locked(reports.progress_line, coord)
        if line is None:  # idle: no line, and no timer until work starts again
            return
        logger.info("%s", line)
        if not self._closed:
            self._progress_handle = loop.call_later(s.progress_log, self._progress)

    async def _shutdown(self) -> None:
        tasks = self._episodes.tasks()
        self._handle(ev.Shutdown(self._now()))
        self._timers.cancel_all()
        self._notify()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ the trainer's side

    def _fill(self, count: int) -> bool:
        """Have ready batches consumed until ``count`` groups are waiting; whether there are."""
        missing = count - len(self._output)
        if missing > 0:
            self._handle(ev.BatchWanted(missing, self._now()))
        return len(self._output) >= count

    def _pop(self, count: int) -> list[Trajectory]:
        out = self._output
        result: list[Trajectory] = []
        for _ in range(count):
            result.extend(out.popleft())
        return result

    async def _take(self, count: int, timeout: float | None, parked: list[Any]) -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while parked or not self._fill(count):
            error, self._source_error = self._source_error, None
            if error is not None:
                raise error
            if self._stopped is not None:
                raise self._stopped
            if self._closed:
                raise ProtocolError("wait(): the executor was destroyed while waiting")
            coord = self._require_coord()  # a used-up loader ends once nothing can complete
            if self._exhausted and not (coord.queued or coord.running_groups or self._intake):
                raise self._exhausted
            waiter = parked.pop() if parked else self._park()
            if deadline is None:
                await waiter
                continue
            handle = loop.call_later(max(0.0, deadline - loop.time()), settle, waiter)
            try:
                await waiter
            finally:
                handle.cancel()
            if loop.time() >= deadline and not self._fill(count):
                assert self._coord is not None
                queued = self._coord.queued + len(self._intake)
                state = self._locked(reports.describe, self._coord, self.get_version(), queued)
                raise TimeoutError(
                    f"wait(count={count}, timeout={timeout}): only {len(self._output)} groups "
                    f"ready after {timeout} s ({state})"
                )
        return self._pop(count)

    def _collect(self) -> list[Trajectory]:
        s = self._settings
        assert s is not None
        if self._fill(s.batch_size):
            return self._pop(s.batch_size)
        if self._stopped is not None:
            raise self._stopped
        return []

    def _set_source(self, new: ItemSource) -> None:
        src = self._source
        if src is None or src.dataloader is not new.dataloader:
            self._exhausted = None
            if self._resume_skip:  # kept until done: a used-up loader says so on every call
                new.skip(self._resume_skip)
            self._resume_skip = None
            self._source = new
        else:  # the same loader: continue where it is, with this call's workflow
            src.workflow, src.accept = new.workflow, new.accept
        self._kick()

    # ------------------------------------------------------------------ checkpoints, reports

    def _state_dict(self) -> dict[str, Any]:
        coord = self._require_coord()
        with self._intake_lock:
            self._drain_intake()
            next_sample = self._next_sample
        drawn = self._source.drawn if self._source is not None else (self._resume_skip or 0)
        return build_state(
            self._locked(coord.snapshot),
            {i: data for i, (data, _) in self._items.items()},
            waiting=self._output,
            loader_position=drawn,
            next_sample=next_sample,
            outcomes=self._outcomes,
            dispatch_wakeups=self._wakeups,
            aborted_requests=self._episodes.aborted_requests,
            aborted_tokens=self._episodes.aborted_tokens,
        )

    def _load_state(
        self, state: Mapping[str, Any], workflow: WorkflowProtocol, accept: ShouldAccept | None
    ) -> None:
        coord = self._require_coord()
        if self._episodes.groups or self._intake or self._output or self._source or coord.queued:
            raise ProtocolError(
                "load_state_dict(): the executor has already taken work; load the state right "
                "after initialize(), before submit() or prepare_batch()"
            )
        saved = read_state(state, coord.policy.name)
        self._locked(coord.restore, **saved.for_coordinator(), accept=accept)
        self._wakeups = saved.dispatch_wakeups
        self._episodes.aborted_requests = Counter(saved.aborted_requests)
        self._episodes.aborted_tokens = Counter(saved.aborted_tokens)
        self._items = {i: (data, workflow) for i, data, _ in saved.pending}
        self._output = deque(saved.waiting)
        self._outcomes = deque(saved.outcomes)
        self._resume_skip = saved.loader_position
        with self._intake_lock:
            self._next_sample = saved.next_sample
        logger.info("%s", saved.summary(coord.version))
        self._kick()

    def _capacity(self) -> int:
        coord = self._require_coord()
        cap = self._locked(coord.capacity, self.get_version())
        if self.staleness_manager is not None:
            cap = min(cap, self.staleness_manager.get_capacity())
        return cap - coord.queued - len(self._intake)

    def _statistics(self) -> ExecutorStatistics:
        coord = self._require_coord()
        manager, episodes = self.staleness_manager, self._episodes
        stats = manager.get_stats() if manager is not None else None  # takes its lock
        return self._locked(
            reports.statistics,
            coord,
            now=self._loop.time() if self._loop is not None else 0.0,
            manager=stats,
            generation=self.get_version(),
            stopped=str(self._stopped) if self._stopped is not None else None,
            queued=coord.queued + len(self._intake),
            waiting=len(self._output),
            wakeups=self._wakeups,
            aborted_requests=episodes.aborted_requests,
            aborted_tokens=episodes.aborted_tokens,
        )


def _method(obj: Any, name: str) -> Callable[..., Any] | None:
    method = getattr(obj, name, None)
    return method if callable(method) else None

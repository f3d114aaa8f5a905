"""The workflow executor: a thin asyncio driver of the decision core.

:class:`WorkflowExecutor` has AReaL's surface (``initialize``, ``submit``, ``wait``,
``collect_results``, ``rollout_batch``, ``prepare_batch``, ``pause``, ``resume``, ``destroy``,
``get_capacity``) over either staleness policy (``rollout.staleness_policy``: ``buffer``, the
per-trajectory bound, or ``capacity``, AReaL's aggregate bound).

It decides nothing about staleness. Every decision — admission, group tracking, filters, the
proactive filter, the watchdog, when to stop — is the :class:`~stalebound.core.Coordinator`'s. The
executor turns what happens into the coordinator's events (a submitted item, an episode's return
value or exception, a timer, the trainer asking for a batch) and carries out the actions it gets
back, in order: start episodes, abort engine requests and cancel tasks, arm timers, hand batches
to the trainer, log. ``action_log`` (a callable) sees every ``(event, actions)`` pair.

How it runs. One event loop in a background thread owns the coordinator and the running tasks.
Public methods called from other threads hop onto that loop (``call_soon_threadsafe``). A
submitted item is one *group*: N′ ``workflow.arun_episode(engine, data)`` calls, each returning one
trajectory (``None`` meaning rejected). Taking a batch *consumes* it, which advances the training
version; the trainer then publishes new weights and calls :meth:`~WorkflowExecutor.set_version`.
The dispatcher is a task that sleeps on an :class:`asyncio.Event`, woken by whatever can open
capacity; it never polls.

Engine requests. When the engine has ``abort(request_id)``, each member's workflow gets a thin
proxy of it (:class:`~stalebound.runtime.episodes.MemberEngine`) that remembers the requests in
flight. Members stopped on purpose have those requests aborted with ``await engine.abort(rid)``
first — the partial outputs are counted as wasted tokens — and their tasks are then cancelled;
engines without ``abort``, requests without ids and shutdown fall back to cancelling the task.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any, TypeVar

from stalebound.config import RolloutConfig
from stalebound.core import (
    ConfigError,
    Coordinator,
    CoordinatorSettings,
    MemberId,
    ProtocolError,
    StalenessPolicy,
    build_policy,
    resolve_settings,
)
from stalebound.core import events as ev
from stalebound.core.coordinator import OUTCOMES
from stalebound.core.filters import buffer_progress
from stalebound.runtime.checkpoint import STATE_FORMAT, build_state, read_state
from stalebound.runtime.episodes import (
    Episodes,
    Item,
    ItemSource,
    MemberTask,
    ShouldAccept,
    WorkflowProtocol,
    token_versions,
)
from stalebound.runtime.loop import LoopThread
from stalebound.runtime.results import ExecutorStatistics, RolloutError, Trajectory
from stalebound.runtime.staleness_manager import StalenessManager

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

    Call :meth:`initialize` first and :meth:`destroy` at the end (or use ``with``).
    """

    def __init__(
        self,
        config: RolloutConfig,
        inference_engine: Any,
        staleness_manager: StalenessManager | None = None,
        *,
        action_log: ev.ActionLog | None = None,
    ) -> None:
        self.config = config
        self.inference_engine = inference_engine
        self.staleness_manager: StalenessManager | None = staleness_manager
        self.action_log = action_log
        getter = getattr(inference_engine, "get_version", None)
        self._engine_version: Callable[[], int] | None = getter if callable(getter) else None
        setter = getattr(inference_engine, "set_version", None)
        self._engine_set_version: Callable[[int], Any] | None = setter if callable(setter) else None
        abort = getattr(inference_engine, "abort", None)
        self._engine_abort: Callable[[Any], Any] | None = abort if callable(abort) else None
        super().__init__()
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
        self._resume_skip: int | None = None  # data-loader items to skip after load_state_dict
        self._output: deque[tuple[Trajectory, ...]] = deque()
        # Settled untrained, not yet drained: appended on the loop thread, drained from any.
        self._outcomes: deque[tuple[int, str]] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._progress_handle: asyncio.TimerHandle | None = None
        self._stopped: RolloutError | None = None
        self._wakeups = 0
        self._episodes: Episodes  # built on the loop thread, when it starts
        self._carry_out: dict[type, Callable[[Any], None]] = {
            ev.StartGroup: self._start_group,
            ev.LaunchMember: lambda a: self._episodes.launch(a.member, a.relaunch),
            ev.AbortRequest: lambda a: self._episodes.stop(a.member, a.cause),
            ev.TruncateMember: lambda a: self._episodes.truncate(a.member, a.cause),
            ev.AbortGroup: self._group_aborted,
            ev.Retry: self._retried,
            ev.ArmTimer: self._arm_timer,
            ev.CancelTimer: self._cancel_timer,
            ev.HandOverBatch: self._hand_over,
            ev.ReportDrop: self._report_drop,
            ev.ReportFailure: self._report_failure,
            ev.ReportStall: self._report_stall,
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
        s = resolve_settings(self.config, train_data_parallel_size)
        if s.proactive == "truncate" and self._engine_abort is None:
            raise ConfigError(
                f"rollout.proactive_filter.method='truncate': the inference engine "
                f"{type(self.inference_engine).__name__} has no abort(request_id), so running "
                "generations cannot be cut short; use method=retry, or an engine with abort"
            )
        start = self._engine_version() if self._engine_version is not None else 0
        self._published = start
        manager = self.staleness_manager
        if s.policy == "buffer":
            coord = Coordinator(build_policy(s, start), s, gate=manager)
        else:
            if manager is None:
                manager = StalenessManager(
                    self, s.max_concurrent, s.batch_size, s.staleness, strict=True
                )
                self.staleness_manager = manager
            with manager.lock:
                policy = build_policy(s, start, counter=manager.counter)
            # the manager's limits are the policy's: report what is actually enforced
            s = replace(s, batch_size=policy.batch_size, staleness=manager.max_staleness)
            coord = Coordinator(policy, s, guard=manager.lock)
        self._settings, self._coord = s, coord
        self._start_thread("stalebound-executor")
        return self

    def destroy(self) -> None:
        """Cancel everything running, stop the loop and join its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_thread(self._shutdown())

    def __enter__(self) -> WorkflowExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int:
        """The training version: the next batch handed out is consumed at this version."""
        return self._require_policy().version

    def get_version(self) -> int:
        """The version new groups are generated with: ``min(engine version, training version)``.

        The engine's ``get_version()`` when it has one, else the last :meth:`set_version`. This is
        also the :class:`VersionProvider` of the manager built for the capacity policy.
        """
        ev_ = self._engine_version() if self._engine_version is not None else self._published
        coord = self._coord
        if coord is None:
            return ev_
        v = coord.policy.version
        return ev_ if ev_ < v else v

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
        self._kick_threadsafe()

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
        _need_workflow("submit", workflow)
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
        _need_workflow("prepare_batch", workflow)
        source = ItemSource(dataloader, workflow, should_accept_fn)
        return self._request(s.batch_size, None, source, "prepare_batch()")

    def pause(self) -> None:
        """Stop admitting new groups (running ones go on). Returns once no admission can follow."""
        self._call(self._event_now, ev.Paused)

    def resume(self) -> None:
        """Admit again; wakes the dispatcher."""
        self._call(self._event_now, ev.Resumed)

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
        policy = self._require_policy()
        return self._call(fn, policy)

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
        """What a restarted executor needs to continue exactly here (:meth:`load_state_dict`).

        Taken in one hop on the loop thread, so it is consistent: the policy's snapshot (the
        buffers' reservations, and the completed groups with their results), the items of the
        groups running now and of the input queue (data and retry counts), the consumed groups not
        yet handed out, the data loader's position, the outcomes not yet drained and every
        counter. Running episodes are not interrupted. Workflows and filters are not saved. The
        training job's checkpoints store it as JSON data (:mod:`stalebound.train.statejson`): the
        items and results must then be plain data or the tasks' ``Sample`` / ``Trajectory``.
        """
        return self._call(self._state_dict)

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        workflow: WorkflowProtocol,
        should_accept_fn: ShouldAccept | None = None,
    ) -> None:
        """Continue from :meth:`state_dict` output; call it after :meth:`initialize`, before
        anything is submitted.

        Completed groups go back into their buffers (or the capacity policy's queue) at their
        versions; groups that were running are aborted in the policy (cause ``resumed``, counted
        as ``resumed_groups``) and their items queued first, to be generated again from the start
        at the current version; then the queued items; the next :meth:`prepare_batch` skips the
        items its data loader had already yielded. Re-dispatched items run ``workflow`` (and
        ``should_accept_fn``). Sample indices, group ids and counters continue. A state of another
        format or policy raises :class:`ProtocolError` and changes nothing.
        """
        self._require_running()
        _need_workflow("load_state_dict", workflow)
        self._call(self._load_state, state, workflow, should_accept_fn)

    # ------------------------------------------------------------------ thread plumbing

    def _require_policy(self) -> StalenessPolicy:
        if self._coord is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")
        return self._coord.policy

    def _require_running(self) -> CoordinatorSettings:
        if self._closed:
            raise ProtocolError("the executor was destroyed; build a new WorkflowExecutor")
        if self._settings is None or self._loop is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")
        return self._settings

    def _request(
        self, count: int, timeout: float | None, source: ItemSource | None, op: str
    ) -> list[Trajectory]:
        """Answer at once when enough is ready, else wait on the loop."""

        def now() -> list[Trajectory] | None:
            if source is not None:
                self._set_source(source)
            return self._pop(count) if self._fill(count) else None

        return self._answer(op, now, lambda: self._take(count, timeout))

    def _loop_started(self, loop: asyncio.AbstractEventLoop) -> None:
        timeout = self._settings.request_timeout if self._settings else None
        self._episodes = Episodes(
            loop, self.inference_engine, self._member_ended, self._progressed, timeout
        )

    # ------------------------------------------------------------------ events in

    def _handle(self, event: ev.Event) -> None:
        """Hand one event to the coordinator and carry out its actions, in order."""
        assert self._coord is not None
        actions = self._coord.handle(event)
        if self.action_log is not None:
            self.action_log(event, actions)
        carry_out = self._carry_out
        for action in actions:
            carry_out[type(action)](action)

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _event_now(self, kind: Callable[[float], ev.Event]) -> None:
        self._handle(kind(self._now()))

    def _guarded(self, what: str, event: ev.Event) -> None:
        """Handle an event from a callback; a failure stops the executor loudly."""
        try:
            self._handle(event)
        except Exception as e:
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
        """Queue what was submitted, draw from the data loader what admission can take, and let
        the coordinator admit."""
        coord = self._coord
        assert coord is not None
        if coord.paused or coord.stopped is not None or self._closed:
            return
        self._drain_intake()
        version = self.get_version()
        gate = self.staleness_manager
        budget = gate.get_capacity() if gate is not None else None
        source = self._source
        if source is not None:
            # as many as admission will take, and one more it refuses (as item-by-item would)
            want = max(coord.capacity(version), 0) + 1
            if budget is not None:
                want = min(want, budget)
            while coord.queued < want:
                try:
                    with self._intake_lock:
                        item = source.next_item(self._next_sample)
                        self._next_sample += 1
                except Exception as e:  # the data loader failed: the trainer hears of it
                    self._source = None
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
        """An episode ended by itself (or timed out): tell the coordinator."""
        now = self._now()
        event: ev.Event
        if failure is None and result is not None:
            event = ev.MemberFinished(m.mid, now, result, token_versions(result))
        elif failure is None:
            event = ev.MemberFailed(m.mid, now, "rejected", self.get_version())
        elif isinstance(failure, str):
            event = ev.MemberFailed(m.mid, now, failure, self.get_version())
        else:
            logger.debug("episode %s failed: %r", m.mid, failure, exc_info=failure)
            cause = f"error:{type(failure).__name__}"
            event = ev.MemberFailed(m.mid, now, cause, self.get_version(), repr(failure))
        self._guarded(f"handling the outcome of {m.mid}", event)

    def _progressed(self, member: MemberId) -> None:
        self._handle(ev.MemberProgress(member, self._now()))

    def _timer_fired(self, timer: str) -> None:
        self._timers.pop(timer, None)
        self._guarded(f"the {timer} timer", ev.TimerFired(timer, self._now()))

    # ------------------------------------------------------------------ actions out

    def _start_group(self, a: ev.StartGroup) -> None:
        data, workflow = self._items[a.sample]
        self._episodes.start_group(a.group_id, data, workflow)
        s = self._settings
        assert s is not None and self._loop is not None
        if s.progress_log is not None and self._progress_handle is None:
            self._progress_handle = self._loop.call_later(s.progress_log, self._progress)

    def _group_aborted(self, a: ev.AbortGroup) -> None:
        logger.debug("group %d left the policy: %s", a.group_id, a.cause)

    def _retried(self, a: ev.Retry) -> None:
        logger.info(
            "proactive filter: the head buffer is STUCK; retrying group %d (item %d, retry %d)",
            a.group_id,
            a.sample,
            a.retries,
        )

    def _arm_timer(self, a: ev.ArmTimer) -> None:
        self._cancel_timer(ev.CancelTimer(a.timer))
        assert self._loop is not None
        self._timers[a.timer] = self._loop.call_at(a.at, self._timer_fired, a.timer)

    def _cancel_timer(self, a: ev.CancelTimer) -> None:
        handle = self._timers.pop(a.timer, None)
        if handle is not None:
            handle.cancel()

    def _hand_over(self, a: ev.HandOverBatch) -> None:
        v, out, items = a.version, self._output, self._items
        for g in a.groups:
            gid, sample = g.group_id, g.sample
            items.pop(sample, None)
            out.append(
                tuple(
                    Trajectory(
                        r.result, gid, r.member.number, r.version, v, v - r.version, tv, cut, sample
                    )
                    for r, tv, cut in g.members
                )
            )

    def _report_drop(self, a: ev.ReportDrop) -> None:
        self._items.pop(a.sample, None)
        self._outcomes.append((a.sample, a.outcome))

    def _report_failure(self, a: ev.ReportFailure) -> None:
        logger.warning("%s", a.why)

    def _report_stall(self, a: ev.ReportStall) -> None:
        requests = self._episodes.requests_in_flight(a.group_id)
        logger.warning(
            "watchdog: group %d (V=%d, training version %d) has produced nothing for %.3g s; "
            "members %s running on %s, engine requests in flight %s",
            a.group_id,
            a.version,
            a.training_version,
            a.silent_for,
            list(a.members),
            type(self.inference_engine).__name__,
            requests,
        )

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
        if not coord.running_groups:  # idle: no line, and no timer until work starts again
            return
        running = f"{coord.running_groups} groups ({coord.running_members} members) running"
        if coord.buffer is not None:
            logger.info("buffers %s; %s", buffer_progress(coord.buffer), running)
        else:
            p = coord.policy.statistics()
            logger.info(
                "policy %s version %d: %d waiting; %s", p.policy, p.version, p.waiting, running
            )
        if not self._closed:
            self._progress_handle = loop.call_later(s.progress_log, self._progress)

    async def _shutdown(self) -> None:
        tasks = self._episodes.tasks()
        self._handle(ev.Shutdown(self._now()))
        for timer in list(self._timers):
            self._cancel_timer(ev.CancelTimer(timer))
        self._notify()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ the trainer's side

    def _notify(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)

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

    async def _take(self, count: int, timeout: float | None) -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._fill(count):
            error, self._source_error = self._source_error, None
            if error is not None:
                raise error
            if self._stopped is not None:
                raise self._stopped
            if self._closed:
                raise ProtocolError("wait(): the executor was destroyed while waiting")
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            if deadline is None:
                await waiter
                continue
            handle = loop.call_later(max(0.0, deadline - loop.time()), _settle, waiter)
            try:
                await waiter
            finally:
                handle.cancel()
            if loop.time() >= deadline and not self._fill(count):
                raise TimeoutError(
                    f"wait(count={count}, timeout={timeout}): only {len(self._output)} groups "
                    f"ready after {timeout} s ({self._describe()})"
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
            skip, self._resume_skip = self._resume_skip, None
            if skip:
                new.skip(skip)
            self._source = new
        else:  # the same loader: continue where it is, with this call's workflow
            src.workflow, src.accept = new.workflow, new.accept
        self._kick()

    # ------------------------------------------------------------------ checkpoints, reports

    def _state_dict(self) -> dict[str, Any]:
        coord = self._coord
        assert coord is not None
        with self._intake_lock:
            self._drain_intake()
            next_sample = self._next_sample
        drawn = self._source.drawn if self._source is not None else (self._resume_skip or 0)
        return build_state(
            coord.snapshot(),
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
        coord = self._coord
        assert coord is not None
        if self._episodes.groups or self._intake or self._output or self._source or coord.queued:
            raise ProtocolError(
                "load_state_dict(): the executor has already taken work; load the state right "
                "after initialize(), before submit() or prepare_batch()"
            )
        saved = read_state(state, coord.policy.name)
        coord.restore(
            policy_state=saved.policy_state,
            running=saved.running,
            pending=[(i, r) for i, _, r in saved.pending],
            samples=saved.samples,
            next_group_id=saved.next_group_id,
            counts=saved.counts,
            by_cause=saved.by_cause,
            accept=accept,
        )
        self._wakeups = saved.dispatch_wakeups
        self._episodes.aborted_requests = Counter(saved.aborted_requests)
        self._episodes.aborted_tokens = Counter(saved.aborted_tokens)
        self._items = {i: (data, workflow) for i, data, _ in saved.pending}
        self._output = deque(saved.waiting)
        self._outcomes = deque(saved.outcomes)
        self._resume_skip = saved.loader_position
        with self._intake_lock:
            self._next_sample = saved.next_sample
        logger.info(
            "resumed at version %d: %d groups waiting in the policy, %d items to dispatch again, "
            "%d queued",
            coord.version,
            len(saved.samples),
            len(saved.running),
            len(saved.pending) - len(saved.running),
        )
        self._kick()

    def _capacity(self) -> int:
        coord = self._coord
        assert coord is not None
        cap = coord.capacity(self.get_version())
        if self.staleness_manager is not None:
            cap = min(cap, self.staleness_manager.get_capacity())
        return cap - coord.queued - len(self._intake)

    def _describe(self) -> str:
        coord = self._coord
        assert coord is not None
        p = coord.policy.statistics()
        generation = self.get_version()
        hint = ""
        if generation < p.version:
            hint = (
                f"; new groups are generated at version {generation}, behind the training version "
                f"{p.version}: after publishing weights, call set_version({p.version})"
            )
        return (
            f"policy {p.policy} at version {p.version}: {p.running} running, {p.waiting} waiting, "
            f"{coord.queued + len(self._intake)} queued, paused={coord.paused}{hint}"
        )

    def _statistics(self) -> ExecutorStatistics:
        coord = self._coord
        if coord is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")
        ps = coord.policy_statistics()
        manager = self.staleness_manager
        stuck = coord.stuck_seconds(self._loop.time() if self._loop is not None else 0.0)
        queued = coord.queued + len(self._intake)
        counts = coord.counts
        counted: dict[str, Any] = {**counts.totals(), **counts.by_cause()}
        return ExecutorStatistics(
            policy=ps,
            manager=manager.get_stats() if manager is not None else None,
            version=coord.version,
            generation_version=self.get_version(),
            paused=coord.paused,
            stopped=str(self._stopped) if self._stopped is not None else None,
            queued=queued,
            submitted=counts.dispatched_groups + queued,
            running_groups=coord.running_groups,
            running_members=coord.running_members,
            aborted_requests=MappingProxyType(dict(self._episodes.aborted_requests)),
            aborted_tokens=MappingProxyType(dict(self._episodes.aborted_tokens)),
            stuck_seconds=sum(stuck.values()),
            stuck_seconds_by_buffer=MappingProxyType(stuck),
            waiting_groups=len(self._output),
            dispatch_wakeups=self._wakeups,
            **counted,
        )


def _need_workflow(op: str, workflow: Any) -> None:
    if not callable(getattr(workflow, "arun_episode", None)):
        raise ProtocolError(
            f"{op}(workflow={workflow!r}): a workflow must have an async "
            "arun_episode(engine, data) method"
        )


def _settle(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)

"""The decision core: one pure object that owns every staleness decision of a rollout driver.

:class:`Coordinator` is a protocol object in the spirit of h11: it does no IO, reads no clock,
starts no thread. A driver feeds it frozen events (:mod:`stalebound.core.events`) and carries out
the actions it returns, in order::

    actions = coordinator.handle(MemberFinished(member, now, result, versions))
    for action in actions:
        ...  # launch, abort, truncate, arm a timer, hand a batch over, report

What it decides (and no driver decides again):

* **Admission and reservation** — which queued items start, at which version, in which buffer
  (through its staleness policy: the buffer or the capacity policy, :mod:`stalebound.core.policy`).
* **Group tracking** — N′ members launched per group, complete at N, surplus aborted, a failed
  member relaunched while N is reachable, else the group fails (:class:`~stalebound.core.GroupTracker`).
* **Occupy / consume** — a completed group passes the filters (``should_accept_fn``, the group
  post-processor) and occupies its entry; the trainer's :class:`~stalebound.core.events.BatchWanted`
  consumes ready batches; surplus reservations of a consumed buffer are aborted.
* **The proactive filter** — a STUCK head buffer with at most ``threshold`` reservations is
  retried (its prompts queued again first, finished groups pulled forward) or truncated, at once
  for overtaken groups or after ``stuck_timeout`` on a timer; at most ``max_retries`` per item.
* **The watchdog** — groups silent for ``watchdog`` seconds are reported once per stall.
* **Stopping** — after ``max_failures`` failed or ``max_filtered`` filtered groups in a row.
* **Deadline actions** — a policy that has ``deadline_verdicts`` (:class:`DeadlinePolicy`) names,
  each time a buffer becomes the head, the running groups whose deadline it is and whether to
  truncate or abort them; the coordinator turns them into :class:`TruncateMember` /
  :class:`AbortRequest` actions (cause ``deadline``).

Every group's life goes through one transition table (:data:`GROUP_TRANSITIONS`); every ended
item is reported once (:class:`ReportDrop`) or handed over (:class:`HandOverBatch`).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Protocol, cast, runtime_checkable

from stalebound.core.buffer import BufferState, StalenessBuffer
from stalebound.core.deadline import GRACE_WINDOW
from stalebound.core.errors import ConfigError, InvariantError, ProtocolError, StaleboundError
from stalebound.core.events import (
    DEADLINE_TIMER,
    STUCK_TIMER,
    WATCHDOG_TIMER,
    AbortGroup,
    AbortRequest,
    Action,
    ArmTimer,
    BatchWanted,
    CancelTimer,
    Dispatch,
    Event,
    HandedGroup,
    HandedMember,
    HandOverBatch,
    LaunchMember,
    MemberFailed,
    MemberFinished,
    MemberLaunched,
    MemberProgress,
    Paused,
    ReportDrop,
    ReportFailure,
    ReportStall,
    Resumed,
    Retry,
    Shutdown,
    StartGroup,
    Stop,
    StopRequested,
    Submitted,
    TimerFired,
    TruncateMember,
    VersionPublished,
    Wake,
)
from stalebound.core.filters import (
    StragglerClock,
    StuckTimer,
    eligible_targets,
    proactive_filter_targets,
)
from stalebound.core.groups import GroupComplete, GroupTracker, MemberId, Relaunch
from stalebound.core.policy import BufferPolicy, PolicyStatistics, StalenessPolicy
from stalebound.core.settings import CoordinatorSettings
from stalebound.core.transitions import (
    GROUP_TRANSITIONS,
    GroupOp,
    GroupState,
    compile_table,
    move,
)

__all__ = [
    "GROUP_TRANSITIONS",
    "OUTCOMES",
    "AdmissionGate",
    "Coordinator",
    "CoordinatorCounts",
    "DeadlinePolicy",
    "GroupOp",
    "GroupState",
]

OUTCOMES = ("filtered", "failed", "dropped", "surplus", "stopped", "deadline")
"""How an item can end without being trained (:class:`ReportDrop`)."""

# Release causes after which the item goes on (queued again, or the state is being torn down).
_NOT_AN_OUTCOME = frozenset({"retried", "resumed", "shutdown"})
_RECENT_FAILURES = 8
_WAKE = Wake()  # immutable and field-less: one instance serves every wake-up

Accept = Callable[[list[Any]], bool]


@runtime_checkable
class AdmissionGate(Protocol):
    """An outside admission gate driven through AReaL's lifecycle callbacks (a user's
    ``StalenessManager`` in front of the buffer policy). Its capacity reaches the coordinator as
    :attr:`Dispatch.budget`."""

    def on_rollout_enqueued(self) -> None: ...
    def on_rollout_submitted(self) -> None: ...
    def on_rollout_accepted(self) -> None: ...
    def on_rollout_rejected(self) -> None: ...


class DeadlinePolicy(Protocol):
    """The hook a deadline policy implements on top of :class:`~stalebound.core.StalenessPolicy`.

    Called with the head version each time a buffer becomes the head (after a consume), and with
    ``trainer_waiting=True`` each time the trainer asks for a batch the head cannot give yet:
    returns ``(group_id, verdict)`` for running groups whose deadline buffer is the head (each
    group at most once), ``verdict`` ``"truncate"`` (force-complete with the partial output) or
    ``"abort"`` (counted as wasted). With ``overdue=True`` (the trainer has waited the grace for
    the head): ``"abort"`` for every group still running whose deadline is the head, sentenced or
    not, and nothing else changes (it also serves as the question whether any is). The coordinator
    carries the verdicts out; the policy's own buffer operations (pull-forward, defer,
    consume-due-first) happen inside its ``consume``."""

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, str]]: ...


@dataclass
class CoordinatorCounts:
    """Every counter the coordinator keeps, by name (what :class:`ExecutorStatistics` reports)."""

    dispatched_groups: int = 0
    launched_members: int = 0
    finished_members: int = 0
    relaunched_members: int = 0
    completed_groups: int = 0
    failed_groups: int = 0
    filtered_groups: int = 0
    retried_groups: int = 0
    pulled_forward_groups: int = 0
    truncated_groups: int = 0
    truncated_trajectories: int = 0
    deadline_groups: int = 0
    overdue_groups: int = 0
    watchdog_stalls: int = 0
    dropped_groups: int = 0
    surplus_groups: int = 0
    consumed_batches: int = 0
    consumed_groups: int = 0
    consumed_trajectories: int = 0
    resumed_groups: int = 0
    consecutive_failures: int = 0
    consecutive_filtered: int = 0
    member_failures: Counter[str] = field(default_factory=Counter)
    """Failed member episodes by cause."""
    cancelled_members: Counter[str] = field(default_factory=Counter)
    """Members aborted on purpose, by cause."""
    discarded_members: Counter[str] = field(default_factory=Counter)
    """Finished trajectories thrown away with their group, by cause."""

    def totals(self) -> dict[str, int]:
        """The plain counts by name (the per-cause maps left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}

    def by_cause(self) -> dict[str, Mapping[str, int]]:
        """The per-cause maps, read-only copies."""
        return {
            f.name: MappingProxyType(dict(getattr(self, f.name)))
            for f in fields(self)
            if f.type != "int"
        }


# The group transition table compiled to indices (the hot paths look moves up without hashing
# enums); _life holds each group's state as an index into _GROUP_STATES.
_GROUP_STATES = tuple(GroupState)
_GROUP_OPS = tuple(GroupOp)
_GROUP_NEXT = compile_table(GROUP_TRANSITIONS, _GROUP_STATES, _GROUP_OPS)
_QUEUED, _COMPLETED = (
    _GROUP_STATES.index(GroupState.QUEUED),
    _GROUP_STATES.index(GroupState.COMPLETED),
)
(
    _ADMIT,
    _COMPLETE,
    _CONSUME,
    _FAIL,
    _FILTER,
    _RETRY,
    _SURPLUS,
    _DROP,
    _STOP,
    _SHUTDOWN,
    _DEADLINE,
) = (
    _GROUP_OPS.index(GroupOp[name])
    for name in (
        "ADMIT",
        "COMPLETE",
        "CONSUME",
        "FAIL",
        "FILTER",
        "RETRY",
        "SURPLUS",
        "DROP",
        "STOP",
        "SHUTDOWN",
        "DEADLINE",
    )
)


def _group_move(
    state: int, op: int, gid: Hashable, error: type[StaleboundError] = ProtocolError
) -> int:
    """A group's next state (indices); a move not in GROUP_TRANSITIONS raises ``error``."""
    new = _GROUP_NEXT[state][op]
    if new < 0:
        move(GROUP_TRANSITIONS, _GROUP_STATES[state], _GROUP_OPS[op], gid, error=error)
    return new


class _GroupRun:
    """A group the coordinator admitted and has not yet handed to the policy (or settled)."""

    __slots__ = (
        "accept",
        "gid",
        "progress",
        "reported",
        "retries",
        "sample",
        "truncated",
        "truncating",
        "version",
        "versions",
    )

    def __init__(
        self, gid: int, sample: int, accept: Accept | None, retries: int, version: int, now: float
    ) -> None:
        self.gid = gid
        self.sample = sample
        self.accept = accept
        self.retries = retries
        self.version = version
        self.progress = now  # when it last produced something (the watchdog's clock)
        self.reported = -1.0  # the progress time the watchdog last reported it at
        self.truncating = False
        self.truncated: set[int] | None = None  # member numbers cut short
        self.versions: dict[int, tuple[int, ...]] | None = None  # per-token versions by member


class Coordinator:
    """Every staleness decision of one rollout driver, behind ``handle(event) -> list[Action]``.

    ``policy`` is the staleness policy it decides through (build one with
    :func:`stalebound.core.settings.build_policy`); ``settings`` the resolved settings; ``gate``
    an outside admission gate driven through AReaL's callbacks (buffer policy only); ``guard`` a
    context manager held around every policy call (the lock an AReaL ``StalenessManager`` shares
    with other threads; the coordinator itself is single-threaded: one driver thread calls it).
    """

    def __init__(
        self,
        policy: StalenessPolicy,
        settings: CoordinatorSettings,
        *,
        gate: AdmissionGate | None = None,
        guard: AbstractContextManager[Any] | None = None,
    ) -> None:
        if settings.proactive != "null" and not isinstance(policy, BufferPolicy):
            raise ConfigError(
                f"rollout.proactive_filter.method={settings.proactive!r}: acts on STUCK buffers, "
                f"which only the buffer policy has (not {policy.name!r}); set it to null"
            )
        self.policy = policy
        self.settings = settings
        self.counts = CoordinatorCounts()
        self._gate = gate
        self._guard: AbstractContextManager[Any] = guard if guard is not None else nullcontext()
        self._tracker = GroupTracker(
            settings.group_size, settings.group_redundancy, max_relaunches=settings.max_relaunches
        )
        self._buffer: StalenessBuffer | None = (
            policy.buffer if isinstance(policy, BufferPolicy) else None
        )
        self._deadlines: Callable[..., Sequence[tuple[Hashable, str]]] | None = getattr(
            policy, "deadline_verdicts", None
        )
        self._queue: deque[tuple[int, Accept | None, int]] = deque()  # (sample, accept, retries)
        self._groups: dict[int, _GroupRun] = {}  # running, in admission order
        # running and completed groups, until they end: group id → (state index, sample index)
        self._life: dict[int, tuple[int, int]] = {}
        self._next_gid = 0
        self._paused = False
        self._stopped: str | None = None
        self._recent: deque[str] = deque(maxlen=_RECENT_FAILURES)
        self._stuck = StuckTimer()
        self._stragglers: StragglerClock | None = (
            StragglerClock()
            if self._buffer is not None
            and settings.proactive != "null"
            and settings.stuck_timeout is None
            else None
        )
        self._checking = False
        self._armed: dict[str, float] = {}
        # the trainer's recent step times (a batch handed over → its next request), for a grace
        # given in steps; when the last batch was handed over, until the next request
        self._steps: deque[float] = deque(maxlen=GRACE_WINDOW)
        self._handed_at: float | None = None
        self._handlers: dict[type, Callable[[Any], list[Action]]] = {
            Submitted: self._on_submitted,
            Dispatch: self._on_dispatch,
            MemberLaunched: self._on_launched,
            MemberProgress: self._on_progress,
            MemberFinished: self._on_finished,
            MemberFailed: self._on_failed,
            TimerFired: self._on_timer,
            BatchWanted: self._on_batch_wanted,
            VersionPublished: self._on_version,
            Paused: self._on_paused,
            Resumed: self._on_resumed,
            StopRequested: self._on_stop_requested,
            Shutdown: self._on_shutdown,
        }

    # ------------------------------------------------------------------ the one entry point

    def handle(self, event: Event) -> list[Action]:
        """Take one event; return what the driver must do, in order."""
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise ProtocolError(
                f"handle({event!r}): not a coordinator event; pass one of the event types of "
                "stalebound.core.events"
            ) from None
        return handler(event)

    # ------------------------------------------------------------------ read-only queries

    @property
    def version(self) -> int:
        """The training version: the next batch handed over is consumed at this version."""
        return self.policy.version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopped(self) -> str | None:
        """Why it stopped, or ``None`` while it runs."""
        return self._stopped

    @property
    def queued(self) -> int:
        """Items waiting for admission."""
        return len(self._queue)

    @property
    def running_groups(self) -> int:
        return len(self._groups)

    @property
    def running_members(self) -> int:
        return self._tracker.running_members()

    @property
    def buffer(self) -> StalenessBuffer | None:
        """The buffer policy's buffer (``None`` under the capacity policy)."""
        return self._buffer

    def running(self) -> Mapping[int, tuple[int, tuple[int, ...]]]:
        """Running groups: group id → (its version, its running member numbers)."""
        return {
            gid: (g.version, tuple(m.number for m in self._tracker.running(gid)))
            for gid, g in self._groups.items()
        }

    def queued_items(self) -> list[tuple[int, int]]:
        """``(sample, retries)`` of the queued items, in admission order."""
        return [(sample, retries) for sample, _, retries in self._queue]

    def capacity(self, version: int) -> int:
        """Groups :class:`Dispatch` at ``version`` would admit now, the queue aside (may be ≤ 0)."""
        with self._guard:
            return self.policy.capacity(version)

    def items_wanted(self, version: int, budget: int | None) -> int:
        """How many items the queue should hold before a :class:`Dispatch` at ``version``, for a
        driver drawing from a data loader: as many as admission will take and one more it
        refuses (as submitting item by item would), at most ``budget`` (the gate's capacity)."""
        want = max(self.capacity(version), 0) + 1
        return want if budget is None else min(want, budget)

    def policy_statistics(self) -> PolicyStatistics:
        """The policy's statistics (read under the guard)."""
        with self._guard:
            return self.policy.statistics()

    def stuck_seconds(self, now: float) -> dict[int, float]:
        """Time the head buffer spent STUCK, per buffer version, the open interval included."""
        stuck = dict(self._stuck.total_stuck_s)
        for b, since in self._stuck.open_intervals().items():
            stuck[b] = stuck.get(b, 0.0) + now - since
        return stuck

    # ------------------------------------------------------------------ admission

    def _on_submitted(self, ev: Submitted) -> list[Action]:
        self._queue.append((ev.sample, ev.accept, ev.retries))
        return []

    def _on_dispatch(self, ev: Dispatch) -> list[Action]:
        """Admit queued items while the policy (and the budget) allow."""
        out: list[Action] = []
        if self._paused or self._stopped is not None:
            return out
        policy, queue, guard = self.policy, self._queue, self._guard
        budget = ev.budget
        head = False
        while queue and (budget is None or budget > 0):
            if budget is not None:
                budget -= 1
            gid = self._next_gid
            self._next_gid = gid + 1  # a refused admission uses up its id, as it always has
            with guard:
                admission = policy.try_admit(gid, ev.version)
            if admission is None:
                break
            sample, accept, retries = queue.popleft()
            self.counts.dispatched_groups += 1
            self._start_group(
                gid,
                sample,
                accept,
                retries,
                admission.version,
                admission.buffer_version,
                ev.now,
                out,
            )
            if admission.buffer_version == policy.version:
                head = True
        if head:  # a reservation in the head buffer can make it STUCK
            self._check_head(ev.now, out)
        return out

    def _start_group(
        self,
        gid: int,
        sample: int,
        accept: Accept | None,
        retries: int,
        version: int,
        buffer_version: int | None,
        now: float,
        out: list[Action],
    ) -> None:
        self._groups[gid] = _GroupRun(gid, sample, accept, retries, version, now)
        self._life[gid] = (_group_move(_QUEUED, _ADMIT, gid), sample)
        if self._stragglers is not None:
            self._stragglers.reserved(gid)
        if self._gate is not None:
            self._gate.on_rollout_enqueued()
            self._gate.on_rollout_submitted()
        watchdog = self.settings.watchdog
        if watchdog is not None and WATCHDOG_TIMER not in self._armed:
            self._armed[WATCHDOG_TIMER] = now + watchdog
            out.append(ArmTimer(WATCHDOG_TIMER, now + watchdog))
        out.append(StartGroup(gid, sample, version, buffer_version))
        members = self._tracker.start(gid, version)
        self.counts.launched_members += len(members)
        out.extend([LaunchMember(m, version) for m in members])

    # ------------------------------------------------------------------ members

    def _on_launched(self, ev: MemberLaunched) -> list[Action]:
        return self._on_progress(cast(MemberProgress, ev))

    def _on_progress(self, ev: MemberProgress) -> list[Action]:
        g = self._groups.get(ev.member[0])  # type: ignore[call-overload]
        if g is not None:
            g.progress = ev.now
        return []

    def _on_finished(self, ev: MemberFinished) -> list[Action]:
        member = ev.member
        g = self._groups.get(member[0])  # type: ignore[call-overload]
        if g is None:
            raise ProtocolError(
                f"MemberFinished(member={member!r}): no such group running (never started, or "
                "already settled; a member aborted on purpose sends no event)"
            )
        done = self._tracker.finish(member, ev.result)
        self.counts.finished_members += 1
        g.progress = ev.now
        if ev.versions is not None:
            if g.versions is None:
                g.versions = {}
            g.versions[member[1]] = ev.versions
        if done is None:
            return []
        out: list[Action] = []
        self._group_complete(g, done, ev.now, out)
        return out

    def _on_failed(self, ev: MemberFailed) -> list[Action]:
        member = ev.member
        g = self._groups.get(cast(int, member[0]))
        if g is None:
            raise ProtocolError(
                f"MemberFailed(member={member!r}): no such group running (never started, or "
                "already settled; a member aborted on purpose sends no event)"
            )
        outcome = self._tracker.fail(member, ev.cause, version=ev.version)
        self.counts.member_failures[ev.cause] += 1
        out: list[Action] = []
        if outcome is None:
            return out
        if isinstance(outcome, Relaunch):
            self.counts.relaunched_members += 1
            self.counts.launched_members += 1
            out.append(LaunchMember(outcome.member, outcome.version, relaunch=True))
            if g.truncating:  # a relaunch of a group being truncated: cut it short too
                self._mark_truncated(g, outcome.member.number)
                out.append(TruncateMember(outcome.member))
            return out
        why = f"group {g.gid}: {', '.join(outcome.causes)}"
        if ev.detail:
            why += f" (last: {ev.detail})"
        out.append(ReportFailure(g.gid, why))
        self._unlist(g.gid)
        self._abort_members(outcome.surplus, "abandoned", out)
        self._settle_failed(g.gid, "failed", why, ev.now, out)
        return out

    def _group_complete(
        self, g: _GroupRun, done: GroupComplete, now: float, out: list[Action]
    ) -> None:
        gid = g.gid
        s = self.settings
        self._unlist(gid)
        self._abort_members(done.surplus, "surplus", out)
        results = None
        if g.accept is not None:
            results = [r.result for r in done.members]
            try:
                keep = g.accept(results)
            except Exception as e:
                self._settle_failed(gid, "failed", f"group {gid}: should_accept_fn {e!r}", now, out)
                return
            if not keep:
                self._filtered(gid, len(done.members), "should_accept_fn returned False", now, out)
                return
        if s.post_process is not None:
            if results is None:
                results = [r.result for r in done.members]
            try:
                decision = s.post_process(results, s.metric)
            except ConfigError as e:  # a metric the trajectories lack: no group can pass
                self._release(gid, _FAIL, "failed", now, out)
                self.counts.failed_groups += 1
                self._stop(str(e), out)
                return
            except Exception as e:
                why = f"group {gid}: group_post_process {s.post_process_name!r} {e!r}"
                self._settle_failed(gid, "failed", why, now, out)
                return
            if not decision.keep:
                reason = f"{s.post_process_name}: {decision.reason}"
                self._filtered(gid, len(done.members), reason, now, out)
                return
        versions, truncated = g.versions, g.truncated
        payload: tuple[HandedMember, ...]
        if versions is None and truncated is None:
            payload = tuple([(r, None, False) for r in done.members])
        else:
            vs = versions or {}
            cut = truncated or set()
            payload = tuple([(r, vs.get(n := r.member.number), n in cut) for r in done.members])
            if truncated is not None:
                self.counts.truncated_trajectories += sum(1 for _, _, t in payload if t)
        segments = (
            {v for tv in versions.values() for v in tv if v >= 0} if versions is not None else ()
        )
        try:
            with self._guard:
                kept = self.policy.complete(gid, payload, segment_versions=segments)
        except ProtocolError as e:  # the engine reported versions outside [V, v]
            self._settle_failed(gid, "bad_versions", f"group {gid}: {e}", now, out)
            return
        state, sample = self._life[gid]
        self._life[gid] = (_group_move(state, _COMPLETE, gid), sample)
        if self._stragglers is not None:
            assert self._buffer is not None
            self._stragglers.forget(gid)
            where = self._buffer.lookup(gid)
            if where is not None:
                self._stragglers.landed(where[1])
        c = self.counts
        c.completed_groups += 1
        c.consecutive_failures = 0
        c.consecutive_filtered = 0
        if kept:
            if self._gate is not None:
                self._gate.on_rollout_accepted()
        else:  # counted here; the consume that reports it again skips it
            c.dropped_groups += 1
            self._end(gid, _DROP, "dropped", out)
        out.append(_WAKE)
        self._check_head(now, out)

    def _filtered(self, gid: int, members: int, reason: str, now: float, out: list[Action]) -> None:
        """Drop a completed group (its entry returns to EMPTY); stop after too many in a row."""
        c, s = self.counts, self.settings
        c.filtered_groups += 1
        c.discarded_members["filtered"] += members
        c.consecutive_filtered += 1
        self._release(gid, _FILTER, "filtered", now, out)
        if c.consecutive_filtered >= s.max_filtered:
            post = (
                f"group_post_process {s.post_process_name!r} on filter_groups.metric={s.metric!r}"
                if s.post_process is not None
                else "should_accept_fn"
            )
            self._stop(
                f"{c.consecutive_filtered} groups in a row were filtered out by {post} "
                f"(rollout.max_consecutive_filtered={s.max_filtered}; the last: {reason}), so "
                "the data would be cycled forever without a batch; check that the reward varies "
                "within a group (a larger rollout.group_size helps), choose another metric, or "
                "disable the filter (rollout.group_post_process.enable=false)",
                out,
            )

    def _settle_failed(self, gid: int, cause: str, why: str, now: float, out: list[Action]) -> None:
        """The group is out of the tracker: abort its entry and count a failure."""
        c = self.counts
        self._release(gid, _FAIL, cause, now, out)
        c.failed_groups += 1
        c.consecutive_failures += 1
        self._recent.append(why)
        limit = self.settings.max_failures
        if c.consecutive_failures >= limit:
            self._stop(
                f"{c.consecutive_failures} groups failed in a row (rollout.max_consecutive_failures="
                f"{limit}); the last causes: {'; '.join(self._recent)}",
                out,
            )

    def _release(self, gid: int, op: int, cause: str, now: float, out: list[Action]) -> None:
        """Return a group's policy slot (abort), report it, and have capacity looked at again."""
        with self._guard:
            self.policy.abort(gid, cause)
        self._end(gid, op, "failed" if cause == "bad_versions" else cause, out)
        if self._stragglers is not None:
            self._stragglers.forget(gid)
        if self._gate is not None:
            self._gate.on_rollout_rejected()
        out.append(AbortGroup(gid, cause))
        out.append(_WAKE)
        self._check_head(now, out)

    def _end(self, gid: int, op: int, cause: str, out: list[Action]) -> None:
        """A group's life ends (through the transition table); report its item if untrained."""
        life = self._life.pop(gid, None)
        if life is None:
            return
        state, sample = life
        _group_move(state, op, gid)
        if cause not in _NOT_AN_OUTCOME:
            out.append(ReportDrop(gid, sample, cause if cause in OUTCOMES else "failed"))

    def _unlist(self, gid: int) -> _GroupRun | None:
        return self._groups.pop(gid, None)

    def _abort_members(self, members: Sequence[MemberId], cause: str, out: list[Action]) -> None:
        for m in members:
            self.counts.cancelled_members[cause] += 1
            out.append(AbortRequest(m, cause))

    def _mark_truncated(self, g: _GroupRun, number: int) -> None:
        if g.truncated is None:
            g.truncated = set()
        g.truncated.add(number)

    # ------------------------------------------------------------------ the trainer's side

    def _on_batch_wanted(self, ev: BatchWanted) -> list[Action]:
        """Consume ready batches until ``ev.groups`` groups were handed over (or none is ready)."""
        out: list[Action] = []
        given = 0
        policy, guard, c = self.policy, self._guard, self.counts
        if self._handed_at is not None:  # the trainer's first request since a batch: a step
            self._steps.append(ev.now - self._handed_at)
            self._handed_at = None
        while given < ev.groups:
            with guard:
                if not policy.ready():
                    break
                batch = policy.consume()
            v = batch.version
            if self._stragglers is not None:
                self._stragglers.consumed(v + 1)
            for gid in batch.aborted:  # surplus reservations of the consumed buffer
                gid = cast(int, gid)
                if self._unlist(gid) is not None:
                    c.discarded_members["surplus"] += len(self._tracker.partial(gid))
                    self._abort_members(self._tracker.cancel(gid), "surplus", out)
                    if self._gate is not None:
                        self._gate.on_rollout_rejected()
                if self._stragglers is not None:
                    self._stragglers.forget(gid)
                c.surplus_groups += 1
                self._end(gid, _SURPLUS, "surplus", out)
                out.append(AbortGroup(gid, "surplus"))
            for gid in batch.dropped:
                if gid in self._life:  # not counted yet (the capacity policy counts at once)
                    c.dropped_groups += 1
                    self._end(gid, _DROP, "dropped", out)
            c.consumed_batches += 1
            life = self._life
            handed = []
            n = 0
            for g in batch.groups:
                gid = cast(int, g.group_id)
                state, sample = life.pop(gid, (_QUEUED, -1))
                _group_move(state, _CONSUME, gid, InvariantError)
                members: tuple[HandedMember, ...] = g.payload
                handed.append(HandedGroup(gid, sample, g.version, members))
                n += len(members)
            c.consumed_groups += len(batch.groups)
            c.consumed_trajectories += n
            given += len(batch.groups)
            out.append(HandOverBatch(v, tuple(handed)))
            out.append(_WAKE)
            self._disarm(DEADLINE_TIMER, out)  # a new head: its own grace, if it needs one
            self._deadline_actions(ev.now, out)
            self._check_head(ev.now, out)
        if given and given >= ev.groups:  # the request is met: the trainer's step starts
            self._handed_at = ev.now
        if given < ev.groups:  # the trainer waits on the head: a deadline policy may act now
            self._deadline_actions(ev.now, out, trainer_waiting=True)
            grace = self._grace()
            if (
                grace is not None
                and DEADLINE_TIMER not in self._armed
                and self._deadlines is not None
                and self._deadlines(self.policy.version, overdue=True)
            ):
                self._arm(DEADLINE_TIMER, ev.now + grace, out)
        return out

    def _grace(self) -> float | None:
        """Seconds the trainer waits for a due group: ``deadline_grace``, else
        ``deadline_grace_steps`` × the median of its recent steps; ``None``: it waits."""
        s = self.settings
        if s.deadline_grace is not None or s.deadline_grace_steps is None or len(self._steps) < 2:
            return s.deadline_grace
        return s.deadline_grace_steps * statistics.median(self._steps)

    def _deadline_actions(
        self,
        now: float,
        out: list[Action],
        *,
        trainer_waiting: bool = False,
        overdue: bool = False,
    ) -> None:
        """The hook of a deadline policy (:class:`DeadlinePolicy`): carry out its verdicts for the
        head buffer (``overdue``: the grace is over, abort what is still due)."""
        if self._deadlines is None:
            return
        verdicts = self._deadlines(
            self.policy.version, trainer_waiting=trainer_waiting, overdue=overdue
        )
        for gid, verdict in verdicts:
            g = self._groups.get(cast(int, gid))
            if g is None:
                raise InvariantError(f"deadline verdict {verdict!r} for group {gid!r}: not running")
            if overdue:
                self.counts.overdue_groups += 1
            if not g.truncating:  # a truncated group aborted after the grace is counted once
                self.counts.deadline_groups += 1
            if verdict == "truncate":
                g.truncating = True
                for m in self._tracker.running(g.gid):
                    self._mark_truncated(g, m.number)
                    out.append(TruncateMember(m, "deadline"))
            elif verdict == "abort":
                self._unlist(g.gid)
                self.counts.discarded_members["deadline"] += len(self._tracker.partial(g.gid))
                self._abort_members(self._tracker.cancel(g.gid), "deadline", out)
                self._release(g.gid, _DEADLINE, "deadline", now, out)
            else:
                raise InvariantError(f"deadline verdict {verdict!r}: not 'truncate' or 'abort'")

    def _on_version(self, ev: VersionPublished) -> list[Action]:
        return [_WAKE]

    def _on_paused(self, ev: Paused) -> list[Action]:
        self._paused = True
        return []

    def _on_resumed(self, ev: Resumed) -> list[Action]:
        self._paused = False
        return [_WAKE]

    # ------------------------------------------------------------------ the proactive filter

    def _check_head(self, now: float, out: list[Action], timer: bool = False) -> None:
        """Whenever the head buffer may have changed: time its STUCK spell and, when the
        proactive filter names targets, retry or truncate them."""
        buf = self._buffer
        if buf is None or self._checking:
            return
        s = self.settings
        stuck_for = self._stuck.observe(buf, now)
        if s.proactive == "null" or self._stopped is not None:
            return
        if buf.state(buf.version) is not BufferState.STUCK:
            self._disarm(STUCK_TIMER, out)
            return
        timeout = s.stuck_timeout
        if timer and timeout is not None:  # the timer may fire a clock tick early
            stuck_for = max(stuck_for, timeout)
        targets = proactive_filter_targets(
            buf, s.threshold, stuck_for=stuck_for, stuck_timeout_s=timeout
        )
        if not targets:
            if timeout is not None and stuck_for < timeout:
                self._arm(STUCK_TIMER, now - stuck_for + timeout, out)
            return
        if self._stragglers is not None:  # acting at once: only on overtaken groups
            targets = self._stragglers.overtaken(targets, buf.version)
        self._disarm(STUCK_TIMER, out)
        groups = self._groups
        if s.proactive == "retry":
            tries: dict[Hashable, int] = {g: groups[g].retries for g in targets if g in groups}
            chosen = eligible_targets(targets, tries, s.max_retries)
        else:
            being: dict[Hashable, int] = {
                g: 1 for g in targets if g in groups and groups[g].truncating
            }
            chosen = eligible_targets(targets, being, 1)
        runs = [groups[g] for g in chosen if g in groups]
        if not runs:
            return
        self._checking = True
        try:
            if s.proactive == "retry":
                self._retry(buf, runs, now, out)
            else:
                self._truncate(runs, out)
        finally:
            self._checking = False
        self._stuck.observe(buf, now)

    def _retry(
        self, buf: StalenessBuffer, chosen: list[_GroupRun], now: float, out: list[Action]
    ) -> None:
        """Abort the head buffer's last reservations, pull finished groups forward into the freed
        entries, and queue the prompts again, first in line (new group ids, new V)."""
        tracker, c = self._tracker, self.counts
        again = []
        for g in chosen:
            self._unlist(g.gid)
            c.discarded_members["retried"] += len(tracker.partial(g.gid))
            self._abort_members(tracker.cancel(g.gid), "retried", out)
            self._release(g.gid, _RETRY, "retried", now, out)
            c.retried_groups += 1
            again.append((g.sample, g.accept, g.retries + 1))
            out.append(Retry(g.gid, g.sample, g.retries + 1))
        with self._guard:
            moved = buf.pull_forward()
        c.pulled_forward_groups += len(moved)
        if moved and self._stragglers is not None:
            self._stragglers.landed(buf.version)
        for item in reversed(again):
            self._queue.appendleft(item)
        out.append(_WAKE)

    def _truncate(self, chosen: list[_GroupRun], out: list[Action]) -> None:
        """Cut the head buffer's last groups short: their members return their partial outputs
        and the group completes (members marked truncated)."""
        for g in chosen:
            g.truncating = True
            self.counts.truncated_groups += 1
            for m in self._tracker.running(g.gid):
                self._mark_truncated(g, m.number)
                out.append(TruncateMember(m))

    def _arm(self, timer: str, at: float, out: list[Action]) -> None:
        if self._armed.get(timer) == at:
            return
        self._armed[timer] = at
        out.append(ArmTimer(timer, at))

    def _disarm(self, timer: str, out: list[Action]) -> None:
        if self._armed.pop(timer, None) is not None:
            out.append(CancelTimer(timer))

    # ------------------------------------------------------------------ timers: stuck, watchdog

    def _on_timer(self, ev: TimerFired) -> list[Action]:
        out: list[Action] = []
        if self._armed.pop(ev.timer, None) is None:
            return out  # cancelled meanwhile (a driver may race a cancel with the firing)
        if ev.timer == STUCK_TIMER:
            self._check_head(ev.now, out, timer=True)
        elif ev.timer == WATCHDOG_TIMER:
            self._watchdog(ev.now, out)
        elif ev.timer == DEADLINE_TIMER:
            self._deadline_actions(ev.now, out, overdue=True)
            out.append(_WAKE)  # the head may be ready now: the trainer asks again
        else:
            raise ProtocolError(f"TimerFired(timer={ev.timer!r}): no such timer")
        return out

    def _watchdog(self, now: float, out: list[Action]) -> None:
        """Report every group that has produced nothing for ``watchdog`` seconds, once per stall."""
        limit = self.settings.watchdog
        assert limit is not None
        wake = now + limit
        for g in self._groups.values():
            if g.reported == g.progress:  # reported; wait for new progress
                continue
            if now - g.progress >= limit:
                g.reported = g.progress
                self.counts.watchdog_stalls += 1
                members = tuple(m.number for m in self._tracker.running(g.gid))
                out.append(
                    ReportStall(g.gid, g.version, self.policy.version, now - g.progress, members)
                )
            else:
                wake = min(wake, g.progress + limit)
        if self._groups and self._stopped is None:
            self._arm(WATCHDOG_TIMER, wake, out)

    # ------------------------------------------------------------------ stopping

    def _on_stop_requested(self, ev: StopRequested) -> list[Action]:
        out: list[Action] = []
        self._stop(ev.reason, out)
        return out

    def _on_shutdown(self, ev: Shutdown) -> list[Action]:
        out: list[Action] = []
        self._abort_all("shutdown", ev.now, out)
        return out

    def _stop(self, why: str, out: list[Action]) -> None:
        """Stop for good: abort every running group."""
        if self._stopped is not None:
            return
        self._stopped = why
        out.append(Stop(why))
        self._abort_all("stopped", None, out)

    def _abort_all(self, cause: str, now: float | None, out: list[Action]) -> None:
        op = _SHUTDOWN if cause == "shutdown" else _STOP
        for gid in list(self._groups):
            self._unlist(gid)
            self._abort_members(self._tracker.cancel(gid), cause, out)
            with self._guard, suppress(ProtocolError):  # already out of the policy
                self.policy.abort(gid, cause)
            self._end(gid, op, cause, out)
            if self._stragglers is not None:
                self._stragglers.forget(gid)
            if self._gate is not None:
                self._gate.on_rollout_rejected()
            out.append(AbortGroup(gid, cause))
        out.append(_WAKE)
        for timer in list(self._armed):
            self._disarm(timer, out)

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self) -> dict[str, Any]:
        """The coordinator's state as plain data (the policy's snapshot included). Running groups
        are listed with their items; they cannot be resumed mid-generation."""
        with self._guard:
            policy_state = self.policy.snapshot()
        running = sorted(self._groups.items())
        return {
            "policy": self.policy.name,
            "version": self.policy.version,
            "policy_state": policy_state,
            "running": [(gid, g.sample, g.retries) for gid, g in running],
            "queued": self.queued_items(),
            "samples": {g: i for g, (_, i) in self._life.items() if g not in self._groups},
            "next_group_id": self._next_gid,
            "counts": self.counts.totals(),
            "by_cause": {k: dict(v) for k, v in self.counts.by_cause().items()},
        }

    def restore(
        self,
        *,
        policy_state: Mapping[str, Any],
        running: Sequence[int],
        pending: Sequence[tuple[int, int]],
        samples: Mapping[int, int],
        next_group_id: int,
        counts: Mapping[str, int],
        by_cause: Mapping[str, Mapping[str, int]],
        accept: Accept | None = None,
    ) -> None:
        """Continue from saved state: the policy's snapshot is loaded, the groups that were
        ``running`` are aborted in it (cause ``resumed``) and ``pending`` items ``(sample,
        retries)`` queued (the running ones first). Raises :class:`ProtocolError` (nothing
        changed) if it has already taken work or the state is damaged."""
        if self._next_gid or self._groups or self._queue or self._life:
            raise ProtocolError(
                "load_state_dict(): the executor has already taken work; load the state right "
                "after initialize(), before submit() or prepare_batch()"
            )
        known = {f.name for f in fields(CoordinatorCounts)}
        unknown = sorted(set(counts) - known) + sorted(set(by_cause) - known)
        if unknown:
            raise ProtocolError(
                f"load_state_dict(): unknown counters {unknown}; load a state written by "
                "state_dict()"
            )
        with self._guard:
            self.policy.load_snapshot(policy_state)
            if isinstance(self.policy, BufferPolicy):  # loading builds a new buffer
                self._buffer = self.policy.buffer
            for gid in running:  # their episodes died with the old process: run them again
                if self.policy.is_running(gid):
                    self.policy.abort(gid, "resumed")
        c = CoordinatorCounts()
        for k, n in counts.items():
            setattr(c, k, int(n))
        for k, m in by_cause.items():
            setattr(c, k, Counter({str(cause): int(n) for cause, n in m.items()}))
        c.resumed_groups += len(running)
        self.counts = c
        self._life = {int(g): (_COMPLETED, int(i)) for g, i in samples.items()}
        self._next_gid = int(next_group_id)
        for sample, retries in pending:
            self._queue.append((int(sample), accept, int(retries)))

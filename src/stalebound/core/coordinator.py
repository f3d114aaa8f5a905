"""The decision core: one pure object that routes a driver's events to the deciders.

:class:`Coordinator` is a protocol object in the spirit of h11: it does no IO, reads no clock,
starts no thread and takes no lock. A driver feeds it frozen events (:mod:`stalebound.core.events`)
and carries out the actions it returns, in order::

    actions = coordinator.handle(MemberFinished(member, now, result, versions))
    for action in actions:
        ...  # launch, abort, truncate, arm a timer, hand a batch over, run filters, report

It routes each event to the part that decides, and merges what they return:

* the staleness policy (:mod:`stalebound.core.policy`) — admission, reservation, occupy, consume;
* the ledger (:class:`~stalebound.core.ledger.Ledger`) — every group from admission to its end,
  its members (N of N′, relaunch while N is reachable), and the one teardown path;
* the proactive filter (:mod:`stalebound.core.proactive`), the watchdog
  (:mod:`stalebound.core.watchdog`), the deadline grace (:mod:`stalebound.core.grace`) and the
  stop rules (:mod:`stalebound.core.stopping`).

**Threading contract.** The coordinator is single-threaded and holds no lock: the driver
serialises every call (``handle`` and the queries) — one event loop, or a lock of the driver's
own around each call (the executor holds an AReaL ``StalenessManager``'s lock when the policy
shares its counters). User code never runs inside a call: a completed group's filters
(``should_accept_fn``, the group post-processor) are an :class:`EvaluateGroup` action whose
verdict the driver sends back (:class:`GroupEvaluated`), and an outside admission gate's
callbacks are :class:`NotifyGate` actions, so both run after the call has returned.

Every group's life goes through one transition table (:data:`GROUP_TRANSITIONS`); every ended
item is reported once (:class:`ReportDrop`) or handed over (:class:`HandOverBatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import stalebound.core.events as ev
from stalebound.core.buffer import StalenessBuffer
from stalebound.core.checks import is_int
from stalebound.core.counts import CoordinatorCounts
from stalebound.core.errors import InvariantError, ProtocolError
from stalebound.core.grace import DeadlineGrace
from stalebound.core.groups import GroupComplete, GroupTracker
from stalebound.core.ledger import AdmissionGate, GroupRun, Ledger
from stalebound.core.names import OUTCOMES, Cause, GateCall, PolicyKind, Timer, Verdict
from stalebound.core.policy import BufferPolicy, DeadlinePolicy, PolicyStatistics, StalenessPolicy
from stalebound.core.proactive import proactive_filter
from stalebound.core.settings import CoordinatorSettings
from stalebound.core.stopping import StopRules
from stalebound.core.timers import Timers
from stalebound.core.transitions import GROUP_TRANSITIONS, GroupOp, GroupState
from stalebound.core.watchdog import watchdog

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

_WAKE = ev.Wake()  # immutable and field-less: one instance serves every wake-up


class Coordinator:
    """Every staleness decision of one rollout driver, behind ``handle(event) -> list[Action]``:
    ``policy`` decides (:func:`~stalebound.core.settings.build_policy`) with ``settings``;
    ``gated``: an outside admission gate is driven by :class:`NotifyGate` actions."""

    def __init__(
        self, policy: StalenessPolicy, settings: CoordinatorSettings, *, gated: bool = False
    ) -> None:
        self.policy = policy
        self.settings = s = settings
        self._timers = timers = Timers()
        tracker = GroupTracker(s.group_size, s.group_redundancy, max_relaunches=s.max_relaunches)
        self._ledger = ledger = Ledger(policy, tracker, gated=gated)
        self._proactive = proactive_filter(policy, s, timers)
        self._watchdog = watchdog(s.watchdog, timers, ledger.counts)
        ledger.deciders = (self._proactive, self._watchdog)
        self._grace = DeadlineGrace(policy, timers, s.deadline_grace, s.deadline_grace_steps)
        self._stops = StopRules(ledger.counts, s)
        self._paused = False
        self._stopped: str | None = None
        self._checking = False  # acting on the head: what that releases does not act again
        self._handlers: dict[type, Callable[[Any], list[ev.Action]]] = {
            ev.Submitted: ledger.submitted,
            ev.Dispatch: self._on_dispatch,
            ev.MemberLaunched: ledger.progressed,
            ev.MemberProgress: ledger.progressed,
            ev.MemberFinished: self._on_finished,
            ev.MemberFailed: self._on_failed,
            ev.GroupEvaluated: self._on_evaluated,
            ev.TimerFired: self._on_timer,
            ev.BatchWanted: self._on_batch_wanted,
            ev.VersionPublished: lambda e: [_WAKE],
            ev.Paused: lambda e: self._pause(True, []),
            ev.Resumed: lambda e: self._pause(False, [_WAKE]),
            ev.StopRequested: lambda e: self._stop(e.reason, []),
            ev.Shutdown: lambda e: self._abort_all(Cause.SHUTDOWN, []),
        }

    def handle(self, event: ev.Event) -> list[ev.Action]:
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
    def counts(self) -> CoordinatorCounts:
        return self._ledger.counts

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
        return len(self._ledger.queue)

    @property
    def running_groups(self) -> int:
        return len(self._ledger.groups)

    @property
    def running_members(self) -> int:
        return self._ledger.tracker.running_members()

    @property
    def buffer(self) -> StalenessBuffer | None:
        """The buffer policy's buffer (``None`` under the capacity and deadline policies)."""
        policy = self.policy
        return cast(BufferPolicy, policy).buffer if policy.kind is PolicyKind.BUFFER else None

    def running(self) -> Mapping[int, tuple[int, tuple[int, ...]]]:
        """Running groups: group id → (its version, its running member numbers)."""
        running, groups = self._ledger.tracker.running, self._ledger.groups
        return {
            gid: (g.version, tuple(m.number for m in running(gid))) for gid, g in groups.items()
        }

    def queued_items(self) -> list[tuple[int, int]]:
        """``(sample, retries)`` of the queued items, in admission order."""
        return [(sample, retries) for sample, _, retries in self._ledger.queue]

    def capacity(self, version: int) -> int:
        """Groups :class:`Dispatch` at ``version`` would admit now, the queue aside (may be ≤ 0)."""
        return self.policy.capacity(version)

    def items_wanted(self, version: int, budget: int | None) -> int:
        """Items to queue before a :class:`Dispatch` at ``version`` (for a driver drawing from a
        data loader): what admission takes and one it refuses, at most ``budget``."""
        want = max(self.capacity(version), 0) + 1
        return want if budget is None else min(want, budget)

    def policy_statistics(self) -> PolicyStatistics:
        return self.policy.statistics()

    def stuck_seconds(self, now: float) -> dict[int, float]:
        """Time the head buffer spent STUCK, per buffer version, the open interval included."""
        return self._proactive.stuck_seconds(now)

    def snapshot(self) -> dict[str, Any]:
        """The state as plain data (:meth:`~stalebound.core.ledger.Ledger.snapshot`)."""
        return self._ledger.snapshot()

    def restore(self, **state: Any) -> None:
        """Continue from saved state (:meth:`~stalebound.core.ledger.Ledger.restore`)."""
        self._ledger.restore(**state)

    # ------------------------------------------------------------------ groups

    def _on_dispatch(self, e: ev.Dispatch) -> list[ev.Action]:
        """Admit queued items while the policy (and the budget) allow."""
        out: list[ev.Action] = []
        if self._paused or self._stopped is not None:
            return out
        policy, ledger = self.policy, self._ledger
        queue, budget, head = ledger.queue, e.budget, False
        while queue and (budget is None or budget > 0):
            budget = None if budget is None else budget - 1
            gid = ledger.next_gid
            ledger.next_gid = gid + 1  # a refused admission uses up its id, as it always has
            admission = policy.try_admit(gid, e.version)
            if admission is None:
                break
            ledger.counts.dispatched_groups += 1
            where = admission.buffer_version
            ledger.start(gid, queue.popleft(), admission.version, where, e.now, out)
            head = head or where == policy.version
        if head:  # a reservation in the head buffer can make it STUCK
            self._check_head(e.now, out)
        return out

    def _pause(self, paused: bool, out: list[ev.Action]) -> list[ev.Action]:
        self._paused = paused
        return out

    def _on_finished(self, e: ev.MemberFinished) -> list[ev.Action]:
        out: list[ev.Action] = []
        complete = self._ledger.finished(e, out)
        if complete is not None:
            g, done = complete
            s = self.settings
            judge = self._ledger.judge(g, done, s.post_process, s.post_process_name, s.metric)
            if judge is None:
                self._occupy(g, done, e.now, out)
            else:  # the driver runs the filters (user code) and answers with GroupEvaluated
                out.append(judge)
        return out

    def _on_failed(self, e: ev.MemberFailed) -> list[ev.Action]:
        out: list[ev.Action] = []
        if (failed := self._ledger.failed(e, out)) is not None:
            self._failed(failed[0].gid, Cause.FAILED, failed[1], e.now, out)
        return out

    def _on_evaluated(self, e: ev.GroupEvaluated) -> list[ev.Action]:
        """The driver ran the filters of a completed group (:class:`EvaluateGroup`)."""
        gid, ledger, out = e.group_id, self._ledger, cast(list[ev.Action], [])
        entry = ledger.judging.pop(gid, None)
        if entry is None:
            if is_int(gid) and gid not in ledger.life and gid < ledger.next_gid:
                return out  # stopped or shut down while its filters ran
            raise ProtocolError(
                f"GroupEvaluated(group_id={gid!r}): no group awaits a verdict; send one for "
                "each EvaluateGroup action"
            )
        g, done = entry
        if e.verdict == Verdict.KEEP:
            self._occupy(g, done, e.now, out)
        elif e.verdict == Verdict.FILTER:
            stop = self._stops.filtered(len(done.members), e.reason)
            self._release(gid, GroupOp.FILTER, Cause.FILTERED, e.now, out)
            if stop is not None:
                self._stop(stop, out)
        elif e.verdict == Verdict.FAIL:
            self._failed(gid, Cause.FAILED, f"group {gid}: {e.reason}", e.now, out)
        elif e.verdict == Verdict.STOP:  # a filter that cannot judge any group
            self._release(gid, GroupOp.FAIL, Cause.FAILED, e.now, out)
            ledger.counts.failed_groups += 1
            self._stop(e.reason, out)
        else:
            raise ProtocolError(
                f"GroupEvaluated(verdict={e.verdict!r}): keep, filter, fail or stop"
            )
        return out

    def _occupy(self, g: GroupRun, done: GroupComplete, now: float, out: list[ev.Action]) -> None:
        """A completed group passed its filters: it occupies its entry in the policy."""
        gid, ledger = g.gid, self._ledger
        payload, segments = ledger.payload(g, done)
        try:
            kept = self.policy.complete(gid, payload, segment_versions=segments)
        except ProtocolError as e:  # the engine reported versions outside [V, v]
            self._failed(gid, Cause.BAD_VERSIONS, f"group {gid}: {e}", now, out)
            return
        ledger.completed(gid)
        self._proactive.occupied(gid)
        self._stops.completed()
        if kept:
            ledger.notify(GateCall.ACCEPTED, out)
        else:  # counted here; the consume that reports it again skips it
            ledger.counts.dropped_groups += 1
            ledger.end(gid, GroupOp.DROP, "dropped", out)
            ledger.notify(GateCall.REJECTED, out)
        out.append(_WAKE)
        self._check_head(now, out)

    def _failed(self, gid: int, cause: Cause, why: str, now: float, out: list[ev.Action]) -> None:
        self._release(gid, GroupOp.FAIL, cause, now, out)
        stop = self._stops.failed(why)
        if stop is not None:
            self._stop(stop, out)

    def _release(
        self, gid: int, op: GroupOp, cause: Cause, now: float, out: list[ev.Action]
    ) -> None:
        """Tear a group down, then have capacity and the head looked at again."""
        self._ledger.teardown(gid, op, cause, out)
        out.append(_WAKE)
        self._check_head(now, out)

    # ------------------------------------------------------------------ deciders

    def _check_head(self, now: float, out: list[ev.Action], timer: bool = False) -> None:
        """The head buffer may have changed: the proactive filter may act on it."""
        if self._checking:
            return
        proactive, ledger = self._proactive, self._ledger
        runs = proactive.targets(now, ledger.groups, self._stopped is not None, out, timer=timer)
        if not runs:
            return
        self._checking = True
        try:
            if proactive.verdict is Verdict.RETRY:
                self._retry(runs, now, out)
            else:
                for g in runs:
                    ledger.truncate(g, Cause.TRUNCATED, out)
                    ledger.counts.truncated_groups += 1
        finally:
            self._checking = False
        proactive.observe(now)

    def _retry(self, runs: list[GroupRun], now: float, out: list[ev.Action]) -> None:
        """Abort the head's last reservations, pull finished groups forward, queue items again."""
        c, again = self._ledger.counts, []
        for g in runs:
            self._release(g.gid, GroupOp.RETRY, Cause.RETRIED, now, out)
            c.retried_groups += 1
            again.append((g.sample, g.accept, g.retries + 1))
            out.append(ev.Retry(g.gid, g.sample, g.retries + 1))
        c.pulled_forward_groups += self._proactive.pull_forward()
        self._ledger.queue.extendleft(reversed(again))
        out.append(_WAKE)

    def _deadline(
        self, verdicts: Sequence[tuple[Hashable, Verdict]], now: float, out: list[ev.Action]
    ) -> None:
        """Carry out a deadline policy's verdicts."""
        ledger = self._ledger
        for gid, verdict in verdicts:
            g = ledger.groups.get(cast(int, gid))
            if g is None:
                raise InvariantError(f"deadline verdict {verdict!r} for group {gid!r}: not running")
            # a truncated group aborted after the grace is counted once; a continued one is not cut
            ledger.counts.deadline_groups += verdict != Verdict.CONTINUE and not g.truncating
            if verdict == Verdict.CONTINUE:  # its deadline moved on: it keeps generating
                ledger.continued(g)
            elif verdict == Verdict.TRUNCATE:
                ledger.truncate(g, Cause.DEADLINE, out)
            elif verdict == Verdict.ABORT:
                self._release(g.gid, GroupOp.DEADLINE, Cause.DEADLINE, now, out)
            else:
                raise InvariantError(f"deadline verdict {verdict!r}: not a deadline action")

    def _on_timer(self, e: ev.TimerFired) -> list[ev.Action]:
        out: list[ev.Action] = []
        if not self._timers.fired(e.timer):
            return out  # cancelled meanwhile (a driver may race a cancel with the firing)
        if e.timer == Timer.STUCK:
            self._check_head(e.now, out, timer=True)
        elif e.timer == Timer.WATCHDOG:
            tracker, stopped = self._ledger.tracker, self._stopped is not None
            members = lambda gid: tuple(m.number for m in tracker.running(gid))  # noqa: E731
            self._watchdog.fired(e.now, self._ledger.groups, self.version, members, stopped, out)
        else:  # the deadline grace is over: abort what is still due
            overdue = self._grace.verdicts(overdue=True)
            self._ledger.counts.overdue_groups += len(overdue)
            self._deadline(overdue, e.now, out)
            out.append(_WAKE)  # the head may be ready now: the trainer asks again
        return out

    def _on_batch_wanted(self, e: ev.BatchWanted) -> list[ev.Action]:
        """Consume ready batches until ``e.groups`` groups were handed over (or none is ready);
        a deadline action taken while the trainer waits may leave the head ready: consumed too."""
        out: list[ev.Action] = []
        given, acted, policy, grace = 0, False, self.policy, self._grace
        grace.asked(e.now)
        while given < e.groups:
            if policy.ready():
                batch = policy.consume()
                self._proactive.consumed(batch.version + 1)
                out += [self._ledger.consumed(batch, out), _WAKE]  # its teardowns come first
                given, acted = given + len(batch.groups), False
                grace.new_head(out)
                self._deadline(grace.verdicts(), e.now, out)
                self._check_head(e.now, out)
            elif not acted:
                self._deadline(grace.verdicts(trainer_waiting=True), e.now, out)
                acted = True
            else:
                grace.wait(e.now, out)
                break
        if given and given >= e.groups:  # the request is met: the trainer's step starts
            grace.handed(e.now)
        return out

    # ------------------------------------------------------------------ stopping

    def _stop(self, why: str, out: list[ev.Action]) -> list[ev.Action]:
        """Stop for good: abort every running group."""
        if self._stopped is None:
            self._stopped = why
            out.append(ev.Stop(why))
            self._abort_all(Cause.STOPPED, out)
        return out

    def _abort_all(self, cause: Cause, out: list[ev.Action]) -> list[ev.Action]:
        op, ledger = GroupOp.SHUTDOWN if cause is Cause.SHUTDOWN else GroupOp.STOP, self._ledger
        for gid in [*ledger.groups, *ledger.judging]:
            ledger.teardown(gid, op, cause, out)
        out.append(_WAKE)
        self._timers.disarm_all(out)
        return out

"""The coordinator's parts one by one: timers, the watchdog, the deadline grace, the proactive
filter, the stop rules, the ledger's one teardown path — and that no user code runs inside the
core."""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import stalebound.core
from stalebound.config import GroupPostProcessConfig, RolloutConfig
from stalebound.core import (
    BufferPolicy,
    Cause,
    Coordinator,
    CoordinatorCounts,
    MemberId,
    StalenessBuffer,
    Timer,
    Verdict,
    build_policy,
    resolve_settings,
)
from stalebound.core import events as ev
from stalebound.core.filters import evaluate_group
from stalebound.core.grace import DeadlineGrace
from stalebound.core.groups import GroupTracker
from stalebound.core.ledger import Ledger
from stalebound.core.names import GateCall
from stalebound.core.proactive import ProactiveFilter
from stalebound.core.stopping import StopRules
from stalebound.core.timers import Timers
from stalebound.core.transitions import GroupOp
from stalebound.core.watchdog import Watchdog


def of(kind: type, actions: Sequence[ev.Action]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def test_the_coordinator_is_small_and_no_core_file_is_large() -> None:
    lines, _ = inspect.getsourcelines(Coordinator)
    assert len(lines) <= 350
    core = Path(stalebound.core.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in core.glob("*.py")}
    assert max(sizes.values()) <= 900, sizes


def test_names_are_their_strings_in_counters_messages_and_old_checkpoints() -> None:
    counts = CoordinatorCounts()
    counts.cancelled_members[Cause.SURPLUS] += 1
    counts.cancelled_members["surplus"] += 1  # as a checkpoint written before the enums reads
    assert counts.cancelled_members == {"surplus": 2}
    assert f"{Cause.SURPLUS}" == str(Cause.SURPLUS) == "surplus"
    assert type(next(iter(counts.by_cause()["cancelled_members"]))) is str
    assert ev.AbortRequest(MemberId(0, 0), Cause.SURPLUS) == ev.AbortRequest((0, 0), "surplus")


def test_timers_emit_only_changes() -> None:
    timers, out = Timers(), []
    timers.arm(Timer.STUCK, 5.0, out)
    timers.arm(Timer.STUCK, 5.0, out)  # already armed for then: nothing to do
    timers.arm(Timer.WATCHDOG, 9.0, out)
    timers.disarm(Timer.DEADLINE, out)  # not armed: nothing to cancel
    assert out == [ev.ArmTimer(Timer.STUCK, 5.0), ev.ArmTimer(Timer.WATCHDOG, 9.0)]
    assert timers.fired("stuck") and not timers.fired("stuck")  # fired once, then gone
    out.clear()
    timers.disarm_all(out)
    assert out == [ev.CancelTimer(Timer.WATCHDOG)]


def test_the_watchdog_reports_a_silent_group_once_per_stall() -> None:
    timers, counts, out = Timers(), CoordinatorCounts(), []
    dog = Watchdog(10.0, timers, counts)
    dog.started(0, 0.0, out)
    dog.started(1, 2.0, out)  # armed once, for the first group's limit
    assert out == [ev.ArmTimer(Timer.WATCHDOG, 10.0)]
    groups = {
        0: SimpleNamespace(gid=0, version=0, progress=0.0),
        1: SimpleNamespace(gid=1, version=0, progress=5.0),
    }
    out.clear()
    timers.fired(Timer.WATCHDOG)
    dog.fired(10.0, groups, 3, lambda gid: (gid,), False, out)
    assert out == [ev.ReportStall(0, 0, 3, 10.0, (0,)), ev.ArmTimer(Timer.WATCHDOG, 15.0)]
    out.clear()
    timers.fired(Timer.WATCHDOG)
    dog.fired(15.0, groups, 3, lambda gid: (gid,), False, out)  # group 0 was reported already
    assert of(ev.ReportStall, out) == [ev.ReportStall(1, 0, 3, 10.0, (1,))]
    assert counts.watchdog_stalls == 2
    dog.forget(0)  # ended: a new group with its id would be reported afresh
    groups[0].progress = 15.0


class Due:
    """A policy whose running group ``7`` is due at the head until told otherwise."""

    version = 4

    def __init__(self) -> None:
        self.due: list[Hashable] = [7]
        self.asked: list[tuple[bool, bool]] = []

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]:
        self.asked.append((trainer_waiting, overdue))
        return [(g, Verdict.ABORT) for g in self.due] if overdue else []


def test_the_grace_in_steps_scales_with_the_trainers_median_step() -> None:
    timers, policy, out = Timers(), Due(), []
    grace = DeadlineGrace(policy, timers, None, 0.5)
    grace.wait(0.0, out)
    assert out == []  # fewer than two steps known: the trainer waits for the group
    for t in (0.0, 10.0, 20.0):  # steps of 4 s: handed over at t, asked again at t + 4
        grace.handed(t)
        grace.asked(t + 4.0)
    assert grace.grace() == 2.0
    grace.wait(30.0, out)
    assert out == [ev.ArmTimer(Timer.DEADLINE, 32.0)]
    grace.wait(31.0, out)  # armed already
    assert grace.verdicts(overdue=True) == [(7, Verdict.ABORT)]
    grace.new_head(out)  # a new head has its own grace
    assert out[-1] == ev.CancelTimer(Timer.DEADLINE)
    policy.due = []
    out.clear()
    grace.wait(40.0, out)
    assert out == []  # nothing due: no timer


def test_a_grace_in_seconds_wins_over_steps() -> None:
    assert DeadlineGrace(Due(), Timers(), 3.0, 0.5).grace() == 3.0


def test_the_proactive_filter_acts_only_on_overtaken_groups_of_a_stuck_head() -> None:
    buf = StalenessBuffer(2, 0)  # B = B′ = 2, η = 0: one buffer
    policy = BufferPolicy(buf)
    timers, out = Timers(), []
    pf = ProactiveFilter(
        policy, timers, method="retry", threshold=1, stuck_timeout=None, max_retries=1
    )
    runs = {g: SimpleNamespace(gid=g, retries=0, truncating=False) for g in (0, 1)}
    for g in runs:
        policy.try_admit(g)
        pf.started(g, 0.0, out)
    assert pf.targets(1.0, runs, False, out) == []  # STUCK on two reservations: more than 1
    policy.complete(0)
    pf.occupied(0)  # group 0 landed in the head after group 1 was reserved: 1 is overtaken
    assert pf.targets(2.0, runs, False, out) == [runs[1]]
    runs[1].retries = 1  # retried max_retries times already: waited for
    assert pf.targets(3.0, runs, False, out) == []
    assert pf.targets(3.0, runs, True, out) == []  # stopped: never acts
    assert pf.stuck_seconds(4.0) == {0: 3.0}  # STUCK since first observed, at 1


def test_the_stop_rules_stop_after_a_run_and_a_completion_breaks_it() -> None:
    counts = CoordinatorCounts()
    s = resolve_settings(RolloutConfig(max_consecutive_failures=2, max_consecutive_filtered=2))
    rules = StopRules(counts, s)
    assert rules.failed("a") is None
    rules.completed()
    assert rules.failed("b") is None
    reason = rules.failed("c")
    assert reason is not None and "2 groups failed in a row" in reason and "b; c" in reason
    assert rules.filtered(4, "same") is None
    reason = rules.filtered(4, "same")
    assert reason is not None and "filtered out by should_accept_fn" in reason
    assert counts.discarded_members == {"filtered": 8} and counts.failed_groups == 3


def test_one_teardown_path_ends_a_running_group_everywhere() -> None:
    buf = StalenessBuffer(1, 1)
    policy = BufferPolicy(buf)
    forgotten: list[Hashable] = []
    decider = SimpleNamespace(started=lambda *a: None, forget=forgotten.append)
    ledger = Ledger(policy, GroupTracker(2), gated=True, deciders=[decider])
    out: list[ev.Action] = []
    policy.try_admit(0)
    ledger.start(0, (5, None, 0), 0, 1, 0.0, out)
    ledger.tracker.finish(MemberId(0, 1), "done")
    out.clear()
    ledger.teardown(0, GroupOp.DEADLINE, Cause.DEADLINE, out)
    assert out == [
        ev.AbortRequest(MemberId(0, 0), Cause.DEADLINE),  # the member still running
        ev.ReportDrop(0, 5, "deadline"),
        ev.NotifyGate(GateCall.REJECTED),
        ev.AbortGroup(0, Cause.DEADLINE),
    ]
    assert 0 not in buf and 0 not in ledger.tracker and forgotten == [0]
    c = ledger.counts
    assert c.discarded_members == {"deadline": 1} and c.cancelled_members == {"deadline": 1}
    assert buf.statistics().aborted == {"deadline": 1}


def filtered_coordinator(accept: Any, **rollout: Any) -> Coordinator:
    s = resolve_settings(RolloutConfig(consumer_batch_size=1, group_size=2, **rollout))
    c = Coordinator(build_policy(s), s)
    c.handle(ev.Submitted(0, accept))
    c.handle(ev.Dispatch(0.0, 0))
    return c


def test_a_completed_groups_filters_run_outside_the_core() -> None:
    calls: list[list[Any]] = []

    def accept(results: list[Any]) -> bool:
        calls.append(results)
        return False

    c = filtered_coordinator(accept)
    c.handle(ev.MemberFinished(MemberId(0, 0), 1.0, {"score": 1}))
    out = c.handle(ev.MemberFinished(MemberId(0, 1), 2.0, {"score": 0}))
    assert calls == []  # the core only asks
    (judge,) = of(ev.EvaluateGroup, out)
    assert out[-1] is judge and judge.results == ({"score": 1}, {"score": 0})
    verdict = evaluate_group(judge, 2.0)
    assert calls == [[{"score": 1}, {"score": 0}]]
    assert verdict == ev.GroupEvaluated(0, 2.0, Verdict.FILTER, "should_accept_fn returned False")
    out = c.handle(verdict)
    assert of(ev.ReportDrop, out) == [ev.ReportDrop(0, 0, "filtered")]
    assert c.counts.filtered_groups == 1
    with pytest.raises(stalebound.core.ProtocolError, match="no group awaits a verdict"):
        c.handle(ev.GroupEvaluated(9, 3.0, Verdict.KEEP))


def test_a_filter_that_raises_fails_the_group_and_one_without_its_metric_stops() -> None:
    def boom(results: list[Any]) -> bool:
        raise ValueError("boom")

    c = filtered_coordinator(boom)
    c.handle(ev.MemberFinished(MemberId(0, 0), 1.0, {}))
    (judge,) = of(ev.EvaluateGroup, c.handle(ev.MemberFinished(MemberId(0, 1), 2.0, {})))
    out = c.handle(evaluate_group(judge, 2.0))
    assert of(ev.ReportFailure, out) == [] and c.counts.failed_groups == 1
    assert of(ev.ReportDrop, out) == [ev.ReportDrop(0, 0, "failed")]

    c = filtered_coordinator(None, group_post_process=GroupPostProcessConfig(enable=True))
    c.handle(ev.MemberFinished(MemberId(0, 0), 1.0, {}))
    (judge,) = of(ev.EvaluateGroup, c.handle(ev.MemberFinished(MemberId(0, 1), 2.0, {})))
    verdict = evaluate_group(judge, 2.0)
    assert verdict.verdict is Verdict.STOP and "has no such metric" in verdict.reason
    out = c.handle(verdict)
    assert of(ev.Stop, out) and c.stopped == verdict.reason


def test_a_gated_coordinator_names_the_gates_callbacks_as_actions() -> None:
    s = resolve_settings(RolloutConfig(consumer_batch_size=1, group_size=1))
    c = Coordinator(build_policy(s), s, gated=True)
    c.handle(ev.Submitted(0))
    started = c.handle(ev.Dispatch(0.0, 0))
    calls = [a.call for a in of(ev.NotifyGate, started)]
    assert calls == [GateCall.ENQUEUED, GateCall.SUBMITTED]
    done = c.handle(ev.MemberFinished(MemberId(0, 0), 1.0, {}))
    assert [a.call for a in of(ev.NotifyGate, done)] == [GateCall.ACCEPTED]
    plain = Coordinator(build_policy(s), s)
    plain.handle(ev.Submitted(0))
    assert of(ev.NotifyGate, plain.handle(ev.Dispatch(0.0, 0))) == []

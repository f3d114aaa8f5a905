"""The coordinator on scripted event sequences: what it decides, and that it decides it alone."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest

from stalebound.config import RolloutConfig
from stalebound.core import (
    DEFAULT_BATCHES_IN_FLIGHT,
    GROUP_TRANSITIONS,
    BufferPolicy,
    Coordinator,
    GroupOp,
    GroupState,
    InvariantError,
    MemberId,
    ProtocolError,
    StalenessBuffer,
    build_policy,
    resolve_settings,
)
from stalebound.core import events as ev
from stalebound.core.transitions import ENTRY_TRANSITIONS, EntryOp, EntryState, move


def coordinator(**rollout: object) -> Coordinator:
    s = resolve_settings(RolloutConfig(**rollout))  # type: ignore[arg-type]
    return Coordinator(build_policy(s), s)


def of(kind: type, actions: Sequence[ev.Action]) -> list[ev.Action]:
    return [a for a in actions if isinstance(a, kind)]


def test_a_move_not_in_the_table_is_refused_by_whose_fault_it_is() -> None:
    assert move(GROUP_TRANSITIONS, GroupState.RUNNING, GroupOp.COMPLETE, 7) is GroupState.COMPLETED
    with pytest.raises(ProtocolError, match=r"consume of 7: not allowed from RUNNING"):
        move(GROUP_TRANSITIONS, GroupState.RUNNING, GroupOp.CONSUME, 7)
    with pytest.raises(InvariantError, match="nothing, it has ended"):
        move(GROUP_TRANSITIONS, GroupState.CONSUMED, GroupOp.DROP, 7, error=InvariantError)
    assert move(ENTRY_TRANSITIONS, EntryState.EMPTY, EntryOp.RESERVE, "g") is EntryState.RESERVED
    with pytest.raises(ProtocolError, match="occupy of 'g': not allowed from EMPTY"):
        move(ENTRY_TRANSITIONS, EntryState.EMPTY, EntryOp.OCCUPY, "g")


def test_a_group_is_admitted_launched_completed_and_handed_over() -> None:
    c = coordinator(consumer_batch_size=1, group_size=2, max_head_offpolicyness=0)
    c.handle(ev.Submitted(sample=5))
    actions = c.handle(ev.Dispatch(now=1.0, version=0))
    assert of(ev.StartGroup, actions) == [ev.StartGroup(0, 5, 0, 0)]
    members = [a.member for a in of(ev.LaunchMember, actions)]
    assert members == [MemberId(0, 0), MemberId(0, 1)]
    assert ev.ArmTimer("watchdog", 1.0 + 300.0) in actions  # time only from the event
    assert c.handle(ev.MemberFinished(members[1], 2.0, {"score": 1}, (0,))) == []
    done = c.handle(ev.MemberFinished(members[0], 3.0, {"score": 0}, (0,)))
    assert done == [ev.Wake()]
    (batch,) = of(ev.HandOverBatch, c.handle(ev.BatchWanted(1, 4.0)))
    assert batch.version == 0 and [g.sample for g in batch.groups] == [5]
    assert [r.member.number for r, _, _ in batch.groups[0].members] == [1, 0]  # finish order
    assert c.version == 1 and c.counts.consumed_trajectories == 2


def test_a_failed_member_is_relaunched_while_n_is_reachable_then_the_group_fails() -> None:
    c = coordinator(consumer_batch_size=1, group_size=1, max_consecutive_failures=5)
    c.handle(ev.Submitted(0))
    (launch,) = of(ev.LaunchMember, c.handle(ev.Dispatch(0.0, 0)))
    again = c.handle(ev.MemberFailed(launch.member, 1.0, "timeout", 0))
    assert again == [ev.LaunchMember(MemberId(0, 1), 0, relaunch=True)]
    failed = c.handle(ev.MemberFailed(MemberId(0, 1), 2.0, "rejected", 0, "boom"))
    assert of(ev.ReportFailure, failed) == [
        ev.ReportFailure(0, "group 0: timeout, rejected (last: boom)")
    ]
    assert of(ev.ReportDrop, failed) == [ev.ReportDrop(0, 0, "failed")]
    assert c.counts.failed_groups == 1 and c.counts.member_failures == {"timeout": 1, "rejected": 1}


def test_consecutive_failures_stop_and_abort_everything_running() -> None:
    c = coordinator(consumer_batch_size=2, group_size=1, max_consecutive_failures=1)
    for i in range(2):
        c.handle(ev.Submitted(i))
    launched = of(ev.LaunchMember, c.handle(ev.Dispatch(0.0, 0)))
    c.handle(ev.MemberFailed(launched[0].member, 0.0, "error:X", 0))  # relaunch
    out = c.handle(ev.MemberFailed(MemberId(0, 1), 0.0, "error:X", 0))
    (stop,) = of(ev.Stop, out)
    assert "1 groups failed in a row" in stop.reason
    assert ev.AbortRequest(launched[1].member, "stopped") in out
    assert c.stopped and c.running_groups == 0 and c.handle(ev.Dispatch(0.0, 0)) == []


def test_an_unknown_event_or_member_is_a_protocol_error() -> None:
    c = coordinator()
    with pytest.raises(ProtocolError, match="not a coordinator event"):
        c.handle("finished")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="no such group running"):
        c.handle(ev.MemberFinished(MemberId(9, 0), 0.0, {}))


def test_the_settings_defaults_live_in_the_core() -> None:
    s = resolve_settings(RolloutConfig(consumer_batch_size=4, max_head_offpolicyness=1000))
    assert s.max_concurrent == DEFAULT_BATCHES_IN_FLIGHT * 4 and s.staleness == 1000
    s = resolve_settings(RolloutConfig(consumer_batch_size=4, max_head_offpolicyness=1))
    assert s.max_concurrent == 2 * 4
    s = resolve_settings(RolloutConfig(consumer_batch_size=4, staleness_policy="capacity"))
    assert s.max_concurrent == 4  # AReaL's fallback: consumer_batch_size


class DeadlineBuffer(BufferPolicy):
    """A stand-in deadline policy: names every running group of the new head buffer (when it
    becomes the head, not again when the trainer waits for it)."""

    verdict = "truncate"

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, str]]:
        if trainer_waiting or overdue:
            return []
        return [(g, self.verdict) for g in self.buffer.reserved_groups(head)]


@pytest.mark.parametrize("verdict", ["truncate", "abort"])
def test_a_deadline_policy_plugs_in_through_its_verdicts(verdict: str) -> None:
    s = resolve_settings(RolloutConfig(consumer_batch_size=1, group_size=1, buffer_size=2))
    policy = DeadlineBuffer(StalenessBuffer(1, s.staleness, buffer_size=2))
    policy.verdict = verdict
    c = Coordinator(policy, s)
    for i in range(6):
        c.handle(ev.Submitted(i))
    launched = of(ev.LaunchMember, c.handle(ev.Dispatch(0.0, 0)))
    # finish what sits in buffer 0 so it can be consumed; buffer 1's groups meet their deadline
    c.handle(ev.MemberFinished(launched[-1].member, 1.0, {"score": 1}))
    due = set(policy.buffer.reserved_groups(1))  # the next head's running groups
    out = c.handle(ev.BatchWanted(1, 2.0))
    assert of(ev.HandOverBatch, out) and due
    kind = ev.TruncateMember if verdict == "truncate" else ev.AbortRequest
    acted = {a.member.group_id for a in of(kind, out) if a.cause == "deadline"}
    assert acted == due and c.counts.deadline_groups == len(due)
    if verdict == "abort":
        assert not due & set(c.running())


def test_a_restored_coordinator_decides_on_the_restored_buffer() -> None:
    c = coordinator(consumer_batch_size=1, group_size=1)
    for i in range(2):
        c.handle(ev.Submitted(i))
    first, _running = of(ev.LaunchMember, c.handle(ev.Dispatch(0.0, 0)))
    c.handle(ev.MemberFinished(first.member, 1.0, {"score": 1}))
    snap = c.snapshot()
    d = coordinator(consumer_batch_size=1, group_size=1)
    d.restore(
        policy_state=snap["policy_state"],
        running=[gid for gid, _, _ in snap["running"]],
        pending=[(sample, retries) for _, sample, retries in snap["running"]],
        samples=snap["samples"],
        next_group_id=snap["next_group_id"],
        counts=snap["counts"],
        by_cause=snap["by_cause"],
    )
    assert d.buffer is d.policy.buffer  # loading a snapshot builds a new buffer
    (batch,) = of(ev.HandOverBatch, d.handle(ev.BatchWanted(1, 2.0)))
    assert [g.sample for g in batch.groups] == [0]
    assert d.queued_items() == [(1, 0)] and d.counts.resumed_groups == 1
    restarted = of(ev.StartGroup, d.handle(ev.Dispatch(3.0, d.version)))
    assert [a.sample for a in restarted] == [1] and restarted[0].group_id == 2


def test_events_and_actions_compare_and_hash_by_type_and_fields() -> None:
    a, b = ev.Paused(1.0), ev.Resumed(1.0)
    assert a == ev.Paused(1.0) and hash(a) == hash(ev.Paused(1.0))
    assert a != b  # the same fields in another type: another event
    assert ev.AbortRequest((1, 0), "surplus") != ev.TruncateMember((1, 0), "surplus")
    assert len({ev.Wake(), ev.Wake(), ev.CancelTimer("stuck")}) == 2
    launch = ev.LaunchMember(MemberId(1, 0), 0)
    assert launch == ev.LaunchMember(MemberId(1, 0), 0) != ev.LaunchMember(MemberId(1, 1), 0)


def test_a_driver_draws_one_item_more_than_admission_takes_within_the_gate() -> None:
    c = coordinator(consumer_batch_size=2, max_head_offpolicyness=0, group_size=1)
    free = c.capacity(0)
    assert free > 0
    assert c.items_wanted(0, None) == free + 1  # the one more is refused: admission shows it
    assert c.items_wanted(0, 1) == 1  # the gate (AReaL's manager) bounds it

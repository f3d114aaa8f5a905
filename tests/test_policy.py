"""The two staleness policies behind one interface."""

from __future__ import annotations

from typing import Any

import pytest

from stalebound import ProtocolError, StalenessBuffer
from stalebound.core import BufferPolicy, CapacityCounter, CapacityPolicy, RolloutStat


def test_capacity_formula_matches_areal_with_its_clamps() -> None:
    c = CapacityCounter(max_concurrent_rollouts=8, consumer_batch_size=4, max_staleness=1)
    assert c.capacity(0) == min(8, (1 + 0 + 1) * 4)
    for _ in range(6):
        c.enqueued()
        c.submitted()
    assert c.capacity(0) == min(8 - 6, 8 - 6)
    for _ in range(4):
        c.accepted()
    assert c.stat == RolloutStat(accepted=4, enqueued=0, rejected=0, running=2)
    assert c.capacity(0) == min(6, 8 - 6) == 2
    assert c.capacity(1) == min(6, 12 - 6) == 6
    assert c.capacity(3) == 6  # concurrency-bound
    zero = CapacityCounter(0, 0, 0)
    assert zero.capacity(0) == 1  # max(1, C) and max(1, B)
    assert zero.pending_limit() == 0


def test_counter_refuses_to_go_negative_and_changes_nothing() -> None:
    c = CapacityCounter(4, 2, 1)
    with pytest.raises(ProtocolError, match=r"on_rollout_submitted\(\): no rollout is enqueued"):
        c.submitted()
    with pytest.raises(ProtocolError, match=r"on_rollout_accepted\(\): no rollout is running"):
        c.accepted()
    assert c.stat == RolloutStat()


def test_version_recovered_counts_trained_batches_as_accepted() -> None:
    c = CapacityCounter(100, 4, 2)
    c.version_recovered(10)
    assert c.stat.accepted == 40
    assert c.capacity(10) == (2 + 1) * 4  # not (2 + 10 + 1) * 4: no burst after resume


def test_capacity_policy_lets_a_straggler_exceed_the_bound() -> None:
    p = CapacityPolicy(CapacityCounter(8, 2, 1))
    admitted = [p.try_admit(f"g{i}") for i in range(4)]
    assert all(admitted)
    for step in range(3):
        for i in range(2):
            gid = f"s{step}{i}"
            if step:  # refill what the last step consumed
                assert p.try_admit(gid)
            else:
                gid = f"g{i + 1}"
            p.complete(gid)
        p.consume()
        if step == 0:
            p.complete("g3")
    p.complete("g0")  # admitted at 0, trained at 3 at the earliest
    while not p.ready():
        gid = f"late{p.statistics().admitted}"
        p.try_admit(gid)
        p.complete(gid)
    batch = p.consume()
    assert max(batch.staleness()) > 1
    assert p.statistics().violations >= 1


def test_capacity_drop_discards_what_is_too_stale_and_counts_it() -> None:
    p = CapacityPolicy(CapacityCounter(8, 1, 1), drop_stale=True)
    assert p.try_admit("slow") and p.try_admit("fast")
    p.complete("fast")
    p.consume()  # v = 1
    for step in (1, 2):
        assert p.try_admit(f"n{step}", version=step)
        p.complete(f"n{step}")
        if step == 1:
            p.consume()  # v = 2: "slow" (version 0) can no longer be trained with η = 1
    assert p.complete("slow") is False
    batch = p.consume()
    assert [g.group_id for g in batch.groups] == ["n2"]
    assert batch.dropped == ("slow",)
    s = p.statistics()
    assert s.dropped == 1 and s.violations == 0 and s.policy == "capacity-drop"


def test_buffer_policy_limits_concurrency_and_never_violates() -> None:
    p = BufferPolicy(StalenessBuffer(batch_size=2, staleness=1), max_concurrent=3)
    assert [p.try_admit(g) is not None for g in "abcd"] == [True, True, True, False]
    assert p.capacity() == 0
    with pytest.raises(ProtocolError, match="already in flight"):
        p.try_admit("a")
    p.complete("a")
    assert p.capacity() == 1
    p.complete("c")
    batch = p.consume()
    assert [g.group_id for g in batch.groups] == ["a", "c"]
    assert p.statistics().violations == 0 and p.statistics().running == 1


def _busy_buffer_policy() -> BufferPolicy:
    p = BufferPolicy(StalenessBuffer(batch_size=2, staleness=1), max_concurrent=5)
    for g in "abcd":
        assert p.try_admit(g) is not None
    p.complete("a", payload=["A"])
    p.complete("c", payload=["C"])
    p.abort("d", "failed")
    return p


def _busy_capacity_policy() -> CapacityPolicy:
    p = CapacityPolicy(CapacityCounter(8, 2, 1), drop_stale=True)
    for g in "abcd":
        assert p.try_admit(g) is not None
    p.complete("a", payload=["A"])
    p.complete("b", payload=["B"])
    p.consume()
    p.complete("c", payload=["C"])
    return p


@pytest.mark.parametrize(
    "make, empty",
    [
        (
            _busy_buffer_policy,
            lambda: BufferPolicy(StalenessBuffer(batch_size=2, staleness=1), max_concurrent=5),
        ),
        (_busy_capacity_policy, lambda: CapacityPolicy(CapacityCounter(8, 2, 1), drop_stale=True)),
    ],
)
def test_policy_snapshot_round_trips_and_continues_alike(make: Any, empty: Any) -> None:
    original, twin, fresh = make(), make(), empty()
    fresh.load_snapshot(original.snapshot())
    assert fresh.snapshot() == twin.snapshot() and fresh.statistics() == twin.statistics()
    for p in (fresh, twin):  # the same calls give the same answers
        for g in [g for g in "abcd" if p.is_running(g)]:
            p.complete(g, payload=[g.upper()])
        assert p.ready()
    assert fresh.consume() == twin.consume()


def test_policy_load_snapshot_refuses_damage_and_foreign_policies_unchanged() -> None:
    buf, cap = _busy_buffer_policy(), _busy_capacity_policy()
    before = (buf.snapshot(), cap.snapshot())
    with pytest.raises(
        ProtocolError, match="snapshot is of the 'capacity-drop' policy, not 'buffer'"
    ):
        buf.load_snapshot(cap.snapshot())
    with pytest.raises(ProtocolError, match="damaged or not a buffer-policy snapshot"):
        buf.load_snapshot({"policy": "buffer"})
    smaller = CapacityPolicy(CapacityCounter(8, 4, 1), drop_stale=True)
    with pytest.raises(ProtocolError, match=r"consumer_batch_size: 2 → 4"):
        smaller.load_snapshot(cap.snapshot())
    damaged = {**cap.snapshot(), "running": [["c", 0], ["d", 7]]}
    with pytest.raises(ProtocolError, match="damaged or not a capacity-policy snapshot"):
        cap.load_snapshot(damaged)
    # a count that is no integer at all (int(inf) overflows) is damage too, not a crash
    with pytest.raises(ProtocolError, match=r"buffer-policy snapshot \(OverflowError"):
        buf.load_snapshot({**buf.snapshot(), "admitted": float("inf")})
    with pytest.raises(ProtocolError, match=r"capacity-policy snapshot \(OverflowError"):
        cap.load_snapshot({**cap.snapshot(), "consumed": float("inf")})
    assert (buf.snapshot(), cap.snapshot()) == before

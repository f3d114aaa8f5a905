"""The staleness buffer, rule by rule (DESIGN §2)."""

from __future__ import annotations

import pytest

from stalebound import (
    BufferState,
    ConfigError,
    ConsumedGroup,
    EntryState,
    ProtocolError,
    Reservation,
    StalenessBuffer,
)
from stalebound.core import BufferPolicy


def fill(buf: StalenessBuffer, *ids: str) -> list[int]:
    """Reserve then occupy each id at the current version; return where each landed."""
    out = []
    for gid in ids:
        assert buf.try_reserve(gid) is not None
        out.append(buf.occupy(gid, payload=gid.upper()))
    return out


def counts(buf: StalenessBuffer, bv: int) -> tuple[int, int, int]:
    e = buf.entries(bv)
    return e[EntryState.OCCUPIED], e[EntryState.RESERVED], e[EntryState.EMPTY]


# ------------------------------------------------------------------------ the seed's example


def test_seed_example_six_reserved_in_v2_first_finisher_lands_in_v1() -> None:
    buf = StalenessBuffer(batch_size=6, staleness=1, start_version=1)
    res = [buf.try_reserve(f"t{i}") for i in range(1, 7)]
    assert res == [Reservation(f"t{i}", 1, 2) for i in range(1, 7)]
    assert counts(buf, 2) == (0, 6, 0) and buf.state(2) is BufferState.STUCK
    assert buf.state(1) is BufferState.PENDING
    assert buf.occupy("t1") == 1
    assert counts(buf, 1) == (1, 0, 5) and counts(buf, 2) == (0, 5, 1)


# ------------------------------------------------------------------------------ Reserve


def test_reserve_takes_the_latest_buffer_with_room_then_earlier_ones() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=2)
    placed = [buf.try_reserve(f"g{i}").buffer_version for i in range(6)]  # type: ignore[union-attr]
    assert placed == [2, 2, 1, 1, 0, 0]
    assert buf.try_reserve("g6") is None
    assert buf.statistics().refused == 1


def test_reserve_with_an_old_version_is_limited_to_its_own_window() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=1)
    fill(buf, "a")
    buf.consume()
    fill(buf, "b")
    buf.consume()  # v = 2
    assert buf.try_reserve("old", version=0) is None  # 0 + 1 < 2: too stale to start
    assert buf.try_reserve("ok", version=1) == Reservation("ok", 1, 2)
    assert buf.statistics().refused == 1


def test_reserve_from_the_future_is_a_protocol_error_and_changes_nothing() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    before = buf.snapshot()
    with pytest.raises(
        ProtocolError, match=r"version 1 is from the future \(the current version is 0\)"
    ):
        buf.try_reserve("g", version=1)
    assert buf.snapshot() == before


def test_reserve_twice_is_a_protocol_error_naming_the_group_and_state() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    buf.try_reserve("g")
    with pytest.raises(
        ProtocolError,
        match=r"try_reserve\(group_id='g', version=0\): the group is already in flight "
        r"\(RESERVED in buffer 1, version 0\)",
    ):
        buf.try_reserve("g")


@pytest.mark.parametrize("bad", [["list"], {"d": 1}])
def test_unhashable_group_ids_are_refused(bad: object) -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    with pytest.raises(ProtocolError, match="group ids must be hashable"):
        buf.try_reserve(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["0", 1.0, True, None])
def test_non_int_versions_are_refused(bad: object) -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    if bad is None:
        assert buf.try_reserve("g", version=bad) is not None  # None means "the current version"
        return
    with pytest.raises(ProtocolError, match="the version must be an int"):
        buf.try_reserve("g", version=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- Occupy


def test_occupy_prefers_the_earliest_buffer_with_fewer_than_b_occupied() -> None:
    # B = 2, B' = 3: buffer 0 may hold a third occupied group, but Occupy prefers a buffer that
    # still needs groups to become ready.
    buf = StalenessBuffer(batch_size=2, staleness=1, buffer_size=3)
    for g in "abcd":
        buf.try_reserve(g)  # a, b, c -> buffer 1; d -> buffer 0
    assert buf.occupy("a") == 0
    assert buf.occupy("b") == 0  # buffer 0 now READY_WITH_CAPACITY (2 occupied, 1 reserved)
    assert buf.state(0) is BufferState.READY
    buf.abort("d")
    assert buf.state(0) is BufferState.READY_WITH_CAPACITY
    assert buf.occupy("c") == 1  # buffer 0 has room but already has B occupied


def test_occupy_falls_back_to_the_earliest_buffer_with_an_empty_entry() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=1, buffer_size=2)
    fill(buf, "a")  # buffer 0: 1 occupied (= B), 1 empty
    buf.try_reserve("b")  # -> buffer 1
    buf.try_reserve("c")  # -> buffer 1
    buf.occupy("b")  # buffer 0 has occ >= B; buffer 1 has occ < B and an empty entry
    assert buf.lookup("b") == (EntryState.OCCUPIED, 1, 0)
    # c: buffer 1 now has occ = B; no buffer in [0, 1] has occ < B; earliest with an empty: 0
    assert buf.occupy("c") == 0
    assert counts(buf, 0) == (2, 0, 0)


def test_occupy_never_moves_a_group_later_than_its_reservation() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=3)
    r = buf.try_reserve("a")
    assert r is not None and r.buffer_version == 3
    assert buf.occupy("a") == 0


def test_double_occupy_and_unknown_ids_are_protocol_errors() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    fill(buf, "a")
    with pytest.raises(
        ProtocolError, match=r"occupy\(group_id='a'\): the group is already OCCUPIED in buffer 0"
    ):
        buf.occupy("a")
    with pytest.raises(ProtocolError, match=r"occupy\(group_id='zz'\): no such group in flight"):
        buf.occupy("zz")


def test_segments_older_than_the_group_or_from_the_future_are_refused() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=2)
    fill(buf, "x")
    buf.consume()  # v = 1
    buf.try_reserve("g")  # version 1
    before = buf.snapshot()
    with pytest.raises(ProtocolError, match=r"segment version 0 is outside \[1, 1\]"):
        buf.occupy("g", segment_versions=[1, 0])
    with pytest.raises(ProtocolError, match=r"segment version 2 is outside \[1, 1\]"):
        buf.occupy("g", segment_versions=[2])
    assert buf.snapshot() == before
    assert buf.occupy("g", segment_versions=[1, 1]) == 1


def test_partial_rollout_segments_from_newer_versions_are_accepted() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=2)
    buf.try_reserve("slow")  # V = 0, reserved in buffer 2
    fill(buf, "a")
    buf.consume()  # v = 1: the weights changed under "slow"
    landed = buf.occupy("slow", segment_versions=[0, 0, 1, 1])
    assert landed == 1
    assert buf.lookup("slow") == (EntryState.OCCUPIED, 1, 0)


# ------------------------------------------------------------------------ buffer states


def test_the_four_buffer_states() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=0, buffer_size=3)
    assert buf.state(0) is BufferState.PENDING
    for g in "abc":
        buf.try_reserve(g)
    assert buf.state(0) is BufferState.STUCK
    buf.occupy("a")
    buf.occupy("b")
    assert buf.state(0) is BufferState.READY
    buf.abort("c")
    assert buf.state(0) is BufferState.READY_WITH_CAPACITY
    assert buf.ready()


def test_state_outside_the_window_is_a_protocol_error() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    with pytest.raises(ProtocolError, match=r"state\(2\): buffer versions in the window are 0 … 1"):
        buf.state(2)
    with pytest.raises(ProtocolError, match=r"entries\(-1\)"):
        buf.entries(-1)


# ------------------------------------------------------------------------------ Consume


def test_consume_returns_the_first_b_in_occupy_order_and_advances() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1, buffer_size=3)
    for g in "abc":
        buf.try_reserve(g)  # all three in buffer 1
    buf.occupy("c", payload="C")
    buf.occupy("a", payload="A")
    batch = buf.consume()
    assert batch.version == 0
    assert batch.groups == (ConsumedGroup("c", 0, "C"), ConsumedGroup("a", 0, "A"))
    assert batch.aborted == () and batch.dropped == ()
    assert buf.version == 1
    assert buf.state(2) is BufferState.PENDING  # buffer v + 1 + η came into the window empty


def test_consume_aborts_surplus_reservations_of_the_consumed_buffer() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=0, buffer_size=3)
    for g in "abc":
        buf.try_reserve(g)
    buf.occupy("b")
    buf.occupy("a")
    batch = buf.consume()
    assert [g.group_id for g in batch.groups] == ["b", "a"]
    assert batch.aborted == ("c",)
    assert "c" not in buf
    assert buf.statistics().aborted == {"surplus": 1}
    with pytest.raises(ProtocolError, match="no such group in flight"):
        buf.occupy("c")


def test_consume_replaces_extra_occupied_groups_in_occupy_order() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=2, buffer_size=3)
    # All three land in buffer 0: the first makes it ready, the rest fall back to the earliest
    # buffer with an empty entry only when no buffer in their range has occ < B...
    for g in "abc":
        buf.try_reserve(g)  # buffer 2 (B' = 3)
    buf.occupy("a")  # -> 0
    buf.occupy("b")  # -> 1 (0 has B occupied)
    buf.occupy("c")  # -> 2
    fill(buf, "d")  # reserved in 2 (full) -> 1 ... occupies earliest with occ < B: none; fallback 0
    assert buf.lookup("d") == (EntryState.OCCUPIED, 0, 0)
    batch = buf.consume()
    assert [g.group_id for g in batch.groups] == ["a"]
    # d (occupy seq 3) is re-placed by the Occupy rule into [1, 0 + 2]: 1 and 2 have occ = B, so
    # the earliest with an empty entry: 1. It keeps its occupy order behind b.
    assert buf.lookup("d") == (EntryState.OCCUPIED, 1, 0)
    assert buf.occupied_groups(1) == ("b", "d")
    assert buf.statistics().replaced == 1


def test_consume_drops_extra_groups_with_no_admissible_place() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=0, buffer_size=2)
    fill(buf, "a", "b")  # both in buffer 0 (η = 0: nowhere else)
    batch = buf.consume()
    assert [g.group_id for g in batch.groups] == ["a"]
    assert batch.dropped == ("b",)
    assert batch.dropped_groups == (ConsumedGroup("b", 0, "B"),)
    assert buf.statistics().dropped == 1
    assert len(buf) == 0


def test_consume_when_not_ready_says_why() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=0)
    fill(buf, "a")
    buf.try_reserve("b")
    with pytest.raises(
        ProtocolError,
        match=r"consume\(\): buffer 0 is STUCK \(1 of 2 occupied, 1 reserved, 0 empty\); "
        r"consume only when ready\(\) is True",
    ):
        buf.consume()


def test_staleness_zero_is_synchronous_training() -> None:
    buf = StalenessBuffer(batch_size=3, staleness=0)
    for step in range(4):
        ids = [f"s{step}g{i}" for i in range(3)]
        assert [buf.try_reserve(g).buffer_version for g in ids] == [step] * 3  # type: ignore[union-attr]
        assert buf.try_reserve("extra") is None  # nothing may start ahead of the trainer
        for g in reversed(ids):
            buf.occupy(g)
        batch = buf.consume()
        assert batch.staleness() == [0, 0, 0]
    assert buf.statistics().staleness_histogram == {0: 12}


# ------------------------------------------------------------------ Abort and capacity


def test_abort_frees_reserved_and_occupied_entries_and_counts_the_cause() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    buf.try_reserve("r")
    fill(buf, "o")
    buf.abort("r")
    buf.abort("o", cause="filtered")
    assert len(buf) == 0 and buf.capacity() == 4
    s = buf.statistics()
    assert s.aborted == {"aborted": 1, "filtered": 1} and s.filtered == 1
    with pytest.raises(ProtocolError, match=r"abort\(group_id='r'\): no such group in flight"):
        buf.abort("r")
    buf.try_reserve("x")
    with pytest.raises(ProtocolError, match="the cause must be a non-empty string"):
        buf.abort("x", cause="")


def test_capacity_counts_empty_entries_in_the_window_of_a_version() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=2, buffer_size=3)
    assert buf.capacity() == 9
    buf.try_reserve("a")
    assert buf.capacity() == 8
    fill(buf, "b")
    buf.consume  # noqa: B018 - not ready yet; just a capacity check
    assert buf.capacity() == 7
    fill(buf, "c")
    buf.consume()  # v = 1; buffer 3 entered with 3 empty entries
    assert buf.capacity() == 3 * 3 - 1  # only "a" is left, in buffer 2
    assert buf.capacity(version=0) == 2 * 3 - 1  # buffers 1 … 2
    reserved = 0
    while buf.try_reserve(f"z{reserved}", version=0) is not None:
        reserved += 1
    assert reserved == 5


# ------------------------------------------------------------------- config and state


def test_bad_settings_are_all_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        StalenessBuffer(0, -1, group_size=0, start_version=-2)
    assert info.value.problems == (
        "batch_size=0: must be an integer ≥ 1; set it to the groups per training step",
        "staleness=-1: must be an integer ≥ 0; use 0 for synchronous training",
        "group_size=0: must be an integer ≥ 1; use 1 when each group is one trajectory",
        "start_version=-2: must be an integer ≥ 0; versions count training steps from 0",
    )
    with pytest.raises(
        ConfigError,
        match=r"buffer_size=3: must be an integer ≥ 4; use None or at least batch_size=4",
    ):
        StalenessBuffer(4, 1, buffer_size=3)
    with pytest.raises(ConfigError, match=r"group_redundancy=2: must be an integer ≥ 4"):
        StalenessBuffer(4, 1, group_size=4, group_redundancy=2)


def test_snapshot_restore_round_trip_continues_identically() -> None:
    def script(buf: StalenessBuffer) -> list[object]:
        out: list[object] = []
        for i in range(5):
            out.append(buf.try_reserve(f"n{i}"))
        for i in (4, 2, 0):
            out.append(buf.occupy(f"n{i}", payload={"i": i}))
        if buf.ready():
            out.append(buf.consume())
        out.append(buf.statistics())
        return out

    a = StalenessBuffer(batch_size=2, staleness=2, buffer_size=3)
    for g in "pqrs":
        a.try_reserve(g)
    a.occupy("r", payload=[1, 2])
    a.occupy("p")
    a.abort("q", cause="failed")
    b = StalenessBuffer.restore(a.snapshot())
    assert b.snapshot() == a.snapshot()
    assert script(a) == script(b)


def test_restore_refuses_damaged_snapshots() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    fill(buf, "a")
    snap = buf.snapshot()
    with pytest.raises(ProtocolError, match="snapshot format 99 is not supported"):
        StalenessBuffer.restore({**snap, "format": 99})
    with pytest.raises(ProtocolError, match="the snapshot is damaged"):
        StalenessBuffer.restore({k: v for k, v in snap.items() if k != "counters"})
    bad = {**snap, "groups": [{**snap["groups"][0], "buffer": 7}]}
    with pytest.raises(ProtocolError, match="group 'a' \\(version 0\\) cannot sit in buffer 7"):
        StalenessBuffer.restore(bad)


def test_restore_refuses_an_occupy_order_that_repeats_or_runs_ahead() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1, buffer_size=3)
    for g in "ab":
        buf.try_reserve(g)
        buf.occupy(g)
    snap = buf.snapshot()
    assert [g["seq"] for g in snap["groups"]] == [0, 1]
    twice = {**snap, "groups": [{**g, "seq": 0} for g in snap["groups"]]}
    with pytest.raises(ProtocolError, match=r"occupy order \[0, 0\] repeats a number"):
        StalenessBuffer.restore(twice)
    with pytest.raises(ProtocolError, match=r"occupy order \[0, 1\] .* reaches next_seq 1"):
        StalenessBuffer.restore({**snap, "next_seq": 1})


def test_statistics_is_a_frozen_snapshot() -> None:
    buf = StalenessBuffer(batch_size=1, staleness=1)
    fill(buf, "a")
    s = buf.statistics()
    buf.consume()
    assert s.consumed_groups == 0 and buf.statistics().consumed_groups == 1
    with pytest.raises(AttributeError):
        s.version = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.aborted["x"] = 1  # type: ignore[index]
    assert buf.statistics().buffer_states == {1: BufferState.PENDING, 2: BufferState.PENDING}


def test_pull_forward_fills_the_head_from_later_buffers_in_order() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=2)
    for g in "abcdef":
        buf.try_reserve(g)  # a, b -> 2; c, d -> 1; e, f -> 0
    buf.occupy("c")  # -> 1 (0 and 1 are full of reservations... 1 has c's own entry)
    buf.occupy("a")  # -> 2
    buf.occupy("b")  # -> 2
    assert buf.state(0) is BufferState.STUCK
    assert buf.pull_forward() == ()  # no room in the head yet
    buf.abort("e", cause="retried")  # the proactive filter gives up on the stragglers
    buf.abort("f", cause="retried")
    assert buf.pull_forward() == ("c", "a")  # earliest later buffer first, then occupy order
    assert buf.occupied_groups(0) == ("c", "a") and buf.ready()
    assert buf.occupied_groups(2) == ("b",)
    assert buf.statistics().pulled_forward == 2
    assert [g.group_id for g in buf.consume().groups] == ["c", "a"]


def test_a_huge_staleness_bound_costs_memory_for_the_buffers_in_use_only() -> None:
    # AReaL users write max_head_offpolicyness=1000 (or more) for "no bound": a snapshot, the
    # progress line and the rows of the live view must not walk or store η + 1 buffers.
    from stalebound.core.filters import buffer_progress
    from stalebound.obs.records import buffer_rows

    buf = StalenessBuffer(batch_size=2, staleness=10**9)
    assert buf.try_reserve("a") == Reservation("a", 0, 10**9)
    buf.occupy("a")
    assert buf.versions_in_use() == [0]
    assert buf.try_reserve("b") == Reservation("b", 0, 10**9)
    states = buf.statistics().buffer_states
    assert len(states) == 10**9 + 1
    assert (states[0], states[5], states[10**9]) == (
        BufferState.PENDING,
        BufferState.PENDING,
        BufferState.PENDING,
    )
    assert 10**9 + 1 not in states
    assert [r.version for r in buffer_rows(buf)] == [0, 10**9]
    assert buffer_progress(buf).count("|") == 1
    assert buf.pull_forward() == ()
    restored = BufferPolicy(StalenessBuffer(batch_size=2, staleness=10**9))
    restored.load_snapshot(BufferPolicy(buf).snapshot())
    assert restored.is_running("b") and not restored.is_running("a")


def test_every_entry_is_in_the_state_of_the_list_it_is_filed_in() -> None:
    # The reserved count is derived from the buffers' lists, so check_invariants checks each
    # entry's own state (the transition table's) against the list that files it.
    from stalebound.core import InvariantError
    from stalebound.core.buffer import _OCCUPIED

    buf = StalenessBuffer(batch_size=2, staleness=1)
    buf.try_reserve("a")
    buf.try_reserve("b")
    buf.occupy("b")
    buf.check_invariants()
    assert buf.reserved_count == 1 and buf.statistics().occupied == 1
    buf._groups["a"].state = _OCCUPIED  # a move made behind the table's back
    with pytest.raises(InvariantError, match="group 'a' is OCCUPIED, filed as RESERVED"):
        buf.check_invariants()


def test_consume_moves_a_batch_through_the_table_and_refuses_a_misfiled_entry() -> None:
    from stalebound.core import InvariantError
    from stalebound.core.buffer import _RESERVED

    buf = StalenessBuffer(batch_size=2, staleness=0)
    fill(buf, "a", "b")
    buf._groups["b"].state = _RESERVED  # OCCUPIED by its list, RESERVED by its state
    with pytest.raises(InvariantError, match="consume of 'b': not allowed from RESERVED"):
        buf.consume()

"""Filters, aborts, retries (with pull-forward) and truncations on the pure core, driven by
Hypothesis: the staleness buffer plus the filter decisions, exactly as a driver combines them.

After every step: the buffer's own invariants hold, no consumed group is staler than η, every
reserved group is in exactly one place (still in the buffer, or ended one counted way), and a
refused call (a ``ProtocolError``) leaves the state unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stalebound import BufferState, EntryState, ProtocolError, StalenessBuffer
from stalebound.core.filters import (
    StragglerClock,
    StuckTimer,
    dynamic_sampling_filter,
    eligible_targets,
    proactive_filter_targets,
)


class FilterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.now = 0.0
        self.ended: dict[Hashable, str] = {}  # group id -> how it ended
        self.reserved: set[Hashable] = set()  # every group ever reserved
        self.prompt: dict[Hashable, str] = {}
        self.retries: Counter[str] = Counter()  # per prompt
        self.truncated: set[Hashable] = set()
        self.stuck_total = 0.0

    @initialize(
        batch=st.integers(1, 3),
        eta=st.integers(0, 2),
        extra=st.integers(0, 1),
        group=st.integers(1, 3),
    )
    def setup(self, batch: int, eta: int, extra: int, group: int) -> None:
        self.buf = StalenessBuffer(batch, eta, buffer_size=batch + extra, group_size=group)
        self.group = group
        self.clock = StragglerClock()
        self.timer = StuckTimer()

    # -- helpers

    def live(self, state: EntryState) -> list[Hashable]:
        return sorted(
            (g for g in self.reserved if (self.buf.lookup(g) or (None,))[0] is state), key=str
        )

    def end(self, gid: Hashable, how: str) -> None:
        assert gid not in self.ended, f"{gid} ended twice: {self.ended[gid]} and {how}"
        self.ended[gid] = how

    def reserve(self, prompt: str, lag: int) -> bool:
        gid = f"g{self.n}"
        self.n += 1
        V = max(0, self.buf.version - lag)
        before = self.buf.snapshot()
        r = self.buf.try_reserve(gid, V)
        if r is None:  # back-pressure changes nothing (beyond counting it)
            after = self.buf.snapshot()
            assert {k: v for k, v in after.items() if k != "counters"} == {
                k: v for k, v in before.items() if k != "counters"
            }
            return False
        self.reserved.add(gid)
        self.prompt[gid] = prompt
        self.clock.reserved(gid)
        return True

    def refused(self, call: Callable[[], Any]) -> None:
        before = self.buf.snapshot()
        with pytest.raises(ProtocolError):
            call()
        assert self.buf.snapshot() == before

    # -- rules

    @rule(lag=st.integers(0, 3), count=st.integers(1, 4))
    def dispatch(self, lag: int, count: int) -> None:
        for _ in range(count):
            self.reserve(f"p{self.n}", lag)

    @rule(
        data=st.data(),
        scores=st.sampled_from([(0.0, 1.0, 0.0), (1.0, 0.0, 1.0), (0.0, 1.0, 1.0), (1.0,) * 3]),
        newest=st.booleans(),
    )
    def complete(self, data: st.DataObject, scores: tuple[float, ...], newest: bool) -> None:
        """A group finishes (often the newest: the older ones straggle); the dynamic sampling
        filter keeps it (occupy) or drops it."""
        reserved = self.live(EntryState.RESERVED)
        if not reserved:
            return
        if newest:
            gid = max(reserved, key=lambda g: int(str(g)[1:]))
        else:
            gid = data.draw(st.sampled_from(reserved))
        members = [{"score": s} for s in scores[: self.group]]
        self.clock.forget(gid)
        if not dynamic_sampling_filter(members).keep:
            self.buf.abort(gid, "filtered")
            self.end(gid, "filtered")
            return
        V = self.buf.lookup(gid)[2]  # type: ignore[index]
        landed = self.buf.occupy(gid, members, segment_versions=[V, self.buf.version])
        self.clock.landed(landed)

    @rule(data=st.data(), cause=st.sampled_from(["failed", "filtered"]))
    def abort(self, data: st.DataObject, cause: str) -> None:
        """A failed group (RESERVED), or a filter dropping an OCCUPIED one."""
        live = self.live(EntryState.RESERVED) + self.live(EntryState.OCCUPIED)
        if not live:
            return
        gid = data.draw(st.sampled_from(live))
        self.buf.abort(gid, cause)
        self.clock.forget(gid)
        self.end(gid, cause)

    @precondition(
        lambda self: hasattr(self, "buf") and self.buf.state(self.buf.version) is BufferState.STUCK
    )
    @rule(
        method=st.sampled_from(["retry", "truncate"]),
        threshold=st.integers(1, 3),
        timeout=st.sampled_from([None, 0.0, 1.0]),
        max_retries=st.integers(0, 2),
        lag=st.integers(0, 1),
    )
    def proactive(
        self, method: str, threshold: int, timeout: float | None, max_retries: int, lag: int
    ) -> None:
        """The proactive filter as the executor applies it to the head buffer (here only while
        it is STUCK, so that it is tried often; off STUCK it must name nothing, see below)."""
        stuck_for = self.timer.observe(self.buf, self.now)
        targets = proactive_filter_targets(
            self.buf, threshold, stuck_for=stuck_for, stuck_timeout_s=timeout
        )
        v = self.buf.version
        if targets:
            assert self.buf.state(v) is BufferState.STUCK and len(targets) <= threshold
            assert set(targets) == set(self.buf.reserved_groups(v))
        if timeout is None:
            targets = self.clock.overtaken(targets, v)
        if method == "retry":
            tries = {g: self.retries[self.prompt[g]] for g in targets}
            chosen = eligible_targets(targets, tries, max_retries)
            for gid in chosen:
                self.buf.abort(gid, "retried")
                self.clock.forget(gid)
                self.end(gid, "retried")
            before = {g: self.buf.lookup(g) for g in self.live(EntryState.OCCUPIED)}
            moved = self.buf.pull_forward()
            for g in moved:  # pulled into the head from a later buffer: staleness only drops
                old, new = before[g], self.buf.lookup(g)
                assert old is not None and new is not None and new[1] == v < old[1]
            if moved:
                self.clock.landed(v)
            if chosen:
                event(f"retried, pulled {len(moved)} forward")
                # Every reservation aborted leaves the head with room: no longer STUCK. When only
                # some were eligible (the others not yet overtaken, or out of retries), those
                # are gone and the rest still hold their entries.
                if not self.buf.reserved_groups(v):
                    assert self.buf.state(v) is not BufferState.STUCK
                assert not set(chosen) & set(self.buf.reserved_groups(v))
            for gid in chosen:
                self.retries[self.prompt[gid]] += 1
                self.reserve(self.prompt[gid], lag)
        else:
            chosen = eligible_targets(targets, dict.fromkeys(self.truncated, 1), 1)
            for gid in chosen:  # force-complete with the partial outputs
                V = self.buf.lookup(gid)[2]  # type: ignore[index]
                self.buf.occupy(gid, [{"truncated": True}], segment_versions=[V])
                self.clock.forget(gid)
                self.clock.landed(self.buf.lookup(gid)[1])  # type: ignore[index]
                self.truncated.add(gid)
            if chosen:
                event("truncated")
                if not self.buf.reserved_groups(v):  # all of them force-completed
                    assert self.buf.state(v) in (
                        BufferState.READY,
                        BufferState.READY_WITH_CAPACITY,
                    )
                assert not set(chosen) & set(self.buf.reserved_groups(v))

    @rule(threshold=st.integers(0, 3))
    def proactive_off_stuck(self, threshold: int) -> None:
        if self.buf.state(self.buf.version) is not BufferState.STUCK:
            assert proactive_filter_targets(self.buf, threshold) == ()

    @rule(dt=st.sampled_from([0.0, 0.5, 2.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.timer.observe(self.buf, self.now)

    @precondition(lambda self: self.buf.ready())
    @rule()
    def consume(self) -> None:
        self.timer.observe(self.buf, self.now)
        batch = self.buf.consume()
        self.clock.consumed(batch.version + 1)
        assert len(batch.groups) == self.buf.batch_size
        for g in batch.groups:
            assert batch.version - g.version <= self.buf.staleness
            self.end(g.group_id, "consumed")
        for gid in batch.aborted:
            self.end(gid, "surplus")
        for gid in batch.dropped:
            self.end(gid, "dropped")

    @rule(data=st.data())
    def refused_calls(self, data: st.DataObject) -> None:
        """Calls that break the protocol are refused and change nothing."""
        choice = data.draw(st.integers(0, 4))
        ended = sorted(self.ended, key=str)
        if choice == 0:
            self.refused(lambda: self.buf.occupy("nobody"))
        elif choice == 1:
            self.refused(lambda: self.buf.abort("nobody", "retried"))
        elif choice == 2 and not self.buf.ready():
            self.refused(self.buf.consume)
        elif choice == 3 and ended:
            gid = data.draw(st.sampled_from(ended))
            self.refused(lambda: self.buf.abort(gid, "filtered"))
        elif choice == 4:
            reserved = self.live(EntryState.RESERVED)
            if reserved:
                gid = reserved[0]
                V = self.buf.lookup(gid)[2]  # type: ignore[index]
                if V > 0:  # a segment older than the group's version
                    self.refused(lambda: self.buf.occupy(gid, segment_versions=[V - 1]))
                self.refused(lambda: self.buf.try_reserve(gid))  # already in flight

    # -- invariants

    @invariant()
    def buffer_invariants(self) -> None:
        if hasattr(self, "buf"):
            self.buf.check_invariants()

    @invariant()
    def conservation(self) -> None:
        """Every reserved group is either still in the buffer or ended exactly one way."""
        if not hasattr(self, "buf"):
            return
        inside = {g for g in self.reserved if g in self.buf}
        assert inside.isdisjoint(self.ended)
        assert inside | set(self.ended) == self.reserved
        s = self.buf.statistics()
        how = Counter(self.ended.values())
        assert s.consumed_groups == how["consumed"]
        assert s.dropped == how["dropped"]
        for cause in ("filtered", "retried", "failed", "surplus"):
            assert s.aborted.get(cause, 0) == how[cause], cause

    @invariant()
    def bound_holds(self) -> None:
        if hasattr(self, "buf"):
            hist = self.buf.statistics().staleness_histogram
            assert all(k <= self.buf.staleness for k in hist)

    @invariant()
    def stuck_time_only_grows(self) -> None:
        if hasattr(self, "timer"):
            total = self.timer.stuck_seconds(self.now)
            assert total >= self.stuck_total
            self.stuck_total = total


FilterMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_filters_stateful = FilterMachine.TestCase

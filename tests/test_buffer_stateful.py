"""The staleness buffer against a naive shadow model, driven by Hypothesis.

The shadow keeps plain lists per buffer and scans everything; the real buffer must place every
group where the shadow does, and the invariants of the protocol must hold after every step. The
deadline action ``continue`` (``extend``) moves a due reservation past ``V + η``: such a group may
be trained later than ``V + η``, by at most the versions it was extended, and is then reported as
continued (never as a violation).
"""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from stalebound import EntryState, ProtocolError, StalenessBuffer


class Shadow:
    """The protocol written as plainly as possible: lists, full scans, no shortcuts."""

    def __init__(self, batch: int, eta: int, size: int) -> None:
        self.B, self.eta, self.size, self.v, self.seq = batch, eta, size, 0, 0
        self.res: dict[int, list[Hashable]] = {b: [] for b in range(eta + 1)}
        self.occ: dict[int, list[tuple[int, Hashable]]] = {b: [] for b in range(eta + 1)}
        self.version: dict[Hashable, int] = {}
        self.ext: dict[Hashable, int] = {}

    def empty(self, b: int) -> int:
        return self.size - len(self.res[b]) - len(self.occ[b])

    def reserve(self, gid: Hashable, V: int) -> int | None:
        for b in range(min(V + self.eta, self.v + self.eta), self.v - 1, -1):
            if self.empty(b) > 0:
                self.res[b].append(gid)
                self.version[gid] = V
                self.ext[gid] = 0
                return b
        return None

    def place(self, r: int) -> int | None:
        open_ = [b for b in range(self.v, r + 1) if self.empty(b) > 0]
        short = [b for b in open_ if len(self.occ[b]) < self.B]
        return (short or open_ or [None])[0]

    def occupy(self, gid: Hashable) -> int:
        r = next(b for b, ids in self.res.items() if gid in ids)
        self.res[r].remove(gid)
        b = self.place(r)
        assert b is not None
        self.occ[b].append((self.seq, gid))
        self.seq += 1
        return b

    def extend(self, gid: Hashable, until: int) -> int | None:
        b = next(b for b, ids in self.res.items() if gid in ids)
        assert b == self.version[gid] + self.eta + self.ext[gid]  # the machine extends due ones
        for nb in range(b + 1, min(until, self.v + self.eta) + 1):
            if self.empty(nb) > 0:
                self.res[b].remove(gid)
                self.res[nb].append(gid)
                self.ext[gid] += nb - b
                return nb
        return None

    def abort(self, gid: Hashable) -> None:
        for b in self.res:
            if gid in self.res[b]:
                self.res[b].remove(gid)
            self.occ[b] = [(s, g) for s, g in self.occ[b] if g != gid]

    def consume(self) -> tuple[list[Hashable], list[Hashable], list[Hashable]]:
        v = self.v
        ordered = sorted(self.occ.pop(v))
        taken, extra = ordered[: self.B], ordered[self.B :]
        surplus = self.res.pop(v)
        self.v += 1
        self.res[v + self.eta + 1], self.occ[v + self.eta + 1] = [], []
        dropped = []
        for s, gid in extra:
            b = self.place(self.version[gid] + self.eta + self.ext[gid])
            if b is None:
                dropped.append(gid)
            else:
                self.occ[b] = sorted([*self.occ[b], (s, gid)])
        return [g for _, g in taken], surplus, dropped


class BufferMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.reserved_in: dict[Hashable, int] = {}
        self.ended: dict[Hashable, str] = {}

    @initialize(
        batch=st.integers(1, 4),
        eta=st.integers(0, 3),
        extra=st.integers(0, 2),
    )
    def setup(self, batch: int, eta: int, extra: int) -> None:
        self.buf = StalenessBuffer(batch, eta, buffer_size=batch + extra)
        self.shadow = Shadow(batch, eta, batch + extra)

    def in_flight(self, state: EntryState) -> list[Hashable]:
        return [g for g in self.reserved_in if (self.buf.lookup(g) or (None,))[0] is state]

    @rule(lag=st.integers(0, 4))
    def reserve(self, lag: int) -> None:
        gid = f"g{self.n}"
        self.n += 1
        V = max(0, self.buf.version - lag)
        before = self.buf.snapshot()
        r = self.buf.try_reserve(gid, V)
        expected = self.shadow.reserve(gid, V)
        if r is None:
            assert expected is None
            after = self.buf.snapshot()
            assert after["groups"] == before["groups"]
        else:
            assert (r.version, r.buffer_version) == (V, expected)
            self.reserved_in[gid] = r.buffer_version

    @rule(data=st.data())
    def occupy(self, data: st.DataObject) -> None:
        reserved = self.in_flight(EntryState.RESERVED)
        if not reserved:
            return
        gid = data.draw(st.sampled_from(reserved))
        V = self.buf.lookup(gid)[2]  # type: ignore[index]
        landed = self.buf.occupy(gid, payload=gid, segment_versions=[V, self.buf.version])
        assert landed == self.shadow.occupy(gid)
        assert landed <= self.reserved_in[gid]

    @rule(data=st.data(), cause=st.sampled_from(["aborted", "filtered", "retried"]))
    def abort(self, data: st.DataObject, cause: str) -> None:
        live = [g for g in self.reserved_in if g in self.buf]
        if not live:
            return
        gid = data.draw(st.sampled_from(live))
        self.buf.abort(gid, cause)
        self.shadow.abort(gid)
        self.ended[gid] = cause

    @precondition(lambda self: self.buf.ready())
    @rule()
    def consume(self) -> None:
        batch = self.buf.consume()
        taken, surplus, dropped = self.shadow.consume()
        assert [g.group_id for g in batch.groups] == taken
        assert list(batch.aborted) == surplus
        assert list(batch.dropped) == dropped
        ext = self.shadow.ext
        assert list(batch.continued) == [g for g in taken if ext[g]]
        for g in batch.groups:
            # the guarantee: a group is trained by V + η, plus the versions it was continued
            assert batch.version - g.version <= self.buf.staleness + ext[g.group_id]
            self.ended[g.group_id] = "consumed"
        for gid in batch.aborted:
            self.ended[gid] = "surplus"
        for gid in batch.dropped:
            self.ended[gid] = "dropped"

    @rule(data=st.data(), reach=st.integers(0, 3))
    def extend(self, data: st.DataObject, reach: int) -> None:
        buf = self.buf
        due = [
            g for g in self.in_flight(EntryState.RESERVED) if buf.deadline(g) == buf.lookup(g)[1]
        ]  # type: ignore[index]
        if not due:
            return
        gid = data.draw(st.sampled_from(due))
        before = buf.snapshot()
        until = buf.deadline(gid) + reach
        moved = buf.extend(gid, until)
        assert moved == self.shadow.extend(gid, until)
        if moved is None:
            assert buf.snapshot() == before
        else:
            assert buf.deadline(gid) == moved == buf.lookup(gid)[1]  # type: ignore[index]
            self.reserved_in[gid] = moved  # its reservation now
        assert StalenessBuffer.restore(buf.snapshot()).snapshot() == buf.snapshot()

    @rule(data=st.data())
    def refused_calls_change_nothing(self, data: st.DataObject) -> None:
        before = self.buf.snapshot()
        call = data.draw(
            st.sampled_from(["future", "unknown", "double", "consume", "dup", "not due"])
        )
        occupied = self.in_flight(EntryState.OCCUPIED)
        early = [
            g
            for g in self.in_flight(EntryState.RESERVED)
            if self.buf.deadline(g) != self.buf.lookup(g)[1]  # type: ignore[index]
        ]
        try:
            if call == "future":
                self.buf.try_reserve("new", version=self.buf.version + 1)
            elif call == "unknown":
                self.buf.occupy("never-reserved")
            elif call == "double" and occupied:
                self.buf.occupy(occupied[0])
            elif call == "consume" and not self.buf.ready():
                self.buf.consume()
            elif call == "dup" and occupied:
                self.buf.try_reserve(occupied[0])
            elif call == "not due" and early:
                self.buf.extend(early[0], self.buf.version + self.buf.staleness)
            else:
                return
        except ProtocolError:
            pass
        else:
            raise AssertionError(f"{call} was accepted")
        assert self.buf.snapshot() == before

    @invariant()
    def internal_consistency(self) -> None:
        self.buf.check_invariants()

    @invariant()
    def every_group_ends_exactly_once(self) -> None:
        s = self.buf.statistics()
        live = [g for g in self.reserved_in if g in self.buf]
        assert not set(live) & set(self.ended)
        assert len(live) + len(self.ended) == len(self.reserved_in) == s.reserved_total
        assert s.reserved_total == s.consumed_groups + s.aborted_total + s.dropped + len(self.buf)

    @invariant()
    def no_slot_leaks(self) -> None:
        total = 0
        for bv in range(self.buf.version, self.buf.version + self.buf.staleness + 1):
            e = self.buf.entries(bv)
            assert sum(e.values()) == self.buf.buffer_size
            assert e[EntryState.EMPTY] == self.shadow.empty(bv)
            total += e[EntryState.RESERVED] + e[EntryState.OCCUPIED]
        assert total == len(self.buf)

    @invariant()
    def never_later_than_the_worst_case(self) -> None:
        # Occupy never moves a group later than its reservation (checked in ``occupy``); an extra
        # group re-placed after a consume may move up to its worst case V + η, never beyond.
        # A continued group's worst case is its moved deadline, V + η + the versions it gained.
        for gid, r in self.reserved_in.items():
            where = self.buf.lookup(gid)
            if where is not None:
                worst = where[2] + self.buf.staleness + self.shadow.ext[gid]
                assert where[1] <= worst == self.buf.deadline(gid)
                assert r <= worst

    @invariant()
    def staleness_never_exceeds_the_bound(self) -> None:
        s = self.buf.statistics()
        eta = self.buf.staleness
        over = {k: n for k, n in s.staleness_histogram.items() if k > eta}
        assert over == {k: n for k, n in s.continued_histogram.items() if k > eta}
        assert s.violations == 0


BufferMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestBufferMachine = BufferMachine.TestCase

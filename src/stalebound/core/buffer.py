"""The per-version staleness buffer: PSRL's Reserve / Occupy / Consume protocol.

Pure and deterministic: no threads, clocks or IO. Drivers (the asyncio runtime, the simulator, the
Ray coordinator) call it and do the waiting themselves.

Terms (see the README for a worked example):

* ``v``  — :attr:`StalenessBuffer.version`, the training version; buffer ``v`` is consumed next.
* ``η``  — ``staleness``: a trajectory generated at version ``V`` is trained at most at ``V + η``.
* ``B``  — ``batch_size``: groups per training step; ``B′`` — ``buffer_size``: entries per buffer.
* The window holds buffers ``v … v + η``; each entry is ``EMPTY``, ``RESERVED`` or ``OCCUPIED``.

Every operation costs time proportional to the number of buffers it walks (at most ``η + 1``, and
usually one), never to the number of entries.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from stalebound.core.buffer_records import (
    BufferState,
    BufferStatistics,
    ConsumedBatch,
    ConsumedGroup,
    Reservation,
    WindowStates,
)
from stalebound.core.checks import check_version, is_int, staleness_problems
from stalebound.core.errors import ConfigError, InvariantError, ProtocolError
from stalebound.core.transitions import (
    ENTRY_TRANSITIONS,
    EntryOp,
    EntryState,
    compile_table,
    move,
)

__all__ = [
    "BufferState",
    "BufferStatistics",
    "ConsumedBatch",
    "ConsumedGroup",
    "EntryState",
    "Reservation",
    "StalenessBuffer",
]

SNAPSHOT_FORMAT = 1


# The entry transition table compiled to indices: an entry's state is an index into _STATES and
# every move is one lookup in _NEXT (no enum hashing on the hot paths).
_STATES = tuple(EntryState)
_OPS = tuple(EntryOp)
_NEXT = compile_table(ENTRY_TRANSITIONS, _STATES, _OPS)
_EMPTY, _RESERVED, _OCCUPIED = (_STATES.index(s) for s in EntryState)
(_RESERVE, _OCCUPY, _ABORT, _SURPLUS, _CONSUME, _DROP, _REPLACE, _PULL_FORWARD, _DEFER, _EXTEND) = (
    _OPS.index(o)
    for o in (
        EntryOp.RESERVE,
        EntryOp.OCCUPY,
        EntryOp.ABORT,
        EntryOp.SURPLUS,
        EntryOp.CONSUME,
        EntryOp.DROP,
        EntryOp.REPLACE,
        EntryOp.PULL_FORWARD,
        EntryOp.DEFER,
        EntryOp.EXTEND,
    )
)
_BORN = _NEXT[_EMPTY][_RESERVE]  # the state Reserve gives a new entry, looked up once
_NO_SEGMENTS: tuple[int, ...] = ()


class _Entry:
    """The entry of one group in flight. ``buffer`` is where it is; ``seq`` is its occupy order;
    ``extended`` how many versions its deadline was moved past ``V + η`` (:meth:`~StalenessBuffer.extend`).
    It is created RESERVED (``EMPTY --reserve--> RESERVED``, read from the transition table);
    ``state`` changes only through :func:`_move` / :func:`_move_all` (the table again)."""

    __slots__ = ("buffer", "extended", "group_id", "payload", "seq", "state", "version")

    def __init__(self, group_id: Hashable, version: int, buffer: int) -> None:
        self.group_id = group_id
        self.version = version
        self.buffer = buffer
        self.state = _BORN  # an entry comes to be by Reserve: RESERVED
        self.seq = -1
        self.payload: Any = None
        self.extended = 0

    @property
    def occupied(self) -> bool:
        return self.state == _OCCUPIED


def _by_seq(g: _Entry) -> int:
    return g.seq


def _by_deadline(g: _Entry) -> tuple[int, int]:
    return (g.version + g.extended, g.seq)  # the deadline V + η + extended orders as this


def _move(g: _Entry, op: int) -> None:
    """The one place an entry's state changes: looked up in the transition table (compiled to
    indices, ``op`` an index into ``_OPS``); a move not in it raises :class:`InvariantError` (the
    public operations check their callers' requests before they move anything)."""
    new = _NEXT[g.state][op]
    if new < 0:
        move(ENTRY_TRANSITIONS, _STATES[g.state], _OPS[op], g.group_id, error=InvariantError)
    g.state = new


def _move_all(entries: list[_Entry], op: int) -> None:
    """:func:`_move` for a batch (consume moves B entries at once): one table lookup when every
    entry is in the same state, entry by entry (and the same errors) otherwise."""
    if not entries:
        return
    old = entries[0].state
    new = _NEXT[old][op]
    if new < 0 or any(g.state != old for g in entries):
        for g in entries:
            _move(g, op)
        return
    for g in entries:
        g.state = new


class _Buffer:
    """The non-empty entries of one buffer: RESERVED by reservation order, OCCUPIED by occupy order."""

    __slots__ = ("occupied", "reserved")

    def __init__(self) -> None:
        self.reserved: dict[Hashable, _Entry] = {}
        self.occupied: list[_Entry] = []


class StalenessBuffer:
    """Per-version buffers that bound the staleness of every trained trajectory by ``staleness``.

    >>> buf = StalenessBuffer(batch_size=2, staleness=1)
    >>> buf.try_reserve("a")
    Reservation(group_id='a', version=0, buffer_version=1)
    >>> buf.occupy("a")            # finished early: moves to the earliest buffer with room
    0
    """

    def __init__(
        self,
        batch_size: int,
        staleness: int,
        *,
        group_size: int = 1,
        buffer_size: int | None = None,
        group_redundancy: int | None = None,
        start_version: int = 0,
    ) -> None:
        problems = _validate(
            batch_size, staleness, group_size, buffer_size, group_redundancy, start_version
        )
        if problems:
            raise ConfigError(problems)
        self.batch_size: int = batch_size
        self.staleness: int = staleness
        self.group_size: int = group_size
        self.buffer_size: int = batch_size if buffer_size is None else buffer_size
        self.group_redundancy: int = group_size if group_redundancy is None else group_redundancy
        self._v = start_version
        self._buffers: dict[int, _Buffer] = {}
        self._groups: dict[Hashable, _Entry] = {}
        self._next_seq = 0
        self._occupied_total = 0
        self._consumed_groups = 0
        self._consumed_batches = 0
        self._aborted: Counter[str] = Counter()
        self._dropped = 0
        self._refused = 0
        self._replaced = 0
        self._pulled_forward = 0
        self._deferred = 0
        self._extended = 0
        self._histogram: Counter[int] = Counter()
        self._continued_histogram: Counter[int] = Counter()

    # ------------------------------------------------------------------ queries

    @property
    def version(self) -> int:
        """The training version v: buffer v is consumed next, and consuming it makes v + 1."""
        return self._v

    def __len__(self) -> int:
        """Groups in flight (RESERVED or OCCUPIED)."""
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        try:
            return group_id in self._groups
        except TypeError:
            return False

    @property
    def reserved_count(self) -> int:
        """Groups RESERVED now (generating), over the whole window."""
        return sum(len(b.reserved) for b in self._buffers.values())

    def lookup(self, group_id: Hashable) -> tuple[EntryState, int, int] | None:
        """``(state, buffer_version, group_version)`` of a group in flight, or ``None``."""
        try:
            g = self._groups.get(group_id)
        except TypeError:  # an unhashable id is never in flight, as for ``in``
            return None
        if g is None:
            return None
        return (_STATES[g.state], g.buffer, g.version)

    def deadline(self, group_id: Hashable) -> int:
        """The latest buffer a group in flight may be trained in: ``V + η``, plus the versions
        :meth:`extend` moved it past that."""
        g = self._known_group("deadline", group_id)
        return g.version + self.staleness + g.extended

    def extended(self, group_id: Hashable) -> int:
        """How many versions :meth:`extend` moved a group's deadline past ``V + η`` (0: never)."""
        return self._known_group("extended", group_id).extended

    def state(self, buffer_version: int) -> BufferState:
        """The state of buffer ``buffer_version`` (one of ``v … v + η``)."""
        self._check_window("state", buffer_version)
        return self._state(self._buffers.get(buffer_version))

    def entries(self, buffer_version: int) -> Mapping[EntryState, int]:
        """How many entries of buffer ``buffer_version`` are in each :class:`EntryState`."""
        self._check_window("entries", buffer_version)
        buf = self._buffers.get(buffer_version)
        occ = len(buf.occupied) if buf else 0
        res = len(buf.reserved) if buf else 0
        return MappingProxyType(
            {
                EntryState.EMPTY: self.buffer_size - occ - res,
                EntryState.RESERVED: res,
                EntryState.OCCUPIED: occ,
            }
        )

    def versions_in_use(self) -> list[int]:
        """The buffers of the window that hold at least one entry, in version order. Every other
        buffer is empty (PENDING): walk these rather than all ``η + 1``, which may be huge."""
        return sorted(bv for bv, b in self._buffers.items() if b.reserved or b.occupied)

    def reserved_groups(self, buffer_version: int) -> tuple[Hashable, ...]:
        """Ids of the RESERVED groups in a buffer, in reservation order."""
        self._check_window("reserved_groups", buffer_version)
        buf = self._buffers.get(buffer_version)
        return tuple(buf.reserved) if buf else ()

    def occupied_groups(self, buffer_version: int) -> tuple[Hashable, ...]:
        """Ids of the OCCUPIED groups in a buffer, in occupy order."""
        self._check_window("occupied_groups", buffer_version)
        buf = self._buffers.get(buffer_version)
        return tuple(g.group_id for g in buf.occupied) if buf else ()

    def ready(self) -> bool:
        """Whether buffer v can be consumed now (READY or READY_WITH_CAPACITY)."""
        buf = self._buffers.get(self._v)
        return buf is not None and len(buf.occupied) >= self.batch_size

    def capacity(self, version: int | None = None) -> int:
        """EMPTY entries in buffers ``v … V + η``: how many ``try_reserve(_, V)`` would succeed now."""
        v = self._v
        V = v if version is None else self._admissible_version("capacity", version)
        top = V + self.staleness
        if top < v:
            return 0
        used = len(self._groups)  # every group in flight holds one entry of the window
        if v != V:  # leave out the buffers above V + η
            used -= sum(
                len(b.reserved) + len(b.occupied) for bv, b in self._buffers.items() if bv > top
            )
        return (top - v + 1) * self.buffer_size - used

    # ------------------------------------------------------------ operations

    def try_reserve(self, group_id: Hashable, version: int | None = None) -> Reservation | None:
        """Reserve an entry for a group that starts generating at ``version`` (default v).

        The entry goes into the *latest* buffer ``b`` with ``v ≤ b ≤ V + η`` that has an EMPTY
        entry: the worst case, so that no completion order can break the bound. Returns ``None``
        when there is no room (back-pressure), including when ``V + η < v``.
        """
        v = self._v
        V = v if version is None else self._admissible_version("try_reserve", version)
        groups = self._groups
        try:
            existing = groups.get(group_id)
        except TypeError:
            raise ProtocolError(
                f"try_reserve(group_id={group_id!r}): group ids must be hashable"
            ) from None
        if existing is not None:
            raise ProtocolError(
                f"try_reserve(group_id={group_id!r}, version={V}): the group is already in flight "
                f"({self._describe(existing)}); use a fresh id for a new group, or abort it first"
            )
        b = V + self.staleness
        buffers = self._buffers
        buf = buffers.get(b)
        if buf is None:
            if b < v:
                self._refused += 1
                return None
            buf = buffers[b] = _Buffer()
        elif len(buf.reserved) + len(buf.occupied) >= self.buffer_size:
            found = self._latest_with_room(b - 1)
            if found is None:
                self._refused += 1
                return None
            b, buf = found
        g = _Entry(group_id, V, b)
        buf.reserved[group_id] = g
        groups[group_id] = g
        return Reservation(group_id, V, b)

    def _latest_with_room(self, b: int, above: int | None = None) -> tuple[int, _Buffer] | None:
        """The latest buffer at or below ``b`` (and ≥ v, and > ``above``) with an EMPTY entry."""
        buffers, cap = self._buffers, self.buffer_size
        low = self._v if above is None else max(self._v, above + 1)
        while b >= low:
            buf = buffers.get(b)
            if buf is None:
                buf = buffers[b] = _Buffer()
                return b, buf
            if len(buf.reserved) + len(buf.occupied) < cap:
                return b, buf
            b -= 1
        return None

    def occupy(
        self,
        group_id: Hashable,
        payload: Any = None,
        *,
        segment_versions: Iterable[int] = _NO_SEGMENTS,
    ) -> int:
        """Mark a RESERVED group complete; return the buffer version it now occupies.

        The reservation at ``r`` is released and the group placed into the earliest buffer in
        ``[v, r]`` with fewer than B occupied and an EMPTY entry, else the earliest with an EMPTY
        entry. ``segment_versions`` are the versions that generated the group's segments or tokens;
        each must be ≥ the group's version and ≤ v.
        """
        try:
            g = self._groups.get(group_id)
        except TypeError:
            g = None
        if g is None or g.state == _OCCUPIED:
            g = self._reserved_group("occupy", group_id)  # raises the precise error
        v = self._v
        if segment_versions is not _NO_SEGMENTS:  # the common case passes none
            self._check_segments(g, v, segment_versions)
        r = g.buffer
        buffers = self._buffers
        del buffers[r].reserved[group_id]
        head = buffers.get(v)
        if head is not None and (
            len(head.occupied) < self.batch_size
            and len(head.occupied) + len(head.reserved) < self.buffer_size
        ):
            b = v  # the common case: the head buffer still needs groups
        else:
            found = self._find_place(r)
            if found is None:  # r itself has the entry we just released
                raise InvariantError(f"occupy({group_id!r}): no place in [{v}, {r}]")
            b = found
        seq = self._next_seq
        self._next_seq = seq + 1
        g.seq = seq
        g.payload = payload
        state = _NEXT[g.state][_OCCUPY]  # _move, inlined: every trained group passes here
        if state < 0:
            _move(g, _OCCUPY)  # raises, naming the move the table lacks
        g.state = state
        g.buffer = b
        buffers[b].occupied.append(g)  # the newest seq: the list stays in occupy order
        self._occupied_total += 1
        return b

    @staticmethod
    def _check_segments(g: _Entry, v: int, segment_versions: Iterable[int]) -> None:
        """Refuse segment versions of ``g`` that are not ints in ``[g.version, v]``."""
        group_id = g.group_id
        try:
            segment_versions = tuple(segment_versions)
        except TypeError:
            raise ProtocolError(
                f"occupy(group_id={group_id!r}, segment_versions={segment_versions!r}): "
                "segment_versions must be an iterable of ints, e.g. () or [3, 4]"
            ) from None
        for sv in segment_versions:
            if not is_int(sv) or sv < g.version or sv > v:
                raise ProtocolError(
                    f"occupy(group_id={group_id!r}): segment version {sv!r} is outside "
                    f"[{g.version}, {v}] (the group's version {g.version} to the current version "
                    f"{v}); a segment may not be generated by a policy older than the group's "
                    "version, nor by one from the future"
                )

    def abort(self, group_id: Hashable, cause: str = "aborted") -> None:
        """Return a group's entry to EMPTY (RESERVED, or OCCUPIED for filters); count ``cause``."""
        if not isinstance(cause, str) or not cause:
            raise ProtocolError(
                f"abort(group_id={group_id!r}, cause={cause!r}): the cause must be a non-empty "
                "string such as 'aborted', 'filtered', 'retried' or 'failed'"
            )
        g = self._known_group("abort", group_id)
        buf = self._buffers[g.buffer]
        if g.occupied:
            buf.occupied.remove(g)
        else:
            del buf.reserved[group_id]
        _move(g, _ABORT)
        del self._groups[group_id]
        self._aborted[cause] += 1

    def consume(self, *, due_first: bool = False) -> ConsumedBatch:
        """Take the first B occupied groups of buffer v (in occupy order) and advance to v + 1.

        Surplus RESERVED entries of buffer v are aborted (their ids are returned, cause
        ``surplus``); extra OCCUPIED entries are re-placed into ``[v + 1, V + η]`` by the Occupy
        rule, in their occupy order, or dropped when no place is admissible.

        ``due_first`` (consume-due-first): take the B groups with the earliest deadline
        ``V + η`` first (occupy order among equals), so a group whose deadline is v is trained now
        rather than left over, with nowhere admissible to go.
        """
        v = self._v
        buf = self._buffers.get(v)
        if buf is None or len(buf.occupied) < self.batch_size:
            counts = self.entries(v)
            raise ProtocolError(
                f"consume(): buffer {v} is {self._state(buf).name} "
                f"({counts[EntryState.OCCUPIED]} of {self.batch_size} occupied, "
                f"{counts[EntryState.RESERVED]} reserved, {counts[EntryState.EMPTY]} empty); "
                "consume only when ready() is True"
            )
        if due_first:
            order = sorted(buf.occupied, key=_by_deadline)
            taken = sorted(order[: self.batch_size], key=_by_seq)
            extra = sorted(order[self.batch_size :], key=_by_seq)
        else:
            taken = buf.occupied[: self.batch_size]
            extra = buf.occupied[self.batch_size :]
        surplus = tuple(buf.reserved)
        groups = self._groups
        hist = self._histogram
        _move_all(taken, _CONSUME)
        for g in taken:
            del groups[g.group_id]
            hist[v - g.version] += 1
            if g.extended:
                self._continued_histogram[v - g.version] += 1
        _move_all([groups.pop(gid) for gid in surplus], _SURPLUS)
        del self._buffers[v]
        self._v = v + 1
        self._consumed_groups += len(taken)
        self._consumed_batches += 1
        if surplus:
            self._aborted["surplus"] += len(surplus)
        dropped = [g for g in extra if not self._replace(g)]
        _move_all(dropped, _DROP)
        for g in dropped:
            del groups[g.group_id]
        self._dropped += len(dropped)
        return ConsumedBatch(
            version=v,
            groups=tuple([ConsumedGroup(g.group_id, g.version, g.payload) for g in taken]),
            aborted=surplus,
            dropped=tuple(g.group_id for g in dropped),
            dropped_groups=tuple(ConsumedGroup(g.group_id, g.version, g.payload) for g in dropped),
            continued=(continued := tuple([g.group_id for g in taken if g.extended])),
            oldest_token=v - self.staleness if continued else None,
        )

    def pull_forward(self, buffer_version: int | None = None) -> tuple[Hashable, ...]:
        """Move OCCUPIED groups from later buffers into ``buffer_version`` (default v).

        Moves while the target has fewer than B occupied and an EMPTY entry, taking the earliest
        later buffer first and, within it, the earliest occupied. Moving a group to an earlier
        buffer lowers its staleness, so it is always legal. Returns the moved ids.
        """
        target = self._v if buffer_version is None else buffer_version
        self._check_window("pull_forward", target)
        moved: list[Hashable] = []
        dst = self._buffers.get(target)
        if dst is None:
            dst = _Buffer()
        for bv in self.versions_in_use():  # the later buffers holding entries, not all η of them
            if bv <= target:
                continue
            src = self._buffers.get(bv)
            while src and src.occupied and self._accepts(dst):
                g = src.occupied.pop(0)
                _move(g, _PULL_FORWARD)
                g.buffer = target
                insort(dst.occupied, g, key=_by_seq)
                moved.append(g.group_id)
        if moved:
            self._buffers[target] = dst
            self._pulled_forward += len(moved)
        return tuple(moved)

    def defer(self, group_id: Hashable) -> int | None:
        """Move a RESERVED group to the latest later buffer within its bound that has an EMPTY
        entry (``b < b′ ≤ V + η``, ``b`` its buffer now); return that buffer, or ``None`` (nothing
        changed) when it is due (``V + η = b``) or no later buffer has room. The group's bound is
        unchanged: it may still land anywhere from v to ``V + η`` when it completes."""
        g = self._reserved_group("defer", group_id)
        b, deadline = g.buffer, g.version + self.staleness + g.extended
        found = self._latest_with_room(deadline, above=b)
        if found is None:
            return None
        nb, dst = found
        del self._buffers[b].reserved[group_id]
        _move(g, _DEFER)
        g.buffer = nb
        dst.reserved[group_id] = g
        self._deferred += 1
        return nb

    def extend(self, group_id: Hashable, until: int) -> int | None:
        """The deadline action ``continue``: move a RESERVED group that is due in its buffer
        (its deadline is the buffer it sits in) to the *earliest* later buffer with an EMPTY
        entry, up to ``until`` (and the window's end), and make that buffer its deadline; return
        it, or ``None`` (nothing changed) when none has room. The group keeps its version ``V``:
        its trajectories are trained later than ``V + η``, so the trainer masks their tokens
        older than the bound (``continued_histogram`` counts them apart from the violations)."""
        g = self._reserved_group("extend", group_id)
        b, deadline = g.buffer, g.version + self.staleness + g.extended
        if b != deadline:
            raise ProtocolError(
                f"extend(group_id={group_id!r}): the group is not due in its buffer {b} (its "
                f"deadline is {deadline}); move it within its bound with defer() instead"
            )
        cap, top = self.buffer_size, min(until, self._v + self.staleness)
        for nb in range(b + 1, top + 1):
            dst = self._buffers.get(nb)
            if dst is None:
                dst = self._buffers[nb] = _Buffer()
            if len(dst.reserved) + len(dst.occupied) < cap:
                del self._buffers[b].reserved[group_id]
                _move(g, _EXTEND)
                g.buffer = nb
                g.extended += nb - b
                dst.reserved[group_id] = g
                self._extended += 1
                return nb
        return None

    def statistics(self) -> BufferStatistics:
        """A frozen snapshot of every counter."""
        top = self._v + self.staleness
        return BufferStatistics(
            version=self._v,
            batch_size=self.batch_size,
            buffer_size=self.buffer_size,
            staleness=self.staleness,
            reserved=(reserved := self.reserved_count),
            occupied=len(self._groups) - reserved,
            capacity=self.capacity(),
            reserved_total=self._reserved_total(),
            occupied_total=self._occupied_total,
            consumed_groups=self._consumed_groups,
            consumed_batches=self._consumed_batches,
            aborted=MappingProxyType(dict(self._aborted)),
            dropped=self._dropped,
            refused=self._refused,
            replaced=self._replaced,
            pulled_forward=self._pulled_forward,
            deferred=self._deferred,
            extended=self._extended,
            buffer_states=WindowStates(
                self._v,
                top,
                {bv: self._state(self._buffers[bv]) for bv in self.versions_in_use()},
            ),
            staleness_histogram=MappingProxyType(dict(sorted(self._histogram.items()))),
            continued_histogram=MappingProxyType(dict(sorted(self._continued_histogram.items()))),
        )

    # ------------------------------------------------------- snapshot/restore

    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain data (dicts, lists, ints, strings and the payloads)."""
        groups: list[dict[str, Any]] = []
        for bv in sorted(self._buffers):
            buf = self._buffers[bv]
            for g in buf.reserved.values():
                item = {"group_id": g.group_id, "version": g.version, "buffer": bv}
                groups.append(item | ({"extended": g.extended} if g.extended else {}))
            for g in buf.occupied:
                item = {
                    "group_id": g.group_id,
                    "version": g.version,
                    "buffer": bv,
                    "seq": g.seq,
                    "payload": g.payload,
                }
                groups.append(item | ({"extended": g.extended} if g.extended else {}))
        return {
            "format": SNAPSHOT_FORMAT,
            "batch_size": self.batch_size,
            "staleness": self.staleness,
            "group_size": self.group_size,
            "buffer_size": self.buffer_size,
            "group_redundancy": self.group_redundancy,
            "version": self._v,
            "next_seq": self._next_seq,
            "groups": groups,
            "counters": {
                "reserved_total": self._reserved_total(),
                "occupied_total": self._occupied_total,
                "consumed_groups": self._consumed_groups,
                "consumed_batches": self._consumed_batches,
                "aborted": dict(self._aborted),
                "dropped": self._dropped,
                "refused": self._refused,
                "replaced": self._replaced,
                "pulled_forward": self._pulled_forward,
                "deferred": self._deferred,
                "extended": self._extended,
                "histogram": {str(k): n for k, n in self._histogram.items()},
                "continued_histogram": {str(k): n for k, n in self._continued_histogram.items()},
            },
        }

    @classmethod
    def restore(cls, snapshot: Mapping[str, Any]) -> StalenessBuffer:
        """Rebuild a buffer from :meth:`snapshot` output; a damaged snapshot raises ProtocolError."""
        try:
            fmt = snapshot["format"]
            if fmt != SNAPSHOT_FORMAT:
                raise ProtocolError(
                    f"restore(): snapshot format {fmt!r} is not supported (this stalebound reads "
                    f"format {SNAPSHOT_FORMAT}); restore it with the version that wrote it"
                )
            buf = cls(
                snapshot["batch_size"],
                snapshot["staleness"],
                group_size=snapshot["group_size"],
                buffer_size=snapshot["buffer_size"],
                group_redundancy=snapshot["group_redundancy"],
                start_version=snapshot["version"],
            )
            buf._next_seq = int(snapshot["next_seq"])
            for item in snapshot["groups"]:
                buf._restore_group(item)
            c = snapshot["counters"]
            buf._occupied_total = int(c["occupied_total"])
            buf._consumed_groups = int(c["consumed_groups"])
            buf._consumed_batches = int(c["consumed_batches"])
            buf._aborted = Counter({str(k): int(n) for k, n in c["aborted"].items()})
            buf._dropped = int(c["dropped"])
            buf._refused = int(c["refused"])
            buf._replaced = int(c["replaced"])
            buf._pulled_forward = int(c["pulled_forward"])
            buf._deferred = int(c.get("deferred", 0))
            buf._extended = int(c.get("extended", 0))
            buf._histogram = Counter({int(k): int(n) for k, n in c["histogram"].items()})
            buf._continued_histogram = Counter(
                {int(k): int(n) for k, n in c.get("continued_histogram", {}).items()}
            )
            if buf._reserved_total() != int(c["reserved_total"]):
                raise ValueError(
                    f"reserved_total {c['reserved_total']} does not match the groups and counters"
                )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ProtocolError(
                f"restore(): the snapshot is damaged or not a StalenessBuffer snapshot "
                f"({type(exc).__name__}: {exc}); restore from an intact checkpoint"
            ) from exc
        try:
            buf.check_invariants()
        except InvariantError as exc:  # consistent field by field, impossible as a whole
            raise ProtocolError(
                f"restore(): the snapshot is damaged ({exc}); restore from an intact checkpoint"
            ) from exc
        return buf

    def _restore_group(self, item: Mapping[str, Any]) -> None:
        gid, version, bv = item["group_id"], int(item["version"]), int(item["buffer"])
        extended = int(item.get("extended", 0))
        v, bound = self._v, self.staleness + extended
        if gid in self._groups or not (v <= bv <= version + bound) or version > v or extended < 0:
            raise ProtocolError(
                f"restore(): group {gid!r} (version {version}) cannot sit in buffer {bv} at "
                f"version {v} with staleness {bound}, or appears twice; the snapshot is damaged"
            )
        g = _Entry(gid, version, bv)
        g.extended = extended
        buf = self._buffers.setdefault(bv, _Buffer())
        if "seq" in item:
            g.seq, g.payload = int(item["seq"]), item.get("payload")
            _move(g, _OCCUPY)
            insort(buf.occupied, g, key=_by_seq)
        else:
            buf.reserved[gid] = g
        self._groups[gid] = g

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` if the internal state is inconsistent (used by tests)."""
        v, bound = self._v, self.staleness
        seen = 0
        all_seqs = [g.seq for buf in self._buffers.values() for g in buf.occupied]
        if len(set(all_seqs)) != len(all_seqs) or any(s >= self._next_seq for s in all_seqs):
            raise InvariantError(
                f"occupy order {sorted(all_seqs)} repeats a number or reaches next_seq "
                f"{self._next_seq}; each occupied entry has its own number below it"
            )
        for bv, buf in self._buffers.items():
            if not v <= bv <= v + bound:
                raise InvariantError(f"buffer {bv} outside the window [{v}, {v + bound}]")
            if len(buf.reserved) + len(buf.occupied) > self.buffer_size:
                raise InvariantError(f"buffer {bv} holds more than {self.buffer_size} entries")
            seqs = [g.seq for g in buf.occupied]
            if seqs != sorted(seqs):
                raise InvariantError(f"buffer {bv} occupied entries out of occupy order")
            for filed, entries in ((_RESERVED, buf.reserved.values()), (_OCCUPIED, buf.occupied)):
                for g in entries:
                    if g.state != filed:
                        raise InvariantError(
                            f"group {g.group_id!r} is {_STATES[g.state].name}, filed as "
                            f"{_STATES[filed].name} in buffer {bv}"
                        )
            for g in [*buf.reserved.values(), *buf.occupied]:
                if self._groups.get(g.group_id) is not g or g.buffer != bv:
                    raise InvariantError(f"group {g.group_id!r} misfiled in buffer {bv}")
                if bv > g.version + bound + g.extended:
                    raise InvariantError(
                        f"group {g.group_id!r} (version {g.version}, extended {g.extended}) in {bv}"
                    )
            seen += len(buf.reserved) + len(buf.occupied)
        if seen != len(self._groups):
            raise InvariantError(f"{seen} entries filed, {len(self._groups)} groups in flight")

    # --------------------------------------------------------------- helpers

    def _reserved_total(self) -> int:
        """Every group ever reserved ends exactly once, so the count is derived, not kept."""
        return (
            self._consumed_groups + sum(self._aborted.values()) + self._dropped + len(self._groups)
        )

    def _state(self, buf: _Buffer | None) -> BufferState:
        occ = len(buf.occupied) if buf else 0
        emp = self.buffer_size - occ - (len(buf.reserved) if buf else 0)
        if occ >= self.batch_size:
            return BufferState.READY if emp == 0 else BufferState.READY_WITH_CAPACITY
        return BufferState.PENDING if emp > 0 else BufferState.STUCK

    def _accepts(self, buf: _Buffer) -> bool:
        occ = len(buf.occupied)
        return occ < self.batch_size and occ + len(buf.reserved) < self.buffer_size

    def _find_place(self, r: int) -> int | None:
        """The Occupy rule: earliest buffer in [v, r] with occ < B and an EMPTY entry, else the
        earliest in [v, r] with an EMPTY entry, else None. Creates the buffer if it is new."""
        fallback = None
        cap, batch = self.buffer_size, self.batch_size
        for bv in range(self._v, r + 1):
            buf = self._buffers.get(bv)
            if buf is None:
                self._buffers[bv] = _Buffer()
                return bv
            occ = len(buf.occupied)
            if occ + len(buf.reserved) < cap:
                if occ < batch:
                    return bv
                if fallback is None:
                    fallback = bv
        return fallback

    def _replace(self, g: _Entry) -> bool:
        """Re-place an extra occupied group after consume; False when it must be dropped."""
        b = self._find_place(g.version + self.staleness + g.extended)
        if b is None:
            return False
        _move(g, _REPLACE)
        g.buffer = b
        insort(self._buffers[b].occupied, g, key=_by_seq)
        self._replaced += 1
        return True

    def _check_window(self, op: str, buffer_version: int) -> None:
        v, top = self._v, self._v + self.staleness
        if not is_int(buffer_version) or not v <= buffer_version <= top:
            raise ProtocolError(
                f"{op}({buffer_version!r}): buffer versions in the window are {v} … {top} "
                f"(version {v}, staleness {self.staleness}); earlier buffers were consumed and "
                "later ones do not exist yet"
            )

    def _admissible_version(self, op: str, version: int) -> int:
        check_version(op, version)
        if version > self._v:
            raise ProtocolError(
                f"{op}(version={version}): version {version} is from the future (the current "
                f"version is {self._v}); generation can only start at a version ≤ {self._v}"
            )
        return version

    def _known_group(self, op: str, group_id: Hashable) -> _Entry:
        try:
            g = self._groups.get(group_id)
        except TypeError:
            g = None
        if g is None:
            raise ProtocolError(
                f"{op}(group_id={group_id!r}): no such group in flight (never reserved, or already "
                f"consumed, aborted or dropped) at version {self._v}"
            )
        return g

    def _reserved_group(self, op: str, group_id: Hashable) -> _Entry:
        g = self._known_group(op, group_id)
        if g.occupied:
            raise ProtocolError(
                f"{op}(group_id={group_id!r}): the group is already OCCUPIED in buffer {g.buffer} "
                f"(version {g.version}); a group is occupied once"
            )
        return g

    def _describe(self, g: _Entry) -> str:
        state = "OCCUPIED" if g.occupied else "RESERVED"
        return f"{state} in buffer {g.buffer}, version {g.version}"


def _validate(
    batch_size: object,
    staleness: object,
    group_size: object,
    buffer_size: object,
    group_redundancy: object,
    start_version: object,
) -> list[str]:
    problems: list[str] = []

    def need_int(name: str, value: object, low: int, fix: str) -> bool:
        if not is_int(value) or value < low:  # type: ignore[operator]
            problems.append(f"{name}={value!r}: must be an integer ≥ {low}; {fix}")
            return False
        return True

    ok_b = need_int("batch_size", batch_size, 1, "set it to the groups per training step")
    problems.extend(staleness_problems("staleness", staleness))
    ok_n = need_int("group_size", group_size, 1, "use 1 when each group is one trajectory")
    need_int("start_version", start_version, 0, "versions count training steps from 0")
    # the redundant sizes (B′, N′) are at least what they add redundancy to (B, N)
    for name, value, floor_ok, floor_name, floor, level in (
        ("buffer_size", buffer_size, ok_b, "batch_size", batch_size, "batch"),
        ("group_redundancy", group_redundancy, ok_n, "group_size", group_size, "group"),
    ):
        if value is not None and floor_ok:
            need_int(
                name,
                value,
                floor,  # type: ignore[arg-type]
                f"use None or at least {floor_name}={floor} (larger adds {level}-level redundancy)",
            )
    return problems

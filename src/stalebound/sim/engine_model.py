"""The engine model: where each trajectory decodes, when it finishes, and what that costs.

A :class:`Member` is one trajectory of an admitted :class:`Group`; the :class:`EngineModel` places
members on the replicas of :mod:`stalebound.sim.engine` (continuous batching) and follows them
through their segments and tool calls. A member's state is one of :data:`DECODING`,
:data:`TOOL_CALL`, :data:`ENDING` (its segment just ended, not yet reported), :data:`CUTTING`
(truncated, its episode returns on the next event), :data:`FINISHED` and :data:`GONE`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from stalebound.core.errors import InvariantError
from stalebound.sim.clock import EventQueue
from stalebound.sim.config import WorkloadConfig
from stalebound.sim.engine import Replica, Sequence

__all__ = [
    "CUTTING",
    "DECODING",
    "ENDING",
    "FINISHED",
    "GONE",
    "RUNNING",
    "TOOL_CALL",
    "EngineModel",
    "Group",
    "Member",
    "ReplicaDue",
]

DECODING, TOOL_CALL, ENDING, CUTTING, FINISHED, GONE = range(6)
RUNNING = (DECODING, TOOL_CALL, ENDING, CUTTING)
"""The states of a member still in flight."""


class ReplicaDue(NamedTuple):
    """The clock event of a segment end on ``replica`` (valid while ``ticket`` is the
    replica's); the engine model's own, re-exported with the others by
    :mod:`stalebound.sim.events`."""

    replica: Replica
    ticket: int


class Member:
    """One trajectory: where it decodes, what it has generated, and how it ended."""

    __slots__ = (
        "end",
        "group",
        "number",
        "replica",
        "seg",
        "seq",
        "spec",
        "start",
        "state",
        "tokens",
        "tools",
        "truncated",
        "version",
    )

    def __init__(self, group: Group, number: int, spec: Any, version: int, start: float) -> None:
        self.group = group
        self.number = number
        self.spec = spec
        self.version = version
        self.start = start
        self.seg = 0
        self.tokens = 0.0
        self.tools = 0
        self.state = DECODING
        self.end = -1.0
        self.truncated = False
        self.replica: Replica | None = None
        self.seq: Sequence | None = None

    @property
    def score(self) -> float:
        """The trajectory's reward, for group post-processors: a source's spec may carry one
        (``spec.score``); sampled workloads have none (0.0)."""
        return float(getattr(self.spec, "score", 0.0))


class Group:
    """One admitted group: its prompt (the sample index), attempt and members, in launch order."""

    __slots__ = ("attempt", "finished", "gid", "members", "prompt", "version")

    def __init__(self, gid: int, prompt: int, attempt: int, version: int) -> None:
        self.gid = gid
        self.prompt = prompt
        self.attempt = attempt
        self.version = version
        self.members: dict[int, Member] = {}
        self.finished = 0


class EngineModel:
    """Inference replicas with continuous batching (:class:`~stalebound.sim.engine.Replica`):
    where each member decodes, when it finishes, and the slots and tokens that costs.

    Members are placed round robin over replicas with a free slot; a member keeps its slot through
    its tool calls. Replicas whose next completion changed are re-scheduled by :meth:`reschedule`
    once per clock event (a :class:`ReplicaDue` event each)."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        e = cfg.engine
        self.replicas = [
            Replica(
                i,
                e.max_concurrency,
                e.step_base,
                e.step_per_seq,
                prefill=e.prefill,
                max_batch=e.max_batch,
                per_ctx=e.step_per_ctx,
                cohort_padding=e.cohort_padding,
            )
            for i in range(e.replicas)
        ]
        self.slots = e.replicas * e.max_concurrency
        self.free_slots = self.slots
        self.min_free_slots = self.slots
        """The fewest free engine slots seen: slots − this is the peak in use."""
        # replicas whose next completion must be re-derived, in first-touched order: a set would
        # iterate in address order and make tie-breaks differ from run to run
        self._dirty: dict[Replica, None] = {}
        self._cursor = 0

    def place(self, m: Member, now: float) -> None:
        """Give ``m`` a slot and start decoding its first segment."""
        r = self.replicas[self._cursor]
        if r.slots < r.max_slots:  # the usual case: round robin finds room at once
            self._cursor = r.index + 1 if r.index + 1 < len(self.replicas) else 0
        else:
            r = self._pick()
        r.slots += 1
        self.free_slots -= 1
        if self.free_slots < self.min_free_slots:
            self.min_free_slots = self.free_slots
        m.replica = r
        self.decode(m, now)

    def _pick(self) -> Replica:
        reps = self.replicas
        n = len(reps)
        i = self._cursor
        for _ in range(n):
            r = reps[i]
            i = i + 1 if i + 1 < n else 0
            if r.slots < r.max_slots:
                self._cursor = i
                return r
        raise InvariantError(f"no free engine slot although {self.free_slots} are counted free")

    def decode(self, m: Member, now: float) -> None:
        """Start decoding ``m``'s current segment."""
        r = m.replica
        assert r is not None
        r.advance(now)
        m.state = DECODING
        m.seq = r.join(m, m.spec.segments[m.seg])
        self._dirty[r] = None

    def stop(self, m: Member, now: float) -> None:
        """Stop ``m`` decoding (if it is) and free its slot; its tokens so far are kept."""
        r = m.replica
        assert r is not None
        if m.state == DECODING:
            assert m.seq is not None
            r.advance(now)
            m.tokens += r.cancel(m.seq)
            m.seq = None
            self._dirty[r] = None
        self.release(m)

    def release(self, m: Member) -> None:
        r = m.replica
        assert r is not None
        r.slots -= 1
        self.free_slots += 1
        m.replica = None

    def finished(self, r: Replica, now: float) -> list[Member]:
        """The members whose segment on ``r`` ended by ``now`` (their tokens counted)."""
        r.advance(now)
        self._dirty[r] = None
        done = []
        for s in r.pop_finished():
            m: Member = s.owner
            m.tokens += s.tokens
            m.seq = None
            m.seg += 1
            m.state = ENDING
            done.append(m)
        return done

    def progress(self, m: Member, now: float) -> float:
        """Tokens ``m`` has generated by ``now``."""
        if m.state == DECODING and m.replica is not None and m.seq is not None:
            m.replica.advance(now)
            return m.tokens + m.replica.decoded(m.seq)
        return m.tokens

    def reschedule(self, queue: EventQueue) -> None:
        """Schedule the next segment end of each replica touched since the last call; its
        ``ticket`` is renewed, so an end scheduled before is superseded."""
        now = queue.now
        for r in self._dirty:
            r.ticket += 1
            t = r.next_finish(now)
            if t is not None:
                queue.schedule(t, ReplicaDue(r, r.ticket))
        self._dirty.clear()

    def stall(self, now: float, seconds: float) -> None:
        """Every replica stops decoding for ``seconds`` (installing new weights, say)."""
        if seconds > 0:
            for r in self.replicas:
                r.advance(now)
                r.stall(seconds)
                self._dirty[r] = None

    def busy(self, now: float) -> float:
        """Seconds a replica had a sequence (decoding or waiting) up to ``now``, averaged."""
        total = 0.0
        for r in self.replicas:
            r.advance(now)
            total += r.busy_time
        return total / len(self.replicas)

    def generated(self, now: float) -> float:
        """Tokens decoded by every replica up to ``now``."""
        total = 0.0
        for r in self.replicas:
            r.advance(now)
            total += r.tokens
        return total

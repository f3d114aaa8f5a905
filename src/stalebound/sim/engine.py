"""The discrete-event engine and the batched inference-replica model.

:class:`EventQueue` is a heap of events ordered by (time, sequence number): events at the same time
run in the order they were scheduled, so a run is a pure function of its inputs and seed. Its clock
only moves forward; scheduling into the past raises :class:`InvariantError`.

:class:`Replica` models continuous batching without one event per token. All active sequences of a
replica advance together, one token per decode step, and a step takes ``a + b × active`` seconds.
The replica keeps a *step counter* ``progress`` (steps taken since start, a real number between
events) and each sequence's finishing step ``join progress + tokens``; a min-heap of those gives the
next completion, whose time follows analytically while the active count stays fixed. A join or a
leave changes the step time, so the replica re-derives its next completion then (one event per
change, superseded events are ignored by a ticket number). Cost: O(log n) per join and finish.
"""

from __future__ import annotations

import heapq
from typing import Any

from stalebound.core.errors import InvariantError

__all__ = ["EventQueue", "Replica", "Sequence"]


class EventQueue:
    """A virtual clock and a heap of ``(time, seq, kind, a, b)`` events."""

    __slots__ = ("_heap", "_seq", "now", "processed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, time: float, kind: int, a: Any = None, b: Any = None) -> None:
        """Schedule an event of ``kind`` with arguments ``a`` and ``b`` at ``time`` (≥ now)."""
        if time < self.now:
            raise InvariantError(f"event {kind} scheduled at {time} before the clock {self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, kind, a, b))

    def pop(self) -> tuple[float, int, int, Any, Any] | None:
        """The next event, advancing the clock to its time; ``None`` when the heap is empty."""
        if not self._heap:
            return None
        event = heapq.heappop(self._heap)
        self.now = event[0]
        self.processed += 1
        return event


class Sequence:
    """One decode segment on a replica: it finishes when the replica's progress reaches ``finish``."""

    __slots__ = ("cancelled", "finish", "owner", "start")

    def __init__(self, owner: Any, start: float, tokens: int) -> None:
        self.owner = owner
        self.start = start
        self.finish = start + tokens
        self.cancelled = False


class Replica:
    """One inference replica with continuous batching (see the module docstring).

    ``slots`` counts the sequences placed on the replica, whether decoding or waiting on a tool;
    ``active`` counts those decoding, which set the step time.
    """

    __slots__ = (
        "_heap",
        "_seq",
        "active",
        "busy_time",
        "index",
        "last",
        "max_slots",
        "per_seq",
        "progress",
        "slots",
        "step_base",
        "ticket",
        "tokens",
    )

    def __init__(self, index: int, max_slots: int, step_base: float, per_seq: float) -> None:
        self.index = index
        self.max_slots = max_slots
        self.step_base = step_base
        self.per_seq = per_seq
        self.slots = 0
        self.active = 0
        self.progress = 0.0
        self.last = 0.0
        self.tokens = 0.0
        """Tokens decoded so far (all sequences), for utilisation."""
        self.busy_time = 0.0
        """Seconds with at least one active sequence."""
        self.ticket = 0
        self._heap: list[tuple[float, int, Sequence]] = []
        self._seq = 0

    def advance(self, now: float) -> None:
        """Bring ``progress`` and the counters up to ``now``."""
        dt = now - self.last
        if dt > 0 and self.active:
            steps = dt / (self.step_base + self.per_seq * self.active)
            self.progress += steps
            self.tokens += steps * self.active
            self.busy_time += dt
        self.last = now

    def join(self, owner: Any, tokens: int) -> Sequence:
        """Start decoding ``tokens`` tokens for ``owner``; call :meth:`advance` first."""
        s = Sequence(owner, self.progress, tokens)
        self._seq += 1
        heapq.heappush(self._heap, (s.finish, self._seq, s))
        self.active += 1
        return s

    def cancel(self, s: Sequence) -> float:
        """Stop a decoding sequence; returns the tokens it decoded. Call :meth:`advance` first."""
        s.cancelled = True
        self.active -= 1
        return min(self.progress, s.finish) - s.start

    def next_finish(self, now: float) -> float | None:
        """When the next active sequence finishes at the current step time, or ``None``."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if not heap:
            return None
        remaining = heap[0][0] - self.progress
        if remaining <= 0:
            return now
        return now + remaining * (self.step_base + self.per_seq * self.active)

    def pop_finished(self) -> list[Sequence]:
        """Sequences whose finishing step has been reached (a tiny tolerance absorbs rounding)."""
        done: list[Sequence] = []
        heap = self._heap
        limit = self.progress + 1e-6
        while heap and heap[0][0] <= limit:
            s = heapq.heappop(heap)[2]
            if not s.cancelled:
                s.cancelled = True  # finished: no longer cancellable
                done.append(s)
        self.active -= len(done)
        return done

"""The simulator's clock: a heap of typed events ordered by (time, sequence number).

Events at the same time run in the order they were scheduled, so a run is a pure function of its
inputs and seed. The clock only moves forward; scheduling into the past raises
:class:`InvariantError`. An event is any object; the simulator's kinds are the small named tuples
of :mod:`stalebound.sim.events`, each dispatched by its type.
"""

from __future__ import annotations

import heapq
from typing import Any

from stalebound.core.errors import InvariantError

__all__ = ["EventQueue"]


class EventQueue:
    """A virtual clock and a heap of ``(time, seq, event)`` entries."""

    __slots__ = ("_heap", "_seq", "now", "processed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, time: float, event: Any) -> None:
        """Schedule ``event`` at ``time`` (≥ now)."""
        if time < self.now:
            raise InvariantError(f"event {event!r} scheduled at {time} before the clock {self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, event))

    def pop(self) -> Any:
        """The next event, advancing the clock to its time; ``None`` when the heap is empty."""
        if not self._heap:
            return None
        time, _, event = heapq.heappop(self._heap)
        self.now = time
        self.processed += 1
        return event

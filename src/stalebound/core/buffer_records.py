"""The staleness buffer's records: its states, a reservation, a consumed batch, its statistics.

Frozen values the buffer hands out (:mod:`stalebound.core.buffer` is the machine that makes them).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "BufferState",
    "BufferStatistics",
    "ConsumedBatch",
    "ConsumedGroup",
    "Reservation",
    "WindowStates",
]


class BufferState(enum.Enum):
    """The state of one buffer, from its occupied (occ) and empty (emp) entry counts."""

    PENDING = "pending"
    """occ < B and emp > 0: still accepts Reserve."""
    STUCK = "stuck"
    """occ < B and emp = 0: full, waiting on RESERVED entries; blocks training and Reserve."""
    READY_WITH_CAPACITY = "ready_with_capacity"
    """occ ≥ B and emp > 0 (only when B′ > B): consumable, still accepts Reserve."""
    READY = "ready"
    """occ ≥ B and emp = 0: consumable."""


class Reservation(NamedTuple):
    """A successful Reserve: ``group_id`` generated at ``version``, held in ``buffer_version``."""

    group_id: Hashable
    version: int
    buffer_version: int


class ConsumedGroup(NamedTuple):
    """A group handed to the trainer (or dropped): its id, its version V and its payload."""

    group_id: Hashable
    version: int
    payload: Any = None


@dataclass(frozen=True, slots=True)
class ConsumedBatch:
    """What :meth:`StalenessBuffer.consume` returns.

    ``groups`` are exactly B groups in occupy order. ``aborted`` are the ids of the surplus RESERVED
    groups the driver must cancel. ``dropped`` are the ids of extra OCCUPIED groups that had no
    admissible place left; ``dropped_groups`` carries them with their payloads, so that their cost
    can be counted. ``continued`` are the ids of the groups of ``groups`` whose deadline the
    deadline action ``continue`` moved past ``V + η``: trained later than their version allows,
    with their tokens generated before ``oldest_token`` (``version − η``; ``None`` when no group
    was continued) masked from the loss.
    """

    version: int
    groups: tuple[ConsumedGroup, ...]
    aborted: tuple[Hashable, ...] = ()
    dropped: tuple[Hashable, ...] = ()
    dropped_groups: tuple[ConsumedGroup, ...] = ()
    continued: tuple[Hashable, ...] = ()
    oldest_token: int | None = None

    def staleness(self) -> list[int]:
        """Staleness of each consumed group: this batch's version minus the group's version."""
        return [self.version - g.version for g in self.groups]


@dataclass(frozen=True)
class BufferStatistics:
    """A frozen snapshot of every counter of a :class:`StalenessBuffer`."""

    version: int
    batch_size: int
    buffer_size: int
    staleness: int
    """The bound: a group of version V is trained at V + staleness at the latest."""
    reserved: int
    """Groups RESERVED now."""
    occupied: int
    """Groups OCCUPIED now."""
    capacity: int
    """Reserve calls at the current version that would succeed now."""
    reserved_total: int
    occupied_total: int
    consumed_groups: int
    consumed_batches: int
    aborted: Mapping[str, int]
    """Aborted groups by cause (``surplus`` for consume-time aborts, ``filtered`` for filters, ...)."""
    dropped: int
    refused: int
    """try_reserve calls answered ``None`` (no capacity)."""
    replaced: int
    """Extra occupied groups moved to a later buffer at consume time."""
    pulled_forward: int
    deferred: int
    """Reservations moved to a later buffer within their bound (:meth:`StalenessBuffer.defer`)."""
    buffer_states: Mapping[int, BufferState]
    staleness_histogram: Mapping[int, int]
    """Consumed groups by staleness (buffer version − group version)."""
    extended: int = 0
    """Deadlines moved past ``V + η`` by the deadline action ``continue``
    (:meth:`StalenessBuffer.extend`; a group continued twice counts twice)."""
    continued_histogram: Mapping[int, int] = field(default_factory=dict)
    """The consumed groups of ``staleness_histogram`` that were continued past their deadline,
    by staleness: trained with their tokens older than the bound masked, so not violations."""

    @property
    def violations(self) -> int:
        """Consumed groups staler than the bound, leaving out the continued ones (their tokens
        older than the bound are masked from the loss)."""
        bound = self.staleness
        over = sum(n for k, n in self.staleness_histogram.items() if k > bound)
        return over - sum(n for k, n in self.continued_histogram.items() if k > bound)

    @property
    def staleness_bound(self) -> int:
        """The bound under its earlier name (kept so existing readers keep working)."""
        return self.staleness

    @property
    def filtered(self) -> int:
        return self.aborted.get("filtered", 0)

    @property
    def aborted_total(self) -> int:
        return sum(self.aborted.values())

    @property
    def max_consumed_staleness(self) -> int | None:
        return max(self.staleness_histogram) if self.staleness_histogram else None


class WindowStates(Mapping[int, BufferState]):
    """The state of every buffer ``v … v + η``, stored sparsely: the buffers that hold entries
    are listed, every other buffer of the window is EMPTY-only, hence PENDING. So a snapshot
    costs memory for the buffers in use, never for η (which may be huge: AReaL users write
    ``max_head_offpolicyness=1000`` for "no bound")."""

    __slots__ = ("_held", "_top", "_v")

    def __init__(self, v: int, top: int, held: dict[int, BufferState]) -> None:
        self._v, self._top, self._held = v, top, held

    def __getitem__(self, buffer_version: int) -> BufferState:
        if not (isinstance(buffer_version, int) and self._v <= buffer_version <= self._top):
            raise KeyError(buffer_version)
        return self._held.get(buffer_version, BufferState.PENDING)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._v, self._top + 1))

    def __len__(self) -> int:
        return self._top - self._v + 1

    def __repr__(self) -> str:
        return f"<buffers {self._v}…{self._top}: {self._held} held, the rest PENDING>"

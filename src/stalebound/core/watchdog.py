"""The watchdog: a decider that reports every group silent for ``watchdog`` seconds, once per stall.

A group's progress time (when it last produced something) is recorded by the coordinator on every
member event; the watchdog keeps its timer armed while groups run and, when it fires, reports each
group whose progress is older than the limit (:class:`~stalebound.core.events.ReportStall`) —
once, until the group makes progress again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

from stalebound.core.counts import CoordinatorCounts
from stalebound.core.events import Action, ReportStall
from stalebound.core.names import Timer
from stalebound.core.timers import Timers

__all__ = ["NoWatchdog", "Watchdog", "watchdog"]


class _Run(Protocol):
    gid: int
    version: int
    progress: float


class Watchdog:
    """Reports groups that produced nothing for ``limit`` seconds (counted as
    ``watchdog_stalls``)."""

    def __init__(self, limit: float, timers: Timers, counts: CoordinatorCounts) -> None:
        self.limit = limit
        self._timers = timers
        self._counts = counts
        self._reported: dict[Hashable, float] = {}  # group → the progress time reported at

    def started(self, gid: Hashable, now: float, out: list[Action]) -> None:
        if Timer.WATCHDOG not in self._timers:
            self._timers.arm(Timer.WATCHDOG, now + self.limit, out)

    def forget(self, gid: Hashable) -> None:
        self._reported.pop(gid, None)

    def fired(
        self,
        now: float,
        groups: Mapping[int, _Run],
        training_version: int,
        members: Callable[[int], tuple[int, ...]],
        stopped: bool,
        out: list[Action],
    ) -> None:
        """Report each silent group (``members`` gives its running member numbers) and arm the
        timer for the next group that may fall silent."""
        limit = self.limit
        wake = now + limit
        reported = self._reported
        for g in groups.values():
            if reported.get(g.gid) == g.progress:  # reported; wait for new progress
                continue
            if now - g.progress >= limit:
                reported[g.gid] = g.progress
                self._counts.watchdog_stalls += 1
                silent = now - g.progress
                out.append(ReportStall(g.gid, g.version, training_version, silent, members(g.gid)))
            else:
                wake = min(wake, g.progress + limit)
        if groups and not stopped:
            self._timers.arm(Timer.WATCHDOG, wake, out)


class NoWatchdog:
    """The null watchdog (``watchdog_timeout_s: null``): arms nothing, so it never fires."""

    def started(self, gid: Hashable, now: float, out: list[Action]) -> None:
        pass

    def forget(self, gid: Hashable) -> None:
        pass

    def fired(self, *args: Any) -> None:
        pass


def watchdog(
    limit: float | None, timers: Timers, counts: CoordinatorCounts
) -> Watchdog | NoWatchdog:
    """The watchdog for ``limit`` seconds (``None``: the null one)."""
    return NoWatchdog() if limit is None else Watchdog(limit, timers, counts)

"""When the coordinator stops for good: too many groups failed, or were filtered, in a row."""

from __future__ import annotations

from collections import deque
from typing import Any

from stalebound.core.counts import CoordinatorCounts
from stalebound.core.names import Cause

__all__ = ["StopRules"]

_RECENT_FAILURES = 8


class StopRules:
    """Counts groups that failed or were filtered in a row; says why to stop once a run of them
    reaches the settings' ``max_failures`` or ``max_filtered``."""

    def __init__(self, counts: CoordinatorCounts, settings: Any) -> None:
        s = settings
        self._counts = counts
        self._max_failures = s.max_failures
        self._max_filtered = s.max_filtered
        self._filter_name = (
            f"group_post_process {s.post_process_name!r} on filter_groups.metric={s.metric!r}"
            if s.post_process is not None
            else "should_accept_fn"
        )
        self._recent: deque[str] = deque(maxlen=_RECENT_FAILURES)

    def completed(self) -> None:
        """A group completed: the runs are broken."""
        c = self._counts
        c.consecutive_failures = 0
        c.consecutive_filtered = 0

    def failed(self, why: str) -> str | None:
        """A group failed (``why``); the reason to stop, if this makes too many in a row."""
        c = self._counts
        c.failed_groups += 1
        c.consecutive_failures += 1
        self._recent.append(why)
        if c.consecutive_failures < self._max_failures:
            return None
        return (
            f"{c.consecutive_failures} groups failed in a row (rollout.max_consecutive_failures="
            f"{self._max_failures}); the last causes: {'; '.join(self._recent)}"
        )

    def filtered(self, members: int, reason: str) -> str | None:
        """A completed group of ``members`` was filtered (``reason``); the reason to stop, if
        this makes too many in a row."""
        c = self._counts
        c.filtered_groups += 1
        c.discarded_members[Cause.FILTERED] += members
        c.consecutive_filtered += 1
        if c.consecutive_filtered < self._max_filtered:
            return None
        return (
            f"{c.consecutive_filtered} groups in a row were filtered out by {self._filter_name} "
            f"(rollout.max_consecutive_filtered={self._max_filtered}; the last: {reason}), so "
            "the data would be cycled forever without a batch; check that the reward varies "
            "within a group (a larger rollout.group_size helps), choose another metric, or "
            "disable the filter (rollout.group_post_process.enable=false)"
        )

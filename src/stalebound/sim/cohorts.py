"""The decode cohorts an embedded engine on a CPU forms, followed on a step counter.

The embedded engine starts a cohort with each batch of requests it admits together and merges
neighbouring cohorts by the rule of :mod:`stalebound.engines.cohorts`; every decode step runs one
forward pass per cohort. :class:`Cohorts` follows that on a replica's step counter
(``progress``): a request that joined at progress ``p`` has a cache ``progress − p`` wide, so a
cohort is as wide as its earliest-joined live request (the engine trims columns that only pad).
Every request gains one token per step, so the widths' differences — and with them the merges —
change only when a request joins or leaves; the merge rule is applied then (lazily, at the next
:meth:`Cohorts.count`).

What the model leaves out: the prompt (taken equal for all requests, so it cancels out of the
padding) and the context a segment after a tool call brings back (it joins as a new request).
"""

from __future__ import annotations

from stalebound.engines.cohorts import next_merge

__all__ = ["Cohort", "Cohorts"]


class Cohort:
    """Requests decoded in one forward pass: how many, and the progress each joined at."""

    __slots__ = ("first", "into", "rows", "starts")

    def __init__(self, start: float) -> None:
        self.rows = 1
        self.first = start
        """The earliest join among the live rows: the cohort is ``progress − first`` wide."""
        self.starts: dict[float, int] = {start: 1}
        self.into: Cohort | None = None
        """The cohort this one merged into (its rows are that one's now)."""


class Cohorts:
    """The cohorts of one replica; ``budget`` is the padding a merge may add (cache slots)."""

    __slots__ = ("_changed", "_cohorts", "_newest", "budget")

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._cohorts: list[Cohort] = []
        self._newest: Cohort | None = None
        self._changed = False

    def join(self, start: float) -> Cohort:
        """A request joins at progress ``start``; returns its cohort (for :meth:`leave`).
        Requests joining at the same progress before the next count form one cohort."""
        c = self._newest
        if self._changed and c is not None and c.rows and c.first == start and len(c.starts) == 1:
            c.rows += 1
            c.starts[start] += 1
            return c
        c = Cohort(start)
        self._cohorts.append(c)
        self._newest = c
        self._changed = True
        return c

    def leave(self, c: Cohort, start: float) -> None:
        """The request that joined ``c`` at ``start`` leaves (finished or cancelled)."""
        while c.into is not None:
            c = c.into
        c.rows -= 1
        left = c.starts[start] - 1
        if left:
            c.starts[start] = left
        else:
            del c.starts[start]
            if not c.rows:
                self._cohorts.remove(c)
            elif start == c.first:
                c.first = min(c.starts)
        self._changed = True

    def count(self, progress: float) -> int:
        """How many cohorts decode at ``progress`` (merging those the rule merges now)."""
        if self._changed:
            self._changed = False
            self._newest = None
            cohorts = self._cohorts
            cohorts.sort(key=lambda c: -c.first)  # narrowest first
            while (
                i := next_merge([(c.rows, progress - c.first) for c in cohorts], self.budget)
            ) is not None:
                a, b = cohorts[i], cohorts[i + 1]
                if len(a.starts) < len(b.starts):
                    a, b = b, a
                for s, n in b.starts.items():
                    a.starts[s] = a.starts.get(s, 0) + n
                a.rows += b.rows
                a.first = min(a.first, b.first)
                b.into = a
                cohorts[i : i + 2] = [a]
        return len(self._cohorts)

    def slots(self, progress: float) -> float:
        """The cache positions one step at ``progress`` attends: each cohort's rows × its width
        (call :meth:`count` first, which applies the merges)."""
        return sum(c.rows * (progress - c.first) for c in self._cohorts)

    def __len__(self) -> int:
        return len(self._cohorts)

"""When the embedded engine merges two decode cohorts: pure and torch-free, so that the engine's
worker and the simulator's model of it (:mod:`stalebound.sim.cohorts`) share one rule.

A *cohort* is a set of running requests decoded in one forward pass, their KV caches padded to
the widest row. Each decode step runs one pass per cohort, so a cohort costs a pass's fixed cost
and its rows cost their padded width. Cohorts are kept sorted by width; two neighbours merge
while the padding the merge adds stays within a budget (on a CPU, about what one more pass
costs), and always while there are more than :data:`MAX_COHORTS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

__all__ = ["COHORT_PADDING_SLOTS", "MAX_COHORTS", "next_merge", "padding"]

COHORT_PADDING_SLOTS = 1024
"""On a CPU, two cohorts merge while the padding the merge adds (rows × positions) stays under
this: about what one more forward pass of a decode step costs (measured on the default model:
~1.2 ms a pass, ~1.3 µs a cache slot at batch 256)."""
MAX_COHORTS = 8
"""At most this many cohorts (forward passes per decode step); past it the cheapest pair merges."""


def padding(a: tuple[int, float], b: tuple[int, float]) -> float:
    """Cache slots of padding that merging cohorts ``a`` and ``b`` (each ``(rows, width)``)
    adds: every row of the narrower one is padded to the wider one's width."""
    width = max(a[1], b[1])
    return a[0] * (width - a[1]) + b[0] * (width - b[1])


def next_merge(cohorts: Sequence[tuple[int, float]], budget: float | None) -> int | None:
    """The index ``i`` of the neighbours ``i``, ``i + 1`` to merge next, or ``None`` when the
    cohorts stay as they are. ``cohorts`` are ``(rows, width)`` sorted by width; ``budget`` is
    the padding a merge may add (``None``: no limit, everything merges into one cohort)."""
    if len(cohorts) < 2:
        return None
    added = [padding(a, b) for a, b in pairwise(cohorts)]
    i = min(range(len(added)), key=added.__getitem__)
    if len(cohorts) <= MAX_COHORTS and budget is not None and added[i] > budget:
        return None
    return i

"""Every counter the coordinator keeps, in one record (what the executor's statistics report and
its checkpoints save)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

__all__ = ["CoordinatorCounts"]


@dataclass
class CoordinatorCounts:
    """Every counter the coordinator keeps, by name (what :class:`ExecutorStatistics` reports)."""

    dispatched_groups: int = 0
    launched_members: int = 0
    finished_members: int = 0
    relaunched_members: int = 0
    completed_groups: int = 0
    failed_groups: int = 0
    filtered_groups: int = 0
    retried_groups: int = 0
    pulled_forward_groups: int = 0
    truncated_groups: int = 0
    truncated_trajectories: int = 0
    deadline_groups: int = 0
    continued_groups: int = 0
    """Groups the deadline action ``continue`` let run past their deadline (each once)."""
    continuations: int = 0
    """Deadlines ``continue`` moved on (a group continued twice counts twice)."""
    overdue_groups: int = 0
    watchdog_stalls: int = 0
    dropped_groups: int = 0
    surplus_groups: int = 0
    consumed_batches: int = 0
    consumed_groups: int = 0
    consumed_trajectories: int = 0
    resumed_groups: int = 0
    consecutive_failures: int = 0
    consecutive_filtered: int = 0
    member_failures: Counter[str] = field(default_factory=Counter)
    """Failed member episodes by cause."""
    cancelled_members: Counter[str] = field(default_factory=Counter)
    """Members aborted on purpose, by cause."""
    discarded_members: Counter[str] = field(default_factory=Counter)
    """Finished trajectories thrown away with their group, by cause."""

    def totals(self) -> dict[str, int]:
        """The plain counts by name (the per-cause maps left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}

    def by_cause(self) -> dict[str, Mapping[str, int]]:
        """The per-cause maps, read-only copies with plain string keys."""
        return {
            f.name: MappingProxyType({str(k): n for k, n in getattr(self, f.name).items()})
            for f in fields(self)
            if f.type != "int"
        }

    @classmethod
    def restored(
        cls, counts: Mapping[str, int], by_cause: Mapping[str, Mapping[str, int]]
    ) -> CoordinatorCounts:
        """The counters a checkpoint saved (:meth:`totals` and :meth:`by_cause`); raises
        ``ValueError`` naming counters it does not know (nothing is built then)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(counts) - known) + sorted(set(by_cause) - known)
        if unknown:
            raise ValueError(f"unknown counters {unknown}")
        c = cls()
        for k, n in counts.items():
            setattr(c, k, int(n))
        for k, m in by_cause.items():
            setattr(c, k, Counter({str(cause): int(n) for cause, n in m.items()}))
        return c

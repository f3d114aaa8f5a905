"""AReaL's count-based admission arithmetic, pure (no lock, no version provider).

``capacity(v) = min(max(1, C) − running, (η + v + 1)·max(1, B) − (accepted + running))``

This bounds staleness in aggregate only: it counts how many samples may exist per version, not
which version each sample came from, so one slow rollout admitted at ``v`` can still be trained
long after ``v + η``. :class:`stalebound.core.StalenessBuffer` closes that gap per trajectory.
The thread-safe, AReaL-compatible wrapper is :class:`stalebound.runtime.StalenessManager`.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalebound.core.checks import check_version, is_int, staleness_problems
from stalebound.core.errors import ConfigError, ProtocolError

__all__ = ["CapacityCounter", "RolloutStat"]


@dataclass
class RolloutStat:
    """AReaL's rollout counters: ``accepted`` and ``rejected`` are cumulative."""

    accepted: int = 0
    enqueued: int = 0
    rejected: int = 0
    running: int = 0


class CapacityCounter:
    """The counters and the capacity formula; every change that would go negative is refused."""

    def __init__(
        self, max_concurrent_rollouts: int, consumer_batch_size: int, max_staleness: int
    ) -> None:
        problems = []
        for name, value, low in (
            ("max_concurrent_rollouts", max_concurrent_rollouts, 0),
            ("consumer_batch_size", consumer_batch_size, 0),
        ):
            if not is_int(value) or value < low:
                problems.append(f"{name}={value!r}: must be an integer ≥ {low}")
        problems.extend(staleness_problems("max_staleness", max_staleness))
        if problems:
            raise ConfigError(problems)
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.staleness = max_staleness  # AReaL's name stops at this constructor's keyword
        self.stat = RolloutStat()

    def capacity(self, version: int) -> int:
        """New rollouts that may start now at training version ``version``; may be ≤ 0."""
        check_version("capacity", version)
        s = self.stat
        concurrency = max(1, self.max_concurrent_rollouts) - s.running
        staleness = (self.staleness + version + 1) * max(1, self.consumer_batch_size) - (
            s.accepted + s.running
        )
        return min(concurrency, staleness)

    def pending_limit(self) -> int:
        """The most rollouts that may wait in the input queue: ``(η + 1)·B``."""
        return (self.staleness + 1) * self.consumer_batch_size

    def enqueued(self) -> None:
        self.stat.enqueued += 1

    def submitted(self) -> None:
        self._need("on_rollout_submitted", "enqueued")
        self.stat.enqueued -= 1
        self.stat.running += 1

    def accepted(self) -> None:
        self._need("on_rollout_accepted", "running")
        self.stat.running -= 1
        self.stat.accepted += 1

    def rejected(self) -> None:
        self._need("on_rollout_rejected", "running")
        self.stat.running -= 1
        self.stat.rejected += 1

    def version_recovered(self, version: int) -> None:
        """After resuming at ``version``: count the batches already trained as accepted."""
        check_version("on_version_recovered", version)
        self.stat.accepted = version * max(1, self.consumer_batch_size)

    def _need(self, op: str, counter: str) -> None:
        if getattr(self.stat, counter) <= 0:
            raise ProtocolError(
                f"{op}(): no rollout is {counter} ({self.stat}); each rollout must be enqueued, "
                "then submitted, then accepted or rejected, once each"
            )

"""The deadline grace: how long the trainer waits for a due group before it is aborted.

A decider beside the deadline *policy* (:mod:`stalebound.core.deadline`), not inside it: the
policy decides with buffer operations which group is due and what its deadline action is; the
grace decides with time — the trainer's recent step times and a timer — when a due group the
trainer is waiting for has been waited for long enough. It asks the policy through the hook
every :class:`~stalebound.core.StalenessPolicy` has (``deadline_verdicts``; a policy without
deadlines answers nothing), so it works with any policy that has deadlines.

The grace is ``deadline_grace`` seconds, else ``deadline_grace_steps`` × the median of the
trainer's last :data:`GRACE_WINDOW` steps (a batch handed over → the trainer's next request);
``None``: the trainer waits for the group.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Protocol

from stalebound.core.events import Action
from stalebound.core.names import Timer, Verdict
from stalebound.core.timers import Timers

__all__ = ["GRACE_WINDOW", "DeadlineGrace", "DeadlineHook"]

GRACE_WINDOW = 8
"""The step time a grace in steps scales with: the median of the trainer's last this many steps."""


class DeadlineHook(Protocol):
    """The part of a staleness policy the grace asks (see ``StalenessPolicy.deadline_verdicts``)."""

    @property
    def version(self) -> int: ...

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]: ...


class DeadlineGrace:
    """The trainer's step-time window, the grace timer, and when to ask the policy for verdicts."""

    def __init__(
        self,
        policy: DeadlineHook,
        timers: Timers,
        grace: float | None,
        grace_steps: float | None,
    ) -> None:
        self._policy = policy
        self._timers = timers
        self._grace = grace
        self._grace_steps = grace_steps
        self._steps: deque[float] = deque(maxlen=GRACE_WINDOW)
        self._handed_at: float | None = None  # the last batch handed over, until the next ask

    def asked(self, now: float) -> None:
        """The trainer asks for a batch: the first ask since a batch was handed over ends a step."""
        if self._handed_at is not None:
            self._steps.append(now - self._handed_at)
            self._handed_at = None

    def handed(self, now: float) -> None:
        """The trainer's request was met: its step starts."""
        self._handed_at = now

    def grace(self) -> float | None:
        """Seconds the trainer waits for a due group; ``None``: it waits."""
        if self._grace is not None or self._grace_steps is None or len(self._steps) < 2:
            return self._grace
        return self._grace_steps * statistics.median(self._steps)

    def verdicts(
        self, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]:
        """The policy's deadline verdicts for the head (``overdue``: the grace is over)."""
        policy = self._policy
        return policy.deadline_verdicts(
            policy.version, trainer_waiting=trainer_waiting, overdue=overdue
        )

    def new_head(self, out: list[Action]) -> None:
        """A buffer became the head: its own grace, if it needs one."""
        self._timers.disarm(Timer.DEADLINE, out)

    def wait(self, now: float, out: list[Action]) -> None:
        """The trainer waits on the head (the verdicts carried out): arm the grace timer when a
        group it waits for is due."""
        grace = self.grace()
        if grace is not None and Timer.DEADLINE not in self._timers and self.verdicts(overdue=True):
            self._timers.arm(Timer.DEADLINE, now + grace, out)

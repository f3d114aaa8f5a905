"""The coordinator's armed timers: each arm or cancel is an action, and only a change is one."""

from __future__ import annotations

from stalebound.core.events import Action, ArmTimer, CancelTimer
from stalebound.core.names import Timer

__all__ = ["Timers"]


class Timers:
    """Which timers are armed, and for when. Shared by the deciders that keep a timer (the
    proactive filter, the watchdog, the deadline grace); the driver only arms and fires them."""

    __slots__ = ("_armed",)

    def __init__(self) -> None:
        self._armed: dict[str, float] = {}

    def __contains__(self, timer: object) -> bool:
        return timer in self._armed

    def arm(self, timer: Timer, at: float, out: list[Action]) -> None:
        """Arm ``timer`` for ``at`` (re-arming it if it was armed for another time)."""
        if self._armed.get(timer) == at:
            return
        self._armed[timer] = at
        out.append(ArmTimer(timer, at))

    def disarm(self, timer: str, out: list[Action]) -> None:
        if self._armed.pop(timer, None) is not None:
            out.append(CancelTimer(Timer(timer)))

    def disarm_all(self, out: list[Action]) -> None:
        for timer in list(self._armed):
            self.disarm(timer, out)

    def fired(self, timer: str) -> bool:
        """``timer`` fired: whether it was armed (a driver may race a cancel with the firing)."""
        return self._armed.pop(timer, None) is not None

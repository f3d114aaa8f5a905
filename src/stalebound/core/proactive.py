"""The proactive filter: a decider that watches the head buffer and acts on its stragglers.

When the head buffer is STUCK on at most ``threshold`` RESERVED groups (optionally for at least
``stuck_timeout_s``), :func:`proactive_filter_targets` names them and :class:`ProactiveFilter`
chooses which to act on: ``retry`` (the coordinator aborts them, this filter pulls finished groups
forward into the freed entries, and their prompts are queued again first) or ``truncate``
(force-completed with their partial outputs). It also times every STUCK spell of the head
(:class:`StuckTimer`, for the statistics), whatever the method.

Pure: times are floats the driver handed in; the timer it keeps is an action.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

from stalebound.core.buffer import BufferState, StalenessBuffer
from stalebound.core.errors import ConfigError
from stalebound.core.events import Action
from stalebound.core.names import PolicyKind, ProactiveMethod, Timer, Verdict
from stalebound.core.timers import Timers

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_THRESHOLD",
    "NoProactiveFilter",
    "ProactiveFilter",
    "StragglerClock",
    "StuckTimer",
    "eligible_targets",
    "proactive_filter",
    "proactive_filter_targets",
]

DEFAULT_THRESHOLD = 4
"""Act on a STUCK head buffer with at most this many RESERVED entries (``rollout.proactive_filter``
and the simulator's ``proactive`` section share it)."""
DEFAULT_MAX_RETRIES = 2
"""``retry``: how often one prompt may be retried."""


class StuckTimer:
    """How long each buffer has been STUCK, from driver-supplied timestamps."""

    def __init__(self) -> None:
        self._since: dict[int, float] = {}
        self.total_stuck_s: dict[int, float] = {}

    def observe(self, buf: StalenessBuffer, now: float) -> float:
        """Record the head buffer's state at ``now``; returns how long it has been STUCK (0 if not)."""
        v = buf.version
        if self._since:  # (called on every event: skip the scan when nothing is open)
            for bv in [b for b in self._since if b < v]:  # consumed since: close them
                self.total_stuck_s[bv] = self.total_stuck_s.get(bv, 0.0) + now - self._since.pop(bv)
        if buf.state(v) is BufferState.STUCK:
            since = self._since.setdefault(v, now)
            return now - since
        if v in self._since:
            self.total_stuck_s[v] = self.total_stuck_s.get(v, 0.0) + now - self._since.pop(v)
        return 0.0

    def open_intervals(self) -> Mapping[int, float]:
        """Buffers STUCK right now (as last observed), each with the time it became STUCK."""
        return dict(self._since)

    def stuck_seconds(self, now: float) -> float:
        """Total STUCK time so far, the open interval included."""
        return sum(self.total_stuck_s.values()) + sum(now - t for t in self._since.values())


class StragglerClock:
    """Which RESERVED groups are stragglers: overtaken by a group that landed in their buffer.

    A group is *overtaken* once some group has landed (was occupied, or pulled forward) in the
    buffer it is reserved in after it was reserved. Acting at once on a STUCK buffer (no
    ``stuck_timeout_s``) targets only overtaken groups: a group that has only just been reserved
    — a retried prompt that lands in the head buffer again, say — has had no chance to finish,
    and retrying or truncating it at once would loop. Counts events, not time, so it stays pure.
    """

    def __init__(self) -> None:
        self._tick = 0
        self._reserved: dict[Hashable, int] = {}
        self._landed: dict[int, int] = {}

    def _next(self) -> int:
        self._tick += 1
        return self._tick

    def reserved(self, group_id: Hashable) -> None:
        self._reserved[group_id] = self._next()

    def landed(self, buffer_version: int) -> None:
        self._landed[buffer_version] = self._next()

    def forget(self, group_id: Hashable) -> None:
        """The group left its entry (occupied, aborted, filtered)."""
        self._reserved.pop(group_id, None)

    def consumed(self, new_version: int) -> None:
        """Buffers before ``new_version`` are gone."""
        for b in [b for b in self._landed if b < new_version]:
            del self._landed[b]

    def overtaken(self, targets: Sequence[Hashable], buffer_version: int) -> tuple[Hashable, ...]:
        """The ``targets`` reserved before the latest landing in ``buffer_version``."""
        last = self._landed.get(buffer_version)
        if last is None:
            return ()
        return tuple(g for g in targets if self._reserved.get(g, last) < last)


def proactive_filter_targets(
    buf: StalenessBuffer,
    threshold: int,
    *,
    stuck_for: float = 0.0,
    stuck_timeout_s: float | None = None,
) -> tuple[Hashable, ...]:
    """The RESERVED groups of a STUCK head buffer to retry or truncate, or ``()``.

    Acts when the head buffer is STUCK with at most ``threshold`` RESERVED entries and, if a
    timeout is set, has been STUCK for at least ``stuck_timeout_s``.
    """
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
        raise ConfigError(
            f"proactive_filter.threshold={threshold!r}: must be an integer ≥ 0; count RESERVED "
            "entries, e.g. 4"
        )
    if stuck_timeout_s is not None and not _non_negative(stuck_timeout_s):
        raise ConfigError(
            f"proactive_filter.stuck_timeout_s={stuck_timeout_s!r}: must be a number ≥ 0 or "
            "None; give seconds, or None to act at once"
        )
    if not _non_negative(stuck_for):
        raise ConfigError(
            f"stuck_for={stuck_for!r}: must be a number ≥ 0; give the seconds the head buffer has "
            "been STUCK (0.0 when unknown)"
        )
    v = buf.version
    if buf.state(v) is not BufferState.STUCK:
        return ()
    if stuck_timeout_s is not None and stuck_for < stuck_timeout_s:
        return ()
    reserved = buf.reserved_groups(v)
    return reserved if len(reserved) <= threshold else ()


def _non_negative(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def eligible_targets(
    targets: Sequence[Hashable], attempts: Mapping[Hashable, int], limit: int
) -> tuple[Hashable, ...]:
    """The targets acted on fewer than ``limit`` times so far (``attempts``, missing = 0).

    ``retry`` passes how often each group's prompt was already retried and
    ``proactive_filter.max_retries``: a fresh retry that lands in the head buffer again is then not
    retried at once, so retrying can never loop. ``truncate`` passes 1 and the groups already being
    truncated, so each is truncated once.
    """
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise ConfigError(f"limit={limit!r}: must be an integer (a count of attempts)")
    return tuple(g for g in targets if attempts.get(g, 0) < limit)


class _Run(Protocol):
    """What the filter reads of a running group."""

    retries: int
    truncating: bool


class _Buffered(Protocol):
    @property
    def buffer(self) -> StalenessBuffer: ...


class ProactiveFilter:
    """The decider over a buffer policy's head (``method`` ``null`` only times STUCK spells).

    Acting at once (no ``stuck_timeout``) targets only overtaken groups (:class:`StragglerClock`);
    ``retry`` skips groups whose item was retried ``max_retries`` times, ``truncate`` groups
    already being cut short. The buffer is read from ``policy`` each time (a restored checkpoint
    builds a new one)."""

    def __init__(
        self,
        policy: _Buffered,
        timers: Timers,
        *,
        method: str,
        threshold: int,
        stuck_timeout: float | None,
        max_retries: int,
    ) -> None:
        self._policy = policy
        self._timers = timers
        self.method = ProactiveMethod(method)
        self.verdict = Verdict.RETRY if self.method is ProactiveMethod.RETRY else Verdict.TRUNCATE
        self._threshold = threshold
        self._timeout = stuck_timeout
        self._max_retries = max_retries
        self.stuck = StuckTimer()
        self._stragglers = (
            StragglerClock()
            if self.method is not ProactiveMethod.NULL and stuck_timeout is None
            else None
        )

    def started(self, gid: Hashable, now: float, out: list[Action]) -> None:
        if self._stragglers is not None:
            self._stragglers.reserved(gid)

    def forget(self, gid: Hashable) -> None:
        if self._stragglers is not None:
            self._stragglers.forget(gid)

    def occupied(self, gid: Hashable) -> None:
        """The group completed: it left its reservation and landed where the buffer put it."""
        if self._stragglers is not None:
            self._stragglers.forget(gid)
            where = self._policy.buffer.lookup(gid)
            if where is not None:
                self._stragglers.landed(where[1])

    def consumed(self, new_version: int) -> None:
        if self._stragglers is not None:
            self._stragglers.consumed(new_version)

    def pull_forward(self) -> int:
        """After a retry: finished groups of later buffers move into the freed head entries."""
        buf = self._policy.buffer
        moved = buf.pull_forward()
        if moved and self._stragglers is not None:
            self._stragglers.landed(buf.version)
        return len(moved)

    def observe(self, now: float) -> None:
        self.stuck.observe(self._policy.buffer, now)

    def targets(
        self,
        now: float,
        groups: Mapping[Any, _Run],
        stopped: bool,
        out: list[Action],
        *,
        timer: bool = False,
    ) -> list[Any]:
        """The head may have changed: time its STUCK spell, keep the STUCK timer, and return the
        running groups to act on (:attr:`verdict`), in the buffer's order."""
        buf = self._policy.buffer
        stuck_for = self.stuck.observe(buf, now)
        if self.method is ProactiveMethod.NULL or stopped:
            return []
        if buf.state(buf.version) is not BufferState.STUCK:
            self._timers.disarm(Timer.STUCK, out)
            return []
        timeout = self._timeout
        if timer and timeout is not None:  # the timer may fire a clock tick early
            stuck_for = max(stuck_for, timeout)
        targets = proactive_filter_targets(
            buf, self._threshold, stuck_for=stuck_for, stuck_timeout_s=timeout
        )
        if not targets:
            if timeout is not None and stuck_for < timeout:
                self._timers.arm(Timer.STUCK, now - stuck_for + timeout, out)
            return []
        if self._stragglers is not None:  # acting at once: only on overtaken groups
            targets = self._stragglers.overtaken(targets, buf.version)
        self._timers.disarm(Timer.STUCK, out)
        if self.method is ProactiveMethod.RETRY:
            tries = {g: groups[g].retries for g in targets if g in groups}
            chosen = eligible_targets(targets, tries, self._max_retries)
        else:
            being = {g: 1 for g in targets if g in groups and groups[g].truncating}
            chosen = eligible_targets(targets, being, 1)
        return [groups[g] for g in chosen if g in groups]

    def stuck_seconds(self, now: float) -> dict[int, float]:
        """Time the head buffer spent STUCK, per buffer version, the open interval included."""
        stuck = dict(self.stuck.total_stuck_s)
        for b, since in self.stuck.open_intervals().items():
            stuck[b] = stuck.get(b, 0.0) + now - since
        return stuck


class NoProactiveFilter:
    """The null filter of a policy without a STUCK head (capacity, deadline): never acts."""

    verdict = Verdict.TRUNCATE

    def started(self, gid: Hashable, now: float, out: list[Action]) -> None:
        pass

    def forget(self, gid: Hashable) -> None:
        pass

    def occupied(self, gid: Hashable) -> None:
        pass

    def consumed(self, new_version: int) -> None:
        pass

    def pull_forward(self) -> int:
        return 0

    def observe(self, now: float) -> None:
        pass

    def targets(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    def stuck_seconds(self, now: float) -> dict[int, float]:
        return {}


def proactive_filter(
    policy: Any, settings: Any, timers: Timers
) -> ProactiveFilter | NoProactiveFilter:
    """The filter over a buffer policy's head (with the settings' method), else the null one."""
    if policy.kind is not PolicyKind.BUFFER:
        return NoProactiveFilter()
    s = settings
    return ProactiveFilter(
        policy,
        timers,
        method=s.proactive,
        threshold=s.threshold,
        stuck_timeout=s.stuck_timeout,
        max_retries=s.max_retries,
    )

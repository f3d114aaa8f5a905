"""Filters: pure decisions about which groups to drop, retry or truncate.

* Group post-processors run when a group completes and may drop it (its entry returns to EMPTY,
  counted as ``filtered``). The built-in ``dynamic_sampling_filter`` drops groups whose members all
  scored the same: their GRPO advantages are all zero, so they carry no learning signal (DAPO).
  Users register their own with :func:`register_group_post_process`.
* The proactive filter watches the head buffer: when it is STUCK on at most ``threshold`` RESERVED
  groups (optionally for at least ``stuck_timeout_s``), :func:`proactive_filter_targets` names them;
  the driver then retries them (abort, pull finished groups forward, re-dispatch the prompts) or
  truncates them (force-complete with their partial outputs).

Times are plain floats handed in by the driver, so the decisions stay pure and replayable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stalebound.core.buffer import BufferState, EntryState, StalenessBuffer
from stalebound.core.errors import ConfigError

__all__ = [
    "METRICS",
    "GroupPostProcess",
    "PostProcessDecision",
    "StragglerClock",
    "StuckTimer",
    "buffer_progress",
    "dynamic_sampling_filter",
    "eligible_targets",
    "get_group_post_process",
    "group_post_processes",
    "member_metric",
    "proactive_filter_targets",
    "register_group_post_process",
]

METRICS = ("score", "acc", "seq_reward", "seq_final_reward")
"""The per-trajectory metrics the dynamic sampling filter understands by name."""

Metric = str | Callable[[Any], float]


@dataclass(frozen=True, slots=True)
class PostProcessDecision:
    """``keep=False`` drops the group; ``reason`` says why (logged and counted)."""

    keep: bool
    reason: str = ""


GroupPostProcess = Callable[[Sequence[Any], Metric], PostProcessDecision]
"""A post-processor gets the group's member trajectories and the configured metric."""

_REGISTRY: dict[str, GroupPostProcess] = {}


def register_group_post_process(
    name: str,
) -> Callable[[GroupPostProcess], GroupPostProcess]:
    """Register a group post-processor under ``name`` (decorator)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"group_post_process.name={name!r}: must be a non-empty string; name the "
            "post-processor, e.g. 'my_filter'"
        )

    def add(fn: GroupPostProcess) -> GroupPostProcess:
        if not callable(fn):
            raise ConfigError(
                f"group_post_process.name={name!r}: {fn!r} is not callable; register a function "
                "(members, metric) -> PostProcessDecision"
            )
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ConfigError(
                f"group_post_process.name={name!r}: a post-processor of that name is already "
                "registered; choose another name"
            )
        _REGISTRY[name] = fn
        return fn

    return add


def get_group_post_process(name: str) -> GroupPostProcess:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ConfigError(
            f"group_post_process.name={name!r}: no such post-processor (registered: {known}); "
            "register yours with stalebound.core.filters.register_group_post_process"
        ) from None


def group_post_processes() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def member_metric(member: Any, metric: Metric) -> float:
    """The value of ``metric`` for one trajectory (a mapping, or an object with attributes)."""
    if callable(metric):
        return _number(metric, metric(member))
    if not isinstance(metric, str):
        raise ConfigError(
            f"filter_groups.metric={metric!r}: must be a metric name ({', '.join(METRICS)}) or a "
            "callable"
        )
    if isinstance(member, Mapping):
        value = member.get(metric)
        if value is None and isinstance(member.get("metrics"), Mapping):
            value = member["metrics"].get(metric)
    else:
        value = getattr(member, metric, None)
        if value is None:
            value = (getattr(member, "metrics", None) or {}).get(metric)
    if value is None:
        raise ConfigError(
            f"filter_groups.metric={metric!r}: a trajectory has no such metric; use one the task "
            f"reports ({', '.join(METRICS)}) or a callable"
        )
    return _number(metric, value)


def _number(metric: Metric, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(
            f"filter_groups.metric={metric!r}: a trajectory's value {value!r} is not a number; "
            "the metric must be a number per trajectory (a reward, a score, 0/1 accuracy)"
        ) from None


@register_group_post_process("dynamic_sampling_filter")
def dynamic_sampling_filter(
    members: Sequence[Any], metric: Metric = "score"
) -> PostProcessDecision:
    """Drop the group when the standard deviation of ``metric`` over its members is 0."""
    values = [member_metric(m, metric) for m in members]
    if len(values) < 2:
        return PostProcessDecision(True)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
    if std == 0.0:
        name = metric if isinstance(metric, str) else getattr(metric, "__name__", "metric")
        return PostProcessDecision(False, f"zero variance: every {name} = {mean:g}")
    return PostProcessDecision(True)


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


def buffer_progress(buf: StalenessBuffer) -> str:
    """One line per window: the head buffer's and each buffer's in use occupied / reserved /
    empty entries and state (the others are empty; η may be huge)."""
    v = buf.version
    parts = []
    for b in sorted({v, *buf.versions_in_use()}):
        e = buf.entries(b)
        parts.append(
            f"b{b} {buf.state(b).name} occ {e[EntryState.OCCUPIED]} "
            f"res {e[EntryState.RESERVED]} emp {e[EntryState.EMPTY]}"
        )
    return f"version {v}: " + " | ".join(parts)

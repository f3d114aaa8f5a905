"""Filters: pure decisions about which groups to drop, retry or truncate.

* Group post-processors run when a group completes and may drop it (its entry returns to EMPTY,
  counted as ``filtered``). The built-in ``dynamic_sampling_filter`` drops groups whose members all
  scored the same: their GRPO advantages are all zero, so they carry no learning signal (DAPO).
  Users register their own with :func:`register_group_post_process`.
* :func:`evaluate_group` runs a completed group's filters for a driver (the coordinator asks
  with an :class:`~stalebound.core.events.EvaluateGroup` action, so that user code runs outside
  any lock around the core) and turns what they say, or raise, into the verdict event.
* The proactive filter (:mod:`stalebound.core.proactive`) watches the head buffer: when it is STUCK on at most ``threshold`` RESERVED
  groups (optionally for at least ``stuck_timeout_s``), :func:`proactive_filter_targets` names them;
  the driver then retries them (abort, pull finished groups forward, re-dispatch the prompts) or
  truncates them (force-complete with their partial outputs).

Times are plain floats handed in by the driver, so the decisions stay pure and replayable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stalebound.core.buffer import EntryState, StalenessBuffer
from stalebound.core.errors import ConfigError
from stalebound.core.events import EvaluateGroup, GroupEvaluated
from stalebound.core.names import Verdict
from stalebound.core.proactive import (
    StragglerClock,
    StuckTimer,
    eligible_targets,
    proactive_filter_targets,
)

__all__ = [
    "METRICS",
    "GroupPostProcess",
    "PostProcessDecision",
    "StragglerClock",
    "StuckTimer",
    "buffer_progress",
    "dynamic_sampling_filter",
    "eligible_targets",
    "evaluate_group",
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


def evaluate_group(action: EvaluateGroup, now: float) -> GroupEvaluated:
    """Run a completed group's filters — the item's ``should_accept_fn``, then the group
    post-processor — and say what they decided, as the event the coordinator waits for. A filter
    that raises fails the group; a post-processor that cannot read its metric (a
    :class:`ConfigError`) can judge no group, so the run stops."""
    gid, results = action.group_id, list(action.results)
    if action.accept is not None:
        try:
            keep = action.accept(results)
        except Exception as e:
            return GroupEvaluated(gid, now, Verdict.FAIL, f"should_accept_fn {e!r}")
        if not keep:
            return GroupEvaluated(gid, now, Verdict.FILTER, "should_accept_fn returned False")
    post = action.post_process
    if post is not None:
        name = action.post_process_name
        try:
            decision = post(results, action.metric)
        except ConfigError as e:  # a metric the trajectories lack: no group can pass
            return GroupEvaluated(gid, now, Verdict.STOP, str(e))
        except Exception as e:
            return GroupEvaluated(gid, now, Verdict.FAIL, f"group_post_process {name!r} {e!r}")
        if not decision.keep:
            return GroupEvaluated(gid, now, Verdict.FILTER, f"{name}: {decision.reason}")
    return GroupEvaluated(gid, now, Verdict.KEEP)


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

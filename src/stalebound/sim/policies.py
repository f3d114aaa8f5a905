"""The simulator's named policies and the coordinator settings each runs with.

A policy name (one of :data:`POLICIES`) picks a core policy kind with its redundancy, proactive
filter or deadline action (:class:`PolicySpec`); :func:`coordinator_settings` turns it, a workload
and the hard bound η_h (and, for the ``deadline`` kinds, the soft target η_s) into the
:class:`~stalebound.core.settings.CoordinatorSettings` that ``stalebound train`` would run with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalebound.core.deadline import deadline_bounds
from stalebound.core.errors import ConfigError
from stalebound.core.settings import CoordinatorSettings, resolve_settings
from stalebound.runtime.config import DeadlineConfig, ProactiveFilterConfig, RolloutConfig
from stalebound.sim.config import WorkloadConfig

__all__ = [
    "POLICIES",
    "PolicySpec",
    "coordinator_settings",
    "policy_spec",
]

POLICIES = (
    "sync",
    "capacity",
    "capacity-drop",
    "buffer",
    "buffer+redundancy",
    "buffer+retry",
    "buffer+truncate",
    "deadline",
    "deadline-tight",
    "deadline-abort",
    "deadline-continue",
)


@dataclass(frozen=True)
class PolicySpec:
    """A named policy: which core policy, with which redundancy and proactive filter."""

    name: str
    kind: str  # "buffer" or "capacity"
    drop_stale: bool = False
    redundancy: bool = False
    filter: str | None = None
    synchronous: bool = False
    tight: bool = False
    """``deadline`` kinds: the soft target η_s defaults to the hard bound η_h itself, not to
    ``η_h // 2``."""
    deadline_action: str = "truncate"

    def target(self, staleness: int, target: int | None = None) -> int | None:
        """The soft admission target η_s at the hard bound ``staleness`` (η_h): ``target`` when
        given, else ``η_h // 2`` (``η_h`` when :attr:`tight`); ``None`` outside ``deadline``."""
        if self.kind != "deadline":
            return None
        soft, _ = deadline_bounds(
            target if target is not None or not self.tight else staleness, staleness
        )
        return soft

    def hard_bound(self, soft: int) -> int:
        """The hard bound η_h that pairs with the soft target ``soft`` by default: what
        ``--staleness`` meant for the ``deadline`` kinds before it named the hard bound."""
        if self.kind != "deadline" or self.tight:
            return soft
        return deadline_bounds(soft, None)[1]


def policy_spec(name: str) -> PolicySpec:
    """The :class:`PolicySpec` of one of :data:`POLICIES`."""
    specs = {
        "sync": PolicySpec("sync", "buffer", synchronous=True),
        "capacity": PolicySpec("capacity", "capacity"),
        "capacity-drop": PolicySpec("capacity-drop", "capacity", drop_stale=True),
        "buffer": PolicySpec("buffer", "buffer"),
        "buffer+redundancy": PolicySpec("buffer+redundancy", "buffer", redundancy=True),
        "buffer+retry": PolicySpec("buffer+retry", "buffer", filter="retry"),
        "buffer+truncate": PolicySpec("buffer+truncate", "buffer", filter="truncate"),
        "deadline": PolicySpec("deadline", "deadline"),
        "deadline-tight": PolicySpec("deadline-tight", "deadline", tight=True),
        "deadline-abort": PolicySpec("deadline-abort", "deadline", deadline_action="abort"),
        "deadline-continue": PolicySpec(
            "deadline-continue", "deadline", deadline_action="continue"
        ),
    }
    if name not in specs:
        raise ConfigError(f"policy={name!r}: unknown policy; use one of {', '.join(POLICIES)}")
    return specs[name]


def coordinator_settings(
    cfg: WorkloadConfig, spec: PolicySpec, staleness: int, target: int | None = None
) -> CoordinatorSettings:
    """The coordinator's settings for one policy on a workload at the hard bound ``staleness``
    (η_h) and, for the ``deadline`` kinds, the soft target ``target`` (η_s; ``None``: the
    policy's default, :meth:`PolicySpec.target`): what ``stalebound train`` would run with the
    matching ``rollout`` section.

    ``batch.max_concurrent_groups`` is ``max_concurrent_rollouts``; without it the engine slots are
    the only limit (a running group holds at least one slot, so the group limit never binds).
    ``proactive.stuck_time = 0`` acts at once (``stuck_timeout_s: null``). Built by the runtime's
    own builder (:func:`~stalebound.core.settings.resolve_settings`) from that section, so every
    setting the workload does not name has the runtime's default."""
    B, N = cfg.batch.groups, cfg.batch.group_size
    slots = cfg.engine.replicas * cfg.engine.max_concurrency
    soft = spec.target(staleness, target)
    max_groups = cfg.batch.max_concurrent_groups
    if max_groups is None and not cfg.batch.runtime_default:
        max_groups = slots
    p = cfg.proactive
    rollout = RolloutConfig(
        staleness_policy=spec.kind,  # type: ignore[arg-type]
        staleness=staleness,
        deadline=DeadlineConfig(
            target=soft,
            action=spec.deadline_action,  # type: ignore[arg-type]
        ),
        consumer_batch_size=B,
        buffer_size=math.ceil(B * cfg.redundancy.batch_factor) if spec.redundancy else None,
        group_size=N,
        group_redundancy=N + (cfg.redundancy.group_extra if spec.redundancy else 0),
        max_concurrent_rollouts=max_groups,
        request_timeout=math.inf,
        # The simulator models a cluster, not an operator's patience: a run of failed groups
        # is measured, not stopped.
        max_consecutive_failures=2**62,
        reject_stale_results=spec.drop_stale,
        proactive_filter=ProactiveFilterConfig(
            method=spec.filter or "null",  # type: ignore[arg-type]
            threshold=p.threshold,
            stuck_timeout_s=p.stuck_time or None,
        ),
        watchdog_timeout_s=None,
        progress_log_s=None,
    )
    return resolve_settings(rollout, max_relaunches=cfg.failures.max_relaunches)

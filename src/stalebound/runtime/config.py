"""The executor's settings: admission, staleness control, filters and the watchdog.

``RolloutConfig`` lives next to what it configures (the executor), so loading the runtime loads no
task and no trainer; :mod:`stalebound.config` composes it into the whole tree.

The staleness bound is one setting, :attr:`RolloutConfig.staleness`. The spellings users bring from
AReaL and PSRL are accepted at the config edge only, and the names are kept in one place:
:data:`STALENESS_ALIASES` (YAML keys, overrides and flags) and AReaL's keyword and
attribute :data:`AREAL_STALENESS_NAME` on this class.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from stalebound.core.checks import SYNCHRONOUS_FIX
from stalebound.core.deadline import (
    DEFAULT_CONTINUE_MAX,
    DEFAULT_GRACE_STEPS,
    DEFAULT_SLACK,
    deadline_bounds,
)
from stalebound.core.proactive import DEFAULT_MAX_RETRIES, DEFAULT_THRESHOLD
from stalebound.typedconfig import Invalid, Switch, bounds, null_means

__all__ = [
    "AREAL_STALENESS_NAME",
    "AREAL_SWITCHED_ALIASES",
    "STALENESS_ALIASES",
    "DeadlineConfig",
    "FilterGroupsConfig",
    "GroupPostProcessConfig",
    "ProactiveFilterConfig",
    "RolloutConfig",
]

AREAL_STALENESS_NAME = "max_head_offpolicyness"
"""AReaL's name of its admission bound. It keeps AReaL's meaning: under ``staleness_policy:
deadline`` it is the soft admission target :attr:`DeadlineConfig.target`, under ``buffer`` and
``capacity`` the bound :attr:`RolloutConfig.staleness` itself. This constant,
:data:`STALENESS_ALIASES`, :data:`AREAL_SWITCHED_ALIASES`, and the keyword and property of the
same name on :class:`RolloutConfig` are the only places that say so."""

STALENESS_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        f"rollout.{AREAL_STALENESS_NAME}": "rollout.staleness",
        AREAL_STALENESS_NAME: "rollout.staleness",  # also --max-head-offpolicyness
        "psrl.staleness": "rollout.staleness",
    }
)
"""Every spelling of the staleness bound a config may use, mapped to its one key (AReaL's, only
while the policy is not ``deadline``: :data:`AREAL_SWITCHED_ALIASES`)."""

AREAL_SWITCHED_ALIASES: Mapping[str, Switch] = MappingProxyType(
    {
        spelling: Switch("rollout.staleness_policy", {"deadline": "rollout.deadline.target"})
        for spelling in (f"rollout.{AREAL_STALENESS_NAME}", AREAL_STALENESS_NAME)
    }
)
"""AReaL's spellings under the deadline policy: the soft target, as AReaL's admission bound."""


@dataclass
class ProactiveFilterConfig:
    """What to do with a STUCK head buffer's last RESERVED groups (PSRL's proactive filter)."""

    method: Literal["null", "retry", "truncate"] = field(
        default="null", metadata=null_means("null")
    )
    """``retry`` aborts and re-dispatches them, ``truncate`` force-completes them, ``null`` waits."""
    threshold: int = field(
        default=DEFAULT_THRESHOLD,
        metadata=bounds(
            ge=0, fix=f"count RESERVED entries, e.g. {DEFAULT_THRESHOLD} (the default)"
        ),
    )
    """Act only when the STUCK buffer has at most this many RESERVED entries."""
    stuck_timeout_s: float | None = field(
        default=None, metadata=bounds(ge=0, fix="give seconds, or null to act at once")
    )
    """Act only once the buffer has been STUCK this long (seconds); ``None`` acts at once."""
    max_retries: int = field(
        default=DEFAULT_MAX_RETRIES,
        metadata=bounds(
            ge=0, fix=f"e.g. {DEFAULT_MAX_RETRIES} (the default); 0 never retries a prompt"
        ),
    )
    """``retry`` only: how often one prompt may be retried; a group past it is waited for."""


@dataclass
class GroupPostProcessConfig:
    """Group post-processors run when a group completes (PSRL's ``group_post_process``)."""

    enable: bool = False
    """Run the post-processor on every completed group."""
    name: str = "dynamic_sampling_filter"
    """A registered post-processor; ``dynamic_sampling_filter`` drops zero-variance groups."""


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups``: which per-trajectory metric the dynamic sampling filter uses."""

    metric: str = "score"
    """``score``, ``acc``, ``seq_reward`` or ``seq_final_reward``."""


@dataclass
class DeadlineConfig:
    """``staleness_policy: deadline`` only (docs/deadline.md)."""

    target: int | None = field(
        default=None, metadata=bounds(ge=0, fix="use null for half the hard bound, or ≥ 0")
    )
    """η_s, the soft admission target (AReaL's capacity arithmetic admits at it); at most
    ``rollout.staleness``, the hard bound η_h. ``None`` means η_h // 2. Also spelt, under this
    policy, ``rollout.max_head_offpolicyness`` (AReaL's admission bound)."""
    slack: int = field(
        default=DEFAULT_SLACK, metadata=bounds(ge=0, fix=f"e.g. {DEFAULT_SLACK} (the default)")
    )
    """Entries per buffer beyond ``buffer_size``."""
    action: Literal["truncate", "abort", "continue"] = "truncate"
    """What happens to a group still running at its deadline: ``truncate`` keeps its partial
    output (marked truncated), ``abort`` throws it away (counted as wasted), ``continue`` lets it
    keep generating under newer weights past its deadline (up to ``continue_max`` versions); the
    trainer then masks its tokens staler than ``rollout.staleness`` from the loss, so no trained
    token is staler than the bound."""
    continue_max: int = field(
        default=DEFAULT_CONTINUE_MAX,
        metadata=bounds(ge=0, fix=f"e.g. {DEFAULT_CONTINUE_MAX} (the default)"),
    )
    """Under ``action: continue``: how many versions past its deadline a group may keep
    generating; one still running then is truncated (counted as a deadline truncation)."""
    at: Literal["consume", "head"] = "consume"
    """When the deadline falls: when the trainer asks for the deadline buffer (``consume``), or
    already when that buffer becomes the head, one training step earlier (``head``)."""
    margin: int | None = field(
        default=None, metadata=bounds(ge=0, fix="e.g. 1, or null for ⌈target / 4⌉ (the default)")
    )
    """Admit only while AReaL's capacity exceeds this many groups (never holding back a group the
    next batch still lacks). ``None``: one group per 4 versions of the soft target, rounded up
    (⌈η_s / 4⌉: 1 up to η_s = 4, 2 at η_s = 8)."""
    grace_s: float | None = field(
        default=None, metadata=bounds(ge=0, fix="give seconds, or null to wait for the group")
    )
    """How long the trainer waits, once it asks for a deadline buffer, for its due groups to land.
    Truncation cuts a generation short, and a tool call the workflow awaits through
    :func:`~stalebound.runtime.interruptible`, but not a wait for a reward or any other wait; a
    group still running after the grace is aborted (its finished members are counted as discarded).
    ``None``: ``grace_steps``."""
    grace_steps: float | None = field(
        default=DEFAULT_GRACE_STEPS,
        metadata=bounds(ge=0, fix="give a number of training steps, e.g. 0.25, or null to wait"),
    )
    """When ``grace_s`` is ``None``: the grace in training steps, a step being the median of the
    trainer's last 8 (from a batch handed over to its next request). Before two steps are known,
    and with ``None`` here too, the trainer waits for the group."""


@dataclass
class RolloutConfig:
    """Admission and staleness control: the executor's settings (AReaL's ``InferenceEngineConfig``
    names, PSRL's ``psrl.*`` names as aliases)."""

    staleness_policy: Literal["buffer", "capacity", "deadline"] = "buffer"
    """``buffer``: PSRL's per-trajectory staleness buffer. ``capacity``: AReaL's count-based
    admission (bounds staleness in aggregate only). ``deadline``: AReaL's admission at the soft
    target ``deadline.target`` with ``staleness`` as the hard bound (docs/deadline.md)."""
    staleness: int = field(default=2, metadata=bounds(ge=0, fix=SYNCHRONOUS_FIX))
    """η, the staleness bound: a trajectory generated at version V is trained at V + η at the latest.
    0 is synchronous training. Also spelt ``psrl.staleness`` (PSRL) and, except under
    ``deadline``, ``rollout.max_head_offpolicyness`` (AReaL) and ``--max-head-offpolicyness``.
    Under ``deadline``, the hard bound η_h."""
    deadline: DeadlineConfig = field(default_factory=DeadlineConfig)
    consumer_batch_size: int = field(
        default=8, metadata=bounds(ge=1, fix="train on at least one group per step")
    )
    """B, groups per training step."""
    max_concurrent_rollouts: int | None = field(
        default=None,
        metadata=bounds(ge=1, fix="allow at least one rollout, or null for all the window allows"),
    )
    """The most groups generating at once. ``None`` means, with ``staleness_policy: buffer``,
    ``min(η + 1, 8)·B′``: all the window allows, but at most 8 batches (a huge η would otherwise
    flood the engines and the first step would wait for all of it); with ``capacity``, ``B``
    (AReaL's fallback)."""
    group_size: int = field(
        default=4, metadata=bounds(ge=1, fix="use 1 for no grouping, more for GRPO-style groups")
    )
    """N, trajectories per group (GRPO's group). Alias: ``psrl.rollout_n``."""
    buffer_size: int | None = field(
        default=None, metadata=bounds(ge=1, fix="use null for B′ = B (no batch-level redundancy)")
    )
    """B′, entries per buffer (≥ B); more than B is batch-level redundancy. ``None`` means B."""
    group_redundancy: int | None = field(
        default=None, metadata=bounds(ge=1, fix="use null for N′ = N (no group-level redundancy)")
    )
    """N′, trajectories launched per group (≥ N); more than N is group-level redundancy."""
    queue_size: int | None = field(
        default=None, metadata=bounds(ge=1, fix="use null for 16 × the concurrency limit")
    )
    """Input queue bound; ``None`` means 16 × the concurrency limit."""
    request_timeout: float = field(
        default=3600.0, metadata=bounds(gt=0, fix="give seconds, e.g. 3600 (the default)")
    )
    """Seconds before a running episode is cancelled and counted as timed out."""
    max_consecutive_failures: int = field(
        default=32, metadata=bounds(ge=1, fix="e.g. 32 (the default)")
    )
    """The executor stops with an error after this many groups fail in a row."""
    reject_stale_results: bool = False
    """``capacity`` policy only: drop results staler than η when they complete (counted as wasted)."""
    workflow: str | None = None
    """The episode workflow, a class named ``package.module:Class`` or ``path/to/file.py:Class``
    with ``async arun_episode(self, engine, row)`` (docs/data.md, "Workflows"); ``None`` runs the
    task's own (one model turn, or the calculator's tool calls)."""
    workflow_args: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments ``rollout.workflow``'s class is constructed with: a mapping in YAML,
    ``'rollout.workflow_args={max_turns: 3}'`` on the command line."""
    proactive_filter: ProactiveFilterConfig = field(default_factory=ProactiveFilterConfig)
    group_post_process: GroupPostProcessConfig = field(default_factory=GroupPostProcessConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    max_consecutive_filtered: int = field(
        default=256, metadata=bounds(ge=1, fix="e.g. 256 (the default)")
    )
    """The data loader stops with an error after this many consecutive groups are filtered."""
    watchdog_timeout_s: float | None = field(
        default=300.0, metadata=bounds(gt=0, fix="give seconds, e.g. 300, or null to disable")
    )
    """Log groups whose generation has produced nothing for this long (ids, versions, engine
    requests); ``None`` disables the watchdog."""
    progress_log_s: float | None = field(
        default=60.0, metadata=bounds(gt=0, fix="give seconds, e.g. 60, or null to disable")
    )
    """While groups are running, log one line per buffer (occupied / reserved / empty, state) at
    most this often; ``None`` disables it."""

    @property
    def max_head_offpolicyness(self) -> int:
        """AReaL's admission bound, read back (see :data:`AREAL_STALENESS_NAME`): the soft target
        under ``deadline`` (η_h // 2 when not set), else :attr:`staleness`."""
        if self.staleness_policy != "deadline":
            return self.staleness
        return deadline_bounds(self.deadline.target, self.staleness)[0]

    def _validate(self) -> Iterator[Invalid]:
        # the redundant sizes (B′, N′) are at least what they add redundancy to (B, N)
        for key, value, floor_key, floor, why, same in (
            ("buffer_size", self.buffer_size, "consumer_batch_size", self.consumer_batch_size,
             "a buffer holds the batch plus its redundancy", "B′ = B"),
            ("group_redundancy", self.group_redundancy, "group_size", self.group_size,
             "N′ members are launched to finish N", "N′ = N"),
        ):  # fmt: skip
            if value is not None and value < floor:
                yield Invalid(
                    key,
                    f"must be ≥ {floor_key} ({floor}): {why}",
                    f"use at least {floor}, or null for {same}",
                )
        target = self.deadline.target
        if self.staleness_policy == "deadline" and target is not None and target > self.staleness:
            yield Invalid(
                "deadline.target",
                f"the soft admission target must be ≤ the hard bound rollout.staleness "
                f"({self.staleness})",
                f"raise rollout.staleness to at least {target} (twice the target is the measured "
                "default), or lower the target",
            )
        method = self.proactive_filter.method
        if method != "null" and self.staleness_policy != "buffer":
            yield Invalid(
                "proactive_filter.method",
                f"acts on STUCK buffers, which only staleness_policy=buffer has (not "
                f"{self.staleness_policy!r})",
                "set it to null, or use staleness_policy=buffer",
            )
        if self.reject_stale_results and self.staleness_policy != "capacity":
            yield Invalid(
                "reject_stale_results",
                "only applies to staleness_policy=capacity (the buffer policy never trains a "
                "stale result)",
                "set it to false, or use staleness_policy=capacity",
            )


def _accept_areal_keyword(cls: type[RolloutConfig]) -> None:
    """``RolloutConfig(max_head_offpolicyness=4)`` sets AReaL's admission bound, as AReaL's
    ``InferenceEngineConfig`` keyword does: :attr:`~RolloutConfig.staleness`, or under
    ``staleness_policy="deadline"`` ``deadline.target`` (a wrapper, not a field, so that the config
    tree sees one setting). Given with the setting it stands for, AReaL's keyword wins: that is
    what ``dataclasses.replace(config, max_head_offpolicyness=4)`` passes (every field, with its
    old value, plus the keyword)."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self: RolloutConfig, *args: Any, **kwargs: Any) -> None:
        if AREAL_STALENESS_NAME in kwargs:
            bound = kwargs.pop(AREAL_STALENESS_NAME)
            policy = args[0] if args else kwargs.get("staleness_policy", "buffer")
            if policy == "deadline":
                deadline = kwargs.get("deadline") or DeadlineConfig()
                kwargs["deadline"] = dataclasses.replace(deadline, target=bound)
            else:
                kwargs["staleness"] = bound
        generated(self, *args, **kwargs)

    setattr(cls, "__init__", __init__)  # noqa: B010 (a method assignment the checker refuses)


_accept_areal_keyword(RolloutConfig)

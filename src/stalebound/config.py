"""One typed configuration tree.

The loader (YAML files, ``key.path=value`` overrides, the seeds' aliases, validation that reports
every problem at once) is built around these dataclasses. Each field's docstring is its reference
documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ProactiveFilterConfig:
    """What to do with a STUCK head buffer's last RESERVED groups (PSRL's proactive filter)."""

    method: Literal["null", "retry", "truncate"] = "null"
    """``retry`` aborts and re-dispatches them, ``truncate`` force-completes them, ``null`` waits."""
    threshold: int = 4
    """Act only when the STUCK buffer has at most this many RESERVED entries."""
    stuck_timeout_s: float | None = None
    """Act only once the buffer has been STUCK this long (seconds); ``None`` acts at once."""


@dataclass
class GroupPostProcessConfig:
    """Group post-processors run when a group completes (PSRL's ``group_post_process``)."""

    enable: bool = False
    name: str = "dynamic_sampling_filter"
    """A registered post-processor; ``dynamic_sampling_filter`` drops zero-variance groups."""


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups``: which per-trajectory metric the dynamic sampling filter uses."""

    metric: str = "score"
    """``score``, ``acc``, ``seq_reward`` or ``seq_final_reward``."""


@dataclass
class RolloutConfig:
    """Admission and staleness control: the executor's settings (AReaL's ``InferenceEngineConfig``
    names, PSRL's ``psrl.*`` names as aliases)."""

    staleness_policy: Literal["buffer", "capacity"] = "buffer"
    """``buffer``: PSRL's per-trajectory staleness buffer. ``capacity``: AReaL's count-based
    admission (bounds staleness in aggregate only)."""
    max_head_offpolicyness: int = 2
    """η, the staleness bound: a trajectory generated at version V is trained at V + η at the latest.
    0 is synchronous training. Aliases: ``psrl.staleness``, ``--max-head-offpolicyness``."""
    consumer_batch_size: int = 8
    """B, groups per training step."""
    max_concurrent_rollouts: int | None = None
    """The most groups generating at once; ``None`` means ``(η + 1)·B′``, all the window allows."""
    group_size: int = 4
    """N, trajectories per group (GRPO's group). Alias: ``psrl.rollout_n``."""
    buffer_size: int | None = None
    """B′, entries per buffer (≥ B); more than B is batch-level redundancy. ``None`` means B."""
    group_redundancy: int | None = None
    """N′, trajectories launched per group (≥ N); more than N is group-level redundancy."""
    queue_size: int | None = None
    """Input queue bound; ``None`` means 16 × the concurrency limit."""
    request_timeout: float = 3600.0
    """Seconds before a running episode is cancelled and counted as timed out."""
    max_consecutive_failures: int = 32
    """The executor stops with an error after this many groups fail in a row."""
    reject_stale_results: bool = False
    """``capacity`` policy only: drop results staler than η when they complete (counted as wasted)."""
    proactive_filter: ProactiveFilterConfig = field(default_factory=ProactiveFilterConfig)
    group_post_process: GroupPostProcessConfig = field(default_factory=GroupPostProcessConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    max_consecutive_filtered: int = 256
    """The data loader stops with an error after this many consecutive groups are filtered."""


@dataclass
class StaleboundConfig:
    """The root of the tree."""

    seed: int = 0
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

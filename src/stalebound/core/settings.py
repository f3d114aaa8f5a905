"""The coordinator's settings, resolved once per data-parallel rank, and the policy they build.

Every default the staleness decisions depend on is decided here: the buffer policy's concurrency
default (:data:`DEFAULT_BATCHES_IN_FLIGHT`), AReaL's capacity fallback (``max_concurrent_rollouts``
unset → ``consumer_batch_size``), the input queue's size. The rollout section of the config is read
duck-typed (any object with its attribute names), so ``core`` imports nothing from the rest of
the project; the AReaL spelling of the bound (``max_head_offpolicyness``) is read at this edge only
and is called ``staleness`` from here on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stalebound.core.buffer import StalenessBuffer
from stalebound.core.capacity import CapacityCounter
from stalebound.core.checks import is_int
from stalebound.core.deadline import (
    DEFAULT_CONTINUE_MAX,
    DeadlineBoundPolicy,
    deadline_bounds,
    default_margin,
)
from stalebound.core.errors import ConfigError
from stalebound.core.filters import GroupPostProcess, get_group_post_process
from stalebound.core.policy import BufferPolicy, CapacityPolicy, StalenessPolicy

__all__ = [
    "DEFAULT_BATCHES_IN_FLIGHT",
    "CoordinatorSettings",
    "build_policy",
    "default_max_concurrent",
    "resolve_settings",
]

DEFAULT_BATCHES_IN_FLIGHT = 8
"""Without ``max_concurrent_rollouts``, the buffer policy lets at most this many batches (``8·B′``
groups) generate at once, however large the bound is. The window allows ``(staleness + 1)·B′``,
but beyond a few batches admission only floods the engines: with a bound of 1000 it would launch
1001 batches at once, and the first step would wait for the last of them (its head buffer is
reserved last). Set ``max_concurrent_rollouts`` to go beyond it."""


@dataclass(frozen=True)
class CoordinatorSettings:
    """Everything the coordinator decides with, per data-parallel rank."""

    policy: str
    """``buffer``, ``capacity`` or ``deadline``."""
    staleness: int
    """The bound η (under ``deadline``, the hard bound η_h)."""
    batch_size: int
    buffer_size: int
    group_size: int
    group_redundancy: int
    max_concurrent: int
    queue_size: int
    request_timeout: float | None
    max_failures: int
    threshold: int
    """The proactive filter's: act on a STUCK head with at most this many reservations."""
    max_retries: int
    """The proactive filter's ``retry``: how often one item may be retried."""
    drop_stale: bool = False
    proactive: str = "null"
    stuck_timeout: float | None = None
    post_process: GroupPostProcess | None = None
    post_process_name: str = ""
    metric: str = "score"
    max_filtered: int = 256
    watchdog: float | None = None
    progress_log: float | None = None
    max_relaunches: int | None = None
    """Relaunches of failed members per group; ``None``: up to N (the group tracker's default)."""
    soft_staleness: int | None = None
    """``deadline`` only: the soft admission target η_s (``None``: η_h // 2)."""
    deadline_slack: int = 0
    """``deadline`` only: entries per buffer beyond B′ (B′ + slack in all)."""
    deadline_action: str = "truncate"
    """``deadline`` only: ``truncate``, ``abort`` or ``continue`` a group still running at its
    deadline."""
    deadline_continue_max: int = DEFAULT_CONTINUE_MAX
    """``deadline`` only, under ``continue``: how many versions past ``V + η_h`` a group may
    continue before it is truncated."""
    admission_margin: int = 0
    """``deadline`` only: admit only while AReaL's capacity exceeds this many groups."""
    deadline_grace: float | None = None
    """``deadline`` only: seconds the trainer waits for a due group before it is aborted
    (``None``: ``deadline_grace_steps``)."""
    deadline_grace_steps: float | None = None
    """``deadline`` only, when ``deadline_grace`` is ``None``: the wait in training steps (the
    median of the trainer's recent step times; ``None``: waits for the group)."""
    deadline_at: str = "consume"
    """``deadline`` only: act when the trainer asks for the deadline buffer (``consume``) or
    when it becomes the head (``head``)."""

    @property
    def admission_staleness(self) -> int:
        """The η AReaL's capacity arithmetic admits at: the bound, or the deadline policy's η_s."""
        return self.staleness if self.soft_staleness is None else self.soft_staleness

    def cuts_short(self) -> tuple[str, str] | None:
        """The setting that cuts running generations short (it needs the engine's abort) and the
        alternative without it; ``None`` when nothing does."""
        if self.proactive == "truncate":
            return "proactive_filter.method", "method=retry"
        if self.policy == "deadline" and self.deadline_action in ("truncate", "continue"):
            return "deadline.action", "deadline.action=abort"
        return None


def _per_rank(name: str, value: int, dp: int, problems: list[str]) -> int:
    if value % dp:
        problems.append(
            f"rollout.{name}={value}: not divisible by train_data_parallel_size={dp}; each data-"
            f"parallel rank gets an equal share, so choose a multiple of {dp}"
        )
        return max(1, value // dp)
    return value // dp


def _bound(config: Any) -> Any:
    """The bound: ``staleness`` when the section has it, else AReaL's ``max_head_offpolicyness``
    (read here, at the edge, only)."""
    return config.staleness if hasattr(config, "staleness") else config.max_head_offpolicyness


def default_max_concurrent(
    policy: str, staleness: int, soft: int | None, batch: int, buffer_size: int
) -> int:
    """The groups that may generate at once when ``max_concurrent_rollouts`` is null: AReaL's
    fallback, ``consumer_batch_size``, under ``capacity``; otherwise the admission window,
    ``(η + 1)·B′`` (η_s for the deadline policy), at most :data:`DEFAULT_BATCHES_IN_FLIGHT`
    batches."""
    if policy == "capacity":
        return batch
    window = staleness if soft is None else soft
    return min(window + 1, DEFAULT_BATCHES_IN_FLIGHT) * buffer_size


def resolve_settings(
    config: Any, dp: int = 1, *, max_relaunches: int | None = None
) -> CoordinatorSettings:
    """The per-rank settings from a rollout config section: the one builder every driver uses
    (the simulator maps its workload onto a rollout section), so each default is the section's.
    ``max_relaunches``: relaunches of failed members per group (``None``: up to N).

    Each setting's own rules (types, ranges, rules between settings) belong to the section's
    class and are checked where it is loaded or handed over (``RolloutConfig``: at load, and by
    the executor when it starts); here only what needs the data-parallel size or a registry is
    checked, every problem reported at once."""
    if not is_int(dp) or dp < 1:
        raise ConfigError(
            f"train_data_parallel_size={dp!r}: must be an integer ≥ 1 (1 without data parallelism)"
        )
    problems: list[str] = []
    policy = config.staleness_policy
    staleness = _bound(config)
    soft: int | None = None
    dl = getattr(config, "deadline", None)
    if policy == "deadline":  # the bound is the hard one, η_h; the soft target η_s is its own
        soft, staleness = deadline_bounds(getattr(dl, "target", None), staleness)
    batch = _per_rank("consumer_batch_size", config.consumer_batch_size, dp, problems)
    buffer_size = (
        batch
        if config.buffer_size is None
        else _per_rank("buffer_size", config.buffer_size, dp, problems)
    )
    if config.max_concurrent_rollouts is not None:
        concurrent = _per_rank(
            "max_concurrent_rollouts", config.max_concurrent_rollouts, dp, problems
        )
    else:
        concurrent = default_max_concurrent(policy, staleness, soft, batch, buffer_size)
    queue = 16 * concurrent if config.queue_size is None else config.queue_size
    timeout = config.request_timeout
    n = config.group_size
    redundancy = n if config.group_redundancy is None else config.group_redundancy
    pf = config.proactive_filter
    post: GroupPostProcess | None = None
    if config.group_post_process.enable:
        try:
            post = get_group_post_process(config.group_post_process.name)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return CoordinatorSettings(
        policy=policy,
        staleness=staleness,
        batch_size=batch,
        buffer_size=buffer_size,
        group_size=n,
        group_redundancy=redundancy,
        max_concurrent=concurrent,
        queue_size=queue,
        request_timeout=None if timeout is None or timeout == float("inf") else float(timeout),
        max_failures=config.max_consecutive_failures,
        drop_stale=config.reject_stale_results,
        proactive=pf.method,
        threshold=pf.threshold,
        stuck_timeout=pf.stuck_timeout_s,
        max_retries=pf.max_retries,
        post_process=post,
        post_process_name=config.group_post_process.name,
        metric=config.filter_groups.metric,
        max_filtered=config.max_consecutive_filtered,
        watchdog=config.watchdog_timeout_s,
        progress_log=config.progress_log_s,
        soft_staleness=soft,
        max_relaunches=max_relaunches,
        **(
            {}
            if dl is None
            else {
                "deadline_slack": dl.slack,
                "deadline_action": dl.action,
                "deadline_continue_max": dl.continue_max,
                "admission_margin": default_margin(soft or 0) if dl.margin is None else dl.margin,
                "deadline_at": dl.at,
                "deadline_grace": dl.grace_s,
                "deadline_grace_steps": dl.grace_steps,
            }
        ),
    )


def build_policy(
    settings: CoordinatorSettings,
    start_version: int = 0,
    *,
    counter: CapacityCounter | None = None,
) -> StalenessPolicy:
    """The staleness policy the settings name. The capacity policy (and the deadline policy, for
    its admission at η_s) uses ``counter`` when given (an AReaL ``StalenessManager``'s, whose
    limits are then the ones enforced)."""
    s = settings
    if s.policy == "buffer":
        buffer = StalenessBuffer(
            s.batch_size,
            s.staleness,
            group_size=s.group_size,
            buffer_size=s.buffer_size,
            group_redundancy=s.group_redundancy,
            start_version=start_version,
        )
        return BufferPolicy(buffer, max_concurrent=s.max_concurrent)
    if s.policy == "deadline":
        soft, _ = deadline_bounds(s.soft_staleness, s.staleness)
        bounded = StalenessBuffer(
            s.batch_size,
            s.staleness,
            group_size=s.group_size,
            buffer_size=s.buffer_size + s.deadline_slack,
            group_redundancy=s.group_redundancy,
            start_version=start_version,
        )
        admission = counter or CapacityCounter(s.max_concurrent, s.batch_size, soft)
        if start_version:
            admission.version_recovered(start_version)
        return DeadlineBoundPolicy(
            bounded,
            admission,
            action=s.deadline_action,
            margin=s.admission_margin,
            at=s.deadline_at,
            continue_max=s.deadline_continue_max,
        )
    if counter is None:
        counter = CapacityCounter(s.max_concurrent, s.batch_size, s.staleness)
    return CapacityPolicy(counter, drop_stale=s.drop_stale, start_version=start_version)

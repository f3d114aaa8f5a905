"""The core's names: causes, outcomes, timers, verdicts and policy kinds as enums.

Each is a ``str`` enum whose values are the strings checkpoints (``rollout_state.json``), metrics
keys, logs and callers have always used: a member compares and hashes equal to its string (a
counter keyed by one is read with the other), it is written as its string (``str()``, f-strings,
JSON) on every supported Python, and a string read back from an old checkpoint still counts.
"""

from __future__ import annotations

import enum

__all__ = [
    "DEADLINE_ACTIONS",
    "DEADLINE_MOMENTS",
    "OUTCOMES",
    "Cause",
    "DeadlineMoment",
    "GateCall",
    "Name",
    "Outcome",
    "PolicyKind",
    "ProactiveMethod",
    "Timer",
    "Verdict",
]


class Name(str, enum.Enum):
    """A name that is also its string. ``str()`` and ``format()`` give the value on Python 3.10
    too (where a mixed-in enum's ``str()`` is ``Class.MEMBER``)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Cause(Name):
    """Why the coordinator took a member or group away (:class:`~stalebound.core.events.AbortRequest`,
    :class:`~stalebound.core.events.AbortGroup`, the per-cause counters)."""

    SURPLUS = "surplus"
    """Not needed: its group already had N members, or its buffer was consumed without it."""
    RETRIED = "retried"
    """The proactive filter aborted the group to queue its item again."""
    TRUNCATED = "truncated"
    """The proactive filter cut a member short (its output is kept)."""
    ABANDONED = "abandoned"
    """Its group failed: the members still running are stopped."""
    FAILED = "failed"
    FILTERED = "filtered"
    BAD_VERSIONS = "bad_versions"
    """The engine reported token versions outside the group's window: the group failed."""
    DEADLINE = "deadline"
    """The deadline policy truncated or aborted a group still running at its deadline (or at
    the end of its continuation, under ``continue``)."""
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"
    RESUMED = "resumed"
    """Running when a checkpoint was taken: aborted on resume and dispatched again."""


class Outcome(Name):
    """How an item ended without being trained (:class:`~stalebound.core.events.ReportDrop`)."""

    FILTERED = "filtered"
    FAILED = "failed"
    DROPPED = "dropped"
    SURPLUS = "surplus"
    STOPPED = "stopped"
    DEADLINE = "deadline"


OUTCOMES = tuple(Outcome)
"""Every :class:`Outcome`, in order."""


class Timer(Name):
    """The coordinator's timers (:class:`~stalebound.core.events.ArmTimer`)."""

    STUCK = "stuck"
    """The proactive filter's: the head buffer has been STUCK for ``stuck_timeout_s``."""
    WATCHDOG = "watchdog"
    """The watchdog's: a group may have produced nothing for ``watchdog_timeout_s``."""
    DEADLINE = "deadline"
    """The deadline grace: the trainer has waited ``deadline.grace_s`` for a due group."""


class Verdict(Name):
    """What happens to a group: a filter's judgement of a completed one, or what a decider (the
    proactive filter, a deadline policy) does with a running one."""

    KEEP = "keep"
    FILTER = "filter"
    """Dropped by a filter (``should_accept_fn``, a group post-processor)."""
    FAIL = "fail"
    """A filter raised: the group failed."""
    STOP = "stop"
    """A filter cannot judge any group (a metric the trajectories lack): the run stops."""
    TRUNCATE = "truncate"
    ABORT = "abort"
    RETRY = "retry"
    CONTINUE = "continue"
    """The deadline action that lets a due group keep generating (token-level bound)."""


DEADLINE_ACTIONS = (Verdict.TRUNCATE, Verdict.ABORT, Verdict.CONTINUE)
"""What a deadline policy may do to a group still running at its deadline."""


class DeadlineMoment(Name):
    """When the deadline policy acts on a due group."""

    CONSUME = "consume"
    """When the trainer asks for the deadline buffer."""
    HEAD = "head"
    """When the deadline buffer becomes the head, one step earlier."""


DEADLINE_MOMENTS = tuple(DeadlineMoment)


class PolicyKind(Name):
    """Which staleness policy decides (``rollout.staleness_policy``)."""

    BUFFER = "buffer"
    CAPACITY = "capacity"
    DEADLINE = "deadline"


class ProactiveMethod(Name):
    """``rollout.proactive_filter.method``."""

    NULL = "null"
    RETRY = "retry"
    TRUNCATE = "truncate"


class GateCall(Name):
    """An outside admission gate's lifecycle callback (AReaL's ``StalenessManager``), named as
    the method the driver calls (:class:`~stalebound.core.events.NotifyGate`)."""

    ENQUEUED = "on_rollout_enqueued"
    SUBMITTED = "on_rollout_submitted"
    ACCEPTED = "on_rollout_accepted"
    REJECTED = "on_rollout_rejected"

"""What the executor tells people: log lines for the coordinator's reports, the statistics
snapshot, the trajectories of a handed-over batch. Pure formatting; nothing here decides."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from stalebound.core import Coordinator, ProtocolError, RolloutStat
from stalebound.core import events as ev
from stalebound.core.deadline import stale_tokens
from stalebound.core.filters import buffer_progress
from stalebound.runtime.episodes import mask_tokens
from stalebound.runtime.results import ExecutorStatistics, Trajectory

__all__ = [
    "describe",
    "log_report",
    "progress_line",
    "statistics",
    "trajectories",
]

logger = logging.getLogger("stalebound.runtime.executor")  # the executor's log, as before


def trajectories(batch: ev.HandOverBatch) -> Iterator[tuple[int, tuple[Trajectory, ...]]]:
    """Each handed-over group's sample index and its trajectories, in order. A continued group's
    tokens staler than the bound (:func:`~stalebound.core.deadline.stale_tokens`) leave its
    trajectories' loss here, so every caller of the executor trains within the bound."""
    v, continued, oldest = batch.version, batch.continued, batch.oldest_token
    for g in batch.groups:
        gid, sample = g.group_id, g.sample
        on = gid in continued
        yield (
            sample,
            tuple(
                [
                    Trajectory(
                        result,
                        gid,
                        member[1],
                        version,
                        v,
                        v - version,
                        tv,
                        cut,
                        sample,
                        on,
                        _mask_stale(result, tv, oldest) if on and oldest is not None else 0,
                    )
                    for (member, version, result), tv, cut in g.members
                ]
            ),
        )


def _mask_stale(result: Any, tv: tuple[int, ...] | None, oldest: int) -> int:
    if tv is None:  # the engine told no token versions: the whole answer is from V
        raise ProtocolError(
            "a continued trajectory reports no token versions: rollout.deadline.action=continue "
            "masks the tokens staler than the bound by the version that generated each, so "
            "return token_versions (or versions) from the workflow, or use "
            "rollout.deadline.action=truncate"
        )
    return mask_tokens(result, stale_tokens(tv, oldest), len(tv))


def log_report(
    action: ev.ReportFailure | ev.ReportStall | ev.Retry | ev.AbortGroup,
    engine: Any,
    requests: list[Any],
) -> None:
    """Log one of the coordinator's reports (``requests``: the group's engine requests)."""
    if isinstance(action, ev.ReportFailure):
        logger.warning("%s", action.why)
    elif isinstance(action, ev.ReportStall):
        logger.warning(
            "watchdog: group %d (V=%d, training version %d) has produced nothing for %.3g s; "
            "members %s running on %s, engine requests in flight %s",
            action.group_id,
            action.version,
            action.training_version,
            action.silent_for,
            list(action.members),
            type(engine).__name__,
            requests,
        )
    elif isinstance(action, ev.Retry):
        logger.info(
            "proactive filter: the head buffer is STUCK; retrying group %d (item %d, retry %d)",
            action.group_id,
            action.sample,
            action.retries,
        )
    else:
        logger.debug("group %d left the policy: %s", action.group_id, action.cause)


def progress_line(coord: Coordinator) -> str | None:
    """One line on the buffers' progress, or ``None`` while nothing runs."""
    if not coord.running_groups:
        return None
    running = f"{coord.running_groups} groups ({coord.running_members} members) running"
    if coord.buffer is not None:
        return f"buffers {buffer_progress(coord.buffer)}; {running}"
    p = coord.policy_statistics()
    return f"policy {p.policy} version {p.version}: {p.waiting} waiting; {running}"


def describe(coord: Coordinator, generation: int, queued: int) -> str:
    """Where the policy stands, for a timed-out wait: with a hint when the engine lags."""
    p = coord.policy_statistics()
    hint = ""
    if generation < p.version:
        hint = (
            f"; new groups are generated at version {generation}, behind the training version "
            f"{p.version}: after publishing weights, call set_version({p.version})"
        )
    return (
        f"policy {p.policy} at version {p.version}: {p.running} running, {p.waiting} waiting, "
        f"{queued} queued, paused={coord.paused}{hint}"
    )


def statistics(
    coord: Coordinator,
    *,
    now: float,
    manager: RolloutStat | None,
    generation: int,
    stopped: str | None,
    queued: int,
    waiting: int,
    wakeups: int,
    aborted_requests: Mapping[str, int],
    aborted_tokens: Mapping[str, int],
) -> ExecutorStatistics:
    """The executor's snapshot: the coordinator's counters by name, and the driver's."""
    counts = coord.counts
    counted: dict[str, Any] = {**counts.totals(), **counts.by_cause()}
    stuck = coord.stuck_seconds(now)
    return ExecutorStatistics(
        policy=coord.policy_statistics(),
        manager=manager,
        version=coord.version,
        generation_version=generation,
        paused=coord.paused,
        stopped=stopped,
        queued=queued,
        submitted=counts.dispatched_groups + queued,
        running_groups=coord.running_groups,
        running_members=coord.running_members,
        aborted_requests=MappingProxyType(dict(aborted_requests)),
        aborted_tokens=MappingProxyType(dict(aborted_tokens)),
        stuck_seconds=sum(stuck.values()),
        stuck_seconds_by_buffer=MappingProxyType(stuck),
        waiting_groups=waiting,
        dispatch_wakeups=wakeups,
        **counted,
    )

"""The executor's state dict: what a restarted executor needs to continue exactly where one was.

:meth:`WorkflowExecutor.state_dict` is taken in one hop on the loop thread, so it is consistent:
the policy's snapshot (the buffers' reservations, and the completed groups with their results),
the items of the groups running now and of the input queue (data and retry counts), the consumed
groups not yet handed out, the data loader's position, the outcomes not yet drained and every
counter. Running episodes are not interrupted. Workflows and filters are not saved.

:meth:`WorkflowExecutor.load_state_dict`: completed groups go back into their buffers (or the
capacity policy's queue) at their versions; groups that were running are aborted in the policy
(cause ``resumed``, counted as ``resumed_groups``) and their items queued first, to be generated
again from the start at the current version; then the queued items; the next ``prepare_batch``
skips the items its data loader had already yielded. Sample indices, group ids and counters
continue. The training job's checkpoints store the state as JSON data
(:mod:`stalebound.train.statejson`): items and results must then be plain data or the tasks'
``Sample`` / ``Trajectory``.

:func:`build_state` writes it from the coordinator's snapshot and the executor's own queues;
:func:`read_state` checks one and returns its parts (:class:`SavedState`), raising
:class:`ProtocolError` — before anything is changed — for a damaged state or one of another
format or policy. The training job's checkpoints store it as JSON data
(:mod:`stalebound.train.statejson`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stalebound.core import CoordinatorCounts, ProtocolError

__all__ = ["STATE_FORMAT", "SavedState", "build_state", "check_state", "read_state"]

STATE_FORMAT = 1
"""The format of :meth:`WorkflowExecutor.state_dict`; :meth:`~WorkflowExecutor.load_state_dict`
refuses any other."""

# The state's names for the coordinator's per-cause counters, and the counts kept outside
# ``events`` (or not saved at all: a run of failures starts again after a resume).
_BY_CAUSE = ("member_failures", "cancelled_members", "discarded_members")
_NOT_EVENTS = frozenset(
    {"launched_members", "finished_members", "consecutive_failures", "consecutive_filtered"}
)


@dataclass(frozen=True)
class SavedState:
    """A checked executor state, in parts."""

    policy_state: Mapping[str, Any]
    pending: list[tuple[int, Any, int]]
    """``(sample, data, retries)``: the running groups' items first, then the queued ones."""
    running: list[int]
    samples: dict[int, int]
    waiting: list[tuple[Any, ...]]
    loader_position: int
    next_sample: int
    next_group_id: int
    outcomes: list[tuple[int, str]]
    counts: dict[str, int]
    by_cause: dict[str, dict[str, int]]
    dispatch_wakeups: int
    aborted_requests: dict[str, int]
    aborted_tokens: dict[str, int]

    def summary(self, version: int) -> str:
        """One line on what a resume at ``version`` continues with."""
        running, queued = len(self.running), len(self.pending) - len(self.running)
        return (
            f"resumed at version {version}: {len(self.samples)} groups waiting in the policy, "
            f"{running} items to dispatch again, {queued} queued"
        )

    def for_coordinator(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`Coordinator.restore` (but ``accept``)."""
        return {
            "policy_state": self.policy_state,
            "running": self.running,
            "pending": [(i, r) for i, _, r in self.pending],
            "samples": self.samples,
            "next_group_id": self.next_group_id,
            "counts": self.counts,
            "by_cause": self.by_cause,
        }


def build_state(
    snapshot: Mapping[str, Any],
    data_of: Mapping[int, Any],
    *,
    waiting: Iterable[tuple[Any, ...]],
    loader_position: int,
    next_sample: int,
    outcomes: Iterable[tuple[int, str]],
    dispatch_wakeups: int,
    aborted_requests: Mapping[str, int],
    aborted_tokens: Mapping[str, int],
) -> dict[str, Any]:
    """The state dict from a :meth:`Coordinator.snapshot` and the executor's parts; ``data_of``
    gives each pending item's data by its sample index."""
    counts, by_cause = snapshot["counts"], snapshot["by_cause"]
    events = {k: n for k, n in counts.items() if k not in _NOT_EVENTS and n}
    events["dispatch_wakeups"] = dispatch_wakeups
    running = snapshot["running"]
    return {
        "format": STATE_FORMAT,
        "policy": snapshot["policy"],
        "version": snapshot["version"],
        "policy_state": snapshot["policy_state"],
        # in admission order, then the input queue: the order they are dispatched again in
        "pending": [(i, data_of[i], r) for _, i, r in running]
        + [(i, data_of[i], r) for i, r in snapshot["queued"]],
        "running_groups": [gid for gid, _, _ in running],
        "samples": snapshot["samples"],  # of the completed groups the policy holds
        "waiting": list(waiting),
        "loader_position": loader_position,
        "next_sample": next_sample,
        "next_group_id": snapshot["next_group_id"],
        "outcomes": list(outcomes),
        "counters": {
            "events": events,
            **{name: dict(by_cause[name]) for name in _BY_CAUSE},
            "aborted_requests": dict(aborted_requests),
            "aborted_tokens": dict(aborted_tokens),
            "launched_members": counts["launched_members"],
            "finished_members": counts["finished_members"],
        },
    }


def read_state(state: Mapping[str, Any], policy: str) -> SavedState:
    """Check a state dict written under ``policy``; :class:`ProtocolError` if it is not one."""
    try:
        fmt = state["format"]
        if fmt != STATE_FORMAT:
            raise ProtocolError(
                f"load_state_dict(): state format {fmt!r} is not supported (this stalebound "
                f"reads format {STATE_FORMAT}); resume with the version that wrote it"
            )
        if state["policy"] != policy:
            raise ProtocolError(
                f"load_state_dict(): the state was written under "
                f"rollout.staleness_policy={state['policy']!r}, this executor runs "
                f"{policy!r}; resume with the policy it was written with"
            )
        c = state["counters"]
        events = _causes(c["events"])
        wakeups = events.pop("dispatch_wakeups", 0)
        counts = {**events, "launched_members": int(c["launched_members"])}
        counts["finished_members"] = int(c["finished_members"])
        known = set(CoordinatorCounts().totals())
        if not set(counts) <= known:
            raise ValueError(f"unknown counters {sorted(set(counts) - known)}")
        return SavedState(
            policy_state=state["policy_state"],
            pending=[(int(i), data, int(r)) for i, data, r in state["pending"]],
            running=[int(gid) for gid in state["running_groups"]],
            samples={int(gid): int(i) for gid, i in state["samples"].items()},
            waiting=[tuple(t) for t in state["waiting"]],
            loader_position=int(state["loader_position"]),
            next_sample=int(state["next_sample"]),
            next_group_id=int(state["next_group_id"]),
            outcomes=[(int(i), str(o)) for i, o in state["outcomes"]],
            counts=counts,
            by_cause={name: _causes(c[name]) for name in _BY_CAUSE},
            dispatch_wakeups=wakeups,
            aborted_requests=_causes(c["aborted_requests"]),
            aborted_tokens=_causes(c["aborted_tokens"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ProtocolError(
            f"load_state_dict(): the state is damaged or not an executor state "
            f"({type(exc).__name__}: {exc}); load one written by state_dict()"
        ) from exc


def check_state(state: Mapping[str, Any], config: Any, version: int) -> SavedState:
    """Check that an executor built from the rollout section ``config`` at ``version`` would load
    ``state``: it is restored into a coordinator of its own, which is then thrown away (the
    coordinator is pure, so nothing else is touched). :class:`ProtocolError` when it would not."""
    from stalebound.core import Coordinator, StaleboundError, build_policy, resolve_settings

    settings = resolve_settings(config)
    coordinator = Coordinator(build_policy(settings, version), settings)
    saved = read_state(state, coordinator.policy.name)
    try:
        coordinator.restore(**saved.for_coordinator())
    except ProtocolError:
        raise
    except (StaleboundError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ProtocolError(
            f"load_state_dict(): the state is damaged ({type(exc).__name__}: {exc}); load one "
            "written by state_dict()"
        ) from exc
    return saved


def _causes(counts: Mapping[Any, Any]) -> dict[str, int]:
    return {str(k): int(n) for k, n in counts.items()}

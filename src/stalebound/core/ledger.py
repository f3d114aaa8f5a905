"""The coordinator's ledger: every admitted group from its admission to its end.

It holds the items waiting for admission, the groups running (and those whose filters the driver
is running), each group's life state (through :data:`~stalebound.core.GROUP_TRANSITIONS`), their
members (:class:`~stalebound.core.GroupTracker`) and every counter. A group that leaves without
being trained leaves through one path, :meth:`Ledger.teardown`: its running members are cancelled,
its slot in the policy released, the cause counted once, its life ended through the table (and the
item reported), every decider told to forget it and the admission gate notified.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import suppress
from typing import Any, Protocol, runtime_checkable

from stalebound.core.buffer import ConsumedBatch
from stalebound.core.counts import CoordinatorCounts
from stalebound.core.errors import InvariantError, ProtocolError, StaleboundError
from stalebound.core.events import (
    AbortGroup,
    AbortRequest,
    Action,
    EvaluateGroup,
    HandedGroup,
    HandedMember,
    HandOverBatch,
    LaunchMember,
    MemberFailed,
    MemberFinished,
    MemberLaunched,
    MemberProgress,
    NotifyGate,
    ReportDrop,
    ReportFailure,
    StartGroup,
    Submitted,
    TruncateMember,
)
from stalebound.core.groups import GroupComplete, GroupTracker, MemberId, Relaunch
from stalebound.core.names import Cause, GateCall, Outcome
from stalebound.core.policy import StalenessPolicy
from stalebound.core.transitions import GROUP_TRANSITIONS, GroupOp, GroupState, compile_table, move

__all__ = ["Accept", "AdmissionGate", "Decider", "GroupRun", "Ledger", "group_move"]

Accept = Callable[[list[Any]], bool]

# The group transition table compiled to indices (the hot paths look moves up without hashing
# enums); the ledger holds each group's state as an index into _STATES.
_STATES = tuple(GroupState)
_OPS = tuple(GroupOp)
_NEXT = compile_table(GROUP_TRANSITIONS, _STATES, _OPS)
QUEUED, COMPLETED = _STATES.index(GroupState.QUEUED), _STATES.index(GroupState.COMPLETED)
OP = {op: _OPS.index(op) for op in GroupOp}
"""Each operation's index."""

# What a cause reports the item as (ReportDrop); ``None``: the item goes on (queued again, or
# the whole state is being torn down).
_OUTCOME: dict[str, Outcome | None] = {
    Cause.RETRIED: None,
    Cause.RESUMED: None,
    Cause.SHUTDOWN: None,
    Cause.BAD_VERSIONS: Outcome.FAILED,
    **{o.value: o for o in Outcome},
}

_NOTICES = {call: NotifyGate(call) for call in GateCall}


def group_move(
    state: int, op: int, gid: Hashable, error: type[StaleboundError] = ProtocolError
) -> int:
    """A group's next state (indices); a move not in GROUP_TRANSITIONS raises ``error``."""
    new = _NEXT[state][op]
    if new < 0:
        move(GROUP_TRANSITIONS, _STATES[state], _OPS[op], gid, error=error)
    return new


@runtime_checkable
class AdmissionGate(Protocol):
    """An outside admission gate driven through AReaL's lifecycle callbacks (a user's
    ``StalenessManager`` in front of the buffer policy): a ledger built with ``gated=True`` names
    each call in a :class:`NotifyGate` action for the driver to make. Its capacity reaches the
    coordinator as :attr:`~stalebound.core.events.Dispatch.budget`."""

    def on_rollout_enqueued(self) -> None: ...
    def on_rollout_submitted(self) -> None: ...
    def on_rollout_accepted(self) -> None: ...
    def on_rollout_rejected(self) -> None: ...


class Decider(Protocol):
    """What every decider with a per-group state hears of a group's life."""

    def started(self, gid: Hashable, now: float, out: list[Action]) -> None: ...

    def forget(self, gid: Hashable) -> None: ...


class GroupRun:
    """A group the coordinator admitted and has not yet handed to the policy (or settled)."""

    __slots__ = (
        "accept",
        "continued",
        "gid",
        "progress",
        "retries",
        "sample",
        "truncated",
        "truncating",
        "version",
        "versions",
    )

    def __init__(
        self, gid: int, sample: int, accept: Accept | None, retries: int, version: int, now: float
    ) -> None:
        self.gid = gid
        self.sample = sample
        self.accept = accept
        self.retries = retries
        self.version = version
        self.progress = now  # when it last produced something (the watchdog's clock)
        self.truncating = False
        self.continued = False  # the deadline action continue moved its deadline on
        self.truncated: set[int] | None = None  # member numbers cut short
        self.versions: dict[int, tuple[int, ...]] | None = None  # per-token versions by member


class Ledger:
    """The admitted groups and how each one ends (see the module docstring)."""

    def __init__(
        self,
        policy: StalenessPolicy,
        tracker: GroupTracker,
        *,
        gated: bool = False,
        deciders: Sequence[Decider] = (),
    ) -> None:
        self.policy = policy
        self.tracker = tracker
        self.counts = CoordinatorCounts()
        self.gated = gated
        self.deciders = tuple(deciders)
        self.queue: deque[tuple[int, Accept | None, int]] = deque()  # (sample, accept, retries)
        self.groups: dict[int, GroupRun] = {}  # running, in admission order
        self.judging: dict[int, tuple[GroupRun, GroupComplete]] = {}  # filters being run
        # running and completed groups, until they end: group id → (state index, sample index)
        self.life: dict[int, tuple[int, int]] = {}
        self.next_gid = 0

    def notify(self, call: GateCall, out: list[Action]) -> None:
        if self.gated:
            out.append(_NOTICES[call])

    def start(
        self,
        gid: int,
        item: tuple[int, Accept | None, int],
        version: int,
        buffer_version: int | None,
        now: float,
        out: list[Action],
    ) -> None:
        """Admit the queued ``item`` as group ``gid`` and launch its members."""
        sample, accept, retries = item
        self.groups[gid] = GroupRun(gid, sample, accept, retries, version, now)
        self.life[gid] = (group_move(QUEUED, OP[GroupOp.ADMIT], gid), sample)
        for d in self.deciders:
            d.started(gid, now, out)
        if self.gated:
            out.append(_NOTICES[GateCall.ENQUEUED])
            out.append(_NOTICES[GateCall.SUBMITTED])
        out.append(StartGroup(gid, sample, version, buffer_version))
        members = self.tracker.start(gid, version)
        self.counts.launched_members += len(members)
        out.extend([LaunchMember(m, version) for m in members])

    # ------------------------------------------------------------------ members

    def submitted(self, e: Submitted) -> list[Action]:
        """An item is queued for admission, at the back."""
        self.queue.append((e.sample, e.accept, e.retries))
        return []

    def progressed(self, e: MemberProgress | MemberLaunched) -> list[Action]:
        """A member produced something: its group is alive (the watchdog's clock)."""
        g = self.groups.get(e.member[0])  # type: ignore[call-overload]
        if g is not None:
            g.progress = e.now
        return []

    def running(self, ev: MemberFinished | MemberFailed) -> GroupRun:
        g: GroupRun | None = self.groups.get(ev.member[0])  # type: ignore[call-overload]
        if g is None:
            raise ProtocolError(
                f"{type(ev).__name__}(member={ev.member!r}): no such group running (never "
                "started, or already settled; a member aborted on purpose sends no event)"
            )
        return g

    def finished(
        self, ev: MemberFinished, out: list[Action]
    ) -> tuple[GroupRun, GroupComplete] | None:
        """A member returned; at the N-th the group is complete (its surplus members aborted)."""
        member = ev.member
        g = self.running(ev)
        done = self.tracker.finish(member, ev.result)
        self.counts.finished_members += 1
        g.progress = ev.now
        if ev.versions is not None:
            if g.versions is None:
                g.versions = {}
            g.versions[member[1]] = ev.versions
        if done is None:
            return None
        self.groups.pop(g.gid)
        self.abort_members(done.surplus, Cause.SURPLUS, out)
        return g, done

    def failed(self, ev: MemberFailed, out: list[Action]) -> tuple[GroupRun, str] | None:
        """A member failed: relaunched while N is reachable; else the group has failed (its
        members still running are abandoned) and why is returned."""
        g, c = self.running(ev), self.counts
        outcome = self.tracker.fail(ev.member, ev.cause, version=ev.version)
        c.member_failures[ev.cause] += 1
        if outcome is None:
            return None
        if isinstance(outcome, Relaunch):
            c.relaunched_members += 1
            c.launched_members += 1
            out.append(LaunchMember(outcome.member, outcome.version, relaunch=True))
            if g.truncating:  # a relaunch of a group being truncated: cut it short too
                self.mark_truncated(g, outcome.member.number)
                out.append(TruncateMember(outcome.member))
            return None
        why = f"group {g.gid}: {', '.join(outcome.causes)}"
        if ev.detail:
            why += f" (last: {ev.detail})"
        out.append(ReportFailure(g.gid, why))
        self.groups.pop(g.gid)
        self.abort_members(outcome.surplus, Cause.ABANDONED, out)
        return g, why

    def judge(
        self, g: GroupRun, done: GroupComplete, post_process: Any, name: str, metric: Any
    ) -> EvaluateGroup | None:
        """The action that has a completed group's filters run, or ``None`` when it has none."""
        if g.accept is None and post_process is None:
            return None
        self.judging[g.gid] = (g, done)
        results = tuple([r.result for r in done.members])
        return EvaluateGroup(g.gid, results, g.accept, post_process, name, metric)

    def payload(
        self, g: GroupRun, done: GroupComplete
    ) -> tuple[tuple[HandedMember, ...], set[int] | tuple[()]]:
        """What a completed group stores in the policy (its members, their token versions and
        whether each was truncated), and the versions its segments were generated with."""
        versions, truncated = g.versions, g.truncated
        if versions is None and truncated is None:
            return tuple([(r, None, False) for r in done.members]), ()
        vs = versions or {}
        cut = truncated or set()
        payload = tuple([(r, vs.get(n := r.member.number), n in cut) for r in done.members])
        if truncated is not None:
            self.counts.truncated_trajectories += sum(1 for _, _, t in payload if t)
        segments = (
            {v for tv in versions.values() for v in tv if v >= 0} if versions is not None else ()
        )
        return payload, segments

    def completed(self, gid: int) -> None:
        state, sample = self.life[gid]
        self.life[gid] = (group_move(state, OP[GroupOp.COMPLETE], gid), sample)
        self.counts.completed_groups += 1

    def consumed(self, batch: ConsumedBatch, out: list[Action]) -> HandOverBatch:
        """A batch was consumed: its surplus reservations are torn down, its dropped groups end,
        its groups are handed over."""
        c, life = self.counts, self.life
        for gid in batch.aborted:  # surplus reservations of the consumed buffer
            self.teardown(gid, GroupOp.SURPLUS, Cause.SURPLUS, out, in_policy=False)  # type: ignore[arg-type]
            c.surplus_groups += 1
        for gid in batch.dropped:
            if gid in life:  # not counted yet (the capacity policy counts at once)
                c.dropped_groups += 1
                self.end(gid, GroupOp.DROP, "dropped", out)
        c.consumed_batches += 1
        handed = []
        n = 0
        for g in batch.groups:
            gid = g.group_id
            state, sample = life.pop(gid, (QUEUED, -1))  # type: ignore[call-overload]
            group_move(state, OP[GroupOp.CONSUME], gid, InvariantError)
            members: tuple[HandedMember, ...] = g.payload
            handed.append(HandedGroup(gid, sample, g.version, members))  # type: ignore[arg-type]
            n += len(members)
        c.consumed_groups += len(batch.groups)
        c.consumed_trajectories += n
        return HandOverBatch(
            batch.version,
            tuple(handed),
            batch.continued,  # type: ignore[arg-type]
            batch.oldest_token,
        )

    def teardown(
        self, gid: int, op: GroupOp, cause: Cause, out: list[Action], *, in_policy: bool = True
    ) -> None:
        """The one way a group leaves untrained (see the module docstring). ``in_policy``:
        its slot is still the policy's (not when a consume already aborted it)."""
        self.groups.pop(gid, None)
        self.judging.pop(gid, None)
        tracker = self.tracker
        if gid in tracker:  # still generating: its finished members are thrown away
            self.counts.discarded_members[cause] += len(tracker.partial(gid))
            self.abort_members(tracker.cancel(gid), cause, out)
        if in_policy:
            if op is GroupOp.STOP or op is GroupOp.SHUTDOWN:
                with suppress(ProtocolError):  # already out of the policy
                    self.policy.abort(gid, cause)
            else:
                self.policy.abort(gid, cause)
        self.end(gid, op, cause, out)
        for d in self.deciders:
            d.forget(gid)
        self.notify(GateCall.REJECTED, out)
        out.append(AbortGroup(gid, cause))

    def end(self, gid: int, op: GroupOp, cause: str, out: list[Action]) -> None:
        """A group's life ends (through the transition table); report its item if untrained."""
        life = self.life.pop(gid, None)
        if life is None:
            return
        state, sample = life
        group_move(state, OP[op], gid)
        outcome = _OUTCOME.get(cause, Outcome.FAILED)
        if outcome is not None:
            out.append(ReportDrop(gid, sample, outcome))

    def abort_members(self, members: Sequence[MemberId], cause: Cause, out: list[Action]) -> None:
        for m in members:
            self.counts.cancelled_members[cause] += 1
            out.append(AbortRequest(m, cause))

    def continued(self, g: GroupRun) -> None:
        """The deadline action ``continue`` moved a running group's deadline on (it keeps
        generating): counted once per group, and once per move."""
        self.counts.continued_groups += not g.continued
        self.counts.continuations += 1
        g.continued = True

    def truncate(self, g: GroupRun, cause: Cause, out: list[Action]) -> None:
        """Cut the group's running members short: they return their partial outputs."""
        g.truncating = True
        for m in self.tracker.running(g.gid):
            self.mark_truncated(g, m.number)
            out.append(TruncateMember(m, cause))

    @staticmethod
    def mark_truncated(g: GroupRun, number: int) -> None:
        if g.truncated is None:
            g.truncated = set()
        g.truncated.add(number)

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self) -> dict[str, Any]:
        """The state as plain data (the policy's snapshot included). Running groups (and those
        being judged) are listed with their items; they cannot be resumed mid-generation."""
        running = sorted(
            [(gid, g.sample, g.retries) for gid, g in self.groups.items()]
            + [(gid, g.sample, g.retries) for gid, (g, _) in self.judging.items()]
        )
        ongoing = set(self.groups) | set(self.judging)
        return {
            "policy": self.policy.name,
            "version": self.policy.version,
            "policy_state": self.policy.snapshot(),
            "running": running,
            "queued": [(sample, retries) for sample, _, retries in self.queue],
            "samples": {g: i for g, (_, i) in self.life.items() if g not in ongoing},
            "next_group_id": self.next_gid,
            "counts": self.counts.totals(),
            "by_cause": {k: dict(v) for k, v in self.counts.by_cause().items()},
        }

    def restore(
        self,
        *,
        policy_state: Mapping[str, Any],
        running: Sequence[int],
        pending: Sequence[tuple[int, int]],
        samples: Mapping[int, int],
        next_group_id: int,
        counts: Mapping[str, int],
        by_cause: Mapping[str, Mapping[str, int]],
        accept: Accept | None = None,
    ) -> None:
        """Continue from saved state (:meth:`snapshot`'s parts, and the ``accept`` of the items
        queued again): the policy's snapshot is loaded, the groups that were ``running`` are
        aborted in it (cause ``resumed``) and the ``pending`` items ``(sample, retries)`` queued
        (the running ones first). Raises :class:`ProtocolError` (nothing changed) if it has
        already taken work or the state is damaged."""
        if self.next_gid or self.groups or self.queue or self.life:
            raise ProtocolError(
                "load_state_dict(): the executor has already taken work; load the state right "
                "after initialize(), before submit() or prepare_batch()"
            )
        try:
            restored = CoordinatorCounts.restored(counts, by_cause)
        except ValueError as e:
            raise ProtocolError(
                f"load_state_dict(): {e}; load a state written by state_dict()"
            ) from None
        self.policy.load_snapshot(policy_state)
        for gid in running:  # their episodes died with the old process: run them again
            if self.policy.is_running(gid):
                self.policy.abort(gid, Cause.RESUMED)
        restored.resumed_groups += len(running)
        self._replace_counts(restored)
        self.life = {int(g): (COMPLETED, int(i)) for g, i in samples.items()}
        self.next_gid = int(next_group_id)
        for sample, retries in pending:
            self.queue.append((int(sample), accept, int(retries)))

    def _replace_counts(self, counts: CoordinatorCounts) -> None:
        """The deciders that count hold this record: change its fields, not the record."""
        for name, value in vars(counts).items():
            setattr(self.counts, name, value)

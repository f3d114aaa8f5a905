"""Group sampling with group-level redundancy: launch N′ members, complete at N.

One reserved buffer entry holds one group. The driver launches N′ ≥ N members for it; the group is
complete as soon as N members have finished, and the N′ − N still running are surplus, returned so
the driver can abort them. A failed member is relaunched while the group can still reach N (up to
``max_relaunches`` times per group); otherwise the group has failed and its entry must be aborted.

Pure bookkeeping: the tracker never talks to engines, it says what the driver must do.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

from stalebound.core.checks import check_version, is_int
from stalebound.core.errors import ConfigError, ProtocolError

__all__ = ["GroupComplete", "GroupFailed", "GroupTracker", "MemberId", "MemberResult", "Relaunch"]


class MemberId(NamedTuple):
    """One trajectory of a group: the group's id and the member's launch index."""

    group_id: Hashable
    number: int


class MemberResult(NamedTuple):
    """A finished member: its id, its V_traj (version at its launch) and the driver's result."""

    member: MemberId
    version: int
    result: Any


@dataclass(frozen=True, slots=True)
class GroupComplete:
    """N members finished: ``members`` in finish order; ``surplus`` must be aborted."""

    group_id: Hashable
    members: tuple[MemberResult, ...]
    surplus: tuple[MemberId, ...]


@dataclass(frozen=True, slots=True)
class GroupFailed:
    """The group can no longer reach N: abort its entry and the ``surplus`` members still running."""

    group_id: Hashable
    causes: tuple[str, ...]
    surplus: tuple[MemberId, ...]


@dataclass(frozen=True, slots=True)
class Relaunch:
    """Launch ``member`` (a fresh index of the same group) at ``version``."""

    member: MemberId
    version: int


class _GroupMembers:
    __slots__ = ("causes", "finished", "next_index", "relaunches", "running")

    def __init__(self) -> None:
        self.running: dict[int, int] = {}  # member index -> V_traj
        self.finished: list[MemberResult] = []
        self.causes: list[str] = []
        self.relaunches = 0
        self.next_index = 0


class GroupTracker:
    """Tracks the members of every group in flight."""

    def __init__(
        self,
        group_size: int,
        group_redundancy: int | None = None,
        *,
        max_relaunches: int | None = None,
    ) -> None:
        problems = []
        if not is_int(group_size) or group_size < 1:
            problems.append(f"group_size={group_size!r}: must be an integer ≥ 1")
        redundancy = group_size if group_redundancy is None else group_redundancy
        if group_redundancy is not None and (
            not is_int(redundancy) or (is_int(group_size) and redundancy < group_size)
        ):
            problems.append(
                f"group_redundancy={group_redundancy!r}: must be an integer ≥ group_size="
                f"{group_size!r}; use None for no group-level redundancy"
            )
        relaunches = group_size if max_relaunches is None else max_relaunches
        if max_relaunches is not None and (not is_int(relaunches) or relaunches < 0):
            problems.append(f"max_relaunches={max_relaunches!r}: must be an integer ≥ 0")
        if problems:
            raise ConfigError(problems)
        self.group_size = group_size
        self.group_redundancy = redundancy
        self.max_relaunches = relaunches
        self._groups: dict[Hashable, _GroupMembers] = {}

    def __contains__(self, group_id: object) -> bool:
        try:
            return group_id in self._groups
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._groups)

    def start(self, group_id: Hashable, version: int) -> tuple[MemberId, ...]:
        """Begin a group at ``version``; returns the N′ members to launch."""
        check_version("start", version)
        try:
            running = group_id in self._groups
        except TypeError:
            raise ProtocolError(
                f"start(group_id={group_id!r}): group ids must be hashable"
            ) from None
        if running:
            raise ProtocolError(f"start(group_id={group_id!r}): the group is already running")
        g = _GroupMembers()
        self._groups[group_id] = g
        return tuple([self._launch(group_id, g, version) for _ in range(self.group_redundancy)])

    def running_members(self) -> int:
        """Members running now, over every group in flight."""
        return sum(len(g.running) for g in self._groups.values())

    def running(self, group_id: Hashable) -> tuple[MemberId, ...]:
        """Members of a group still running."""
        return tuple(MemberId(group_id, i) for i in self._group("running", group_id).running)

    def finish(self, member: MemberId, result: Any = None) -> GroupComplete | None:
        """A member finished; returns :class:`GroupComplete` when it is the N-th."""
        if type(member) is not MemberId:  # the ids start() returns need no conversion
            member = _member("finish", member)
        group_id, number = member  # unpacked: cheaper than the named fields, once per trajectory
        try:  # the common case without a call; any doubt goes through the checks below
            g = self._groups[group_id]
            if type(number) is not int:
                raise KeyError(number)
            version = g.running.pop(number)
        except (KeyError, TypeError):
            g = self._group("finish", group_id)
            version = self._pop_running("finish", g, member)
        finished = g.finished
        finished.append(MemberResult(member, version, result))
        if len(finished) < self.group_size:
            return None
        del self._groups[group_id]
        surplus = tuple([MemberId(group_id, i) for i in g.running])
        return GroupComplete(group_id, tuple(finished), surplus)

    def fail(
        self, member: MemberId, cause: str = "failed", *, version: int
    ) -> Relaunch | GroupFailed | None:
        """A member failed. ``version`` is the current version, for a relaunched member's V_traj.

        Returns ``None`` when the members still running can reach N, a :class:`Relaunch` when one
        more member is needed and allowed, else :class:`GroupFailed`.
        """
        member = _member("fail", member)
        g = self._group("fail", member.group_id)
        check_version("fail", version)
        if not isinstance(cause, str) or not cause:
            raise ProtocolError(
                f"fail(member={member!r}, cause={cause!r}): the cause must be a non-empty string "
                "such as 'failed' or 'timeout'"
            )
        self._pop_running("fail", g, member)
        g.causes.append(cause)
        if len(g.finished) + len(g.running) >= self.group_size:
            return None
        if g.relaunches < self.max_relaunches:
            g.relaunches += 1
            return Relaunch(self._launch(member.group_id, g, version), version)
        del self._groups[member.group_id]
        surplus = tuple(MemberId(member.group_id, i) for i in g.running)
        return GroupFailed(member.group_id, tuple(g.causes), surplus)

    def cancel(self, group_id: Hashable) -> tuple[MemberId, ...]:
        """Forget a group (aborted from outside); returns its members still running."""
        g = self._group("cancel", group_id)
        del self._groups[group_id]
        return tuple(MemberId(group_id, i) for i in g.running)

    def partial(self, group_id: Hashable) -> tuple[MemberResult, ...]:
        """Members of a running group that have already finished."""
        return tuple(self._group("partial", group_id).finished)

    def _launch(self, group_id: Hashable, g: _GroupMembers, version: int) -> MemberId:
        index = g.next_index
        g.next_index += 1
        g.running[index] = version
        return MemberId(group_id, index)

    def _group(self, op: str, group_id: Hashable) -> _GroupMembers:
        try:
            g = self._groups.get(group_id)
        except TypeError:  # unhashable: never started
            g = None
        if g is None:
            raise ProtocolError(
                f"{op}(group_id={group_id!r}): no such group running (never started, or already "
                "complete, failed or cancelled)"
            )
        return g

    def _pop_running(self, op: str, g: _GroupMembers, member: MemberId) -> int:
        number = member.number
        if not is_int(number) or number not in g.running:
            raise ProtocolError(
                f"{op}(member={member!r}): the member is not running (never launched, or already "
                "finished or failed)"
            )
        return g.running.pop(number)


def _member(op: str, member: object) -> MemberId:
    """``member`` as a :class:`MemberId`, refusing anything that is not a pair."""
    if not isinstance(member, tuple) or len(member) != 2:
        raise ProtocolError(
            f"{op}(member={member!r}): not a MemberId; pass one of the ids start() or a "
            "Relaunch returned"
        )
    return MemberId(*member)

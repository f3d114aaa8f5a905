"""The transition tables: every state change of a buffer entry and of a group's life.

Each table maps ``(state, operation)`` to the next state; :func:`move` is the one function that
looks a move up, and a move that is not in the table raises — :class:`ProtocolError` when a caller
asked for it, :class:`~stalebound.core.InvariantError` when our own bookkeeping did. The docs' state diagrams are
these tables (:func:`describe` prints one).

Entry (one buffer slot, §2 of the design)::

    EMPTY --reserve--> RESERVED --occupy--> OCCUPIED --consume/drop--> EMPTY
                       RESERVED --abort/surplus--> EMPTY,  OCCUPIED --abort--> EMPTY (filters)
                       RESERVED --defer--> RESERVED       (a later buffer; deadline policy)
                       OCCUPIED --replace/pull_forward--> OCCUPIED   (another buffer, same bound)

Group (the coordinator's view of one admitted item)::

    QUEUED --admit--> RUNNING --complete--> COMPLETED --consume--> CONSUMED
                      RUNNING --fail/filter/retry/surplus/stop/shutdown/deadline--> (ended)
                      COMPLETED --drop--> DROPPED
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import TypeVar

from stalebound.core.errors import ProtocolError, StaleboundError

__all__ = [
    "ENTRY_TRANSITIONS",
    "GROUP_TRANSITIONS",
    "EntryOp",
    "EntryState",
    "GroupOp",
    "GroupState",
    "compile_table",
    "describe",
    "move",
]

_S = TypeVar("_S", bound=enum.Enum)
_Op = TypeVar("_Op", bound=enum.Enum)


class EntryOp(enum.Enum):
    """What can happen to a buffer entry."""

    RESERVE = "reserve"
    OCCUPY = "occupy"
    ABORT = "abort"
    SURPLUS = "surplus"
    CONSUME = "consume"
    DROP = "drop"
    REPLACE = "replace"
    PULL_FORWARD = "pull_forward"
    DEFER = "defer"
    EXTEND = "extend"
    """The deadline action ``continue``: a due reservation moves past its deadline."""


class GroupState(enum.Enum):
    """Where an admitted item's group stands."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CONSUMED = "consumed"
    FAILED = "failed"
    FILTERED = "filtered"
    RETRIED = "retried"
    SURPLUS = "surplus"
    DROPPED = "dropped"
    STOPPED = "stopped"
    ABORTED = "aborted"


class GroupOp(enum.Enum):
    """What can happen to a group."""

    ADMIT = "admit"
    COMPLETE = "complete"
    CONSUME = "consume"
    FAIL = "fail"
    FILTER = "filter"
    RETRY = "retry"
    SURPLUS = "surplus"
    DROP = "drop"
    STOP = "stop"
    SHUTDOWN = "shutdown"
    DEADLINE = "deadline"


class EntryState(enum.Enum):
    """The state of one buffer entry (an entry holds one group)."""

    EMPTY = "empty"
    RESERVED = "reserved"
    OCCUPIED = "occupied"


_E = EntryState
ENTRY_TRANSITIONS: Mapping[tuple[EntryState, EntryOp], EntryState] = MappingProxyType(
    {
        (_E.EMPTY, EntryOp.RESERVE): _E.RESERVED,
        (_E.RESERVED, EntryOp.OCCUPY): _E.OCCUPIED,
        (_E.RESERVED, EntryOp.ABORT): _E.EMPTY,
        (_E.RESERVED, EntryOp.SURPLUS): _E.EMPTY,
        (_E.RESERVED, EntryOp.DEFER): _E.RESERVED,
        (_E.RESERVED, EntryOp.EXTEND): _E.RESERVED,
        (_E.OCCUPIED, EntryOp.ABORT): _E.EMPTY,
        (_E.OCCUPIED, EntryOp.CONSUME): _E.EMPTY,
        (_E.OCCUPIED, EntryOp.DROP): _E.EMPTY,
        (_E.OCCUPIED, EntryOp.REPLACE): _E.OCCUPIED,
        (_E.OCCUPIED, EntryOp.PULL_FORWARD): _E.OCCUPIED,
    }
)
"""A buffer entry's moves (§2): every change of an entry's state is one of these."""

_G, _O = GroupState, GroupOp
GROUP_TRANSITIONS: Mapping[tuple[GroupState, GroupOp], GroupState] = MappingProxyType(
    {
        (_G.QUEUED, _O.ADMIT): _G.RUNNING,
        (_G.RUNNING, _O.COMPLETE): _G.COMPLETED,
        (_G.RUNNING, _O.FAIL): _G.FAILED,
        (_G.RUNNING, _O.FILTER): _G.FILTERED,
        (_G.RUNNING, _O.RETRY): _G.RETRIED,
        (_G.RUNNING, _O.SURPLUS): _G.SURPLUS,
        (_G.RUNNING, _O.STOP): _G.STOPPED,
        (_G.RUNNING, _O.SHUTDOWN): _G.STOPPED,
        (_G.RUNNING, _O.DEADLINE): _G.ABORTED,
        (_G.COMPLETED, _O.CONSUME): _G.CONSUMED,
        (_G.COMPLETED, _O.DROP): _G.DROPPED,
    }
)
"""A group's life; every state but QUEUED, RUNNING and COMPLETED is an end."""


def move(
    table: Mapping[tuple[_S, _Op], _S],
    state: _S,
    op: _Op,
    subject: Hashable,
    *,
    error: type[StaleboundError] = ProtocolError,
) -> _S:
    """The state after ``op`` from ``state``; ``error`` (naming ``subject``) if the table has no
    such move. Nothing is changed by a refused move: callers assign the result."""
    try:
        return table[(state, op)]
    except KeyError:
        allowed = sorted(o.value for (s, o) in table if s is state)
        raise error(
            f"{op.value} of {subject!r}: not allowed from {getattr(state, 'name', state)} "
            f"(allowed from there: {', '.join(allowed) or 'nothing, it has ended'})"
        ) from None


def compile_table(
    table: Mapping[tuple[_S, _Op], _S], states: Sequence[_S], ops: Sequence[_Op]
) -> tuple[tuple[int, ...], ...]:
    """The same table as rows by state index and columns by operation index, each cell the next
    state's index or −1 (not allowed): hot paths look moves up without hashing enums."""
    return tuple(
        tuple(states.index(table[(s, o)]) if (s, o) in table else -1 for o in ops) for s in states
    )


def describe(table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum]) -> str:
    """The table as lines ``STATE --op--> STATE``, in table order."""
    return "\n".join(f"{s.name} --{o.value}--> {t.name}" for (s, o), t in table.items())

"""The coordinator's vocabulary: frozen events in, frozen actions out.

A driver (the asyncio executor, the simulator, the Ray backend) turns what happens — a submitted
item, an engine's answer, a timer, the trainer asking for a batch — into an :data:`Event`, hands it
to :meth:`stalebound.core.Coordinator.handle`, and carries out the :data:`Action` list it gets back,
in order. Time enters only as the ``now`` value an event carries; nothing here reads a clock.

Identifiers: a group is identified by the ``int`` the coordinator gave it (:class:`StartGroup`); a
member by :class:`~stalebound.core.MemberId` ``(group_id, number)``; an item of input by its
``sample`` index, which the driver assigns in intake order and which survives retries.

Stable surface: drivers and the conformance test depend on these names and fields. New event or
action types may be added (a driver ignores an action type it does not know only if the type says
so in its docstring); existing fields are not renamed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from stalebound.core.groups import MemberId, MemberResult
from stalebound.core.names import Cause, GateCall, Outcome, Timer, Verdict

_F = TypeVar("_F")

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # only type checkers read it

    def dataclass_transform(**_: Any) -> Callable[[_F], _F]:
        return lambda f: f


__all__ = [
    "DEADLINE_TIMER",
    "STUCK_TIMER",
    "WATCHDOG_TIMER",
    "AbortGroup",
    "AbortRequest",
    "Action",
    "ActionLog",
    "ArmTimer",
    "BatchWanted",
    "CancelTimer",
    "Dispatch",
    "EvaluateGroup",
    "Event",
    "GroupEvaluated",
    "HandOverBatch",
    "HandedGroup",
    "HandedMember",
    "LaunchMember",
    "MemberFailed",
    "MemberFinished",
    "MemberLaunched",
    "MemberProgress",
    "NotifyGate",
    "Paused",
    "ReportDrop",
    "ReportFailure",
    "ReportStall",
    "Resumed",
    "Retry",
    "Shutdown",
    "StartGroup",
    "Stop",
    "StopRequested",
    "Submitted",
    "TimerFired",
    "TruncateMember",
    "VersionPublished",
    "Wake",
]

_C = TypeVar("_C", bound=type)


@dataclass_transform(frozen_default=True)
def _frozen(cls: _C) -> _C:
    """A record of the class's annotated fields: frozen to the type checker (assigning a field is
    a type error, and the package is type-checked), a plain ``@dataclass(slots=True)`` at run
    time, equal and hashing by type and fields. A run-time freeze (``frozen=True``, or a named
    tuple) makes building or reading every event dearer, and every trajectory pays for a few."""
    return dataclass(slots=True, unsafe_hash=True)(cls)  # type: ignore[return-value]


STUCK_TIMER = Timer.STUCK
WATCHDOG_TIMER = Timer.WATCHDOG
DEADLINE_TIMER = Timer.DEADLINE

# ----------------------------------------------------------------------------------- events


@_frozen
class Submitted:
    """An item of input is queued for admission (at the back, in intake order).

    ``accept`` is the caller's ``should_accept_fn`` for the item's group (called with the group's
    member results when it completes; ``False`` filters it). ``retries`` counts proactive-filter
    retries the item already had (a resumed run queues its pending items with their counts)."""

    sample: int
    accept: Callable[[list[Any]], bool] | None = None
    retries: int = 0


@_frozen
class Dispatch:
    """Admit queued items now, at generation version ``version`` (``min(engine version, training
    version)``). ``budget`` caps the admissions (an outside gate's capacity; ``None``: no cap)."""

    now: float
    version: int
    budget: int | None = None


@_frozen
class MemberLaunched:
    """The driver started a member's episode (drivers that model start-up time send it; the
    coordinator counts the group's progress from it)."""

    member: MemberId
    now: float


@_frozen
class MemberProgress:
    """A member's engine answered a request: the group is alive (the watchdog's clock)."""

    member: MemberId
    now: float


@_frozen
class MemberFinished:
    """A member's episode returned a trajectory.

    ``result`` is what the workflow returned (opaque; filters read their metric from it);
    ``versions`` the per-token policy versions the engine reported (``None``: none reported);
    ``tokens`` and ``reward`` are optional facts a driver may know (the simulator does)."""

    member: MemberId
    now: float
    result: Any
    versions: tuple[int, ...] | None = None
    tokens: int = 0
    reward: float | None = None


@_frozen
class MemberFailed:
    """A member's episode ended without a trajectory. ``cause``: ``timeout``, ``rejected`` (it
    returned ``None``), ``cancelled``, ``error:<ExceptionType>`` …; ``version`` is the generation
    version now (a relaunched member starts at it); ``detail`` is logged with a group failure."""

    member: MemberId
    now: float
    cause: str
    version: int
    detail: str = ""


@_frozen
class TimerFired:
    """A timer armed by :class:`ArmTimer` fired; ``now`` is when (it may be a clock tick early)."""

    timer: str
    now: float


@_frozen
class BatchWanted:
    """The trainer wants ``groups`` more groups than the driver holds: consume ready batches
    (in version order) until that many have been handed over, or none is ready."""

    groups: int
    now: float


@_frozen
class GroupEvaluated:
    """The driver ran a completed group's filters (:class:`EvaluateGroup`): ``verdict`` is
    ``KEEP``, ``FILTER``, ``FAIL`` or ``STOP`` (:class:`~stalebound.core.names.Verdict`), and
    ``reason`` says why (logged and reported)."""

    group_id: int
    now: float
    verdict: Verdict
    reason: str = ""


@_frozen
class VersionPublished:
    """New weights of ``version`` were published to the engines."""

    version: int
    now: float


@_frozen
class Paused:
    """Stop admitting (running groups go on)."""

    now: float


@_frozen
class Resumed:
    """Admit again."""

    now: float


@_frozen
class StopRequested:
    """The driver cannot go on (a bug, a broken data loader): stop for good with ``reason``."""

    reason: str
    now: float


@_frozen
class Shutdown:
    """The driver is closing: cancel everything running (cause ``shutdown``)."""

    now: float


Event = (
    Submitted
    | Dispatch
    | MemberLaunched
    | MemberProgress
    | MemberFinished
    | MemberFailed
    | TimerFired
    | BatchWanted
    | GroupEvaluated
    | VersionPublished
    | Paused
    | Resumed
    | StopRequested
    | Shutdown
)
"""Everything a driver tells the coordinator."""

# ---------------------------------------------------------------------------------- actions


@_frozen
class StartGroup:
    """Group ``group_id`` was admitted for the item ``sample`` at ``version``; its entry is in
    ``buffer_version`` (``None`` under the capacity policy). Its members follow as
    :class:`LaunchMember` actions."""

    group_id: int
    sample: int
    version: int
    buffer_version: int | None


@_frozen
class LaunchMember:
    """Start one episode: ``member`` of its group, generated at ``version`` (its V_traj).
    ``relaunch``: it replaces a failed member."""

    member: MemberId
    version: int
    relaunch: bool = False


@_frozen
class AbortRequest:
    """Stop a running member for ``cause`` (``surplus``, ``retried``, ``abandoned``, ``stopped``,
    ``shutdown``, ``deadline``): abort its engine requests, then cancel it. The coordinator has
    already accounted for it; the driver sends no event about it afterwards."""

    member: MemberId
    cause: Cause


@_frozen
class TruncateMember:
    """Cut a member short but keep its output: abort its engine requests so the episode returns
    what it has (marked truncated). ``cause``: ``truncated`` (the proactive filter) or
    ``deadline`` (a deadline policy). The member still ends with an event."""

    member: MemberId
    cause: Cause = Cause.TRUNCATED


@_frozen
class AbortGroup:
    """A group left the policy without being trained (``cause``); its members still running, if
    any, come as :class:`AbortRequest` actions just before. Informational for most drivers."""

    group_id: int
    cause: Cause


@_frozen
class Retry:
    """The proactive filter aborted the group; its item ``sample`` is queued again first in line
    (its ``retries``-th retry) and will start as a new group at a new version."""

    group_id: int
    sample: int
    retries: int


@_frozen
class ArmTimer:
    """Arrange a :class:`TimerFired` for ``timer`` at time ``at`` (replacing an earlier one)."""

    timer: Timer
    at: float


@_frozen
class CancelTimer:
    """Disarm ``timer`` if armed."""

    timer: Timer


HandedMember = tuple[MemberResult, tuple[int, ...] | None, bool]
"""One trajectory of a handed-over group: its result, its per-token versions (``None``: not
reported) and whether it was truncated. A plain tuple: it is also the payload the policy stores
and checkpoints hold."""


@_frozen
class HandedGroup:
    """A consumed group: id, item, version V, and its N members in finish order."""

    group_id: int
    sample: int
    version: int
    members: tuple[HandedMember, ...]


@_frozen
class HandOverBatch:
    """Buffer ``version`` was consumed: hand ``groups`` to the trainer, in order. ``continued``:
    the ids of those the deadline action ``continue`` let run past their deadline; their tokens
    generated before ``oldest_token`` (``version − η``) are staler than the bound and leave the
    loss (:func:`~stalebound.core.deadline.stale_tokens` says which)."""

    version: int
    groups: tuple[HandedGroup, ...]
    continued: tuple[int, ...] = ()
    oldest_token: int | None = None


@_frozen
class ReportDrop:
    """The item ``sample`` ended untrained: ``outcome`` ∈ ``filtered``, ``failed``, ``dropped``,
    ``surplus``, ``stopped``. Every item taken in ends trained or reported here, once."""

    group_id: int
    sample: int
    outcome: Outcome


@_frozen
class ReportFailure:
    """A group failed (``why`` says how); log it."""

    group_id: int
    why: str


@_frozen
class ReportStall:
    """The watchdog: group ``group_id`` (V = ``version``) produced nothing for ``silent_for``
    seconds; ``members`` are the member numbers still running."""

    group_id: int
    version: int
    training_version: int
    silent_for: float
    members: tuple[int, ...]


@_frozen
class EvaluateGroup:
    """Group ``group_id`` completed: judge it by its filters outside the core and send back
    :class:`GroupEvaluated` (:func:`stalebound.core.filters.evaluate_group` does both). The
    filters are user code — ``accept`` (the item's ``should_accept_fn``), then ``post_process``
    (the group post-processor named ``post_process_name``, reading ``metric``) — so the driver
    runs them outside any lock it holds around the coordinator. Always the last action of its
    list."""

    group_id: int
    results: tuple[Any, ...]
    accept: Callable[[list[Any]], bool] | None
    post_process: Callable[[Any, Any], Any] | None
    post_process_name: str
    metric: Any


@_frozen
class NotifyGate:
    """Call the outside admission gate's ``call`` (AReaL's ``StalenessManager`` callbacks, by
    method name: :class:`~stalebound.core.names.GateCall`). Only a coordinator built with
    ``gated=True`` emits it."""

    call: GateCall


@_frozen
class Wake:
    """Capacity or results may have changed: run a :class:`Dispatch` soon and wake any trainer
    waiting for a batch."""


@_frozen
class Stop:
    """Stopped for good (``reason``): every running group has been aborted; a waiting trainer
    gets the error from now on."""

    reason: str


Action = (
    StartGroup
    | LaunchMember
    | AbortRequest
    | TruncateMember
    | AbortGroup
    | Retry
    | ArmTimer
    | CancelTimer
    | HandOverBatch
    | ReportDrop
    | ReportFailure
    | ReportStall
    | EvaluateGroup
    | NotifyGate
    | Wake
    | Stop
)
"""Everything the coordinator tells a driver to do."""

ActionLog = Callable[[Event, list[Action]], None]
"""An optional observer a driver calls with each event and the actions it produced (the
cross-driver conformance test compares these logs)."""

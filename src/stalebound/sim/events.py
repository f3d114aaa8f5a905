"""The simulator's clock events, one small named tuple per kind.

The driver (:class:`~stalebound.sim.simulator.Simulation`) dispatches each popped event by its
type through a table. An event that carries a ``ticket`` is stale (and ignored) once its subject
has issued a newer one: a replica whose next segment end moved, a trainer step whose end moved, a
timer re-armed or cancelled.
"""

from __future__ import annotations

from typing import NamedTuple

from stalebound.sim.engine_model import Member, ReplicaDue

__all__ = [
    "ClockEvent",
    "CutReturned",
    "PublicationReturned",
    "ReplicaDue",
    "TimerDue",
    "ToolAnswered",
    "TrainingDone",
    "WeightsArrive",
]


class ToolAnswered(NamedTuple):
    """The tool call after segment ``seg`` of ``member`` answers."""

    member: Member
    seg: int


class CutReturned(NamedTuple):
    """A truncated ``member``'s episode returns with what it has."""

    member: Member


class TrainingDone(NamedTuple):
    """The step training on batch ``version`` ends (valid while ``ticket`` is the trainer's)."""

    version: int
    ticket: int


class WeightsArrive(NamedTuple):
    """The engines serve the weights of ``version`` (after ``engine.sync_delay``)."""

    version: int


class PublicationReturned(NamedTuple):
    """The publication of new weights returned to the trainer (after the episodes it started)."""


class TimerDue(NamedTuple):
    """The coordinator's ``timer`` fires (valid while ``ticket`` is its latest arming)."""

    timer: str
    ticket: int


ClockEvent = (
    ReplicaDue
    | ToolAnswered
    | CutReturned
    | TrainingDone
    | WeightsArrive
    | PublicationReturned
    | TimerDue
)

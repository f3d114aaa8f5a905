"""The proactive filter's decision, kept pure so it can move into the core unchanged.

PSRL's proactive filter acts on a STUCK head buffer (every entry taken, fewer than B occupied, so
the trainer cannot consume it) whose RESERVED entries are few: ``retry`` aborts those groups and
re-dispatches their prompts (after pulling finished groups forward from later buffers into the
freed entries); ``truncate`` force-completes them with their partial outputs.

:func:`decide` looks only at plain values; the simulator gathers them from
:class:`stalebound.core.StalenessBuffer` (``state``, ``reserved_groups``) and carries the action
out with ``abort``, ``pull_forward`` and ``complete``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from stalebound.core import BufferState, ConfigError

__all__ = ["METHODS", "FilterAction", "decide"]

METHODS = ("retry", "truncate")


@dataclass(frozen=True, slots=True)
class FilterAction:
    """Retry or truncate ``groups`` (RESERVED groups of the head buffer, in reservation order)."""

    method: str
    groups: tuple[Hashable, ...]


def decide(
    method: str,
    head_state: BufferState,
    reserved: Sequence[Hashable],
    *,
    threshold: int,
    stuck_for: float,
    stuck_time: float = 0.0,
    trainer_idle: bool = True,
    missing: int = 0,
    pullable: int = 0,
) -> FilterAction | None:
    """What the proactive filter does now, or ``None`` to wait.

    Acts only when the head buffer is STUCK, holds between 1 and ``threshold`` RESERVED groups,
    has been STUCK for at least ``stuck_time`` seconds, and the trainer is idle (a STUCK head that
    the trainer is not waiting for costs nothing yet, and the stragglers may still finish).

    ``retry`` additionally needs ``pullable`` (OCCUPIED groups in later buffers) ≥ ``missing``
    (B minus the head's OCCUPIED count): the retried prompts restart in the latest buffers, so
    only groups pulled forward can make the head READY; retrying without them would only waste
    the stragglers' work and could repeat forever.
    """
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: use one of {', '.join(METHODS)}")
    if head_state is not BufferState.STUCK or not trainer_idle:
        return None
    if not 0 < len(reserved) <= threshold or stuck_for < stuck_time:
        return None
    if method == "retry" and pullable < missing:
        return None
    return FilterAction(method, tuple(reserved))

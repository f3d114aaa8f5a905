"""The proactive filter as the simulator drives it: the core's decision plus two driver guards.

PSRL's proactive filter acts on a STUCK head buffer (every entry taken, fewer than B occupied, so
the trainer cannot consume it) whose RESERVED entries are few: ``retry`` aborts those groups and
re-dispatches their prompts (after pulling finished groups forward from later buffers into the
freed entries); ``truncate`` force-completes them with their partial outputs.

Which groups is the core's decision (:func:`stalebound.core.filters.proactive_filter_targets`).
:func:`decide` adds what only a driver knows, both pure functions of plain values:

* act only while the trainer is idle: a STUCK head the trainer is not waiting for costs nothing
  yet, and its stragglers may still finish;
* ``retry`` only when enough OCCUPIED groups sit in later buffers to fill the head once pulled
  forward: retried prompts restart in the *latest* buffer, so without them a retry only throws the
  stragglers' work away — and could repeat on every event.

The simulator carries the action out with ``abort``, ``pull_forward`` and ``complete``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from stalebound.core import ConfigError, EntryState, StalenessBuffer
from stalebound.core.filters import proactive_filter_targets

__all__ = ["METHODS", "FilterAction", "decide", "retry_can_fill_head"]

METHODS = ("retry", "truncate")


@dataclass(frozen=True, slots=True)
class FilterAction:
    """Retry or truncate ``groups`` (RESERVED groups of the head buffer, in reservation order)."""

    method: str
    groups: tuple[Hashable, ...]


def retry_can_fill_head(buf: StalenessBuffer) -> bool:
    """Whether pulling forward could give the head buffer B occupied groups once its RESERVED
    entries are aborted: OCCUPIED groups in later buffers ≥ B − OCCUPIED in the head."""
    v = buf.version
    missing = buf.batch_size - buf.entries(v)[EntryState.OCCUPIED]
    later = sum(buf.entries(b)[EntryState.OCCUPIED] for b in buf.versions_in_use() if b > v)
    return later >= missing


def decide(
    method: str,
    buf: StalenessBuffer,
    *,
    threshold: int,
    stuck_for: float,
    stuck_time: float = 0.0,
    trainer_idle: bool = True,
) -> FilterAction | None:
    """What the proactive filter does now, or ``None`` to wait (see the module docstring)."""
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: use one of {', '.join(METHODS)}")
    if not trainer_idle:
        return None
    targets = proactive_filter_targets(
        buf, threshold, stuck_for=stuck_for, stuck_timeout_s=stuck_time or None
    )
    if not targets or (method == "retry" and not retry_can_fill_head(buf)):
        return None
    return FilterAction(method, targets)

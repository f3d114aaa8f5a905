"""AReaL's ``StalenessManager``: count-based admission control behind one lock.

``capacity = min(max(1, C) − running, (η + v + 1)·max(1, B) − (accepted + running))``

where C is ``max_concurrent_rollouts``, B ``consumer_batch_size``, η ``max_staleness`` and v the
version the :class:`VersionProvider` reports. The arithmetic is
:class:`stalebound.core.CapacityCounter`'s; this class adds the lock, the version provider and
AReaL's method names, so AReaL code can use it unchanged.

By default it is a drop-in for AReaL's class: a callback out of order (``on_rollout_accepted()``
without a running rollout, say) moves the counters exactly as AReaL's does, even below zero; such
calls are counted (:attr:`StalenessManager.protocol_violations`) and the first is logged as a
warning. With ``strict=True`` (what :class:`~stalebound.runtime.WorkflowExecutor` uses) such a
call raises :class:`~stalebound.core.ProtocolError` and changes nothing. The remaining differences
from AReaL are listed in ``docs/areal.md``.

What it does **not** guarantee: the bound is on *counts*, in aggregate. It never looks at which
version a running rollout started at, so one slow rollout admitted at version v can be trained long
after v + η. The example below plays exactly that (η = 1, one straggler, one fast rollout per step):

>>> class TrainerVersion:
...     version = 0
...     def get_version(self) -> int:
...         return self.version
>>> trainer = TrainerVersion()
>>> manager = StalenessManager(trainer, max_concurrent_rollouts=2, consumer_batch_size=1,
...                            max_staleness=1)
>>> def start() -> None:
...     manager.on_rollout_enqueued()
...     manager.on_rollout_submitted()
>>> start(); start()              # the straggler and a fast rollout both start at version 0
>>> for step in range(4):
...     manager.on_rollout_accepted()     # the fast rollout finishes; it is trained at `step`
...     trainer.version += 1              # one training step
...     print(f"v={trainer.version} capacity={manager.get_capacity()}")
...     start()                           # the manager admits the next fast rollout
v=1 capacity=1
v=2 capacity=1
v=3 capacity=1
v=4 capacity=1
>>> manager.on_rollout_accepted()         # the straggler (version 0) finally finishes ...
>>> trainer.version - 0                   # ... and is trained at staleness 4, with η = 1
4

:class:`stalebound.core.StalenessBuffer` (``staleness_policy: buffer``) closes that gap: it would
have stopped training at version 1 until the straggler finished.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from stalebound.core import CapacityCounter, RolloutStat

logger = logging.getLogger(__name__)

# AReaL's callbacks: the counter each one takes a rollout from, and the one it moves it to.
_MOVES = {
    "on_rollout_submitted": ("enqueued", "running"),
    "on_rollout_accepted": ("running", "accepted"),
    "on_rollout_rejected": ("running", "rejected"),
}

__all__ = ["RolloutStat", "StalenessManager", "VersionProvider"]


@runtime_checkable
class VersionProvider(Protocol):
    """Anything that reports the current policy version (an inference engine, an executor)."""

    def get_version(self) -> int: ...


class StalenessManager:
    """Thread-safe admission control: AReaL's concurrency limit and staleness limit.

    ``max_concurrent_rollouts`` (C) and ``consumer_batch_size`` (B) may be 0; the formula then uses
    1, as AReaL does. All methods may be called from any thread; each takes :attr:`lock` once.
    ``strict``: refuse a callback that would drive a counter below zero (``ProtocolError``)
    instead of applying it as AReaL does.
    """

    def __init__(
        self,
        version_provider: VersionProvider,
        max_concurrent_rollouts: int,
        consumer_batch_size: int,
        max_staleness: int,
        *,
        strict: bool = False,
    ) -> None:
        self.version_provider = version_provider
        self.counter = CapacityCounter(max_concurrent_rollouts, consumer_batch_size, max_staleness)
        """The counters. Read or change them only while holding :attr:`lock`."""
        self.lock = threading.Lock()
        """The one lock guarding :attr:`counter` (the executor holds it around policy calls)."""
        self.strict = strict
        self.protocol_violations = 0
        """Callbacks applied although their rollout was not in the state they move it from (only
        without ``strict``; AReaL applies them the same way, silently)."""

    @property
    def rollout_stat(self) -> RolloutStat:
        """The live counters, under AReaL's attribute name (hold :attr:`lock` to read them)."""
        return self.counter.stat

    @property
    def max_concurrent_rollouts(self) -> int:
        return self.counter.max_concurrent_rollouts

    @property
    def consumer_batch_size(self) -> int:
        return self.counter.consumer_batch_size

    @property
    def max_staleness(self) -> int:
        return self.counter.staleness

    def get_capacity(self) -> int:
        """How many rollouts may start now; may be ≤ 0 (start none then).

        The version is read under the lock, as AReaL does: the provider must not call back into
        this manager."""
        with self.lock:
            return self.counter.capacity(self.version_provider.get_version())

    def get_pending_limit(self) -> int:
        """The most rollouts that may wait for admission: ``(η + 1)·B`` (constants: no lock)."""
        return self.counter.pending_limit()

    def on_rollout_enqueued(self) -> None:
        """A rollout entered the input queue."""
        with self.lock:
            self.counter.enqueued()

    def on_rollout_submitted(self) -> None:
        """An enqueued rollout started running."""
        self._move("on_rollout_submitted", self.counter.submitted)

    def on_rollout_accepted(self) -> None:
        """A running rollout finished and its result was kept for training."""
        self._move("on_rollout_accepted", self.counter.accepted)

    def on_rollout_rejected(self) -> None:
        """A running rollout failed, was filtered or was discarded."""
        self._move("on_rollout_rejected", self.counter.rejected)

    def _move(self, op: str, checked: Callable[[], None]) -> None:
        """One callback: the counter's own (checked) move, or AReaL's unchecked one."""
        source, target = _MOVES[op]
        with self.lock:
            stat = self.counter.stat
            if self.strict or getattr(stat, source) > 0:
                checked()
                return
            setattr(stat, source, getattr(stat, source) - 1)
            setattr(stat, target, getattr(stat, target) + 1)
            self.protocol_violations += 1
            first = self.protocol_violations == 1
        if first:
            logger.warning(
                "StalenessManager.%s(): no rollout was %s, so %s is now %d (as AReaL's manager "
                "does); the callbacks are out of order — each rollout must be enqueued, then "
                "submitted, then accepted or rejected. Further such calls are only counted "
                "(protocol_violations); strict=True raises instead",
                op,
                source,
                source,
                getattr(stat, source),
            )

    def on_version_recovered(self, version: int) -> None:
        """After resuming from a checkpoint at ``version``: count its trained batches as accepted."""
        with self.lock:
            self.counter.version_recovered(version)

    def get_stats(self) -> RolloutStat:
        """A copy of the counters (changing it changes nothing here)."""
        with self.lock:
            return dataclasses.replace(self.counter.stat)

    def __repr__(self) -> str:
        s = self.get_stats()
        return (
            f"StalenessManager(max_concurrent_rollouts={self.max_concurrent_rollouts}, "
            f"consumer_batch_size={self.consumer_batch_size}, max_staleness={self.max_staleness}, "
            f"strict={self.strict}, protocol_violations={self.protocol_violations}, stats={s})"
        )

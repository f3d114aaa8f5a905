"""AReaL's ``StalenessManager``: count-based admission control behind one lock.

``capacity = min(max(1, C) − running, (η + v + 1)·max(1, B) − (accepted + running))``

where C is ``max_concurrent_rollouts``, B ``consumer_batch_size``, η ``max_staleness`` and v the
version the :class:`VersionProvider` reports. The arithmetic is
:class:`stalebound.core.CapacityCounter`'s; this class adds the lock, the version provider and
AReaL's method names, so AReaL code can use it unchanged. Unlike AReaL, a callback that would drive
a counter below zero raises :class:`~stalebound.core.ProtocolError` and changes nothing.

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
import threading
from typing import Protocol, runtime_checkable

from stalebound.core import CapacityCounter, RolloutStat

__all__ = ["RolloutStat", "StalenessManager", "VersionProvider"]


@runtime_checkable
class VersionProvider(Protocol):
    """Anything that reports the current policy version (an inference engine, an executor)."""

    def get_version(self) -> int: ...


class StalenessManager:
    """Thread-safe admission control: AReaL's concurrency limit and staleness limit.

    ``max_concurrent_rollouts`` (C) and ``consumer_batch_size`` (B) may be 0; the formula then uses
    1, as AReaL does. All methods may be called from any thread; each takes :attr:`lock` once.
    """

    def __init__(
        self,
        version_provider: VersionProvider,
        max_concurrent_rollouts: int,
        consumer_batch_size: int,
        max_staleness: int,
    ) -> None:
        self.version_provider = version_provider
        self.counter = CapacityCounter(max_concurrent_rollouts, consumer_batch_size, max_staleness)
        """The counters. Read or change them only while holding :attr:`lock`."""
        self.lock = threading.Lock()
        """The one lock guarding :attr:`counter` (the executor holds it around policy calls)."""

    @property
    def max_concurrent_rollouts(self) -> int:
        return self.counter.max_concurrent_rollouts

    @property
    def consumer_batch_size(self) -> int:
        return self.counter.consumer_batch_size

    @property
    def max_staleness(self) -> int:
        return self.counter.max_staleness

    def get_capacity(self) -> int:
        """How many rollouts may start now; may be ≤ 0 (start none then)."""
        # Read the version outside the lock: the provider is user code and may be slow or re-enter.
        version = self.version_provider.get_version()
        with self.lock:
            return self.counter.capacity(version)

    def get_pending_limit(self) -> int:
        """The most rollouts that may wait for admission: ``(η + 1)·B``."""
        with self.lock:
            return self.counter.pending_limit()

    def on_rollout_enqueued(self) -> None:
        """A rollout entered the input queue."""
        with self.lock:
            self.counter.enqueued()

    def on_rollout_submitted(self) -> None:
        """An enqueued rollout started running."""
        with self.lock:
            self.counter.submitted()

    def on_rollout_accepted(self) -> None:
        """A running rollout finished and its result was kept for training."""
        with self.lock:
            self.counter.accepted()

    def on_rollout_rejected(self) -> None:
        """A running rollout failed, was filtered or was discarded."""
        with self.lock:
            self.counter.rejected()

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
            f"stats={s})"
        )

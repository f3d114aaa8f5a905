"""Staleness policies: one interface over PSRL's buffer and AReaL's count-based admission.

Drivers — the asyncio executor, the simulator and the Ray coordinator — hold one policy and call
the same five decisions on it: :meth:`~StalenessPolicy.try_admit` before launching a group,
:meth:`~StalenessPolicy.complete` when it finishes, :meth:`~StalenessPolicy.abort` when it fails or
is cancelled, :meth:`~StalenessPolicy.ready` / :meth:`~StalenessPolicy.consume` for the trainer.
Because the decisions live here, one trace of calls gives the same decisions in every driver.

* :class:`BufferPolicy` — the staleness buffer: a per-trajectory bound, never violated.
* :class:`CapacityPolicy` — AReaL's ``StalenessManager`` arithmetic with a FIFO of results: the
  bound holds in aggregate only. With ``drop_stale=True`` results staler than η are discarded
  (the "capacity-drop" policy several frameworks use), which keeps the bound by wasting work.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from stalebound.core.buffer import ConsumedBatch, ConsumedGroup, EntryState, StalenessBuffer
from stalebound.core.capacity import CapacityCounter, RolloutStat
from stalebound.core.checks import check_version, is_int
from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.core.names import PolicyKind, Verdict

__all__ = [
    "Admission",
    "BufferBacked",
    "BufferPolicy",
    "CapacityPolicy",
    "DeadlinePolicy",
    "PolicyStatistics",
    "StalenessPolicy",
]


class Admission(NamedTuple):
    """A group may start: generate it with a policy of version ``version``."""

    group_id: Hashable
    version: int
    buffer_version: int | None = None
    """Where the buffer policy reserved its entry; ``None`` for the capacity policy."""


@dataclass(frozen=True)
class PolicyStatistics:
    """What every policy reports, so drivers and the simulator can compare them."""

    policy: str
    version: int
    staleness: int
    """The bound (the capacity policy bounds it in aggregate only)."""
    running: int
    """Groups admitted and not yet completed, aborted or cancelled."""
    waiting: int
    """Completed groups not yet consumed."""
    admitted: int
    completed: int
    consumed: int
    aborted: Mapping[str, int]
    dropped: int
    """Completed groups discarded without training (no admissible place, or too stale)."""
    staleness_histogram: Mapping[int, int]
    violations: int
    """Consumed groups staler than the bound (always 0 for the buffer policy)."""
    continued: int = 0
    """Deadlines moved past the bound by the deadline action ``continue`` (a group continued
    twice counts twice); such groups are trained with their too-old tokens masked, and are not
    violations."""

    @property
    def staleness_bound(self) -> int:
        """The bound under its earlier name (kept so existing readers keep working)."""
        return self.staleness


class StalenessPolicy(Protocol):
    """The decisions a driver asks of a staleness policy. Implementations are pure and
    single-threaded; drivers serialise calls (one event loop, or one lock)."""

    name: str
    kind: PolicyKind

    @property
    def version(self) -> int: ...

    @property
    def staleness(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    def capacity(self, version: int | None = None) -> int: ...

    def try_admit(self, group_id: Hashable, version: int | None = None) -> Admission | None: ...

    def complete(
        self, group_id: Hashable, payload: Any = None, *, segment_versions: Iterable[int] = ()
    ) -> bool: ...

    def abort(self, group_id: Hashable, cause: str = "aborted") -> None: ...

    def ready(self) -> bool: ...

    def consume(self) -> ConsumedBatch: ...

    def is_running(self, group_id: Hashable) -> bool: ...

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]:
        """Running groups whose deadline buffer is ``head`` and what to do with them:
        ``TRUNCATE`` (force-complete with the partial output), ``ABORT`` (counted as wasted) or
        ``CONTINUE`` (the policy already moved its deadline on: it keeps generating).

        Asked each time a buffer becomes the head (after a consume), with ``trainer_waiting``
        each time the trainer asks for a batch the head cannot give yet, and with ``overdue``
        once the trainer has waited the grace (then ``ABORT`` for every group still running
        whose deadline is the head, and nothing else changes — it also serves as the question
        whether any is). A policy without deadlines answers ``()``; the coordinator carries the
        verdicts out."""
        ...

    def statistics(self) -> PolicyStatistics: ...

    def snapshot(self) -> dict[str, Any]: ...

    def load_snapshot(self, snapshot: Mapping[str, Any]) -> None: ...


class DeadlinePolicy(Protocol):
    """The deadline hook alone (:meth:`StalenessPolicy.deadline_verdicts`, which every policy now
    has; kept under this name for code that imports it)."""

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]: ...


@contextmanager
def _reading_snapshot(kind: str) -> Iterator[None]:
    """Report a snapshot that does not parse as damaged (nothing has been changed yet)."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ProtocolError(
            f"load_snapshot(): the snapshot is damaged or not a {kind} snapshot "
            f"({type(exc).__name__}: {exc}); restore from an intact checkpoint"
        ) from exc


def _check_policy(snapshot: Mapping[str, Any], name: str) -> None:
    if snapshot["policy"] != name:
        raise ProtocolError(
            f"load_snapshot(): the snapshot is of the {snapshot['policy']!r} policy, not "
            f"{name!r}; resume with the staleness policy that wrote it"
        )


def _not_a(kind: type, value: object) -> bool:
    """True when ``value`` is not a ``kind`` (callers outside the type checker pass anything)."""
    return not isinstance(value, kind)


def _hashable(op: str, group_id: Hashable) -> None:
    try:
        hash(group_id)
    except TypeError:
        raise ProtocolError(f"{op}(group_id={group_id!r}): group ids must be hashable") from None


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ConfigError(f"{name}={value!r}: must be an integer ≥ 1 or None; None means no limit")


class BufferBacked:
    """What a policy backed by a :class:`StalenessBuffer` reads from it: the version, the bound,
    the batch size, which groups run, and every count it reports."""

    name: str
    buffer: StalenessBuffer

    @property
    def version(self) -> int:
        return self.buffer.version

    @property
    def staleness(self) -> int:
        return self.buffer.staleness

    @property
    def batch_size(self) -> int:
        return self.buffer.batch_size

    def is_running(self, group_id: Hashable) -> bool:
        where = self.buffer.lookup(group_id)
        return where is not None and where[0] is EntryState.RESERVED

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]:
        """No deadlines (the buffer waits for every group)."""
        return ()

    def statistics(self) -> PolicyStatistics:
        s = self.buffer.statistics()
        return PolicyStatistics(
            policy=self.name,
            version=s.version,
            staleness=s.staleness,
            running=s.reserved,
            waiting=s.occupied,
            admitted=s.reserved_total,
            completed=s.occupied_total,
            consumed=s.consumed_groups,
            aborted=s.aborted,
            dropped=s.dropped,
            staleness_histogram=s.staleness_histogram,
            violations=s.violations,
            continued=s.extended,
        )


class BufferPolicy(BufferBacked):
    """PSRL's staleness buffer plus an optional concurrency limit on running groups.

    It keeps no counters or sets of its own: running groups are the buffer's RESERVED entries,
    and every count it reports is the buffer's."""

    name = "buffer"
    kind = PolicyKind.BUFFER

    def __init__(self, buffer: StalenessBuffer, max_concurrent: int | None = None) -> None:
        if _not_a(StalenessBuffer, buffer):
            raise ConfigError(f"buffer={buffer!r}: must be a StalenessBuffer")
        _check_limit("max_concurrent", max_concurrent)
        self.buffer = buffer
        self.max_concurrent = max_concurrent

    def capacity(self, version: int | None = None) -> int:
        free = self.buffer.capacity(version)
        if self.max_concurrent is not None:
            free = min(free, self.max_concurrent - self.buffer.reserved_count)
        return free

    def try_admit(self, group_id: Hashable, version: int | None = None) -> Admission | None:
        if group_id in self.buffer:
            raise ProtocolError(
                f"try_admit(group_id={group_id!r}): the group is already in flight; use a fresh id"
            )
        if self.max_concurrent is not None and self.buffer.reserved_count >= self.max_concurrent:
            return None
        r = self.buffer.try_reserve(group_id, version)
        if r is None:
            return None
        return Admission(group_id, r.version, r.buffer_version)

    def complete(
        self, group_id: Hashable, payload: Any = None, *, segment_versions: Iterable[int] = ()
    ) -> bool:
        """Occupy the group's entry; always True (the buffer never refuses a finished group)."""
        self.buffer.occupy(group_id, payload, segment_versions=segment_versions)
        return True

    def abort(self, group_id: Hashable, cause: str = "aborted") -> None:
        self.buffer.abort(group_id, cause)

    def ready(self) -> bool:
        return self.buffer.ready()

    def consume(self) -> ConsumedBatch:
        """Consume buffer v; its surplus reservations are in ``aborted`` (the driver cancels them)."""
        return self.buffer.consume()

    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain data: the buffer's :meth:`~StalenessBuffer.snapshot` (its
        reservations and occupied groups with their payloads) and the policy's counters."""
        return {
            "policy": self.name,
            "max_concurrent": self.max_concurrent,
            "buffer": self.buffer.snapshot(),
            # the buffer's own counts, repeated so a damaged snapshot is caught on load
            **self._counts(self.buffer),
        }

    @staticmethod
    def _counts(buffer: StalenessBuffer) -> dict[str, Any]:
        s = buffer.statistics()
        return {
            "admitted": s.reserved_total,
            "completed": s.occupied_total,
            "aborted": dict(s.aborted),
        }

    def load_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the state with :meth:`snapshot` output. The buffer's reservations come back as
        running groups (a driver that lost them aborts them, naming its cause). A damaged or
        foreign snapshot raises :class:`ProtocolError` and changes nothing."""
        with _reading_snapshot("buffer-policy"):
            _check_policy(snapshot, self.name)
            buffer = StalenessBuffer.restore(snapshot["buffer"])
            saved = {
                "admitted": int(snapshot["admitted"]),
                "completed": int(snapshot["completed"]),
                "aborted": {str(k): int(n) for k, n in snapshot["aborted"].items()},
            }
            if saved != self._counts(buffer):
                raise ValueError(f"the counts {saved} do not match the buffer's")
        self.buffer = buffer


class CapacityPolicy:
    """AReaL's count-based admission with results consumed first-in, first-out by completion."""

    name = "capacity"
    kind = PolicyKind.CAPACITY

    def __init__(
        self,
        counter: CapacityCounter,
        *,
        drop_stale: bool = False,
        start_version: int = 0,
    ) -> None:
        problems = []
        if _not_a(CapacityCounter, counter):
            problems.append(f"counter={counter!r}: must be a CapacityCounter")
        if _not_a(bool, drop_stale):
            problems.append(f"drop_stale={drop_stale!r}: must be true or false")
        if not is_int(start_version) or start_version < 0:
            problems.append(f"start_version={start_version!r}: must be an integer ≥ 0")
        if problems:
            raise ConfigError(problems)
        self.counter = counter
        self.drop_stale = drop_stale
        if drop_stale:
            self.name = "capacity-drop"
        self._v = start_version
        self._running: dict[Hashable, int] = {}
        self._done: deque[ConsumedGroup] = deque()
        self._done_ids: set[Hashable] = set()
        self._dropped_since: list[ConsumedGroup] = []
        self._admitted = 0
        self._completed = 0
        self._consumed = 0
        self._dropped = 0
        self._aborted: Counter[str] = Counter()
        self._histogram: Counter[int] = Counter()
        if start_version:
            counter.version_recovered(start_version)

    @property
    def version(self) -> int:
        return self._v

    @property
    def staleness(self) -> int:
        return self.counter.staleness

    @property
    def batch_size(self) -> int:
        return max(1, self.counter.consumer_batch_size)

    def capacity(self, version: int | None = None) -> int:
        """AReaL's formula at ``version``: the engines' weight version when the driver knows it
        (AReaL reads it from the engines, so it moves only after a weight update), else the
        training version."""
        if version is not None:
            check_version("capacity", version)
        return self.counter.capacity(self._v if version is None else min(version, self._v))

    def try_admit(self, group_id: Hashable, version: int | None = None) -> Admission | None:
        _hashable("try_admit", group_id)
        if version is not None:
            check_version("try_admit", version)
        if group_id in self._running or group_id in self._done_ids:
            raise ProtocolError(
                f"try_admit(group_id={group_id!r}): the group is already in flight; use a fresh id"
            )
        V = self._v if version is None else version
        if self._v < V:
            raise ProtocolError(
                f"try_admit(version={V}): version {V} is from the future (the current version "
                f"is {self._v})"
            )
        if self.counter.capacity(V) <= 0:
            return None
        self.counter.enqueued()
        self.counter.submitted()
        self._running[group_id] = V
        self._admitted += 1
        return Admission(group_id, V)

    def complete(
        self, group_id: Hashable, payload: Any = None, *, segment_versions: Iterable[int] = ()
    ) -> bool:
        """Queue the result; False when ``drop_stale`` discards it as already staler than η."""
        V = self._running_version("complete", group_id)
        try:
            segment_versions = tuple(segment_versions)
        except TypeError:
            raise ProtocolError(
                f"complete(group_id={group_id!r}, segment_versions={segment_versions!r}): "
                "segment_versions must be an iterable of ints, e.g. () or [3, 4]"
            ) from None
        for sv in segment_versions:
            if not is_int(sv) or sv < V or sv > self._v:
                raise ProtocolError(
                    f"complete(group_id={group_id!r}): segment version {sv!r} is outside "
                    f"[{V}, {self._v}]"
                )
        del self._running[group_id]
        self._completed += 1
        group = ConsumedGroup(group_id, V, payload)
        if self.drop_stale and self._v - V > self.counter.staleness:
            self.counter.rejected()
            self._drop(group)
            return False
        self.counter.accepted()
        self._done.append(group)
        self._done_ids.add(group_id)
        return True

    def abort(self, group_id: Hashable, cause: str = "aborted") -> None:
        if not isinstance(cause, str) or not cause:
            raise ProtocolError(
                f"abort(group_id={group_id!r}, cause={cause!r}): the cause must be a non-empty "
                "string such as 'aborted', 'filtered', 'retried' or 'failed'"
            )
        self._running_version("abort", group_id)
        del self._running[group_id]
        self.counter.rejected()
        self._aborted[cause] += 1

    def ready(self) -> bool:
        return len(self._done) >= self.batch_size

    def consume(self) -> ConsumedBatch:
        if not self.ready():
            raise ProtocolError(
                f"consume(): {len(self._done)} of {self.batch_size} results are waiting; "
                "consume only when ready() is True"
            )
        v = self._v
        groups = tuple(self._done.popleft() for _ in range(self.batch_size))
        for g in groups:
            self._done_ids.discard(g.group_id)
            self._histogram[v - g.version] += 1
        self._consumed += len(groups)
        self._v = v + 1
        if self.drop_stale:  # what would be staler than η at the next step can never be trained
            keep = [g for g in self._done if self._v - g.version <= self.counter.staleness]
            for g in self._done:
                if self._v - g.version > self.counter.staleness:
                    self._done_ids.discard(g.group_id)
                    self._drop(g)
            self._done = deque(keep)
        dropped, self._dropped_since = tuple(self._dropped_since), []
        return ConsumedBatch(
            version=v,
            groups=groups,
            dropped=tuple(g.group_id for g in dropped),
            dropped_groups=dropped,
        )

    def is_running(self, group_id: Hashable) -> bool:
        try:
            return group_id in self._running
        except TypeError:  # unhashable: never admitted
            return False

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]:
        """No deadlines (results are consumed as they come)."""
        return ()

    def statistics(self) -> PolicyStatistics:
        bound = self.counter.staleness
        return PolicyStatistics(
            policy=self.name,
            version=self._v,
            staleness=bound,
            running=len(self._running),
            waiting=len(self._done),
            admitted=self._admitted,
            completed=self._completed,
            consumed=self._consumed,
            aborted=MappingProxyType(dict(self._aborted)),
            dropped=self._dropped,
            staleness_histogram=MappingProxyType(dict(sorted(self._histogram.items()))),
            violations=sum(n for k, n in self._histogram.items() if k > bound),
        )

    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain data: version, counters, running groups and completed groups
        with their payloads (first-in, first-out)."""
        c = self.counter
        return {
            "policy": self.name,
            "max_concurrent_rollouts": c.max_concurrent_rollouts,
            "consumer_batch_size": c.consumer_batch_size,
            "max_staleness": c.staleness,  # the checkpoint's key (format kept)
            "version": self._v,
            "stat": dict(vars(c.stat)),
            "running": [[gid, v] for gid, v in self._running.items()],
            "done": [[g.group_id, g.version, g.payload] for g in self._done],
            "admitted": self._admitted,
            "completed": self._completed,
            "consumed": self._consumed,
            "dropped": self._dropped,
            "aborted": dict(self._aborted),
            "histogram": {str(k): n for k, n in self._histogram.items()},
        }

    def load_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the state (and the counter's) with :meth:`snapshot` output. The counter's
        limits must match the snapshot's. A damaged or foreign snapshot raises
        :class:`ProtocolError` and changes nothing."""
        c = self.counter
        with _reading_snapshot("capacity-policy"):
            _check_policy(snapshot, self.name)
            limits = {
                "max_concurrent_rollouts": c.max_concurrent_rollouts,
                "consumer_batch_size": c.consumer_batch_size,
                "max_staleness": c.staleness,
            }
            changed = [
                f"{k}: {snapshot[k]!r} → {v!r}" for k, v in limits.items() if snapshot[k] != v
            ]
            if changed:
                raise ProtocolError(
                    f"load_snapshot(): the limits differ from the snapshot's ({', '.join(changed)}); "
                    "resume with the limits it was written with"
                )
            version = int(snapshot["version"])
            stat = RolloutStat(**{k: int(n) for k, n in snapshot["stat"].items()})
            running = {gid: int(v) for gid, v in snapshot["running"]}
            done = deque(
                ConsumedGroup(gid, int(v), payload) for gid, v, payload in snapshot["done"]
            )
            counts = [int(snapshot[k]) for k in ("admitted", "completed", "consumed", "dropped")]
            aborted = Counter({str(k): int(n) for k, n in snapshot["aborted"].items()})
            histogram = Counter({int(k): int(n) for k, n in snapshot["histogram"].items()})
            bad = [v for v in (version, *running.values(), *(g.version for g in done)) if v < 0] + [
                v for v in running.values() if v > version
            ]
            if bad or len(running) != stat.running or min(vars(stat).values()) < 0:
                raise ValueError(
                    f"versions {bad} or running count {stat.running} (of {len(running)} groups) "
                    "are inconsistent"
                )
        c.stat = stat
        self._v, self._running, self._done = version, running, done
        self._done_ids = {g.group_id for g in done}
        self._dropped_since = []
        self._admitted, self._completed, self._consumed, self._dropped = counts
        self._aborted, self._histogram = aborted, histogram

    def _drop(self, group: ConsumedGroup) -> None:
        self._dropped += 1
        self._dropped_since.append(group)

    def _running_version(self, op: str, group_id: Hashable) -> int:
        _hashable(op, group_id)
        V = self._running.get(group_id)
        if V is None:
            raise ProtocolError(
                f"{op}(group_id={group_id!r}): no such group running (never admitted, or already "
                "completed or aborted)"
            )
        return V

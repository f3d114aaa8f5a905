"""The deadline policy: AReaL's admission at a soft target, PSRL's per-trajectory hard bound.

Two numbers (section 12 of the design):

* ``η_s`` — the **soft target**: admission is AReaL's capacity arithmetic at ``η_s``
  (:class:`~stalebound.core.CapacityCounter`), optionally less an admission margin of ``m``
  groups (admit only while the capacity exceeds ``m``). It fixes how much work is in flight, and
  so the mean staleness and the throughput, exactly as AReaL's ``max_head_offpolicyness`` does.
* ``η_h ≥ η_s`` — the **hard bound**: every admitted group reserves an entry at ``V + η_h`` in
  per-version buffers of ``B′ = B + slack`` entries (:class:`~stalebound.core.StalenessBuffer`),
  so no trajectory is ever trained later than ``V + η_h``, whatever the timing.

The buffer alone waits for its head to fill by itself; this policy consumes at capacity's pace
instead. As soon as B groups have completed anywhere in the window, the head buffer is made ready
from them: completed groups in later buffers are pulled forward into the head (their staleness
only shrinks) and, where the head has no free entry, reservations in it that are not due
(``V + η_h > v``) are deferred to a later buffer within their bound. A group still running when
its deadline buffer ``V + η_h`` becomes the head gets the deadline action (:meth:`deadline_verdicts`,
carried out by the coordinator): ``truncate`` (force-completed with its partial output, kept and
marked truncated), ``abort`` (its tokens are wasted) or ``continue`` (the token-level bound: its
reservation moves to the earliest later buffer with room, at most ``continue_max`` versions past
``V + η_h``, and it keeps generating under newer weights; when it is trained at version ``c`` the
trainer masks its tokens generated before ``c − η_h``, so no *trained token* is staler than
``η_h``, while the trajectory keeps its version ``V`` for admission and accounting. A continued
group still running at its moved deadline continues again, until the cap or no later buffer has
room: then it is truncated, counted as a deadline truncation). The head is consumed due-first,
and not while a due group is still running (a truncation under way lands in it).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from stalebound.core.buffer import ConsumedBatch, StalenessBuffer
from stalebound.core.capacity import CapacityCounter, RolloutStat
from stalebound.core.checks import is_int, staleness_problems
from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.core.grace import GRACE_WINDOW
from stalebound.core.names import DEADLINE_ACTIONS, DEADLINE_MOMENTS, PolicyKind, Verdict
from stalebound.core.policy import Admission, BufferBacked, _not_a

__all__ = [
    "DEADLINE_ACTIONS",
    "DEADLINE_MOMENTS",
    "DEFAULT_CONTINUE_MAX",
    "DEFAULT_GRACE_STEPS",
    "DEFAULT_SLACK",
    "GRACE_WINDOW",
    "MARGIN_PER_TARGET",
    "DeadlineBoundPolicy",
    "deadline_bounds",
    "deadline_knob_problems",
    "default_margin",
    "stale_tokens",
]

MARGIN_PER_TARGET = 4
"""The default admission margin is one group per this many versions of the soft target
(:func:`default_margin`), chosen on the simulator's presets."""
DEFAULT_SLACK = 0
"""Entries per buffer beyond B′ (``rollout.deadline.slack``), chosen on the simulator's presets."""
DEFAULT_GRACE_STEPS = 0.25
"""The trainer's wait for a due group, in training steps (``rollout.deadline.grace_steps``),
chosen on the real bench (docs/deadline.md)."""


DEFAULT_CONTINUE_MAX = 2
"""How many versions past ``V + η_h`` the deadline action ``continue`` may move a group's deadline
(``rollout.deadline.continue_max``) before it truncates the group."""


def default_margin(soft: int) -> int:
    """The admission margin ``rollout.deadline.margin: null`` stands for: ``⌈η_s / 4⌉`` groups
    (1 up to η_s = 4, 2 at η_s = 8). Each group of margin lowers the mean staleness by about
    0.03 for about 0.8 % of throughput, and the staleness the deadline policy would otherwise
    add over AReaL's grows with η_s (docs/deadline.md)."""
    return -(-soft // MARGIN_PER_TARGET)


def stale_tokens(token_versions: Sequence[int], oldest: int) -> tuple[int, ...]:
    """The positions of the tokens generated before version ``oldest``: the ones a continued
    group's trajectory may not train on (``oldest`` is its batch's ``version − η_h``,
    :attr:`~stalebound.core.events.HandOverBatch.oldest_token`).

    >>> stale_tokens([0, 0, 1, 2, 3], oldest=2)
    (0, 1, 2)
    """
    return tuple([i for i, v in enumerate(token_versions) if v < oldest])


def deadline_bounds(soft: int | None, hard: int | None) -> tuple[int, int]:
    """``(η_s, η_h)`` from the settings given: both; only the soft target (``η_h = 2·η_s``);
    only the hard bound (``η_s = η_h // 2``). ``η_s > η_h`` is a :class:`ConfigError`."""
    problems = [
        problem
        for name, value in (("deadline.target", soft), ("staleness", hard))
        if value is not None
        for problem in staleness_problems(f"rollout.{name}", value)
    ]
    if soft is None and hard is None:
        problems.append(
            "rollout.staleness=None: staleness_policy=deadline needs the hard bound "
            "(rollout.staleness) or the soft target (rollout.deadline.target)"
        )
    if problems:
        raise ConfigError(problems)
    if hard is None:
        assert soft is not None
        return soft, 2 * soft
    if soft is None:
        return hard // 2, hard
    if soft > hard:
        raise ConfigError(
            f"rollout.deadline.target={soft}: the soft admission target must be ≤ the hard "
            f"bound rollout.staleness={hard}; raise rollout.staleness to at least {soft} (twice "
            "the target is the measured default) or lower the target"
        )
    return soft, hard


def deadline_knob_problems(
    *,
    action: object,
    at: object,
    margin: object,
    slack: object = 0,
    continue_max: object = DEFAULT_CONTINUE_MAX,
) -> list[str]:
    """What is wrong with :class:`DeadlineBoundPolicy`'s arguments, as
    ``rollout.deadline.name=value: why`` lines (a config section is checked by its own class)."""
    problems = [
        f"rollout.deadline.{name}={value!r}: must be an integer ≥ 0 ({unit})"
        for name, value, unit in (
            ("slack", slack, "groups"),
            ("margin", margin, "groups"),
            ("continue_max", continue_max, "versions"),
        )
        if not is_int(value) or value < 0  # type: ignore[operator]
    ]
    if action not in DEADLINE_ACTIONS:
        problems.append(
            f"rollout.deadline.action={action!r}: must be 'truncate' (keep the partial output), "
            "'abort' (throw it away) or 'continue' (keep generating; mask the tokens staler "
            "than the bound)"
        )
    if at not in DEADLINE_MOMENTS:
        problems.append(
            f"rollout.deadline.at={at!r}: must be 'consume' (when the trainer asks for the "
            "deadline buffer) or 'head' (when the deadline buffer becomes the head)"
        )
    return problems


class DeadlineBoundPolicy(BufferBacked):
    """Soft admission at ``η_s``, hard bound at ``η_h`` (see the module docstring).

    ``buffer`` holds the hard bound (its ``staleness`` is ``η_h``, its ``buffer_size`` is
    ``B + slack``); ``counter`` the soft target (its ``max_staleness`` is ``η_s``, its limit on
    concurrent rollouts the concurrency limit). ``action`` is ``truncate``, ``abort`` or
    ``continue``; ``margin`` the admission margin in groups; ``continue_max`` how many versions
    past ``V + η_h`` ``continue`` may move a deadline before it truncates."""

    name = "deadline"
    kind = PolicyKind.DEADLINE

    def __init__(
        self,
        buffer: StalenessBuffer,
        counter: CapacityCounter,
        *,
        action: str = "truncate",
        margin: int = 0,
        at: str = "consume",
        continue_max: int = DEFAULT_CONTINUE_MAX,
    ) -> None:
        problems = []
        if _not_a(StalenessBuffer, buffer):
            problems.append(f"buffer={buffer!r}: must be a StalenessBuffer")
        if _not_a(CapacityCounter, counter):
            problems.append(f"counter={counter!r}: must be a CapacityCounter")
        elif not _not_a(StalenessBuffer, buffer):
            if counter.staleness > buffer.staleness:
                problems.append(
                    f"soft target {counter.staleness} > hard bound {buffer.staleness}: the "
                    "soft admission target must be ≤ the hard bound"
                )
            if counter.consumer_batch_size != buffer.batch_size:
                problems.append(
                    f"counter.consumer_batch_size={counter.consumer_batch_size}: must equal the "
                    f"buffer's batch_size={buffer.batch_size}"
                )
        problems += deadline_knob_problems(
            action=action, at=at, margin=margin, continue_max=continue_max
        )
        if problems:
            raise ConfigError(problems)
        self.buffer = buffer
        self.counter = counter
        self.action = Verdict(action)
        self.margin = margin
        self.at = at
        self.continue_max = continue_max
        self._sentenced: set[Hashable] = set()  # due groups given their verdict, still running

    # ------------------------------------------------------------------ the policy's surface

    @property
    def soft_staleness(self) -> int:
        """The soft admission target η_s (the hard bound η_h is :attr:`staleness`)."""
        return self.counter.staleness

    def capacity(self, version: int | None = None) -> int:
        """AReaL's capacity at η_s less the margin, and never more than the buffer has room for
        (with η_h ≥ η_s and B′ ≥ B the buffer never binds: its window is the larger)."""
        V = self.version if version is None else min(version, self.version)
        return min(self._admissible(V), self.buffer.capacity(V))

    def _admissible(self, V: int) -> int:
        """AReaL's capacity at η_s less the margin — except that the margin never keeps back a
        group the batch of version ``V`` still lacks (at η_s = 0 it would never fill)."""
        cap = self.counter.capacity(V)
        s = self.counter.stat
        short = (V + 1) * self.counter.consumer_batch_size - (s.accepted + s.running)
        return max(cap - self.margin, min(cap, short))

    def try_admit(self, group_id: Hashable, version: int | None = None) -> Admission | None:
        if group_id in self.buffer:
            raise ProtocolError(
                f"try_admit(group_id={group_id!r}): the group is already in flight; use a fresh id"
            )
        V = self.version if version is None else version
        if is_int(V) and 0 <= V <= self.version and self._admissible(V) <= 0:
            return None
        r = self.buffer.try_reserve(group_id, version)
        if r is None:
            return None
        self.counter.enqueued()
        self.counter.submitted()
        return Admission(group_id, r.version, r.buffer_version)

    def complete(
        self, group_id: Hashable, payload: Any = None, *, segment_versions: Iterable[int] = ()
    ) -> bool:
        """Occupy the group's entry (never refused), then make the head ready if B groups have
        completed anywhere in the window."""
        self.buffer.occupy(group_id, payload, segment_versions=segment_versions)
        self.counter.accepted()
        self._sentenced.discard(group_id)
        self._make_ready()
        return True

    def abort(self, group_id: Hashable, cause: str = "aborted") -> None:
        self.buffer.abort(group_id, cause)
        self.counter.rejected()
        self._sentenced.discard(group_id)
        self._make_ready()

    def ready(self) -> bool:
        """Buffer v holds B completed groups and no due group is still running in it."""
        return self.buffer.ready() and not self._due_running(self.version)

    def consume(self) -> ConsumedBatch:
        """Defer the head's not-due reservations, consume it due-first, and make the next head
        ready. Reservations that found no later room are surplus (``aborted``; counted)."""
        buf = self.buffer
        v = buf.version
        for gid in buf.reserved_groups(v):
            buf.defer(gid)  # a due one (or one without room) stays: consume aborts it
        batch = buf.consume(due_first=True)
        for gid in batch.aborted:
            self.counter.rejected()
            self._sentenced.discard(gid)
        self._make_ready()
        return batch

    def deadline_verdicts(
        self, head: int, *, trainer_waiting: bool = False, overdue: bool = False
    ) -> Sequence[tuple[Hashable, Verdict]]:
        """The running groups whose deadline buffer ``V + η_h`` is ``head``, each with the
        deadline action, each once. The coordinator asks when ``head`` becomes the head and when
        the trainer waits for it; the policy acts at the moment ``at`` names: ``head`` (the
        first) or ``consume`` (the second: a group keeps generating while the trainer trains on
        the batch before its deadline buffer). ``overdue`` (the trainer has waited the grace):
        ``abort`` for every running group due at ``head``, and no other change."""
        if self.staleness == 0:
            return []  # η_h = 0 is synchronous training: the trainer waits for every group
        if overdue:  # the grace is over: abort what is still due, sentenced or not
            return [(gid, Verdict.ABORT) for gid in self._due_running(head)]
        if trainer_waiting != (self.at == "consume"):
            return []
        due = [gid for gid in self._due_running(head) if gid not in self._sentenced]
        if self.action is Verdict.CONTINUE:
            return [(gid, self._continue(gid)) for gid in due]
        if self.action is Verdict.TRUNCATE:
            self._sentenced.update(due)
        return [(gid, self.action) for gid in due]

    def _continue(self, gid: Hashable) -> Verdict:
        """Move a due group's deadline on (``CONTINUE``), or truncate it once it has reached
        ``continue_max`` versions past ``V + η_h`` or no later buffer has room."""
        buf = self.buffer
        until = _version(buf, gid) + buf.staleness + self.continue_max
        if buf.extend(gid, until) is not None:
            return Verdict.CONTINUE
        self._sentenced.add(gid)
        return Verdict.TRUNCATE

    def snapshot(self) -> dict[str, Any]:
        """The buffer's snapshot, the counter's state and the knobs, as plain data."""
        c = self.counter
        return {
            "policy": self.name,
            "buffer": self.buffer.snapshot(),
            "soft_staleness": c.staleness,
            "max_concurrent_rollouts": c.max_concurrent_rollouts,
            "stat": dict(vars(c.stat)),
            "action": self.action,
            "margin": self.margin,
            "continue_max": self.continue_max,
        }

    def load_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the state with :meth:`snapshot` output; a damaged or foreign snapshot raises
        :class:`ProtocolError` and changes nothing."""
        try:
            if snapshot["policy"] != self.name:
                raise ProtocolError(
                    f"load_snapshot(): the snapshot is of the {snapshot['policy']!r} policy, not "
                    f"{self.name!r}; resume with the staleness policy that wrote it"
                )
            buffer = StalenessBuffer.restore(snapshot["buffer"])
            stat = RolloutStat(**{k: int(n) for k, n in snapshot["stat"].items()})
            if stat.running != buffer.reserved_count or min(vars(stat).values()) < 0:
                raise ValueError(
                    f"running count {stat.running} does not match the buffer's "
                    f"{buffer.reserved_count} reservations"
                )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(
                f"load_snapshot(): the snapshot is damaged or not a deadline-policy snapshot "
                f"({type(exc).__name__}: {exc}); restore from an intact checkpoint"
            ) from exc
        self.buffer = buffer
        self.counter.stat = stat

    # ------------------------------------------------------------------ the head

    def _due_running(self, head: int) -> list[Hashable]:
        """Reservations in buffer ``head`` whose deadline is ``head``."""
        buf = self.buffer
        if head != buf.version:
            return []
        return [gid for gid in buf.reserved_groups(head) if buf.deadline(gid) == head]

    def _make_ready(self) -> None:
        """Consume at capacity's pace: once B groups have completed anywhere in the window, pull
        them forward into the head, deferring not-due reservations of the head for room."""
        buf = self.buffer
        if buf.ready() or len(buf) - buf.reserved_count < buf.batch_size:
            return
        v = buf.version
        while True:
            buf.pull_forward()
            if buf.ready() or len(buf) - buf.reserved_count == len(buf.occupied_groups(v)):
                return  # ready, or nothing left to pull
            # the head has no free entry: defer its not-due reservation with the most slack
            movable = sorted(
                (g for g in buf.reserved_groups(v) if buf.deadline(g) > v),
                key=lambda g: -buf.deadline(g),
            )
            if not any(buf.defer(g) is not None for g in movable):  # stops at the first
                return


def _version(buf: StalenessBuffer, gid: Hashable) -> int:
    where = buf.lookup(gid)
    assert where is not None
    return where[2]

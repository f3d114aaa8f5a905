"""The simulator: the core's staleness policies driven on a virtual clock.

One :class:`Simulation` runs one policy at one η on one seeded workload. It holds the real core
objects — a :class:`~stalebound.core.StalenessPolicy` (``BufferPolicy`` or ``CapacityPolicy``) and a
:class:`~stalebound.core.GroupTracker` — and plays the cluster around them: the dispatcher asks
``try_admit`` while engine slots are free, the engines (:class:`~stalebound.sim.engine.Replica`)
decode, finished members go to the tracker, complete groups to ``complete``, and the trainer calls
``consume`` whenever ``ready()`` is true and it is idle. After each train step the engines serve the
next version (after ``engine.sync_delay``). Nothing of the protocol is re-implemented here.

Accounting is per trajectory (group member): every member launched ends trained, dropped, failed or
cancelled (surplus, retried, aborted with its group), or is still in flight or waiting at the end;
:meth:`Simulation.conservation` counts each.
"""

from __future__ import annotations

import gc
import logging
import math
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from stalebound.core import (
    BufferPolicy,
    BufferState,
    CapacityCounter,
    CapacityPolicy,
    ConfigError,
    ConsumedBatch,
    GroupComplete,
    GroupFailed,
    GroupTracker,
    InvariantError,
    MemberId,
    Relaunch,
    StalenessBuffer,
    StalenessPolicy,
)
from stalebound.obs.trace import TraceRecorder, TrajectoryRecord
from stalebound.sim import proactive
from stalebound.sim.config import WorkloadConfig
from stalebound.sim.engine import EventQueue, Replica, Sequence
from stalebound.sim.workload import SampledSource, TrajectorySource, distribution_mean

__all__ = [
    "POLICIES",
    "Bound",
    "PolicySpec",
    "SimResult",
    "Simulation",
    "compute_bound",
    "policy_spec",
    "simulate",
]

log = logging.getLogger(__name__)

POLICIES = (
    "sync",
    "capacity",
    "capacity-drop",
    "buffer",
    "buffer+redundancy",
    "buffer+retry",
    "buffer+truncate",
)

# event kinds
_REPLICA, _TOOL, _TRAIN_DONE, _SYNC, _CHECK = range(5)

# member states
_DECODING, _TOOL_CALL, _FINISHED, _GONE = range(4)


@dataclass(frozen=True)
class PolicySpec:
    """A named policy: which core policy, with which redundancy and proactive filter."""

    name: str
    kind: str  # "buffer" or "capacity"
    drop_stale: bool = False
    redundancy: bool = False
    filter: str | None = None
    synchronous: bool = False


def policy_spec(name: str) -> PolicySpec:
    """The :class:`PolicySpec` of one of :data:`POLICIES`."""
    specs = {
        "sync": PolicySpec("sync", "buffer", synchronous=True),
        "capacity": PolicySpec("capacity", "capacity"),
        "capacity-drop": PolicySpec("capacity-drop", "capacity", drop_stale=True),
        "buffer": PolicySpec("buffer", "buffer"),
        "buffer+redundancy": PolicySpec("buffer+redundancy", "buffer", redundancy=True),
        "buffer+retry": PolicySpec("buffer+retry", "buffer", filter="retry"),
        "buffer+truncate": PolicySpec("buffer+truncate", "buffer", filter="truncate"),
    }
    if name not in specs:
        raise ConfigError(f"policy={name!r}: unknown policy; use one of {', '.join(POLICIES)}")
    return specs[name]


@dataclass(frozen=True)
class Bound:
    """The physical limit in trajectories per second: min(generation, training) capacity.

    ``generation`` = engine slots ÷ slot-seconds per usable trajectory, at full concurrency C per
    replica: ``R·C ÷ ((E[tokens per attempt]·(a + b·C) + E[tool seconds per attempt]) ÷ (1 − p))``
    with p the failure rate (a failed attempt stops at a uniform point, E[tokens] = E[L]·(1 − p/2)).
    ``training`` = ``B·N ÷ (step_time + per_token·B·N·E[L])``. Redundancy, drops and filters only
    lower what a policy achieves, never the bound.
    """

    generation: float
    training: float
    mean_length: float
    token_rate: float
    """Decode tokens per second of all replicas at full concurrency."""

    @property
    def value(self) -> float:
        return min(self.generation, self.training)


def compute_bound(
    cfg: WorkloadConfig,
    *,
    attempt_tokens: float | None = None,
    attempt_tool: float | None = None,
    failure_rate: float | None = None,
) -> Bound:
    """The :class:`Bound` of a workload. A replayed trace supplies its own per-attempt means
    (tokens, tool seconds) and failure rate in place of the workload's distributions."""
    e = cfg.engine
    batch = min(e.max_concurrency, e.max_batch or e.max_concurrency)
    step = e.step_base + e.step_per_seq * batch
    mean_l = distribution_mean(cfg.lengths, cfg.base_dir)
    p = cfg.failures.rate if failure_rate is None else failure_rate
    if attempt_tokens is None:
        attempt_tokens = mean_l * (1 - p / 2)
    else:
        mean_l = attempt_tokens
    if attempt_tool is None:
        attempt_tool = 0.0
        if cfg.agent.turns > 1:
            tool_mean = distribution_mean(cfg.agent.tool_latency, cfg.base_dir)
            attempt_tool = (cfg.agent.turns - 1) * tool_mean
    slots = e.replicas * batch
    per_success = (attempt_tokens * step + attempt_tool) / (1 - p) if p < 1 else math.inf
    generation = slots / per_success
    traj = cfg.batch.groups * cfg.batch.group_size
    training = traj / (cfg.trainer.step_time + cfg.trainer.per_token * traj * mean_l)
    return Bound(generation, training, mean_l, slots / step)


@dataclass
class SimResult:
    """What one run measured; :meth:`to_json` gives the documented keys."""

    policy: str
    staleness: int
    throughput: float
    bound: Bound
    trainer_util: float
    engine_util: float
    staleness_histogram: dict[int, int]
    violations: int
    wasted_fraction: float
    stuck_fraction: float | None
    blocked_fraction: float | None
    """Time the head buffer was STUCK while the trainer waited (buffer policies)."""
    truncated_fraction: float
    """Trained trajectories that were truncated by the proactive filter."""
    steps: int
    sim_time: float
    window: float
    events: int
    counts: dict[str, int]
    tokens: dict[str, float]
    timeline: list[tuple[float, str]] = field(default_factory=list)
    engine_idle: float = 0.0
    """Fraction of the window the replicas had no sequence (decoding or waiting), averaged."""

    @property
    def efficiency(self) -> float:
        return self.throughput / self.bound.value if self.bound.value > 0 else 0.0

    @property
    def staleness_mean(self) -> float:
        n = sum(self.staleness_histogram.values())
        return sum(k * c for k, c in self.staleness_histogram.items()) / n if n else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness_histogram, default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "staleness": self.staleness,
            "throughput": self.throughput,
            "bound": self.bound.value,
            "efficiency": self.efficiency,
            "trainer_util": self.trainer_util,
            "engine_util": self.engine_util,
            "engine_idle": self.engine_idle,
            "staleness_mean": self.staleness_mean,
            "staleness_max": self.staleness_max,
            "violations": self.violations,
            "wasted_fraction": self.wasted_fraction,
            "stuck_fraction": self.stuck_fraction,
            "blocked_fraction": self.blocked_fraction,
            "truncated_fraction": self.truncated_fraction,
            "bound_generation": self.bound.generation,
            "bound_training": self.bound.training,
            "steps": self.steps,
            "sim_time": self.sim_time,
            "events": self.events,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            "counts": dict(self.counts),
        }


class _Member:
    """One trajectory in flight."""

    __slots__ = (
        "end",
        "group",
        "number",
        "replica",
        "seg",
        "seq",
        "spec",
        "start",
        "state",
        "tokens",
        "tools",
        "truncated",
        "version",
    )

    def __init__(self, group: _Group, number: int, spec: Any, version: int, start: float) -> None:
        self.group = group
        self.number = number
        self.spec = spec
        self.version = version
        self.start = start
        self.seg = 0
        self.tokens = 0.0
        self.tools = 0
        self.state = _DECODING
        self.end = -1.0
        self.truncated = False
        self.replica: Replica | None = None
        self.seq: Sequence | None = None


class _Group:
    """One admitted group: its prompt, attempt and members (all launched, in launch order)."""

    __slots__ = ("attempt", "completed", "gid", "members", "prompt", "trained_members", "version")

    def __init__(self, gid: int, prompt: int, attempt: int, version: int) -> None:
        self.gid = gid
        self.prompt = prompt
        self.attempt = attempt
        self.version = version
        self.members: dict[int, _Member] = {}
        self.completed = False
        self.trained_members: tuple[_Member, ...] = ()


class Simulation:
    """One policy at one η on one workload (see the module docstring)."""

    def __init__(
        self,
        cfg: WorkloadConfig,
        policy: str,
        staleness: int,
        *,
        seed: int = 0,
        steps: int | None = None,
        source: TrajectorySource | None = None,
        recorder: TraceRecorder | None = None,
        record_timeline: bool = False,
        bound: Bound | None = None,
    ) -> None:
        if not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"staleness={staleness!r}: must be an integer ≥ 0 (η)")
        self.cfg = cfg
        self.spec = policy_spec(policy)
        self.eta = 0 if self.spec.synchronous else staleness
        self.steps = cfg.run.steps if steps is None else steps
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps!r}: must be ≥ 1 train steps")
        B, N = cfg.batch.groups, cfg.batch.group_size
        extra = cfg.redundancy.group_extra if self.spec.redundancy else 0
        self.launch = N + extra
        slots = cfg.engine.replicas * cfg.engine.max_concurrency
        # Engine slots are the physical limit; a group limit applies only when configured (a
        # running group holds at least one slot, so ``slots`` never binds).
        max_groups = cfg.batch.max_concurrent_groups or slots
        self.policy: StalenessPolicy
        self.buffer: StalenessBuffer | None = None
        if self.spec.kind == "buffer":
            buffer_size = math.ceil(B * cfg.redundancy.batch_factor) if self.spec.redundancy else B
            self.buffer = StalenessBuffer(
                B, self.eta, group_size=N, buffer_size=buffer_size, group_redundancy=self.launch
            )
            self.policy = BufferPolicy(self.buffer, max_concurrent=max_groups)
        else:
            counter = CapacityCounter(max_groups, B, self.eta)
            self.policy = CapacityPolicy(counter, drop_stale=self.spec.drop_stale)
        self.tracker = GroupTracker(N, self.launch, max_relaunches=cfg.failures.max_relaunches)
        self.source: TrajectorySource = source or SampledSource(cfg, seed, self.launch)
        self.recorder = recorder
        self.bound = compute_bound(cfg) if bound is None else bound
        e = cfg.engine
        self.replicas = [
            Replica(
                i,
                e.max_concurrency,
                e.step_base,
                e.step_per_seq,
                prefill=e.prefill,
                max_batch=e.max_batch,
            )
            for i in range(e.replicas)
        ]
        self.queue = EventQueue()
        self.free_slots = slots
        self.min_free_slots = slots
        """The fewest free engine slots seen: slots − this is the peak in use."""
        self.engine_version = 0
        self.training = False
        self.steps_done = 0
        self.groups: dict[int, _Group] = {}
        # replicas whose next completion must be re-derived, in first-touched order: a set would
        # iterate in address order and make tie-breaks differ from run to run
        self._dirty: dict[Replica, None] = {}
        self._cursor = 0
        self._next_gid = 0
        self._next_prompt = 0
        self._retry: deque[tuple[int, int]] = deque()
        self._admit_blocked = False
        self._touched = True  # the policy changed since the head state was last looked at
        self.counts: Counter[str] = Counter()
        self.tokens: dict[str, float] = {"generated": 0.0, "wasted": 0.0, "trained": 0.0}
        self.histogram: Counter[int] = Counter()
        self._busy = 0.0
        self._train_start = 0.0
        # the head buffer's state over time (buffer policies)
        self._head = BufferState.PENDING
        self._head_since = 0.0
        self._stuck = 0.0
        self._blocked = False
        self._blocked_since = 0.0
        self._blocked_time = 0.0
        self._check_pending = False
        self.record_timeline = record_timeline
        self.timeline: list[tuple[float, str]] = (
            [(0.0, BufferState.PENDING.name)] if record_timeline and self.buffer is not None else []
        )
        # the measuring window starts after the warm-up steps
        self._warmup = min(self.steps - 1, int(self.steps * cfg.run.warmup_fraction))
        self._mark: dict[str, float] = {}

    # ------------------------------------------------------------------ run

    def run(self) -> SimResult:
        """Run until ``steps`` train steps have finished; returns the measurements."""
        # The run allocates millions of short-lived objects; the cyclic collector would rescan the
        # live ones over and over (about a fifth of the run time). Groups break their reference
        # cycles when they leave, so plain reference counting frees them.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

    def _run(self) -> SimResult:
        q = self.queue
        self._snapshot_window()  # t = 0, replaced at the end of the warm-up steps
        self._after_event()
        while self.steps_done < self.steps:
            event = q.pop()
            if event is None:
                log.warning(
                    "%s η=%d: nothing left to happen after %d of %d steps (t=%.1f s)",
                    self.spec.name,
                    self.eta,
                    self.steps_done,
                    self.steps,
                    q.now,
                )
                break
            _, _, kind, a, b = event
            if kind == _REPLICA:
                if b == a.ticket:
                    self._on_replica(a)
            elif kind == _TOOL:
                self._on_tool_done(a, b)
            elif kind == _TRAIN_DONE:
                self._on_train_done(a)
            elif kind == _SYNC:
                self.engine_version = max(self.engine_version, a)
                self._admit_blocked = False
            else:
                self._check_pending = False
            if self.steps_done >= self.steps:
                break  # measure exactly ``steps`` batches: do not start the next one
            self._after_event()
        if self.recorder is not None:
            self._record_unfinished()
        return self._result()

    def _record_unfinished(self) -> None:
        """End of run: record what is still in flight, so a trace keeps every trajectory."""
        for g in self.groups.values():
            for m in g.members.values():
                if m.state in (_DECODING, _TOOL_CALL):
                    progress = self._progress(m)
                    m.tokens = progress
                    self._record(m, "running", complete=False)
                elif m.state == _FINISHED:
                    self._record(m, "finished", complete=not m.truncated)

    def _after_event(self) -> None:
        if self.spec.filter is not None:
            self._run_proactive_filter()
        if not self.training and self.policy.ready():
            self._train()
            self._touched = True
        if not self._admit_blocked and self.free_slots >= self.launch:
            self._dispatch()
        now = self.queue.now
        for r in self._dirty:
            r.ticket += 1
            t = r.next_finish(now)
            if t is not None:
                self.queue.schedule(t, _REPLICA, r, r.ticket)
        self._dirty.clear()
        if self._touched and self.buffer is not None:
            self._touched = False
            self._track_head(now)

    # ------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        if self._admit_blocked:
            return
        policy, launch, now = self.policy, self.launch, self.queue.now
        while self.free_slots >= launch:
            if self._retry:
                prompt, attempt = self._retry[0]
            else:
                prompt, attempt = self._next_prompt, 0
            gid = self._next_gid
            admission = policy.try_admit(gid, self.engine_version)
            if admission is None:
                # The policy says no until its state changes (a completion, an abort, a consume
                # or a new engine version); asking again before that would only cost time.
                self._admit_blocked = True
                return
            self._next_gid += 1
            self._touched = True
            if self._retry:
                self._retry.popleft()
            else:
                self._next_prompt += 1
            group = _Group(gid, prompt, attempt, admission.version)
            self.groups[gid] = group
            self.counts["groups_admitted"] += 1
            for mid in self.tracker.start(gid, admission.version):
                self._launch(group, mid.number, admission.version, now)

    def _launch(self, group: _Group, number: int, version: int, now: float) -> None:
        spec = self.source.spec(group.prompt, group.attempt, number)
        m = _Member(group, number, spec, version, now)
        group.members[number] = m
        r = self.replicas[self._cursor]
        if r.slots < r.max_slots:  # the usual case: round robin finds room at once
            self._cursor = r.index + 1 if r.index + 1 < len(self.replicas) else 0
        else:
            r = self._pick_replica()
        r.slots += 1
        self.free_slots -= 1
        if self.free_slots < self.min_free_slots:
            self.min_free_slots = self.free_slots
        m.replica = r
        r.advance(now)
        m.seq = r.join(m, spec.segments[0])
        self._dirty[r] = None
        self.counts["launched"] += 1

    def _pick_replica(self) -> Replica:
        reps = self.replicas
        n = len(reps)
        i = self._cursor
        for _ in range(n):
            r = reps[i]
            i = i + 1 if i + 1 < n else 0
            if r.slots < r.max_slots:
                self._cursor = i
                return r
        raise InvariantError(f"no free engine slot although {self.free_slots} are counted free")

    # --------------------------------------------------------------- engines

    def _on_replica(self, r: Replica) -> None:
        now = self.queue.now
        r.advance(now)
        self._dirty[r] = None
        for s in r.pop_finished():
            m: _Member = s.owner
            m.tokens += s.finish - s.start
            m.seq = None
            m.seg += 1
            if m.seg < len(m.spec.segments):
                m.state = _TOOL_CALL
                self.queue.schedule(now + m.spec.tools[m.seg - 1], _TOOL, m, m.seg)
            else:
                self._end_member(m)

    def _on_tool_done(self, m: _Member, seg: int) -> None:
        if m.state != _TOOL_CALL or m.seg != seg:
            return  # cancelled during the tool call
        m.tools += 1
        m.state = _DECODING
        r = m.replica
        assert r is not None
        r.advance(self.queue.now)
        m.seq = r.join(m, m.spec.segments[m.seg])
        self._dirty[r] = None

    def _free_slot(self, m: _Member) -> None:
        r = m.replica
        assert r is not None
        r.slots -= 1
        self.free_slots += 1

    def _end_member(self, m: _Member) -> None:
        """A member reached its natural end: it finished, or it failed."""
        m.replica.slots -= 1  # type: ignore[union-attr]
        self.free_slots += 1
        m.state = _FINISHED
        m.end = self.queue.now
        g = m.group
        mid = MemberId(g.gid, m.number)
        self.tokens["generated"] += m.tokens
        if m.spec.failed:
            m.state = _GONE
            self._count_member(m, "failed", complete=True)
            outcome = self.tracker.fail(mid, "failed", version=self.engine_version)
            if isinstance(outcome, Relaunch):
                self.counts["relaunched"] += 1
                self._launch(g, outcome.member.number, outcome.version, self.queue.now)
            elif isinstance(outcome, GroupFailed):
                self.policy.abort(g.gid, "failed")
                self._abort_group(g, "aborted")
                self.counts["groups_failed"] += 1
            return
        done = self.tracker.finish(mid, m)
        if isinstance(done, GroupComplete):
            self._cancel_members(g, done.surplus, "surplus")
            self._complete(g, tuple(r.result for r in done.members))

    def _complete(self, g: _Group, members: tuple[_Member, ...]) -> None:
        self._admit_blocked = False
        self._touched = True
        g.completed = True
        g.trained_members = members
        if not self.policy.complete(g.gid, g):
            self._drop(g)  # capacity-drop: already staler than η

    def _cancel(self, m: _Member, cause: str, *, trained: bool = False) -> None:
        """Stop a member still generating; its tokens count as ``cause`` unless ``trained``."""
        now = self.queue.now
        if m.state == _DECODING:
            r = m.replica
            assert r is not None and m.seq is not None
            r.advance(now)
            m.tokens += r.cancel(m.seq)
            m.seq = None
            self._dirty[r] = None
        elif m.state != _TOOL_CALL:
            raise InvariantError(f"cancel of member {m.group.gid}/{m.number} in state {m.state}")
        self._free_slot(m)
        self.tokens["generated"] += m.tokens
        m.end = now
        m.truncated = trained
        m.state = _FINISHED if trained else _GONE
        if not trained:
            self._count_member(m, cause, complete=False)

    def _cancel_members(self, g: _Group, members: tuple[MemberId, ...], cause: str) -> None:
        for mid in members:
            self._cancel(g.members[mid.number], cause)

    def _abort_group(self, g: _Group, cause: str) -> None:
        """The group's entry is gone: stop its running members and waste what it generated."""
        if g.gid in self.tracker:
            self.tracker.cancel(g.gid)
        for m in g.members.values():
            if m.state in (_DECODING, _TOOL_CALL):
                self._cancel(m, cause)
            elif m.state == _FINISHED:
                m.state = _GONE
                self._count_member(m, cause, complete=True)
        self._forget(g, cause)

    def _forget(self, g: _Group, cause: str) -> None:
        self._admit_blocked = False  # an abort, drop or surplus cancel frees policy room
        self._touched = True
        del self.groups[g.gid]
        g.members = {}  # break the group ↔ member cycles
        g.trained_members = ()
        self.counts[f"groups_{cause}"] += 1

    def _count_member(self, m: _Member, outcome: str, *, complete: bool) -> None:
        self.counts[outcome] += 1
        self.tokens["wasted"] += m.tokens
        if self.recorder is not None:
            self._record(m, outcome, complete)

    def _record(self, m: _Member, outcome: str, complete: bool) -> None:
        assert self.recorder is not None
        self.recorder.record(
            TrajectoryRecord(
                prompt_id=m.group.prompt,
                group_id=m.group.gid,
                member=m.number,
                start=m.start,
                end=m.end if m.end >= 0 else self.queue.now,
                tokens=round(m.tokens),
                tool_latencies=tuple(m.spec.tools[: m.tools]),
                failed=m.spec.failed and complete,
                version=m.version,
                complete=complete,
                outcome=outcome,
            )
        )

    # --------------------------------------------------------------- trainer

    def _train(self) -> None:
        batch = self.policy.consume()
        self._admit_blocked = False
        self._settle(batch)
        tokens = 0.0
        trained = truncated = 0
        for cg in batch.groups:
            g: _Group = cg.payload
            staleness = batch.version - cg.version
            for m in g.trained_members:
                tokens += m.tokens
                trained += 1
                truncated += m.truncated
                m.state = _GONE
                if self.recorder is not None:
                    self._record(m, "trained", complete=not m.truncated)
            self.histogram[staleness] += len(g.trained_members)
            del self.groups[g.gid]
            g.members = {}  # break the group ↔ member cycles
            g.trained_members = ()
        self.counts["trained"] += trained
        self.counts["truncated_trained"] += truncated
        self.tokens["trained"] += tokens
        t = self.cfg.trainer
        now = self.queue.now
        self.training = True
        # the hand-over counts as trainer idle; publishing the weights as busy
        self._train_start = now + t.handoff
        busy = t.step_time + t.per_token * tokens + t.publish
        self.queue.schedule(now + t.handoff + busy, _TRAIN_DONE, batch.version)

    def _settle(self, batch: ConsumedBatch) -> None:
        """Carry out what consume returned: cancel surplus reservations, waste dropped groups."""
        for gid in batch.aborted:
            self._abort_group(self.groups[self._gid(gid)], "surplus")
        for cg in batch.dropped_groups:
            # CapacityPolicy reports a group refused by complete() again here: drop it once
            if self._gid(cg.group_id) in self.groups:
                self._drop(cg.payload)

    def _drop(self, g: _Group) -> None:
        for m in g.trained_members:
            m.state = _GONE
            self._count_member(m, "dropped", complete=True)
        self._forget(g, "dropped")

    def _on_train_done(self, version: int) -> None:
        now = self.queue.now
        self.training = False
        self._busy += now - self._train_start
        self.steps_done += 1
        new = version + 1
        if self.cfg.engine.update_stall > 0:  # the replicas install the new weights
            for r in self.replicas:
                r.advance(now)
                r.stall(self.cfg.engine.update_stall)
                self._dirty[r] = None
        if self.cfg.engine.sync_delay > 0:
            self.queue.schedule(now + self.cfg.engine.sync_delay, _SYNC, new)
        else:
            self.engine_version = max(self.engine_version, new)
            self._admit_blocked = False
        if self.steps_done == self._warmup:
            self._snapshot_window()

    # ------------------------------------------------------- proactive filter

    def _run_proactive_filter(self) -> None:
        """Ask :func:`stalebound.sim.proactive.decide` and carry out its action on the core."""
        buf = self.buffer
        assert buf is not None and self.spec.filter is not None
        if self.training:
            return  # the decision needs an idle trainer; skip gathering its inputs
        v = buf.version
        if buf.state(v) is not BufferState.STUCK:
            return
        now = self.queue.now
        p = self.cfg.proactive
        stuck_for = now - self._head_since if self._head is BufferState.STUCK else 0.0
        action = proactive.decide(
            self.spec.filter,
            buf,
            threshold=p.threshold,
            stuck_for=stuck_for,
            stuck_time=p.stuck_time,
            trainer_idle=not self.training,
        )
        if action is None:
            if p.stuck_time > stuck_for and not self._check_pending:
                self._check_pending = True  # wake up when the time trigger is due
                self.queue.schedule(now + p.stuck_time - stuck_for, _CHECK)
            return
        if action.method == "retry":
            for gid in action.groups:
                g = self.groups[self._gid(gid)]
                self.policy.abort(g.gid, "retried")
                self._abort_group(g, "retried")
                self._retry.append((g.prompt, g.attempt + 1))
                self.counts["groups_retry"] += 1
            self.counts["pulled_forward"] += len(buf.pull_forward(v))
        else:
            for gid in action.groups:
                self._truncate(self.groups[self._gid(gid)])

    def _truncate(self, g: _Group) -> None:
        """Force-complete a group with what its members generated so far."""
        finished = [r.result for r in self.tracker.partial(g.gid)]
        running = self.tracker.cancel(g.gid)
        need = self.cfg.batch.group_size - len(finished)
        keep = sorted(running, key=lambda mid: -self._progress(g.members[mid.number]))[:need]
        for mid in running:
            m = g.members[mid.number]
            if mid in keep:
                self._cancel(m, "truncated", trained=True)
                self.counts["truncated"] += 1
            else:
                self._cancel(m, "surplus")
        self.counts["groups_truncated"] += 1
        self._complete(g, tuple(finished) + tuple(g.members[mid.number] for mid in keep))

    def _progress(self, m: _Member) -> float:
        if m.state == _DECODING and m.replica is not None and m.seq is not None:
            m.replica.advance(self.queue.now)
            return m.tokens + m.replica.decoded(m.seq)
        return m.tokens

    @staticmethod
    def _gid(gid: Hashable) -> int:
        if not isinstance(gid, int):
            raise InvariantError(f"group id {gid!r} is not one the simulator issued")
        return gid

    # --------------------------------------------------------------- metrics

    def _track_head(self, now: float) -> None:
        buf = self.buffer
        assert buf is not None
        state = buf.state(buf.version)
        blocked = state is BufferState.STUCK and not self.training
        if blocked is not self._blocked:
            if self._blocked:
                self._blocked_time += now - self._blocked_since
            self._blocked = blocked
            self._blocked_since = now
        if state is not self._head:
            if self._head is BufferState.STUCK:
                self._stuck += now - self._head_since
            self._head = state
            self._head_since = now
            if self.record_timeline:
                self.timeline.append((now, state.name))

    def _stuck_until(self, now: float) -> float:
        if self._head is BufferState.STUCK:
            return self._stuck + now - self._head_since
        return self._stuck

    def _blocked_until(self, now: float) -> float:
        if self._blocked:
            return self._blocked_time + now - self._blocked_since
        return self._blocked_time

    def _generated_until(self, now: float) -> float:
        total = 0.0
        for r in self.replicas:
            r.advance(now)
            total += r.tokens
        return total

    def _busy_until(self, now: float) -> float:
        return self._busy + (max(0.0, now - self._train_start) if self.training else 0.0)

    def _engine_busy_until(self, now: float) -> float:
        total = 0.0
        for r in self.replicas:
            r.advance(now)
            total += r.busy_time
        return total / len(self.replicas)

    def _snapshot_window(self) -> None:
        now = self.queue.now
        self._mark = {
            "time": now,
            "trained": float(self.counts["trained"]),
            "busy": self._busy_until(now),
            "tokens": self._generated_until(now),
            "engine_busy": self._engine_busy_until(now),
            "stuck": self._stuck_until(now),
            "blocked": self._blocked_until(now),
            "truncated": float(self.counts["truncated_trained"]),
        }

    def _result(self) -> SimResult:
        now = self.queue.now
        mark = self._mark
        window = now - mark["time"]
        trained = self.counts["trained"] - mark["trained"]
        throughput = trained / window if window > 0 else 0.0
        trainer_util = (self._busy_until(now) - mark["busy"]) / window if window > 0 else 0.0
        tokens = self._generated_until(now) - mark["tokens"]
        engine_util = tokens / (self.bound.token_rate * window) if window > 0 else 0.0
        engine_busy = self._engine_busy_until(now) - mark["engine_busy"]
        engine_idle = 1.0 - engine_busy / window if window > 0 else 0.0
        stuck = blocked = None
        if self.buffer is not None and window > 0:
            stuck = (self._stuck_until(now) - mark["stuck"]) / window
            blocked = (self._blocked_until(now) - mark["blocked"]) / window
        truncated = self.counts["truncated_trained"] - mark["truncated"]
        decided = self.tokens["wasted"] + self.tokens["trained"]
        counts = dict(self.counts)
        counts.update(self.conservation())
        return SimResult(
            policy=self.spec.name,
            staleness=self.eta,
            throughput=throughput,
            bound=self.bound,
            trainer_util=trainer_util,
            engine_util=engine_util,
            staleness_histogram=dict(sorted(self.histogram.items())),
            violations=sum(n for k, n in self.histogram.items() if k > self.eta),
            wasted_fraction=self.tokens["wasted"] / decided if decided else 0.0,
            stuck_fraction=stuck,
            blocked_fraction=blocked,
            truncated_fraction=truncated / trained if trained else 0.0,
            steps=self.steps_done,
            sim_time=now,
            window=window,
            events=self.queue.processed,
            counts=counts,
            tokens=dict(self.tokens),
            timeline=self.timeline,
            engine_idle=engine_idle,
        )

    def conservation(self) -> dict[str, int]:
        """Members still in flight (``running``), finished in an incomplete group
        (``finished_pending``), or in a complete group not yet consumed (``waiting``)."""
        running = finished_pending = waiting = 0
        for g in self.groups.values():
            if g.completed:
                waiting += len(g.trained_members)
                continue
            for m in g.members.values():
                if m.state in (_DECODING, _TOOL_CALL):
                    running += 1
                elif m.state == _FINISHED:
                    finished_pending += 1
        return {"running": running, "finished_pending": finished_pending, "waiting": waiting}


def simulate(
    cfg: WorkloadConfig,
    policy: str,
    staleness: int,
    *,
    seed: int = 0,
    steps: int | None = None,
    source: TrajectorySource | None = None,
    recorder: TraceRecorder | None = None,
    record_timeline: bool = False,
    bound: Bound | None = None,
) -> SimResult:
    """Run one :class:`Simulation` and return its :class:`SimResult`."""
    return Simulation(
        cfg,
        policy,
        staleness,
        seed=seed,
        steps=steps,
        source=source,
        recorder=recorder,
        record_timeline=record_timeline,
        bound=bound,
    ).run()

"""The simulator: a virtual clock, an engine model and a trainer model driving the core's coordinator.

One :class:`Simulation` runs one policy at one η on one seeded workload. Every staleness decision —
admission, reservation, groups (N of N′, relaunches), occupy, consume, surplus, filters, the
proactive filter and its timer — is the :class:`~stalebound.core.Coordinator`'s, the same object
``stalebound train`` runs in its executor. The simulator only plays the world around it:

* the clock (:class:`~stalebound.sim.engine.EventQueue`): events ordered by time, then sequence;
* the engines (:class:`EngineModel`): replicas with continuous batching decode each member's
  segments; a member's end becomes ``MemberFinished`` or ``MemberFailed``;
* the trainer (:class:`TrainerModel`): when idle it asks for a batch (``BatchWanted``), trains on
  what is handed over, then publishes the next version (``VersionPublished``, after
  ``engine.sync_delay``);
* the dispatcher: whenever the coordinator says capacity may have opened (``Wake``), it keeps
  prompts queued (``Submitted``) and asks for admissions (``Dispatch``) as far as free engine slots
  allow.

Actions are carried out in order: launch a member on a replica, abort or truncate one, arm or cancel
a timer, train on a handed-over batch, count what ended untrained. With ``action_log`` every event
and the actions it produced are reported, so a run can be compared with the executor's.

Accounting is per trajectory (group member): every member launched ends trained, dropped, failed or
cancelled (surplus, retried, aborted with its group), or is still in flight or waiting at the end;
:meth:`Simulation.conservation` counts each.
"""

from __future__ import annotations

import gc
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

from stalebound.core import (
    BufferState,
    ConfigError,
    InvariantError,
    MemberId,
)
from stalebound.core.coordinator import Coordinator
from stalebound.core.deadline import (
    DEFAULT_GRACE_STEPS,
    DEFAULT_SLACK,
    deadline_bounds,
    default_margin,
)
from stalebound.core.events import (
    AbortGroup,
    AbortRequest,
    ActionLog,
    ArmTimer,
    BatchWanted,
    CancelTimer,
    Dispatch,
    Event,
    HandOverBatch,
    LaunchMember,
    MemberFailed,
    MemberFinished,
    ReportDrop,
    ReportFailure,
    ReportStall,
    Retry,
    StartGroup,
    Stop,
    Submitted,
    TimerFired,
    TruncateMember,
    VersionPublished,
    Wake,
)
from stalebound.core.settings import CoordinatorSettings, build_policy, default_max_concurrent
from stalebound.obs.trace import TraceRecorder, TrajectoryRecord
from stalebound.sim.config import WorkloadConfig
from stalebound.sim.engine import EventQueue, Replica, Sequence
from stalebound.sim.workload import SampledSource, TrajectorySource, distribution_mean

__all__ = [
    "POLICIES",
    "Bound",
    "EngineModel",
    "PolicySpec",
    "SimResult",
    "Simulation",
    "TrainerModel",
    "compute_bound",
    "coordinator_settings",
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
    "deadline",
    "deadline-tight",
    "deadline-abort",
)

PROACTIVE_MAX_RETRIES = 2
"""How often the proactive filter may retry one prompt: the runtime's default
(``rollout.proactive_filter.max_retries``)."""

# clock event kinds
_REPLICA, _TOOL, _CUT, _TRAIN_DONE, _SYNC, _TIMER, _STEP_DONE = range(7)

# member states (_ENDING: its segment just ended, not yet reported; _CUTTING: truncated, its
# episode returns on the next event)
_DECODING, _TOOL_CALL, _ENDING, _CUTTING, _FINISHED, _GONE = range(6)

# How the coordinator's causes are counted per member (the simulator's result keys): a member
# stopped or thrown away with its failed group is "aborted"; "failed" counts its own failures.
_COUNTED_AS = {"abandoned": "aborted", "failed": "aborted"}


@dataclass(frozen=True)
class PolicySpec:
    """A named policy: which core policy, with which redundancy and proactive filter."""

    name: str
    kind: str  # "buffer" or "capacity"
    drop_stale: bool = False
    redundancy: bool = False
    filter: str | None = None
    synchronous: bool = False
    tight: bool = False
    """``deadline`` kinds: the soft target η_s defaults to the hard bound η_h itself, not to
    ``η_h // 2``."""
    deadline_action: str = "truncate"

    def target(self, staleness: int, target: int | None = None) -> int | None:
        """The soft admission target η_s at the hard bound ``staleness`` (η_h): ``target`` when
        given, else ``η_h // 2`` (``η_h`` when :attr:`tight`); ``None`` outside ``deadline``."""
        if self.kind != "deadline":
            return None
        soft, _ = deadline_bounds(
            target if target is not None or not self.tight else staleness, staleness
        )
        return soft

    def hard_bound(self, soft: int) -> int:
        """The hard bound η_h that pairs with the soft target ``soft`` by default: what
        ``--staleness`` meant for the ``deadline`` kinds before it named the hard bound."""
        if self.kind != "deadline" or self.tight:
            return soft
        return deadline_bounds(soft, None)[1]


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
        "deadline": PolicySpec("deadline", "deadline"),
        "deadline-tight": PolicySpec("deadline-tight", "deadline", tight=True),
        "deadline-abort": PolicySpec("deadline-abort", "deadline", deadline_action="abort"),
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
    trainer_waits: list[float] = field(default_factory=list)
    """Each measured step's wait: from the trainer asking for the batch (the end of the step
    before) to its training starting (hand-over included), as ``wait_s`` in a real run's
    metrics."""
    target: int | None = None
    """The soft admission target η_s of the ``deadline`` kinds (``staleness`` is the hard bound
    η_h); ``None`` for the others, which admit at the bound itself."""

    @property
    def admission(self) -> int:
        """η_s: the staleness admission aims at (the target, else the bound itself)."""
        return self.staleness if self.target is None else self.target

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
            "target": self.admission,
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
    """One trajectory: where it decodes, what it has generated, and how it ended."""

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

    @property
    def score(self) -> float:
        """The trajectory's reward, for group post-processors: a source's spec may carry one
        (``spec.score``); sampled workloads have none (0.0)."""
        return float(getattr(self.spec, "score", 0.0))


class _Group:
    """One admitted group: its prompt (the sample index), attempt and members, in launch order."""

    __slots__ = ("attempt", "finished", "gid", "members", "prompt", "version")

    def __init__(self, gid: int, prompt: int, attempt: int, version: int) -> None:
        self.gid = gid
        self.prompt = prompt
        self.attempt = attempt
        self.version = version
        self.members: dict[int, _Member] = {}
        self.finished = 0


class EngineModel:
    """Inference replicas with continuous batching (:class:`~stalebound.sim.engine.Replica`):
    where each member decodes, when it finishes, and the slots and tokens that costs.

    Members are placed round robin over replicas with a free slot; a member keeps its slot through
    its tool calls. Replicas whose next completion changed are re-scheduled by :meth:`reschedule`
    once per clock event."""

    def __init__(self, cfg: WorkloadConfig) -> None:
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
        self.slots = e.replicas * e.max_concurrency
        self.free_slots = self.slots
        self.min_free_slots = self.slots
        """The fewest free engine slots seen: slots − this is the peak in use."""
        # replicas whose next completion must be re-derived, in first-touched order: a set would
        # iterate in address order and make tie-breaks differ from run to run
        self._dirty: dict[Replica, None] = {}
        self._cursor = 0

    def place(self, m: _Member, now: float) -> None:
        """Give ``m`` a slot and start decoding its first segment."""
        r = self.replicas[self._cursor]
        if r.slots < r.max_slots:  # the usual case: round robin finds room at once
            self._cursor = r.index + 1 if r.index + 1 < len(self.replicas) else 0
        else:
            r = self._pick()
        r.slots += 1
        self.free_slots -= 1
        if self.free_slots < self.min_free_slots:
            self.min_free_slots = self.free_slots
        m.replica = r
        self.decode(m, now)

    def _pick(self) -> Replica:
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

    def decode(self, m: _Member, now: float) -> None:
        """Start decoding ``m``'s current segment."""
        r = m.replica
        assert r is not None
        r.advance(now)
        m.state = _DECODING
        m.seq = r.join(m, m.spec.segments[m.seg])
        self._dirty[r] = None

    def stop(self, m: _Member, now: float) -> None:
        """Stop ``m`` decoding (if it is) and free its slot; its tokens so far are kept."""
        r = m.replica
        assert r is not None
        if m.state == _DECODING:
            assert m.seq is not None
            r.advance(now)
            m.tokens += r.cancel(m.seq)
            m.seq = None
            self._dirty[r] = None
        self.release(m)

    def release(self, m: _Member) -> None:
        r = m.replica
        assert r is not None
        r.slots -= 1
        self.free_slots += 1
        m.replica = None

    def finished(self, r: Replica, now: float) -> list[_Member]:
        """The members whose segment on ``r`` ended by ``now`` (their tokens counted)."""
        r.advance(now)
        self._dirty[r] = None
        done = []
        for s in r.pop_finished():
            m: _Member = s.owner
            m.tokens += s.finish - s.start
            m.seq = None
            m.seg += 1
            m.state = _ENDING
            done.append(m)
        return done

    def progress(self, m: _Member, now: float) -> float:
        """Tokens ``m`` has generated by ``now``."""
        if m.state == _DECODING and m.replica is not None and m.seq is not None:
            m.replica.advance(now)
            return m.tokens + m.replica.decoded(m.seq)
        return m.tokens

    def reschedule(self, queue: EventQueue) -> None:
        now = queue.now
        for r in self._dirty:
            r.ticket += 1
            t = r.next_finish(now)
            if t is not None:
                queue.schedule(t, _REPLICA, r, r.ticket)
        self._dirty.clear()

    def stall(self, now: float, seconds: float) -> None:
        """Every replica stops decoding for ``seconds`` (installing new weights, say)."""
        if seconds > 0:
            for r in self.replicas:
                r.advance(now)
                r.stall(seconds)
                self._dirty[r] = None

    def busy(self, now: float) -> float:
        """Seconds a replica had a sequence (decoding or waiting) up to ``now``, averaged."""
        total = 0.0
        for r in self.replicas:
            r.advance(now)
            total += r.busy_time
        return total / len(self.replicas)

    def generated(self, now: float) -> float:
        """Tokens decoded by every replica up to ``now``."""
        total = 0.0
        for r in self.replicas:
            r.advance(now)
            total += r.tokens
        return total


class TrainerModel:
    """The trainer: one batch at a time. ``handoff`` seconds pass before it starts (counted as
    idle), then ``step_time + per_token × trained tokens`` seconds of training and ``publish``
    seconds handing the weights to the engines (both busy).

    With ``contention`` the training runs ``1 + contention × s`` times slower while a share ``s``
    of the replicas has work: :meth:`reshare` is told each change of ``s`` and returns the step's
    new end (the simulator moves the step's end event, superseding the old one by ``ticket``)."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        t = cfg.trainer
        self.step_time = t.step_time
        self.per_token = t.per_token
        self.handoff = t.handoff
        self.publish = t.publish
        self.contention = t.contention
        self.publish_per_start = t.publish_per_start
        self.training = False
        self.steps_done = 0
        self.ticket = 0
        """Numbers the step's end event; a moved end supersedes the earlier event."""
        self._busy = 0.0
        self._start = 0.0
        self._work = 0.0
        """Training left at ``_mark``, in seconds on an uncontended processor."""
        self._mark = 0.0
        self._slow = 1.0
        self._free_since = 0.0
        self.waits: list[float] = []
        """Each step's wait, from the trainer asking for a batch to training (the hand-over)."""

    def start(self, now: float, tokens: float, share: float = 0.0) -> float:
        """Take a batch of ``tokens`` tokens while a share ``share`` of the replicas has work;
        returns when the step (publication included) ends."""
        self.training = True
        self.ticket += 1
        self._start = self._mark = now + self.handoff
        self.waits.append(self._start - self._free_since)
        self._work = self.step_time + self.per_token * tokens
        self._slow = 1.0 + self.contention * share
        return self._end()

    def _end(self) -> float:
        return self._mark + self._work * self._slow + self.publish

    def reshare(self, now: float, share: float) -> float | None:
        """The share of replicas with work changed at ``now``: the step's new end, or ``None``
        when it does not move (no contention, no step, or the training is over)."""
        slow = 1.0 + self.contention * share
        if not self.training or slow == self._slow:
            return None
        if now > self._mark:  # training since the mark (not still in the hand-over)
            done = (now - self._mark) / self._slow
            if done >= self._work:
                return None  # publishing
            self._work -= done
            self._mark = now
        self._slow = slow
        self.ticket += 1
        return self._end()

    def done(self, now: float) -> None:
        self.training = False
        self._busy += now - self._start
        self._free_since = now
        self.steps_done += 1

    def busy_until(self, now: float) -> float:
        return self._busy + (max(0.0, now - self._start) if self.training else 0.0)


def coordinator_settings(
    cfg: WorkloadConfig, spec: PolicySpec, staleness: int, target: int | None = None
) -> CoordinatorSettings:
    """The coordinator's settings for one policy on a workload at the hard bound ``staleness``
    (η_h) and, for the ``deadline`` kinds, the soft target ``target`` (η_s; ``None``: the
    policy's default, :meth:`PolicySpec.target`): what ``stalebound train`` would run with the
    matching ``rollout`` section.

    ``batch.max_concurrent_groups`` is ``max_concurrent_rollouts``; without it the engine slots are
    the only limit (a running group holds at least one slot, so the group limit never binds).
    ``proactive.stuck_time = 0`` acts at once (``stuck_timeout_s: null``)."""
    B, N = cfg.batch.groups, cfg.batch.group_size
    launch = N + (cfg.redundancy.group_extra if spec.redundancy else 0)
    slots = cfg.engine.replicas * cfg.engine.max_concurrency
    buffer_size = math.ceil(B * cfg.redundancy.batch_factor) if spec.redundancy else B
    p = cfg.proactive
    deadline = spec.kind == "deadline"
    hard = staleness
    soft = spec.target(staleness, target)
    max_groups = cfg.batch.max_concurrent_groups or slots
    if cfg.batch.max_concurrent_groups is None and cfg.batch.runtime_default:
        max_groups = default_max_concurrent(spec.kind, hard, soft, B, buffer_size)
    return CoordinatorSettings(
        policy=spec.kind,
        staleness=hard,
        soft_staleness=soft,
        deadline_slack=DEFAULT_SLACK,
        deadline_action=spec.deadline_action,
        admission_margin=default_margin(soft) if soft is not None else 0,
        deadline_grace_steps=DEFAULT_GRACE_STEPS if deadline else None,
        batch_size=B,
        buffer_size=buffer_size,
        group_size=N,
        group_redundancy=launch,
        max_concurrent=max_groups,
        queue_size=max_groups + 1,
        request_timeout=None,
        # The simulator models a cluster, not an operator's patience: a run of failed groups
        # is measured, not stopped.
        max_failures=2**62,
        max_relaunches=cfg.failures.max_relaunches,
        drop_stale=spec.drop_stale,
        proactive=spec.filter or "null",
        threshold=p.threshold,
        stuck_timeout=p.stuck_time or None,
        max_retries=PROACTIVE_MAX_RETRIES,
    )


class Simulation:
    """One policy at the hard bound ``staleness`` (η_h) on one workload (see the module
    docstring); ``target`` is the ``deadline`` kinds' soft target η_s (default: ``η_h // 2``, or
    η_h for ``deadline-tight``).

    ``source`` hands out the trajectories (default: drawn from the workload with ``seed``);
    ``settings`` replaces the coordinator settings derived from the workload
    (:func:`coordinator_settings`); ``prompts`` limits the run to that many prompts, all queued at
    the start (default: endless, drawn as admission takes them); ``action_log`` is called with
    every event handed to the coordinator and the actions it returned.
    """

    def __init__(
        self,
        cfg: WorkloadConfig,
        policy: str,
        staleness: int,
        *,
        target: int | None = None,
        seed: int = 0,
        steps: int | None = None,
        source: TrajectorySource | None = None,
        recorder: TraceRecorder | None = None,
        record_timeline: bool = False,
        bound: Bound | None = None,
        settings: CoordinatorSettings | None = None,
        prompts: int | None = None,
        action_log: ActionLog | None = None,
    ) -> None:
        if not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"staleness={staleness!r}: must be an integer ≥ 0 (η)")
        self.cfg = cfg
        self.spec = policy_spec(policy)
        self.eta = 0 if self.spec.synchronous else staleness
        self.steps = cfg.run.steps if steps is None else steps
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps!r}: must be ≥ 1 train steps")
        if prompts is not None and (not isinstance(prompts, int) or prompts < 1):
            raise ConfigError(f"prompts={prompts!r}: must be an integer ≥ 1, or None (endless)")
        self.settings = settings or coordinator_settings(cfg, self.spec, self.eta, target)
        self.launch = self.settings.group_redundancy
        self.coordinator = Coordinator(build_policy(self.settings), self.settings)
        self.buffer = self.coordinator.buffer  # read for the STUCK metrics, never changed here
        self.source: TrajectorySource = source or SampledSource(cfg, seed, self.launch)
        self.recorder = recorder
        self.action_log = action_log
        self.bound = compute_bound(cfg) if bound is None else bound
        self.queue = EventQueue()
        """The virtual clock."""
        self.engines = EngineModel(cfg)
        self.trainer = TrainerModel(cfg)
        self._share = 0.0
        """The share of replicas with work, as the trainer last heard it."""
        self._training = 0
        """The version of the batch the trainer is training."""
        self._catching_up: int | None = None
        """Set when new weights were just published (``trainer.publish_per_start``): the
        launch count then, to charge the publication for the episodes the publication starts."""
        self.engine_version = 0
        self.groups: dict[int, _Group] = {}
        self._prompts = prompts
        self._submitted = 0
        self._attempts: dict[int, int] = {}  # sample → its retry count, until it starts again
        self._timers: dict[str, int] = {}  # timer → the ticket of its armed event
        self._wake = True
        self._stopped: str | None = None
        self._carry: dict[type, Any] = {
            StartGroup: self._start_group,
            LaunchMember: self._launch,
            AbortRequest: self._abort_request,
            TruncateMember: self._truncate,
            AbortGroup: self._abort_group,
            Retry: self._retry,
            ArmTimer: self._arm,
            CancelTimer: self._disarm,
            HandOverBatch: self._hand_over,
            ReportDrop: self._report_drop,
            ReportFailure: self._report_failure,
            ReportStall: self._report_stall,
            Wake: self._woken,
            Stop: self._stop,
        }
        self.counts: Counter[str] = Counter()
        self.tokens: dict[str, float] = {
            "generated": 0.0,
            "wasted": 0.0,
            "trained": 0.0,
            "truncated": 0.0,  # trained tokens of truncated trajectories
        }
        self.histogram: Counter[int] = Counter()
        # the head buffer's state over time (buffer policies)
        self._head = BufferState.PENDING
        self._head_since = 0.0
        self._stuck = 0.0
        self._blocked = False
        self._blocked_since = 0.0
        self._blocked_time = 0.0
        self.record_timeline = record_timeline
        self.timeline: list[tuple[float, str]] = (
            [(0.0, BufferState.PENDING.name)] if record_timeline and self.buffer is not None else []
        )
        # the measuring window starts after the warm-up steps
        self._warmup = min(self.steps - 1, int(self.steps * cfg.run.warmup_fraction))
        self._mark: dict[str, float] = {}

    @property
    def free_slots(self) -> int:
        return self.engines.free_slots

    @property
    def min_free_slots(self) -> int:
        return self.engines.min_free_slots

    @property
    def steps_done(self) -> int:
        return self.trainer.steps_done

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
        while self.steps_done < self.steps and self._stopped is None:
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
            elif kind == _CUT:
                self._on_cut(a)
            elif kind == _TRAIN_DONE:
                if b == self.trainer.ticket:
                    self._on_train_done(a)
            elif kind == _SYNC:
                self._publish(a)
            elif kind == _STEP_DONE:
                self._finish_step()
            elif self._timers.get(a) == b:
                del self._timers[a]
                self._feed(TimerFired(a, q.now))
            if self.steps_done >= self.steps:
                break  # measure exactly ``steps`` batches: do not start the next one
            self._after_event()
        if self.recorder is not None:
            self._record_unfinished()
        return self._result()

    def _record_unfinished(self) -> None:
        """End of run: record what is still in flight, so a trace keeps every trajectory."""
        now = self.queue.now
        for g in self.groups.values():
            for m in g.members.values():
                if m.state in (_DECODING, _TOOL_CALL):
                    m.tokens = self.engines.progress(m, now)
                    self._record(m, "running", complete=False)
                elif m.state in (_FINISHED, _CUTTING):
                    self._record(m, "finished", complete=not m.truncated)

    # ------------------------------------------------------------ the seam

    def _feed(self, event: Event) -> None:
        """Hand one event to the coordinator and carry out its actions, in order."""
        actions = self.coordinator.handle(event)
        if self.action_log is not None:
            self.action_log(event, actions)
        carry = self._carry
        for action in actions:
            carry[type(action)](action)

    def _after_event(self) -> None:
        """While the coordinator says capacity or results may have changed (``Wake``): the
        dispatcher admits what the free engine slots hold, then the idle trainer asks for a
        batch — the order the executor's dispatcher task and waiting trainer run in."""
        now = self.queue.now
        while self._wake and self._stopped is None:
            self._wake = False
            self._dispatch(now)
            if self._wake:
                continue  # woken again by its own admissions: the dispatcher runs again first
            if not self.trainer.training:
                self._feed(BatchWanted(self.settings.batch_size, now))
        if self._catching_up is not None:  # the publication waits for the episodes started
            started = self.counts["launched"] - self._catching_up
            self._catching_up = None
            self.queue.schedule(now + self.trainer.publish_per_start * started, _STEP_DONE)
        self.engines.reschedule(self.queue)
        if self.trainer.contention:
            self._reshare(now)
        if self.buffer is not None:
            self._track_head(now)

    def _reshare(self, now: float) -> None:
        """Tell the trainer the share of replicas with work, and move its step's end."""
        replicas = self.engines.replicas
        share = sum(1 for r in replicas if r.active or r.waiting) / len(replicas)
        if share != self._share:
            self._share = share
            end = self.trainer.reshare(now, share)
            if end is not None:
                self.queue.schedule(end, _TRAIN_DONE, self._training, self.trainer.ticket)

    def _dispatch(self, now: float) -> None:
        """What the executor's dispatcher does: draw prompts as a data loader is drawn (as many as
        admission will take, and one more it refuses), then let the coordinator admit. The
        budget is the free engine slots (``None`` when they cannot bind before the coordinator's
        own limit) and, under the capacity policy, AReaL's capacity, which the executor's
        ``StalenessManager`` passes as its gate."""
        coord = self.coordinator
        version = min(self.engine_version, coord.version)
        slots = self.engines.free_slots // self.launch
        budget = None if slots >= self.settings.max_concurrent else slots
        capacity = coord.capacity(version)
        if self.settings.policy == "capacity":
            budget = capacity if budget is None else min(budget, capacity)
        if self._prompts is None:
            self._intake(coord.items_wanted(version, budget) - coord.queued)
        else:
            self._intake(self._prompts - self._submitted)
        if coord.queued:
            self._feed(Dispatch(now, version, budget))

    def _intake(self, count: int) -> None:
        """Queue ``count`` more prompts for admission, in order."""
        for _ in range(count):
            self._submitted += 1
            self._feed(Submitted(self._submitted - 1))

    # --------------------------------------------------------------- actions

    def _start_group(self, a: StartGroup) -> None:
        g = _Group(a.group_id, a.sample, self._attempts.pop(a.sample, 0), a.version)
        self.groups[a.group_id] = g
        self.counts["groups_admitted"] += 1

    def _launch(self, a: LaunchMember) -> None:
        g = self.groups[cast(int, a.member.group_id)]
        number = a.member.number
        now = self.queue.now
        m = _Member(g, number, self.source.spec(g.prompt, g.attempt, number), a.version, now)
        g.members[number] = m
        self.engines.place(m, now)
        self.counts["launched"] += 1
        if a.relaunch:
            self.counts["relaunched"] += 1

    def _member(self, mid: MemberId) -> _Member:
        return self.groups[cast(int, mid.group_id)].members[mid.number]

    def _abort_request(self, a: AbortRequest) -> None:
        """Stop a running member; what it generated is wasted."""
        m = self._member(a.member)
        if m.state in (_DECODING, _TOOL_CALL, _ENDING):
            self.engines.stop(m, self.queue.now)
        elif m.state != _CUTTING:
            raise InvariantError(f"abort of member {a.member} in state {m.state}")
        self._gone(m, _COUNTED_AS.get(a.cause, a.cause), complete=False)

    def _truncate(self, a: TruncateMember) -> None:
        """Cut a member short: its requests are aborted, and the episode returns what it has
        (a member in a tool call returns at once with ``agent.cut_tools``, else when the tool
        answers)."""
        m = self._member(a.member)
        m.truncated = True
        self.counts["truncated"] += 1
        if m.state == _DECODING or (m.state == _TOOL_CALL and self._cuts_tool(m)):
            self.engines.stop(m, self.queue.now)
            m.state = _CUTTING  # a tool's answer is then ignored (`_on_tool_done`)
            self.queue.schedule(self.queue.now, _CUT, m)
        elif m.state not in (_TOOL_CALL, _ENDING):  # those return at their next step
            raise InvariantError(f"truncate of member {a.member} in state {m.state}")

    def _cuts_tool(self, m: _Member) -> bool:
        """A truncation ends ``m``'s pause at once: a tool call with ``agent.cut_tools``, never the
        wait for the reward (the runtime's reward wait is no tool call)."""
        spec = m.spec
        return self.cfg.agent.cut_tools and not (
            spec.reward_wait and m.seg == len(spec.segments) - 1
        )

    def _abort_group(self, a: AbortGroup) -> None:
        g = self.groups.get(a.group_id)
        if g is not None:
            self._leave(g, a.cause)

    def _retry(self, a: Retry) -> None:
        self._attempts[a.sample] = a.retries
        self.counts["groups_retry"] += 1

    def _arm(self, a: ArmTimer) -> None:
        ticket = self._timers.get(a.timer, 0) + 1
        self._timers[a.timer] = ticket
        now = self.queue.now
        self.queue.schedule(a.at if a.at > now else now, _TIMER, a.timer, ticket)

    def _disarm(self, a: CancelTimer) -> None:
        self._timers.pop(a.timer, None)

    def _hand_over(self, a: HandOverBatch) -> None:
        """The trainer takes the batch and trains on it."""
        if self.trainer.training:
            raise InvariantError(f"batch {a.version} handed over while the trainer is busy")
        tokens = 0.0
        trained = truncated = 0
        for hg in a.groups:
            for r, _, cut in hg.members:
                m: _Member = r.result
                m.state = _GONE
                tokens += m.tokens
                trained += 1
                truncated += cut
                if cut:
                    self.tokens["truncated"] += m.tokens
                self.histogram[a.version - r.version] += 1
                if self.recorder is not None:
                    self._record(m, "trained", complete=not cut)
            g = self.groups.pop(hg.group_id)
            g.members = {}  # break the group ↔ member cycles
        self.counts["trained"] += trained
        self.counts["truncated_trained"] += truncated
        self.tokens["trained"] += tokens
        now = self.queue.now
        end = self.trainer.start(now, tokens, self._share)
        self._training = a.version
        self.queue.schedule(end, _TRAIN_DONE, a.version, self.trainer.ticket)

    def _report_drop(self, a: ReportDrop) -> None:
        g = self.groups.get(a.group_id)
        if g is not None:
            self._leave(g, a.outcome)

    def _report_failure(self, a: ReportFailure) -> None:
        self.counts["groups_failed"] += 1
        log.debug("group %d failed: %s", a.group_id, a.why)

    def _report_stall(self, a: ReportStall) -> None:
        self.counts["watchdog_stalls"] += 1

    def _woken(self, a: Wake) -> None:
        self._wake = True

    def _stop(self, a: Stop) -> None:
        log.warning("%s η=%d: the coordinator stopped: %s", self.spec.name, self.eta, a.reason)
        self._stopped = a.reason

    # ------------------------------------------------------------- engines

    def _on_replica(self, r: Replica) -> None:
        now = self.queue.now
        for m in self.engines.finished(r, now):
            if m.state != _ENDING:
                continue  # aborted by what an earlier one of them caused (surplus, say)
            if m.seg < len(m.spec.segments):
                m.state = _TOOL_CALL
                self.queue.schedule(now + m.spec.tools[m.seg - 1], _TOOL, m, m.seg)
            else:
                self.engines.release(m)
                self._ended(m)

    def _on_tool_done(self, m: _Member, seg: int) -> None:
        if m.state != _TOOL_CALL or m.seg != seg:
            return  # cancelled during the tool call
        m.tools += 1
        if m.truncated:  # cut short during the tool call: the episode returns now
            self.engines.release(m)
            self._finished(m)
        else:
            self.engines.decode(m, self.queue.now)

    def _on_cut(self, m: _Member) -> None:
        if m.state == _CUTTING:  # not aborted meanwhile
            self._finished(m)

    def _ended(self, m: _Member) -> None:
        """A member reached its natural end: it finished, or it failed."""
        if not m.spec.failed:
            self._finished(m)
            return
        now = self.queue.now
        m.end = now
        self.tokens["generated"] += m.tokens
        self._gone(m, "failed", complete=True, generated=False)
        version = min(self.engine_version, self.coordinator.version)
        self._feed(MemberFailed(MemberId(m.group.gid, m.number), now, "failed", version))

    def _finished(self, m: _Member) -> None:
        now = self.queue.now
        m.state = _FINISHED
        m.end = now
        m.group.finished += 1
        self.tokens["generated"] += m.tokens
        mid = MemberId(m.group.gid, m.number)
        self._feed(MemberFinished(mid, now, m, tokens=round(m.tokens)))

    def _gone(self, m: _Member, outcome: str, *, complete: bool, generated: bool = True) -> None:
        """``m`` ended untrained (``outcome``); what it generated is wasted."""
        if generated and m.state != _FINISHED:
            m.end = self.queue.now
            self.tokens["generated"] += m.tokens
        m.state = _GONE
        self.counts[outcome] += 1
        self.tokens["wasted"] += m.tokens
        if self.recorder is not None:
            self._record(m, outcome, complete)

    def _leave(self, g: _Group, cause: str) -> None:
        """The group left untrained: what its finished members generated is wasted."""
        outcome = _COUNTED_AS.get(cause, cause)
        for m in g.members.values():
            if m.state == _FINISHED:
                self._gone(m, outcome, complete=not m.truncated)
        del self.groups[g.gid]
        g.members = {}  # break the group ↔ member cycles
        self.counts[f"groups_{outcome}"] += 1

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

    def _on_train_done(self, version: int) -> None:
        now = self.queue.now
        self.engines.stall(now, self.cfg.engine.update_stall)  # installing the new weights
        if self.trainer.publish_per_start and not self.cfg.engine.sync_delay:
            # the engines serve the new weights now; the executor starts the episodes this
            # admits before the publication returns to the trainer (:meth:`_after_event`)
            self._publish(version + 1)
            self._catching_up = self.counts["launched"]
        else:
            self._finish_step(version + 1)

    def _finish_step(self, version: int | None = None) -> None:
        """The publication returned: the trainer asks for its next batch. With ``version``, the
        engines take those weights now (or after ``engine.sync_delay``)."""
        now = self.queue.now
        self.trainer.done(now)
        self._wake = True
        if version is not None:
            if self.cfg.engine.sync_delay > 0:
                self.queue.schedule(now + self.cfg.engine.sync_delay, _SYNC, version)
            else:
                self._publish(version)
        if self.steps_done == self._warmup:
            self._snapshot_window()

    def _publish(self, version: int) -> None:
        """The engines serve weights of ``version`` from now on."""
        self.engine_version = max(self.engine_version, version)
        self._wake = True
        self._feed(VersionPublished(version, self.queue.now))

    # --------------------------------------------------------------- metrics

    def _track_head(self, now: float) -> None:
        buf = self.buffer
        assert buf is not None
        state = buf.state(buf.version)
        blocked = state is BufferState.STUCK and not self.trainer.training
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

    def _snapshot_window(self) -> None:
        now = self.queue.now
        self._mark = {
            "time": now,
            "trained": float(self.counts["trained"]),
            "busy": self.trainer.busy_until(now),
            "tokens": self.engines.generated(now),
            "engine_busy": self.engines.busy(now),
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
        trainer_util = (self.trainer.busy_until(now) - mark["busy"]) / window if window > 0 else 0.0
        tokens = self.engines.generated(now) - mark["tokens"]
        engine_util = tokens / (self.bound.token_rate * window) if window > 0 else 0.0
        engine_busy = self.engines.busy(now) - mark["engine_busy"]
        engine_idle = 1.0 - engine_busy / window if window > 0 else 0.0
        stuck = blocked = None
        if self.buffer is not None and window > 0:
            stuck = (self._stuck_until(now) - mark["stuck"]) / window
            blocked = (self._blocked_until(now) - mark["blocked"]) / window
        truncated = self.counts["truncated_trained"] - mark["truncated"]
        decided = self.tokens["wasted"] + self.tokens["trained"]
        counts = dict(self.counts)
        c = self.coordinator.counts
        counts["pulled_forward"] = c.pulled_forward_groups
        counts["groups_truncated"] = c.truncated_groups
        counts["overdue_groups"] = c.overdue_groups
        counts.update(self.conservation())
        return SimResult(
            policy=self.spec.name,
            staleness=self.eta,
            throughput=throughput,
            bound=self.bound,
            trainer_util=trainer_util,
            engine_util=engine_util,
            staleness_histogram=dict(sorted(self.histogram.items())),
            violations=sum(n for k, n in self.histogram.items() if k > self.settings.staleness),
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
            trainer_waits=self.trainer.waits[self._warmup :],
            target=self.settings.soft_staleness,
        )

    def conservation(self) -> dict[str, int]:
        """Members still in flight (``running``), finished in an incomplete group
        (``finished_pending``), or in a complete group not yet consumed (``waiting``)."""
        running = finished_pending = waiting = 0
        n = self.settings.group_size
        for g in self.groups.values():
            done = 0
            for m in g.members.values():
                if m.state in (_DECODING, _TOOL_CALL, _ENDING, _CUTTING):
                    running += 1
                elif m.state == _FINISHED:
                    done += 1
            if g.finished >= n:
                waiting += done
            else:
                finished_pending += done
        return {"running": running, "finished_pending": finished_pending, "waiting": waiting}


def simulate(
    cfg: WorkloadConfig,
    policy: str,
    staleness: int,
    *,
    target: int | None = None,
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
        target=target,
        seed=seed,
        steps=steps,
        source=source,
        recorder=recorder,
        record_timeline=record_timeline,
        bound=bound,
    ).run()

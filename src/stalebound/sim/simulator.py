"""The simulator: a virtual clock, an engine model and a trainer model driving the core's coordinator.

One :class:`Simulation` runs one policy at one η on one seeded workload. Every staleness decision —
admission, reservation, groups (N of N′, relaunches), occupy, consume, surplus, filters, the
proactive filter and its timer — is the :class:`~stalebound.core.Coordinator`'s, the same object
``stalebound train`` runs in its executor. The simulator only plays the world around it:

* the clock (:class:`~stalebound.sim.clock.EventQueue`): typed events
  (:mod:`stalebound.sim.events`) ordered by time, then sequence, each dispatched by its type;
* the engines (:class:`~stalebound.sim.engine_model.EngineModel`): replicas with continuous
  batching decode each member's segments; a member's end becomes ``MemberFinished`` or
  ``MemberFailed``;
* the trainer (:class:`~stalebound.sim.trainer.TrainerModel`): when idle it asks for a batch
  (``BatchWanted``), trains on what is handed over, then publishes the next version
  (``VersionPublished``, after ``engine.sync_delay``);
* the dispatcher: whenever the coordinator says capacity may have opened (``Wake``), it keeps
  prompts queued (``Submitted``) and asks for admissions (``Dispatch``) as far as free engine slots
  allow.

Actions are carried out in order: launch a member on a replica, abort or truncate one, arm or cancel
a timer, train on a handed-over batch, count what ended untrained. With ``action_log`` every event
and the actions it produced are reported, so a run can be compared with the executor's.

Accounting is per trajectory (group member): every member launched ends trained, dropped, failed or
cancelled (surplus, retried, aborted with its group), or is still in flight or waiting at the end;
:meth:`Simulation.conservation` counts each; a :class:`~stalebound.sim.results.Meter` measures
the run. The named policies and their coordinator settings are in :mod:`stalebound.sim.policies`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any, cast

from stalebound.core import ConfigError, InvariantError, MemberId
from stalebound.core.checks import staleness_problems
from stalebound.core.coordinator import Coordinator
from stalebound.core.events import (
    AbortGroup,
    AbortRequest,
    ActionLog,
    ArmTimer,
    BatchWanted,
    CancelTimer,
    Dispatch,
    EvaluateGroup,
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
from stalebound.core.filters import evaluate_group
from stalebound.core.settings import CoordinatorSettings, build_policy
from stalebound.obs.trace import TraceRecorder
from stalebound.sim.clock import EventQueue
from stalebound.sim.config import WorkloadConfig
from stalebound.sim.engine_model import (
    CUTTING,
    DECODING,
    ENDING,
    FINISHED,
    TOOL_CALL,
    EngineModel,
    Group,
    Member,
)
from stalebound.sim.events import (
    CutReturned,
    PublicationReturned,
    ReplicaDue,
    TimerDue,
    ToolAnswered,
    TrainingDone,
    WeightsArrive,
)
from stalebound.sim.fleet import COUNTED_AS, Fleet
from stalebound.sim.policies import (
    POLICIES,
    PolicySpec,
    coordinator_settings,
    policy_spec,
)
from stalebound.sim.results import Bound, Meter, SimResult, compute_bound
from stalebound.sim.trainer import TrainerModel
from stalebound.sim.workload import SampledSource, TrajectorySource

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
        problems = staleness_problems("staleness", staleness)
        if problems:
            raise ConfigError(problems)
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
        self._prompts = prompts
        self._submitted = 0
        self._attempts: dict[int, int] = {}  # sample → its retry count, until it starts again
        self._timers: dict[str, int] = {}  # timer → the ticket of its armed event
        self._tickets = 0  # never reused: an event of a cancelled timer cannot pass as a new one
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
            EvaluateGroup: lambda a: self._feed(evaluate_group(a, self.queue.now)),
            Wake: self._woken,
            Stop: self._stop,
        }
        self.meter = Meter(self.buffer is not None, record_timeline)
        self.fleet = Fleet(self.meter, recorder)
        self.groups = self.fleet.groups
        self.counts = self.meter.counts
        self.tokens = self.meter.tokens
        self.histogram = self.meter.histogram
        self.timeline = self.meter.timeline
        # the measuring window starts after the warm-up steps
        self._warmup = min(self.steps - 1, int(self.steps * cfg.run.warmup_fraction))
        self._on_clock: dict[type, Callable[[Any], None]] = {
            ReplicaDue: self._on_replica,
            ToolAnswered: self._on_tool_done,
            CutReturned: self._on_cut,
            TrainingDone: self._on_train_done,
            WeightsArrive: self._on_weights,
            PublicationReturned: self._on_publication,
            TimerDue: self._on_timer,
        }

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
        on_clock = self._on_clock
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
            on_clock[type(event)](event)
            if self.steps_done >= self.steps:
                break  # measure exactly ``steps`` batches: do not start the next one
            self._after_event()
        if self.recorder is not None:
            self.fleet.record_unfinished(self.engines, self.queue.now)
        return self._result()

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
            self.queue.schedule(
                now + self.trainer.publish_per_start * started, PublicationReturned()
            )
        self.engines.reschedule(self.queue)
        if self.trainer.contention:
            self._reshare(now)
        if self.buffer is not None:
            buf = self.buffer
            self.meter.track_head(buf.state(buf.version), not self.trainer.training, now)

    def _reshare(self, now: float) -> None:
        """Tell the trainer the share of replicas with work, and move its step's end."""
        replicas = self.engines.replicas
        share = sum(1 for r in replicas if r.active or r.waiting) / len(replicas)
        if share != self._share:
            self._share = share
            end = self.trainer.reshare(now, share)
            if end is not None:
                self.queue.schedule(end, TrainingDone(self._training, self.trainer.ticket))

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
        g = Group(a.group_id, a.sample, self._attempts.pop(a.sample, 0), a.version)
        self.groups[a.group_id] = g
        self.counts["groups_admitted"] += 1

    def _launch(self, a: LaunchMember) -> None:
        g = self.groups[cast(int, a.member.group_id)]
        number = a.member.number
        now = self.queue.now
        m = Member(g, number, self.source.spec(g.prompt, g.attempt, number), a.version, now)
        g.members[number] = m
        self.engines.place(m, now)
        self.counts["launched"] += 1
        if a.relaunch:
            self.counts["relaunched"] += 1

    def _abort_request(self, a: AbortRequest) -> None:
        """Stop a running member; what it generated is wasted."""
        m = self.fleet.member(a.member)
        if m.state in (DECODING, TOOL_CALL, ENDING):
            self.engines.stop(m, self.queue.now)
        elif m.state != CUTTING:
            raise InvariantError(f"abort of member {a.member} in state {m.state}")
        self.fleet.gone(m, COUNTED_AS.get(a.cause, a.cause), self.queue.now, complete=False)

    def _truncate(self, a: TruncateMember) -> None:
        """Cut a member short: its requests are aborted, and the episode returns what it has
        (a member in a tool call returns at once with ``agent.cut_tools``, else when the tool
        answers)."""
        m = self.fleet.member(a.member)
        m.truncated = True
        self.counts["truncated"] += 1
        if m.state == DECODING or (m.state == TOOL_CALL and self._cuts_tool(m)):
            self.engines.stop(m, self.queue.now)
            m.state = CUTTING  # a tool's answer is then ignored (`_on_tool_done`)
            self.queue.schedule(self.queue.now, CutReturned(m))
        elif m.state not in (TOOL_CALL, ENDING):  # those return at their next step
            raise InvariantError(f"truncate of member {a.member} in state {m.state}")

    def _cuts_tool(self, m: Member) -> bool:
        """A truncation ends ``m``'s pause at once: a tool call with ``agent.cut_tools``, never the
        wait for the reward (the runtime's reward wait is no tool call)."""
        spec = m.spec
        return self.cfg.agent.cut_tools and not (
            spec.reward_wait and m.seg == len(spec.segments) - 1
        )

    def _abort_group(self, a: AbortGroup) -> None:
        g = self.groups.get(a.group_id)
        if g is not None:
            self.fleet.leave(g, a.cause, self.queue.now)

    def _retry(self, a: Retry) -> None:
        self._attempts[a.sample] = a.retries
        self.counts["groups_retry"] += 1

    def _arm(self, a: ArmTimer) -> None:
        self._tickets += 1
        ticket = self._timers[a.timer] = self._tickets
        now = self.queue.now
        self.queue.schedule(a.at if a.at > now else now, TimerDue(a.timer, ticket))

    def _disarm(self, a: CancelTimer) -> None:
        self._timers.pop(a.timer, None)

    def _hand_over(self, a: HandOverBatch) -> None:
        """The trainer takes the batch and trains on it."""
        if self.trainer.training:
            raise InvariantError(f"batch {a.version} handed over while the trainer is busy")
        now = self.queue.now
        tokens = self.fleet.train(a, now)
        end = self.trainer.start(now, tokens, self._share)
        self._training = a.version
        self.queue.schedule(end, TrainingDone(a.version, self.trainer.ticket))

    def _report_drop(self, a: ReportDrop) -> None:
        g = self.groups.get(a.group_id)
        if g is not None:
            self.fleet.leave(g, a.outcome, self.queue.now)

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

    def _on_replica(self, e: ReplicaDue) -> None:
        r = e.replica
        if e.ticket != r.ticket:
            return  # superseded: the replica's next end moved
        now = self.queue.now
        for m in self.engines.finished(r, now):
            if m.state != ENDING:
                continue  # aborted by what an earlier one of them caused (surplus, say)
            if m.seg < len(m.spec.segments):
                m.state = TOOL_CALL
                self.queue.schedule(now + m.spec.tools[m.seg - 1], ToolAnswered(m, m.seg))
            else:
                self.engines.release(m)
                self._ended(m)

    def _on_tool_done(self, e: ToolAnswered) -> None:
        m = e.member
        if m.state != TOOL_CALL or m.seg != e.seg:
            return  # cancelled during the tool call
        m.tools += 1
        if m.truncated:  # cut short during the tool call: the episode returns now
            self.engines.release(m)
            self._finished(m)
        else:
            self.engines.decode(m, self.queue.now)

    def _on_cut(self, e: CutReturned) -> None:
        m = e.member
        if m.state == CUTTING:  # not aborted meanwhile
            self._finished(m)

    def _ended(self, m: Member) -> None:
        """A member reached its natural end: it finished, or it failed."""
        if not m.spec.failed:
            self._finished(m)
            return
        now = self.queue.now
        m.end = now
        self.tokens["generated"] += m.tokens
        self.fleet.gone(m, "failed", now, complete=True, generated=False)
        version = min(self.engine_version, self.coordinator.version)
        self._feed(MemberFailed(MemberId(m.group.gid, m.number), now, "failed", version))

    def _finished(self, m: Member) -> None:
        now = self.queue.now
        m.state = FINISHED
        m.end = now
        m.group.finished += 1
        self.tokens["generated"] += m.tokens
        mid = MemberId(m.group.gid, m.number)
        self._feed(MemberFinished(mid, now, m, tokens=round(m.tokens)))

    # --------------------------------------------------------------- trainer

    def _on_train_done(self, e: TrainingDone) -> None:
        if e.ticket != self.trainer.ticket:
            return  # superseded: the step's end moved
        version = e.version
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
                self.queue.schedule(now + self.cfg.engine.sync_delay, WeightsArrive(version))
            else:
                self._publish(version)
        if self.steps_done == self._warmup:
            self._snapshot_window()

    def _on_weights(self, e: WeightsArrive) -> None:
        self._publish(e.version)

    def _on_publication(self, e: PublicationReturned) -> None:
        self._finish_step()

    def _on_timer(self, e: TimerDue) -> None:
        if self._timers.get(e.timer) == e.ticket:  # else re-armed or cancelled since
            del self._timers[e.timer]
            self._feed(TimerFired(e.timer, self.queue.now))

    def _publish(self, version: int) -> None:
        """The engines serve weights of ``version`` from now on."""
        self.engine_version = max(self.engine_version, version)
        self._wake = True
        self._feed(VersionPublished(version, self.queue.now))

    # --------------------------------------------------------------- metrics

    def _snapshot_window(self) -> None:
        self.meter.open_window(self.queue.now, self.trainer, self.engines)

    def _result(self) -> SimResult:
        counts = dict(self.counts)
        c = self.coordinator.counts
        counts["pulled_forward"] = c.pulled_forward_groups
        counts["groups_truncated"] = c.truncated_groups
        counts["overdue_groups"] = c.overdue_groups
        counts["continued_groups"] = c.continued_groups
        counts.update(self.conservation())
        return self.meter.result(
            self.queue.now,
            self.trainer,
            self.engines,
            bound=self.bound,
            buffered=self.buffer is not None,
            counts=counts,
            hard=self.settings.staleness,
            warmup=self._warmup,
            policy=self.spec.name,
            staleness=self.eta,
            target=self.settings.soft_staleness,
            steps=self.steps_done,
            events=self.queue.processed,
        )

    def conservation(self) -> dict[str, int]:
        """Members still in flight, finished in an incomplete group, or waiting to be trained
        (:meth:`Fleet.conservation`)."""
        return self.fleet.conservation(self.settings.group_size)


def simulate(cfg: WorkloadConfig, policy: str, staleness: int, **options: Any) -> SimResult:
    """Run one :class:`Simulation` (same arguments) and return its :class:`SimResult`."""
    return Simulation(cfg, policy, staleness, **options).run()

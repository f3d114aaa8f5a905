"""Same trace, same decisions: one scenario through the coordinator, the executor and the simulator.

A scenario is a rollout configuration, a number of prompts, the trainer's step time and a script
of when each member's episode ends (finished with a score, or failed). Three drivers play it:

(a) the coordinator directly, under a scripted world (:func:`run_coordinator`): the members end at
    their scripted times, the trainer trains for ``step_time``, timers fire when they are due;
(b) the :class:`~stalebound.runtime.WorkflowExecutor` with a scripted engine on an event loop whose
    clock the test sets (:func:`run_executor`): the test answers engine requests, moves the clock,
    and plays the trainer (``wait`` / ``set_version``) in the order (a) saw them happen;
(c) the :class:`~stalebound.sim.Simulation` (:func:`run_simulator`), whose engine model decodes one
    token a second, with each member's length chosen so that it ends at its scripted time.

Each driver logs every event it hands the coordinator with the actions it got back; the three logs
must be identical. Compared are the decisions, not the drivers' own objects: a finished member's
result and token versions, a failure's description (the executor names the exception, the
simulator says ``failed``) and the progress reports that only feed the watchdog (the executor sends
one per engine answer, yielding no action) are left out.
"""

from __future__ import annotations

import asyncio
import heapq
import threading
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, cast

import pytest

from scripted import Episode, ProtocolEngine, RequestCall, parked_in_wait, quiesce
from stalebound.config import (
    DeadlineConfig,
    FilterGroupsConfig,
    GroupPostProcessConfig,
    ProactiveFilterConfig,
    RolloutConfig,
)
from stalebound.core import MemberId, MemberResult
from stalebound.core.coordinator import Coordinator
from stalebound.core.events import (
    AbortRequest,
    Action,
    ArmTimer,
    BatchWanted,
    CancelTimer,
    Dispatch,
    EvaluateGroup,
    Event,
    GroupEvaluated,
    HandOverBatch,
    LaunchMember,
    MemberFailed,
    MemberFinished,
    MemberProgress,
    ReportDrop,
    ReportFailure,
    ReportStall,
    Retry,
    StartGroup,
    Submitted,
    TimerFired,
    TruncateMember,
    VersionPublished,
    Wake,
)
from stalebound.core.filters import evaluate_group
from stalebound.core.settings import CoordinatorSettings, build_policy, resolve_settings
from stalebound.runtime import WorkflowExecutor
from stalebound.sim.config import workload_from_dict
from stalebound.sim.simulator import Simulation
from stalebound.sim.workload import TrajectorySpec

Log = list[tuple[Event, list[Action]]]

NEVER = 10**6
"""The length of a member the script does not end: it runs until it is aborted (or the run ends)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    config: RolloutConfig
    prompts: int
    step_time: float
    steps: int
    ends: dict[tuple[int, int], tuple[float, str, float]]
    """Member ``(group id, number)`` → ``(time, "ok" or "fail", score)``."""
    expect: tuple[str, ...] = ()
    """What the scenario is there to exercise (:func:`features`)."""

    @property
    def settings(self) -> CoordinatorSettings:
        return resolve_settings(self.config)


def rollout(**changes: Any) -> RolloutConfig:
    changes.setdefault("watchdog_timeout_s", None)
    changes.setdefault("progress_log_s", None)
    return RolloutConfig(**changes)


SCENARIOS = [
    # B = 2, η = 1, N = 2 of N′ = 3: groups 2 and 3 reserve the head buffer 0, groups 0 and 1
    # buffer 1. Group 2 completes first (its third member is surplus); group 0 loses a member and
    # completes with its third; group 3 straggles: two members fail, one is relaunched, and only
    # then is buffer 0 ready. Buffer 1 completes while the trainer is busy.
    Scenario(
        "buffer: redundancy, a straggler, failures and a relaunch",
        rollout(
            max_head_offpolicyness=1,
            consumer_batch_size=2,
            group_size=2,
            group_redundancy=3,
            max_concurrent_rollouts=4,
        ),
        prompts=5,
        step_time=10.0,
        steps=2,
        ends={
            (2, 0): (1, "ok", 0.0),
            (2, 1): (2, "ok", 0.0),
            (0, 0): (3, "ok", 0.0),
            (0, 1): (4, "fail", 0.0),
            (0, 2): (5, "ok", 0.0),
            (3, 0): (6, "fail", 0.0),
            (3, 1): (7, "fail", 0.0),
            (3, 2): (8, "ok", 0.0),
            (3, 3): (9, "ok", 0.0),
            (1, 0): (11, "ok", 0.0),
            (1, 1): (12, "ok", 0.0),
        },
        expect=("surplus", "member failed", "relaunch", "batch"),
    ),
    # The proactive filter with a stuck timer: the head buffer is STUCK from the start; its last
    # reservation is truncated when the timer fires (5 s), and again for the next head while the
    # trainer is still busy.
    Scenario(
        "buffer: the proactive filter truncates on its stuck timer",
        rollout(
            max_head_offpolicyness=1,
            consumer_batch_size=2,
            group_size=1,
            max_concurrent_rollouts=4,
            proactive_filter=ProactiveFilterConfig(
                method="truncate", threshold=1, stuck_timeout_s=5.0
            ),
        ),
        prompts=6,
        step_time=10.0,
        steps=2,
        ends={(2, 0): (1, "ok", 0.0), (0, 0): (2, "ok", 0.0)},
        expect=("timer fired", "truncate", "batch"),
    ),
    # AReaL's capacity policy with the dynamic sampling filter: group 0 scores the same on both
    # members and is filtered; a member of group 2 fails and is relaunched.
    Scenario(
        "capacity: a filtered group and a relaunched failure",
        rollout(
            staleness_policy="capacity",
            max_head_offpolicyness=1,
            consumer_batch_size=2,
            group_size=2,
            max_concurrent_rollouts=3,
            group_post_process=GroupPostProcessConfig(enable=True),
            filter_groups=FilterGroupsConfig(metric="score"),
        ),
        prompts=8,
        step_time=10.0,
        steps=2,
        ends={
            (0, 0): (1, "ok", 1.0),
            (0, 1): (2, "ok", 1.0),
            (1, 0): (3, "ok", 0.0),
            (1, 1): (4, "ok", 1.0),
            (2, 0): (5, "fail", 0.0),
            (4, 0): (6, "ok", 1.0),
            (4, 1): (7, "ok", 0.0),
            (2, 1): (8, "ok", 0.0),
            (2, 2): (9, "ok", 1.0),
            (3, 0): (10, "ok", 0.0),
            (3, 1): (11, "ok", 1.0),
        },
        expect=("filtered", "member failed", "relaunch", "batch"),
    ),
    # The proactive filter retries on its stuck timer and the watchdog reports the straggler
    # first: groups 2 and 3 hold the head buffer 0; group 3 never answers. The watchdog (4.5 s)
    # reports it; the STUCK timer (6 s) retries it, pulling a finished group of buffer 1 forward,
    # and its item starts again as group 8 — which is retried in turn, and then, as group 11
    # (retried twice: the limit), waited for.
    Scenario(
        "buffer: the proactive filter retries, the watchdog reports",
        rollout(
            max_head_offpolicyness=1,
            consumer_batch_size=2,
            group_size=1,
            max_concurrent_rollouts=4,
            proactive_filter=ProactiveFilterConfig(
                method="retry", threshold=1, stuck_timeout_s=6.0
            ),
            watchdog_timeout_s=4.5,
        ),
        prompts=6,
        step_time=10.0,
        steps=2,
        ends={
            (2, 0): (1, "ok", 0.0),
            (0, 0): (2, "ok", 0.0),
            (1, 0): (3, "ok", 0.0),
            (11, 0): (17, "ok", 0.0),
        },
        expect=("timer fired", "retry", "stall", "batch"),
    ),
    # The deadline policy, η_h = 2 (target 1): group 2 (V = 0) never answers; the second consume
    # defers it into buffer 2, its deadline, where it gets the deadline action: abort (its tokens
    # wasted) as soon as buffer 2 is the head, or truncate (kept, marked truncated) when the
    # trainer asks for buffer 2. With ``continue`` group 2 answers at 40: it continues past
    # buffer 2 while the trainer trains buffer 2 from later groups, and lands in buffer 3,
    # trained continued; with a cap of 0 it is truncated at buffer 2 instead.
    *[
        Scenario(
            f"deadline: a straggler due at its deadline buffer: {name}",
            rollout(
                staleness_policy="deadline",
                staleness=2,
                consumer_batch_size=2,
                group_size=1,
                max_concurrent_rollouts=4,
                deadline=deadline,
            ),
            prompts=12 if steps == 3 else 20,
            step_time=10.0,
            steps=steps,
            ends={
                (0, 0): (1, "ok", 0.0),
                (1, 0): (2, "ok", 0.0),
                (7, 0): (16, "ok", 0.0),
                (8, 0): (17, "ok", 0.0),
                **{(g, 0): (g + (20 if g < 16 else 40), "ok", 0.0) for g in range(9, 30)},
                **({(2, 0): (40, "ok", 0.0)} if steps == 4 else {}),
            },
            expect=expect,
        )
        for name, deadline, steps, expect in (
            ("abort", DeadlineConfig(action="abort", at="head"), 3, ("deadline abort", "batch")),
            ("truncate", DeadlineConfig(action="truncate"), 3, ("deadline truncate", "batch")),
            (
                "continue",
                DeadlineConfig(action="continue"),
                4,
                ("deadline continue", "batch"),
            ),
            (
                "continue, cap 0",
                DeadlineConfig(action="continue", continue_max=0),
                4,
                ("deadline truncate",),
            ),
        )
    ],
]


# ----------------------------------------------------------------------------- comparison


def features(log: Log) -> set[str]:
    """What a log exercises, by name."""
    found = set()
    for event, actions in log:
        if isinstance(event, MemberFailed):
            found.add("member failed")
        if isinstance(event, TimerFired):
            found.add("timer fired")
        for a in actions:
            if isinstance(a, AbortRequest | TruncateMember) and a.cause == "deadline":
                found.add(f"deadline {'abort' if isinstance(a, AbortRequest) else 'truncate'}")
            if isinstance(a, AbortRequest) and a.cause == "surplus":
                found.add("surplus")
            elif isinstance(a, LaunchMember) and a.relaunch:
                found.add("relaunch")
            elif isinstance(a, TruncateMember):
                found.add("truncate")
            elif isinstance(a, ReportDrop) and a.outcome == "filtered":
                found.add("filtered")
            elif isinstance(a, HandOverBatch):
                found.add("batch")
                if a.continued:
                    found.add("deadline continue")
            elif isinstance(a, Retry):
                found.add("retry")
            elif isinstance(a, ReportStall):
                found.add("stall")
    return found


def _comparable(item: Any) -> Any:
    """An event or action with the driver's own objects left out (see the module docstring)."""
    if isinstance(item, MemberFinished):
        return replace(item, result=None, versions=None, tokens=0, reward=None)
    if isinstance(item, MemberFailed):
        return replace(item, cause="", detail="")
    if isinstance(item, ReportFailure):
        return replace(item, why="")
    if isinstance(item, HandOverBatch):
        groups = tuple(
            replace(
                g,
                members=tuple(
                    (MemberResult(r.member, r.version, None), None, cut) for r, _, cut in g.members
                ),
            )
            for g in item.groups
        )
        return replace(item, groups=groups)
    if isinstance(item, Submitted):
        return replace(item, accept=None)
    if isinstance(item, EvaluateGroup):
        return replace(item, results=())
    return item


def comparable(log: Log) -> list[tuple[Any, list[Any]]]:
    """The log up to the last weight publication, progress reports left out."""
    out = []
    for event, actions in log:
        if isinstance(event, MemberProgress):
            assert actions == []  # it only feeds the watchdog
            continue
        out.append((_comparable(event), [_comparable(a) for a in actions]))
    last = max(i for i, (e, _) in enumerate(out) if isinstance(e, VersionPublished))
    return out[: last + 1]


def assert_same(name: str, a: Log, b: Log) -> None:
    ca, cb = comparable(a), comparable(b)
    for i, (x, y) in enumerate(zip(ca, cb, strict=False)):
        assert x == y, f"{name}: entry {i} differs:\n  {x}\n  {y}"
    assert len(ca) == len(cb), f"{name}: {len(ca)} entries against {len(cb)}"


# ----------------------------------------------------------------------------- (a) coordinator


@dataclass
class World:
    """What (a) saw happen, for the other drivers to reproduce."""

    log: Log = field(default_factory=list)
    launched: dict[tuple[int, int], float] = field(default_factory=dict)
    """Member → the time it was launched."""
    origin: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Group id → (prompt, attempt)."""


def run_coordinator(sc: Scenario) -> World:
    """(a): the coordinator fed directly, the world scripted by the test."""
    s = sc.settings
    coord = Coordinator(build_policy(s), s)
    world = World()
    heap: list[tuple[float, int, str, Any]] = []
    seq = [0]
    state: dict[str, Any] = {
        "now": 0.0,
        "wake": True,
        "training": False,
        "steps": 0,
        "engine": 0,
        "submitted": 0,
        "timers": {},
        "gone": set(),
        "attempts": {},
    }

    def at(time: float, kind: str, what: Any) -> None:
        assert time >= state["now"]
        seq[0] += 1
        heapq.heappush(heap, (time, seq[0], kind, what))

    def feed(event: Event) -> None:
        actions = coord.handle(event)
        world.log.append((event, actions))
        now = state["now"]
        for a in actions:
            if isinstance(a, StartGroup):
                world.origin[a.group_id] = (a.sample, state["attempts"].pop(a.sample, 0))
            elif isinstance(a, LaunchMember):
                key = (cast(int, a.member.group_id), a.member.number)
                world.launched[key] = now
                if key in sc.ends:
                    time, how, score = sc.ends[key]
                    at(time, how, (a.member, score))
            elif isinstance(a, AbortRequest):
                state["gone"].add(a.member)
            elif isinstance(a, TruncateMember):
                state["gone"].add(a.member)  # its scripted end no longer comes
                at(now, "cut", a.member)
            elif isinstance(a, Retry):
                state["attempts"][a.sample] = a.retries
            elif isinstance(a, ArmTimer):
                state["timers"][a.timer] = a.at
                at(max(a.at, now), "timer", (a.timer, a.at))
            elif isinstance(a, CancelTimer):
                state["timers"].pop(a.timer, None)
            elif isinstance(a, HandOverBatch):
                state["training"] = True
                at(now + sc.step_time, "trained", a.version)
            elif isinstance(a, Wake):
                state["wake"] = True
            elif isinstance(a, EvaluateGroup):
                feed(evaluate_group(a, now))

    def after() -> None:
        now = state["now"]
        while state["wake"]:
            state["wake"] = False
            while state["submitted"] < sc.prompts:
                feed(Submitted(state["submitted"]))
                state["submitted"] += 1
            if coord.queued:
                version = min(state["engine"], coord.version)
                # AReaL's capacity gates admission under the capacity policy (the executor's
                # StalenessManager); nothing else does here
                gated = s.policy == "capacity"
                feed(Dispatch(now, version, coord.capacity(version) if gated else None))
            if state["wake"]:
                continue
            if not state["training"]:
                feed(BatchWanted(s.batch_size, now))

    after()
    while heap:
        time, _, kind, what = heapq.heappop(heap)
        state["now"] = time
        if kind in ("ok", "fail"):
            member, score = what
            if member in state["gone"]:
                continue
            if kind == "ok":
                feed(MemberFinished(member, time, {"score": score}))
            else:
                feed(MemberFailed(member, time, "failed", min(state["engine"], coord.version)))
        elif kind == "cut":
            feed(MemberFinished(what, time, {"score": 0.0}))
        elif kind == "timer":
            name, due = what
            if state["timers"].get(name) != due:
                continue  # re-armed or cancelled since
            del state["timers"][name]
            feed(TimerFired(name, time))
        else:  # trained
            state["training"] = False
            state["steps"] += 1
            state["engine"] = what + 1
            feed(VersionPublished(what + 1, time))
            if state["steps"] == sc.steps:
                break
            state["wake"] = True
        after()
    assert state["steps"] == sc.steps, f"{sc.name}: only {state['steps']} steps"
    return world


# ----------------------------------------------------------------------------- (c) simulator


class Spec(NamedTuple):
    """A :class:`~stalebound.sim.workload.TrajectorySpec` with a score (what the simulator's
    members report to group post-processors)."""

    segments: tuple[int, ...]
    tools: tuple[float, ...]
    failed: bool
    score: float


@dataclass
class ScriptSource:
    """Each member's length chosen so that, its first token with its (instant) prefill and then
    a token a second, it ends at its time."""

    sc: Scenario
    world: World

    def spec(self, prompt: int, attempt: int, member: int) -> TrajectorySpec:
        gid = next(g for g, origin in self.world.origin.items() if origin == (prompt, attempt))
        key = (gid, member)
        if key not in self.sc.ends:
            return cast(TrajectorySpec, Spec((NEVER,), (), False, 0.0))
        time, how, score = self.sc.ends[key]
        steps = time - self.world.launched[key]
        assert steps == int(steps) and steps >= 1, f"{key}: ends {steps} s after launch"
        return cast(TrajectorySpec, Spec((int(steps) + 1,), (), how == "fail", score))


def run_simulator(sc: Scenario, world: World) -> Log:
    """(c): the simulator, its engine model decoding one token per second per sequence."""
    s = sc.settings
    cfg = workload_from_dict(
        {
            "engine": {
                "replicas": 1,
                "max_concurrency": 64,
                "step_base": 1.0,
                "step_per_seq": 0.0,
            },
            "batch": {"groups": s.batch_size, "group_size": s.group_size},
            "trainer": {"step_time": sc.step_time},
            "run": {"steps": sc.steps, "warmup_fraction": 0.0},
        }
    )
    log: Log = []
    sim = Simulation(
        cfg,
        s.policy,
        s.staleness,
        source=ScriptSource(sc, world),
        settings=s,
        prompts=sc.prompts,
        action_log=lambda event, actions: log.append((event, actions)),
    )
    assert sim.run().steps == sc.steps
    return log


# ----------------------------------------------------------------------------- (b) executor


@dataclass
class VirtualClock:
    now: float = 0.0


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock the test sets: timers fire once the test has moved the clock
    past them and the loop next wakes (every hop onto it wakes it)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def time(self) -> float:
        return self._clock.now


def run_executor(sc: Scenario, world: World) -> Log:
    """(b): the executor with a scripted engine, replaying what happened in (a) — the same
    answers at the same times, the trainer asking and publishing at the same moments. Its own
    dispatches, timers, truncations and re-asks of a waiting trainer are its own doing."""
    clock = VirtualClock()
    engine = ProtocolEngine()
    log: Log = []
    ex = WorkflowExecutor(
        sc.config,
        engine,
        action_log=lambda event, actions: log.append((event, actions)),
        loop_factory=lambda: VirtualTimeLoop(clock),
    ).initialize()
    workflow = Episode()
    batch = sc.settings.batch_size
    trainer: threading.Thread | None = None
    asks = True  # the trainer's next BatchWanted is its own call (not a re-ask while parked)
    cut: set[Any] = {
        a.member for _, acts in world.log for a in acts if isinstance(a, TruncateMember)
    }

    def call_of(member: MemberId) -> RequestCall:
        launched = ex._call(
            lambda: [a.member for _, acts in log for a in acts if isinstance(a, LaunchMember)]
        )
        return engine.calls[launched.index(member)]

    def submit_all() -> None:
        for i in range(sc.prompts):
            ex.submit(i, workflow)

    def ask() -> threading.Thread:
        thread = threading.Thread(target=ex.wait, args=(batch,), daemon=True)
        thread.start()
        quiesce(ex, engine, until=parked_in_wait(ex, thread))
        return thread

    try:
        for event, _ in world.log:
            if isinstance(event, Submitted):
                if event.sample == 0:  # all of them, in one hop: one dispatch takes them in
                    ex._call(submit_all)
                continue
            if isinstance(event, Dispatch | GroupEvaluated):
                continue  # the executor's dispatcher, and its filters, do that by themselves
            if isinstance(event, BatchWanted):
                if asks:
                    asks = False
                    trainer = ask()
                continue
            now = getattr(event, "now", clock.now)
            assert now >= clock.now
            clock.now = now
            if isinstance(event, MemberFinished):
                if event.member not in cut:  # a truncated member returns by itself
                    score = event.result["score"]
                    engine.answer(call_of(event.member), score=score)
            elif isinstance(event, MemberFailed):
                engine.answer(call_of(event.member), error=RuntimeError("failed"))
            elif isinstance(event, VersionPublished):
                assert trainer is not None
                trainer.join(20)
                assert not trainer.is_alive(), "the trainer got no batch"
                ex.set_version(event.version)
                asks = True
            elif not isinstance(event, TimerFired):  # a timer fires when the clock passes it
                raise AssertionError(f"no way to replay {event}")
            quiesce(ex, engine)
    finally:
        ex.destroy()
    return log


# ----------------------------------------------------------------------------- the test


@pytest.mark.parametrize(
    "sc", SCENARIOS, ids=[sc.name.split(":")[0] + str(i) for i, sc in enumerate(SCENARIOS)]
)
def test_the_coordinator_the_executor_and_the_simulator_decide_alike(sc: Scenario) -> None:
    world = run_coordinator(sc)
    missing = set(sc.expect) - features(world.log)
    assert not missing, f"{sc.name}: the scenario no longer exercises {sorted(missing)}"
    assert_same(f"{sc.name}, simulator", world.log, run_simulator(sc, world))
    assert_same(f"{sc.name}, executor", world.log, run_executor(sc, world))

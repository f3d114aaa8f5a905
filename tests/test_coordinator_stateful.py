"""The coordinator against a small shadow model, driven by Hypothesis.

Hypothesis plays the driver: it submits items, dispatches at the current version, finishes or
fails running members in any order with any results, fires armed timers and asks for batches.
The shadow keeps only what a driver can see from the actions — which members run, which groups
started and how each ended — and after every step checks what the coordinator promises:

* the bound: every handed-over trajectory is at most ``staleness`` versions stale;
* every group ends exactly once (handed over, reported as dropped, or retried) and every item
  taken in is queued, running, waiting in a buffer, or ended;
* no leaked reservation: the policy's running groups are exactly the coordinator's, and the
  members the coordinator counts as running are exactly the ones the driver was told to run.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stalebound.core import (
    Coordinator,
    CoordinatorSettings,
    EntryState,
    MemberId,
    build_policy,
)
from stalebound.core import events as ev
from stalebound.core.filters import evaluate_group, get_group_post_process


class CoordinatorMachine(RuleBasedStateMachine):
    @initialize(
        batch=st.integers(1, 2),
        staleness=st.integers(0, 2),
        group=st.integers(1, 2),
        extra_members=st.integers(0, 1),
        extra_entries=st.integers(0, 1),
        proactive=st.sampled_from(["null", "retry", "truncate"]),
        stuck_timeout=st.sampled_from([None, 1.0]),
        filtered=st.booleans(),
    )
    def setup(
        self,
        batch: int,
        staleness: int,
        group: int,
        extra_members: int,
        extra_entries: int,
        proactive: str,
        stuck_timeout: float | None,
        filtered: bool,
    ) -> None:
        self.settings = CoordinatorSettings(
            policy="buffer",
            staleness=staleness,
            batch_size=batch,
            buffer_size=batch + extra_entries,
            group_size=group,
            group_redundancy=group + extra_members,
            max_concurrent=(staleness + 1) * (batch + extra_entries),
            queue_size=1000,
            request_timeout=None,
            max_failures=1000,
            proactive=proactive,
            threshold=1,
            stuck_timeout=stuck_timeout,
            max_retries=2,
            post_process=get_group_post_process("dynamic_sampling_filter") if filtered else None,
            post_process_name="dynamic_sampling_filter",
            metric="score",
            max_filtered=1000,
            watchdog=5.0,
        )
        self.coord = Coordinator(build_policy(self.settings), self.settings)
        self.now = 0.0
        self.next_sample = 0
        self.running: dict[MemberId, int] = {}  # member → its V_traj
        self.group_of: dict[int, int] = {}  # started group → its sample
        self.group_version: dict[int, int] = {}
        self.ends: Counter[int] = Counter()  # group → times it ended
        self.ended_samples: set[int] = set()
        self.handed_samples: set[int] = set()
        self.timers: dict[str, float] = {}
        self.stopped = False

    # ------------------------------------------------------------------ the driver

    def send(self, event: ev.Event) -> list[ev.Action]:
        actions = self.coord.handle(event)
        verdicts = []  # the driver runs a completed group's filters and answers at once
        for a in actions:
            if isinstance(a, ev.StartGroup):
                assert a.group_id not in self.group_of, f"group {a.group_id} started twice"
                self.group_of[a.group_id] = a.sample
                self.group_version[a.group_id] = a.version
                assert a.version <= self.coord.version
            elif isinstance(a, ev.LaunchMember):
                assert a.member not in self.running
                assert a.member.group_id in self.group_of
                self.running[a.member] = a.version
            elif isinstance(a, ev.AbortRequest):
                assert self.running.pop(a.member, None) is not None, f"{a} of no running member"
            elif isinstance(a, ev.TruncateMember):
                assert a.member in self.running
            elif isinstance(a, ev.HandOverBatch):
                for g in a.groups:
                    self.end(g.group_id)
                    self.handed_samples.add(g.sample)
                    for r, _, _ in g.members:
                        assert a.version - r.version <= self.settings.staleness, "bound broken"
                        assert r.version >= g.version
            elif isinstance(a, ev.ReportDrop):
                self.end(a.group_id)
                assert self.group_of[a.group_id] == a.sample
                self.ended_samples.add(a.sample)
            elif isinstance(a, ev.Retry):
                self.end(a.group_id)
            elif isinstance(a, ev.ArmTimer):
                self.timers[a.timer] = a.at
            elif isinstance(a, ev.CancelTimer):
                self.timers.pop(a.timer, None)
            elif isinstance(a, ev.Stop):
                self.stopped = True
            elif isinstance(a, ev.EvaluateGroup):
                assert a is actions[-1], "a group's filters run after the other actions"
                verdicts = self.send(evaluate_group(a, self.now))
        return actions + verdicts

    def end(self, gid: int) -> None:
        self.ends[gid] += 1
        assert self.ends[gid] == 1, f"group {gid} ended {self.ends[gid]} times"
        assert not any(m.group_id == gid for m in self.running), f"group {gid} still runs"

    # ------------------------------------------------------------------ rules

    @rule(count=st.integers(0, 3), budget=st.sampled_from([None, None, 1]))
    def submit_and_dispatch(self, count: int, budget: int | None) -> None:
        for _ in range(count):
            self.send(ev.Submitted(self.next_sample))
            self.next_sample += 1
        self.send(ev.Dispatch(self.now, self.coord.version, budget))

    @rule(lag=st.integers(0, 1), budget=st.sampled_from([None, 0, 1, 3]))
    def dispatch(self, lag: int, budget: int | None) -> None:
        self.send(ev.Dispatch(self.now, max(0, self.coord.version - lag), budget))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), score=st.integers(0, 1), dt=st.floats(0, 2))
    def finish(self, data: st.DataObject, score: int, dt: float) -> None:
        member = data.draw(st.sampled_from(sorted(self.running, key=repr)))
        version = self.running.pop(member)
        self.now += dt
        result = {"score": score}
        self.send(ev.MemberFinished(member, self.now, result, (version, self.coord.version)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), cause=st.sampled_from(["timeout", "rejected", "error:ValueError"]))
    def fail(self, data: st.DataObject, cause: str) -> None:
        member = data.draw(st.sampled_from(sorted(self.running, key=repr)))
        self.running.pop(member)
        self.send(ev.MemberFailed(member, self.now, cause, self.coord.version))

    @precondition(lambda self: self.timers)
    @rule(data=st.data())
    def fire_timer(self, data: st.DataObject) -> None:
        timer = data.draw(st.sampled_from(sorted(self.timers)))
        self.now = max(self.now, self.timers.pop(timer))
        self.send(ev.TimerFired(timer, self.now))

    @rule(groups=st.integers(1, 3))
    def want_batch(self, groups: int) -> None:
        self.send(ev.BatchWanted(groups, self.now))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), scores=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def finish_several(self, data: st.DataObject, scores: list[int]) -> None:
        for score in scores:
            if self.running:
                self.finish(data, score, 0.5)

    @rule()
    def pause_and_resume(self) -> None:
        assert self.send(ev.Paused(self.now)) == []
        assert not [a for a in self.send(ev.Dispatch(self.now, self.coord.version)) if a]
        self.send(ev.Resumed(self.now))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def no_leaked_reservation(self) -> None:
        buf = self.coord.buffer
        assert buf is not None
        buf.check_invariants()
        running_groups = {m.group_id for m in self.running}
        assert buf.reserved_count == self.coord.running_groups
        assert running_groups <= set(self.coord.running())
        assert self.coord.running_members == len(self.running)

    @invariant()
    def every_group_and_item_is_accounted_for(self) -> None:
        buf = self.coord.buffer
        assert buf is not None
        running = set(self.coord.running())
        for gid in self.group_of:
            where = buf.lookup(gid)
            waiting = where is not None and where[0] is EntryState.OCCUPIED
            states = (gid in running) + waiting + self.ends[gid]
            assert states == 1, f"group {gid}: running {gid in running}, waiting {waiting}"
        queued = {sample for sample, _ in self.coord.queued_items()}
        live = {self.group_of[g] for g in self.group_of if self.ends[g] == 0}
        for sample in range(self.next_sample):
            places = (
                (sample in queued)
                + (sample in live)
                + (sample in self.ended_samples)
                + (sample in self.handed_samples)
            )
            assert places == 1, f"item {sample} is in {places} places"

    def teardown(self) -> None:
        if not hasattr(self, "coord"):
            return
        self.send(ev.StopRequested("the test ends", self.now))
        assert not self.running and self.coord.running_groups == 0
        assert self.coord.buffer is not None and self.coord.buffer.reserved_count == 0
        self.every_group_and_item_is_accounted_for()


CoordinatorMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None
)
test_coordinator_against_the_shadow = CoordinatorMachine.TestCase

"""Whole simulations on small workloads: determinism, the clock, the bound, conservation."""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
from typing import Any

import pytest

from stalebound.config import DeadlineConfig, ProactiveFilterConfig, RolloutConfig
from stalebound.core.events import Retry, TruncateMember
from stalebound.core.settings import resolve_settings
from stalebound.obs.trace import TraceRecorder
from stalebound.sim.config import WorkloadConfig, workload_from_dict
from stalebound.sim.engine import EventQueue
from stalebound.sim.policies import coordinator_settings, policy_spec
from stalebound.sim.simulator import POLICIES, Simulation, simulate

# Long tails on a tiny cluster: p99 is 30× the median, so stragglers outlive several steps.
TAIL: dict[str, Any] = {
    "name": "tail",
    "lengths": {"distribution": "lognormal", "median": 100, "p99": 3000, "cap": 6000},
    "engine": {"replicas": 2, "max_concurrency": 16, "step_base": 0.01, "step_per_seq": 0.0005},
    "batch": {"groups": 4, "group_size": 2},
    "trainer": {"step_time": 0.5},
    "redundancy": {"batch_factor": 1.5, "group_extra": 1},
    "proactive": {"threshold": 2},
    "run": {"steps": 30},
}


def tail(**changes: Any) -> WorkloadConfig:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in TAIL.items()}
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value}
    return workload_from_dict(data)


def trace_text(cfg: WorkloadConfig, policy: str, eta: int, seed: int) -> str:
    out = io.StringIO()
    recorder = TraceRecorder(out)
    simulate(cfg, policy, eta, seed=seed, recorder=recorder)
    lines = out.getvalue().splitlines()
    return "\n".join(lines[1:])  # the header holds the creation time


def test_same_seed_same_trace_and_different_seeds_differ() -> None:
    cfg = tail()
    a = trace_text(cfg, "buffer", 2, seed=1)
    assert a.count("\n") > 50
    assert a == trace_text(cfg, "buffer", 2, seed=1)
    assert a != trace_text(cfg, "buffer", 2, seed=2)


class RecordingQueue(EventQueue):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def pop(self) -> Any:
        event = super().pop()
        if event is not None:
            self.times.append(self.now)
        return event


@pytest.mark.parametrize("policy", ["buffer+retry", "capacity-drop"])
def test_virtual_clock_never_goes_backwards(policy: str) -> None:
    sim = Simulation(tail(failures={"rate": 0.1}, agent={"turns": 3}), policy, 1, seed=3)
    sim.queue = RecordingQueue()
    sim.run()
    times = sim.queue.times
    assert len(times) > 100
    assert all(a <= b for a, b in itertools.pairwise(times))


def test_buffer_never_violates_the_bound_while_capacity_does() -> None:
    cfg = tail()
    for seed in (0, 1):
        cap = simulate(cfg, "capacity", 1, seed=seed)
        buf = simulate(cfg, "buffer", 1, seed=seed)
        assert cap.violations > 0
        assert cap.staleness_max > 1
        assert buf.violations == 0
        assert buf.staleness_max <= 1
    drop = simulate(cfg, "capacity-drop", 1, seed=0)
    assert drop.violations == 0
    assert drop.wasted_fraction > 0  # the bound is kept by throwing work away


def test_sync_is_the_buffer_at_staleness_zero() -> None:
    cfg = tail()
    sync = simulate(cfg, "sync", 5, seed=0)
    assert sync.staleness == 0
    assert sync.staleness_histogram == {0: sync.counts["trained"]}
    assert sync.to_json() == {**simulate(cfg, "buffer", 0, seed=0).to_json(), "policy": "sync"}


OUTCOMES = ("trained", "failed", "surplus", "retried", "aborted", "dropped", "deadline")
STILL = ("running", "finished_pending", "waiting")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_launched_trajectory_is_accounted_for(policy: str) -> None:
    cfg = tail(failures={"rate": 0.15, "max_relaunches": 1}, agent={"turns": 2})
    result = simulate(cfg, policy, 2, seed=5)
    c = result.counts
    assert c["launched"] > 100
    assert c["trained"] == result.steps * 4 * 2
    assert c["launched"] == sum(c.get(k, 0) for k in OUTCOMES + STILL)
    tokens = result.tokens
    assert tokens["trained"] + tokens["wasted"] <= tokens["generated"] + 1e-6


def test_filters_and_redundancy_are_counted() -> None:
    cfg = tail()
    truncated = simulate(cfg, "buffer+truncate", 1, seed=0)
    assert truncated.counts.get("truncated", 0) > 0
    assert 0 < truncated.truncated_fraction < 1
    redundant = simulate(cfg, "buffer+redundancy", 1, seed=0)
    assert redundant.counts.get("surplus", 0) > 0  # N′ = 3 for N = 2: one member cut per group
    assert redundant.wasted_fraction > 0


def test_metrics_are_fractions_and_within_the_bound() -> None:
    for policy in ("buffer", "capacity", "buffer+truncate"):
        r = simulate(tail(), policy, 2, seed=0)
        assert r.throughput > 0
        assert r.efficiency <= 1.05  # the window edges may add a little
        for x in (r.trainer_util, r.engine_util, r.wasted_fraction):
            assert 0 <= x <= 1
        if r.stuck_fraction is not None:
            assert 0 <= r.stuck_fraction <= 1


def test_results_do_not_depend_on_object_addresses() -> None:
    # Interleave allocations between two identical runs so objects land at other addresses.
    cfg = tail(agent={"turns": 2})
    first = simulate(cfg, "buffer+redundancy", 2, seed=4).to_json()
    ballast = [object() for _ in range(10_000)]
    second = simulate(cfg, "buffer+redundancy", 2, seed=4).to_json()
    assert ballast and first == second


def test_the_proactive_time_trigger_waits() -> None:
    eager = simulate(tail(), "buffer+truncate", 1, seed=0)
    patient = simulate(tail(proactive={"stuck_time": 1e9}), "buffer+truncate", 1, seed=0)
    assert eager.counts.get("truncated", 0) > 0
    assert patient.counts.get("truncated", 0) == 0
    assert patient.to_json()["throughput"] == simulate(tail(), "buffer", 1, seed=0).throughput


def test_a_weight_sync_delay_slows_synchronous_training() -> None:
    fast = simulate(tail(), "sync", 0, seed=0)
    slow = simulate(tail(engine={"sync_delay": 2.0}), "sync", 0, seed=0)
    assert slow.throughput < fast.throughput
    assert slow.violations == 0


def test_the_proactive_filter_decides_as_the_runtime_does() -> None:
    # The coordinator decides, not the simulator: it truncates while the trainer is still busy
    # (a STUCK head is acted on as soon as its stragglers are overtaken), and a prompt is
    # retried at most max_retries times.
    busy_cuts = []
    sim: Simulation

    def watch(event: Any, actions: list[Any]) -> None:
        if any(isinstance(a, TruncateMember) for a in actions):
            busy_cuts.append(sim.trainer.training)

    sim = Simulation(tail(), "buffer+truncate", 1, seed=0, action_log=watch)
    sim.run()
    assert any(busy_cuts)
    retries = []

    def count(event: Any, actions: list[Any]) -> None:
        retries.extend(a.retries for a in actions if isinstance(a, Retry))

    Simulation(tail(), "buffer+retry", 1, seed=0, action_log=count).run()
    assert retries
    assert max(retries) <= sim.settings.max_retries


@pytest.mark.parametrize("cut_tools", [True, False])
def test_a_truncation_in_a_tool_call_ends_it_at_once_or_waits_as_the_workload_says(
    cut_tools: bool,
) -> None:
    # Tool calls of 3 training steps: deadlines fall during them. Cut, the episode returns at
    # once (as a workflow awaiting its tools through `interruptible` does) and is trained
    # truncated; not cut, the trainer waits the grace and then aborts the group.
    cfg = tail(
        agent={
            "turns": 2,
            "tool_latency": {"distribution": "fixed", "value": 1.5},
            "cut_tools": cut_tools,
        }
    )
    r = simulate(cfg, "deadline-tight", 1, seed=0)
    assert r.violations == 0 and r.counts["truncated_trained"] > 0
    if cut_tools:
        assert r.counts.get("deadline", 0) == 0 and r.wasted_fraction == 0
    else:
        assert r.counts["deadline"] > 0 and r.wasted_fraction > 0


def test_a_truncation_never_cuts_the_wait_for_a_reward() -> None:
    # Rewards that take 3 training steps: a deadline falls during them. Tool calls are cut
    # (`agent.cut_tools`), the reward's wait is not (the runtime cannot cut it either): the
    # trainer waits the grace, then the group is aborted.
    cfg = tail(agent={"reward_latency": {"distribution": "fixed", "value": 1.5}, "cut_tools": True})
    r = simulate(cfg, "deadline-tight", 1, seed=0)
    assert r.violations == 0
    assert r.counts["deadline"] > 0 and r.wasted_fraction > 0


def test_contention_slows_training_only_while_the_engines_generate() -> None:
    # synchronous: the engines are idle while the trainer trains, so nothing changes
    alone = simulate(tail(), "sync", 0, seed=0)
    shared = simulate(tail(trainer={"contention": 1.0}), "sync", 0, seed=0)
    assert shared.throughput == alone.throughput
    # asynchronous: generation overlaps training, which runs slower
    alone = simulate(tail(), "buffer", 2, seed=0)
    shared = simulate(tail(trainer={"contention": 1.0}), "buffer", 2, seed=0)
    assert shared.throughput < alone.throughput
    assert shared.violations == 0


def test_a_null_group_limit_means_the_runtime_default_when_the_workload_says_so() -> None:
    from stalebound.sim.simulator import coordinator_settings, policy_spec

    cluster = tail()
    runtime = tail(batch={"runtime_default": True})
    slots = cluster.engine.replicas * cluster.engine.max_concurrency
    B = cluster.batch.groups
    for policy, eta, expected in [("capacity", 2, B), ("buffer", 2, 3 * B), ("deadline", 2, 2 * B)]:
        spec = policy_spec(policy)
        assert coordinator_settings(cluster, spec, eta).max_concurrent == slots
        assert coordinator_settings(runtime, spec, eta).max_concurrent == expected, policy


def test_a_publication_that_waits_for_the_episodes_it_starts_lengthens_the_step() -> None:
    fast = simulate(tail(), "buffer", 2, seed=0)
    slow = simulate(tail(trainer={"publish_per_start": 0.05}), "buffer", 2, seed=0)
    assert slow.throughput < fast.throughput
    assert slow.trainer_util > fast.trainer_util  # the trainer is busy while it waits
    assert slow.violations == 0
    c = slow.counts
    assert c["trained"] == slow.steps * 4 * 2
    assert c["launched"] == sum(c.get(k, 0) for k in OUTCOMES + STILL)


# What the simulator sets on purpose: it models a cluster, not an operator's patience or logs.
SIMULATOR_CHOICES = {"request_timeout", "max_failures", "watchdog", "progress_log"}


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "sync"])
def test_the_simulator_and_the_runtime_resolve_one_default_per_setting(policy: str) -> None:
    """The simulator builds its coordinator settings with the runtime's builder: every setting the
    workload does not name resolves to the runtime's default, under every policy."""
    cfg = workload_from_dict({"batch": {"groups": 4, "group_size": 2, "runtime_default": True}})
    spec = policy_spec(policy)
    sim = coordinator_settings(cfg, spec, 4)
    runtime = resolve_settings(
        RolloutConfig(
            staleness_policy=spec.kind,  # type: ignore[arg-type]
            staleness=4,
            deadline=DeadlineConfig(
                target=spec.target(4),
                action=spec.deadline_action,  # type: ignore[arg-type]
            ),
            consumer_batch_size=4,
            group_size=2,
            buffer_size=math.ceil(4 * cfg.redundancy.batch_factor) if spec.redundancy else None,
            group_redundancy=2 + cfg.redundancy.group_extra if spec.redundancy else None,
            reject_stale_results=spec.drop_stale,
            proactive_filter=ProactiveFilterConfig(method=spec.filter or "null"),  # type: ignore[arg-type]
        ),
    )
    differ = {
        f.name
        for f in dataclasses.fields(sim)
        if getattr(sim, f.name) != getattr(runtime, f.name) and f.name not in SIMULATOR_CHOICES
    }
    assert differ == set(), {n: (getattr(sim, n), getattr(runtime, n)) for n in differ}

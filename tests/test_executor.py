"""WorkflowExecutor driven by a scripted in-memory engine.

The engine holds every generation request until the test answers it, so the completion order is
chosen by the test (reverse, random, stragglers), not by timing. Between steps the test waits until
the executor is quiescent: every running member has reached the engine and every answer has been
processed.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from scripted import Call, Generate, ScriptedEngine, armed_timers, quiesce
from stalebound.config import RolloutConfig
from stalebound.core import BufferPolicy, ConfigError, DataExhausted, ProtocolError
from stalebound.core import settings as settings_module
from stalebound.runtime import (
    RolloutError,
    StalenessManager,
    Trajectory,
    WorkflowExecutor,
)


def make(engine: Any, manager: StalenessManager | None = None, **settings: Any) -> WorkflowExecutor:
    settings.setdefault("group_size", 1)
    return WorkflowExecutor(RolloutConfig(**settings), engine, manager).initialize()


def groups(batch: list[Trajectory]) -> dict[int, list[Trajectory]]:
    out: dict[int, list[Trajectory]] = {}
    for t in batch:
        out.setdefault(t.group_id, []).append(t)
    return out


def train(
    ex: WorkflowExecutor,
    engine: ScriptedEngine,
    steps: int,
    choose: Callable[[list[Call]], Call],
    feed: Callable[[], None],
) -> list[list[Trajectory]]:
    """A trainer: answer one request at a time in the order ``choose`` picks; take each batch as
    soon as one is ready and publish the next version."""
    batches: list[list[Trajectory]] = []
    while len(batches) < steps:
        feed()
        quiesce(ex, engine)
        batch = ex.collect_results()
        if batch:
            batches.append(batch)
            ex.set_version(ex.version)
            continue
        pending = engine.pending()
        assert pending, f"nothing to answer and no batch: {ex.statistics()}"
        engine.answer(choose(pending))
    return batches


# ---------------------------------------------------------------------------- basics


def test_rollout_batch_returns_trajectories_with_versions() -> None:
    engine = ScriptedEngine(auto=True, version=3)
    with make(engine, consumer_batch_size=2, group_size=2) as ex:
        batch = ex.rollout_batch(["a", "b"], Generate())
        assert len(batch) == 4
        assert sorted(t.data["data"] for t in batch) == ["a", "a", "b", "b"]
        for t in batch:
            assert (t.version, t.consumed_version, t.staleness) == (3, 3, 0)
            assert t.token_versions == (3, 3)
        assert len(groups(batch)) == 2 and all(len(g) == 2 for g in groups(batch).values())
        assert ex.version == 4  # consuming advanced the training version
        s = ex.statistics()
        assert (s.consumed_batches, s.consumed_groups, s.consumed_trajectories) == (1, 2, 4)
        assert s.policy.policy == "buffer"


def test_methods_need_initialize_and_stop_after_destroy() -> None:
    ex = WorkflowExecutor(RolloutConfig(), ScriptedEngine())
    with pytest.raises(ProtocolError, match="initialize"):
        ex.submit("x", Generate())
    ex.initialize()
    with pytest.raises(ProtocolError, match="already initialized"):
        ex.initialize()
    with pytest.raises(ProtocolError, match="arun_episode"):
        ex.submit("x", object())  # type: ignore[arg-type]
    ex.destroy()
    ex.destroy()  # idempotent
    with pytest.raises(ProtocolError, match="destroyed"):
        ex.get_capacity()


def test_import_stalebound_stays_light() -> None:
    code = (
        "import sys, stalebound; "
        "assert 'asyncio' not in sys.modules and 'stalebound.runtime' not in sys.modules; "
        "assert stalebound.WorkflowExecutor.__name__ == 'WorkflowExecutor'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- the buffer policy


@pytest.mark.parametrize(
    "eta, batch, seed, redundancy",
    [(0, 2, 1, None), (1, 2, 2, None), (2, 3, 3, None), (1, 2, 4, 3), (3, 2, 5, None)],
)
def test_buffer_policy_never_trains_staler_than_eta(
    eta: int, batch: int, seed: int, redundancy: int | None
) -> None:
    """Random completion orders with stragglers: every trajectory's staleness ≤ η, batches come
    out in version order, and training blocks rather than break the bound."""
    rng = random.Random(seed)
    engine = ScriptedEngine()
    group_size = 2 if redundancy else 1
    ex = make(
        engine,
        max_head_offpolicyness=eta,
        consumer_batch_size=batch,
        group_size=group_size,
        group_redundancy=redundancy,
    )
    stragglers = {c for c in range(0, 400, 7)}  # every 7th request is held as long as possible

    def choose(pending: list[Call]) -> Call:
        fast = [c for c in pending if c.index not in stragglers]
        return rng.choice(fast) if fast else min(pending, key=lambda c: c.index)

    def feed() -> None:
        while ex.get_capacity() > 0:
            ex.submit(rng.random(), Generate())

    try:
        batches = train(ex, engine, 12, choose, feed)
    finally:
        ex.destroy()
    assert [b[0].consumed_version for b in batches] == list(range(12))
    for b in batches:
        assert len(groups(b)) == batch
        assert all(len(g) == group_size for g in groups(b).values())
        for t in b:
            assert t.consumed_version == b[0].consumed_version
            assert 0 <= t.staleness <= eta
            assert t.token_versions is not None and min(t.token_versions) >= t.version
    stats = ex.statistics()
    assert stats.policy.violations == 0
    assert max(stats.policy.staleness_histogram) <= eta


def test_buffer_policy_blocks_training_on_a_straggler() -> None:
    engine = ScriptedEngine()
    with make(engine, max_head_offpolicyness=1, consumer_batch_size=1) as ex:
        ex.submit("straggler", Generate())
        quiesce(ex, engine)
        ex.submit("fast-0", Generate())
        quiesce(ex, engine)
        straggler, fast = engine.pending()
        assert straggler.data == "straggler"
        engine.answer(fast)
        quiesce(ex, engine)
        first = ex.collect_results()
        assert [t.data["data"] for t in first] == ["fast-0"]
        ex.set_version(1)
        # another fast rollout finishes, but buffer 1 is held for the straggler
        ex.submit("fast-1", Generate())
        quiesce(ex, engine)
        engine.answer(engine.pending()[-1])
        quiesce(ex, engine)
        assert ex.collect_results() == []
        engine.answer(straggler)
        quiesce(ex, engine)
        second = ex.collect_results()
        assert [(t.data["data"], t.staleness) for t in second] == [("straggler", 1)]


# ---------------------------------------------------------------------------- the capacity policy


def straggler_run(engine: ScriptedEngine, ex: WorkflowExecutor, steps: int) -> list[Trajectory]:
    """A straggler admitted at version 0, and one fast rollout per training step."""
    ex.submit("straggler", Generate())
    quiesce(ex, engine)
    (straggler,) = engine.pending()
    trained: list[Trajectory] = []
    for step in range(steps):
        ex.submit(f"fast-{step}", Generate())
        quiesce(ex, engine)
        fast = [c for c in engine.pending() if c is not straggler]
        assert len(fast) == 1, f"step {step}: the manager admitted {len(fast)} fast rollouts"
        engine.answer(fast[0])
        quiesce(ex, engine)
        trained += ex.collect_results()
        ex.set_version(ex.version)
    engine.answer(straggler)
    quiesce(ex, engine)
    trained += ex.collect_results()
    return trained


def test_capacity_policy_bound_is_aggregate_only() -> None:
    """AReaL's arithmetic lets a straggler admitted at version 0 be trained at staleness 5 > η."""
    engine = ScriptedEngine()
    with make(
        engine,
        staleness_policy="capacity",
        max_head_offpolicyness=1,
        consumer_batch_size=1,
        max_concurrent_rollouts=2,
    ) as ex:
        trained = straggler_run(engine, ex, steps=5)
        by_name = {t.data["data"]: t for t in trained}
        assert all(by_name[f"fast-{i}"].staleness == 0 for i in range(5))
        late = by_name["straggler"]
        assert (late.version, late.consumed_version, late.staleness) == (0, 5, 5)
        stats = ex.statistics()
        assert stats.policy.violations == 1
        assert stats.policy.staleness_histogram == {0: 5, 5: 1}
        assert stats.manager is not None and stats.manager.accepted == 6


def test_capacity_policy_can_reject_stale_results() -> None:
    engine = ScriptedEngine()
    with make(
        engine,
        staleness_policy="capacity",
        max_head_offpolicyness=1,
        consumer_batch_size=1,
        max_concurrent_rollouts=2,
        reject_stale_results=True,
    ) as ex:
        trained = straggler_run(engine, ex, steps=5)
        assert "straggler" not in {t.data["data"] for t in trained}
        assert all(t.staleness <= 1 for t in trained)
        stats = ex.statistics()
        assert stats.dropped_groups == 1 and stats.policy.dropped == 1
        assert stats.policy.policy == "capacity-drop"
        assert stats.manager is not None and stats.manager.rejected == 1


def test_capacity_policy_should_accept_fn_rejects() -> None:
    engine = ScriptedEngine(auto=True)
    with make(engine, staleness_policy="capacity", consumer_batch_size=2) as ex:

        def accept(trajectories: list[Any]) -> bool:
            return str(trajectories[0]["data"]).startswith("keep")

        ex.pause()  # all four queued before the first admission: the order below is fixed
        for name in ["keep-1", "drop-1", "keep-2", "drop-2"]:
            ex.submit(name, Generate(), should_accept_fn=accept)
        ex.resume()
        batch = ex.wait(2, timeout=20)
        assert sorted(t.data["data"] for t in batch) == ["keep-1", "keep-2"]
        stats = ex.statistics()
        assert stats.filtered_groups == 2
        assert stats.manager is not None and stats.manager.rejected == 2
        assert stats.policy.aborted == {"filtered": 2}


# ---------------------------------------------------------------------------- dispatch


def test_pause_stops_dispatch_and_resume_restarts_it() -> None:
    engine = ScriptedEngine(auto=True)
    with make(engine, consumer_batch_size=4) as ex:
        ex.pause()
        assert ex.paused
        for i in range(4):
            ex.submit(i, Generate())
        s = quiesce(ex, engine)
        assert engine.calls == [] and s.queued == 4 and s.dispatched_groups == 0
        ex.resume()
        batch = ex.wait(4, timeout=20)
        assert sorted(t.data["data"] for t in batch) == [0, 1, 2, 3]


def test_dispatch_is_woken_by_a_version_change_not_by_polling() -> None:
    engine = ScriptedEngine(auto=True)
    with make(engine, max_head_offpolicyness=0, consumer_batch_size=2) as ex:
        for i in range(4):
            ex.submit(i, Generate())
        assert len(ex.wait(2, timeout=20)) == 2  # version 1; the engine still has version 0
        idle = quiesce(ex, engine)
        assert len(engine.calls) == 2 and idle.queued == 2  # η = 0: nothing may start at version 0
        # no timer but the log lines' will fire: nothing wakes a dispatcher that does not poll
        assert set(armed_timers(ex)) <= {"timer:watchdog", "WorkflowExecutor._progress"}
        ex.set_version(1)
        engine.wait_calls(4)
        after = quiesce(ex, engine)
        assert after.dispatch_wakeups - idle.dispatch_wakeups <= 3
        assert [t.version for t in ex.wait(2, timeout=20)] == [1, 1]


def test_get_capacity_counts_queued_submissions() -> None:
    engine = ScriptedEngine()
    with make(engine, max_head_offpolicyness=1, consumer_batch_size=2) as ex:
        assert ex.get_capacity() == 4  # (η + 1)·B entries
        ex.pause()
        ex.submit("a", Generate())
        assert ex.get_capacity() == 3
        ex.resume()
        quiesce(ex, engine)
        assert ex.get_capacity() == 3


def test_a_huge_eta_admits_at_most_eight_batches_and_the_first_finished_make_a_batch() -> None:
    # η = 1000 without max_concurrent_rollouts once admitted (η + 1)·B′ groups at once; the head
    # buffer's entries were reserved last, so the first step waited for all of them.
    engine = ScriptedEngine()
    with make(engine, max_head_offpolicyness=1000, consumer_batch_size=2) as ex:
        assert ex.get_capacity() == 8 * 2
        loader = iter(range(10**6))
        batch: list[list[Trajectory]] = []
        trainer = threading.Thread(
            target=lambda: batch.append(ex.prepare_batch(loader, Generate())), daemon=True
        )
        trainer.start()
        engine.wait_calls(16)
        quiesce(ex, engine)
        assert len(engine.pending()) == 16  # no more than 8 batches in flight
        first, second = engine.pending()[:2]
        engine.answer(first)
        engine.answer(second)
        trainer.join(timeout=20)
        assert sorted(t.data["data"] for t in batch[0]) == [0, 1]  # the first two finished
        assert ex.statistics().policy.consumed == 2


def test_queue_full_is_refused_clearly() -> None:
    with make(ScriptedEngine(), queue_size=2) as ex:
        ex.pause()
        ex.submit(1, Generate())
        ex.submit(2, Generate())
        with pytest.raises(ProtocolError, match=r"queue is full.*queue_size=2"):
            ex.submit(3, Generate())
        assert ex.statistics().queued == 2


def test_policy_is_only_touched_from_the_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[int] = set()

    class Recording(BufferPolicy):
        def __getattribute__(self, name: str) -> Any:
            threads.add(threading.get_ident())
            return super().__getattribute__(name)

    monkeypatch.setattr(settings_module, "BufferPolicy", Recording)  # what build_policy builds
    engine = ScriptedEngine(auto=True)
    ex = make(engine, consumer_batch_size=2)
    threads.clear()  # construction happens in initialize(), before the loop exists
    ex.get_capacity()
    ex.rollout_batch([1, 2], Generate())
    ex.collect_results()
    ex.statistics()
    ex.destroy()
    assert threads and threading.get_ident() not in threads and len(threads) == 1


# ---------------------------------------------------------------------------- groups and redundancy


def test_group_surplus_members_are_cancelled_at_the_engine() -> None:
    engine = ScriptedEngine()
    with make(engine, consumer_batch_size=1, group_size=2, group_redundancy=3) as ex:
        ex.submit("p", Generate())
        engine.wait_calls(3)
        quiesce(ex, engine)
        first, second, third = engine.calls
        engine.answer(third)
        engine.answer(first)
        quiesce(ex, engine)
        assert second.cancelled  # the engine saw the cancellation
        batch = ex.collect_results()
        assert sorted(t.member for t in batch) == [0, 2]
        s = ex.statistics()
        assert s.cancelled_members == {"surplus": 1} and s.running_members == 0


def test_surplus_reservation_is_cancelled_when_its_buffer_is_consumed() -> None:
    engine = ScriptedEngine()
    with make(engine, max_head_offpolicyness=0, consumer_batch_size=1, buffer_size=2) as ex:
        ex.submit("fast", Generate())
        ex.submit("slow", Generate())
        engine.wait_calls(2)
        quiesce(ex, engine)
        fast, slow = engine.calls
        engine.answer(fast)
        quiesce(ex, engine)
        assert [t.data["data"] for t in ex.collect_results()] == ["fast"]
        quiesce(ex, engine)
        assert slow.cancelled
        s = ex.statistics()
        assert s.surplus_groups == 1 and s.policy.aborted == {"surplus": 1}
        assert s.running_groups == 0


def test_failed_member_is_relaunched() -> None:
    engine = ScriptedEngine()
    with make(engine, consumer_batch_size=1, group_size=2) as ex:
        ex.submit("p", Generate())
        engine.wait_calls(2)
        engine.answer(engine.calls[0], ValueError("engine hiccup"))
        engine.wait_calls(3)  # the relaunch
        quiesce(ex, engine)
        for c in engine.pending():
            engine.answer(c)
        batch = ex.wait(1, timeout=20)
        assert sorted(t.member for t in batch) == [1, 2]
        s = ex.statistics()
        assert s.relaunched_members == 1
        assert s.member_failures == {"error:ValueError": 1}
        assert s.failed_groups == 0


# ---------------------------------------------------------------------------- failures


class Flaky:
    """Raises for ``boom``, returns None for ``none``, hangs for ``hang``, else answers."""

    async def arun_episode(self, engine: Any, data: str) -> Any:
        if data == "boom":
            raise RuntimeError("workflow bug")
        if data == "none":
            return None
        if data == "hang":
            await asyncio.Event().wait()
        return {"data": data}


def test_exceptions_timeouts_and_none_never_leak_a_slot() -> None:
    engine = ScriptedEngine()
    with make(
        engine,
        max_head_offpolicyness=0,
        consumer_batch_size=4,
        request_timeout=0.05,
        max_consecutive_failures=10,
    ) as ex:
        full = ex.get_capacity()
        for name in ["boom", "none", "hang", "ok"]:
            ex.submit(name, Flaky())
        deadline = time.monotonic() + 20
        while ex.statistics().failed_groups < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        s = ex.statistics()
        assert s.failed_groups == 3 and s.completed_groups == 1
        # each failed member was relaunched once (group_size 1 allows one relaunch), then given up
        assert s.member_failures == {"error:RuntimeError": 2, "rejected": 2, "timeout": 2}
        assert s.running_members == 0 and s.running_groups == 0
        assert s.policy.running == 0 and s.policy.aborted == {"failed": 3}
        assert ex.get_capacity() == full - 1  # only the finished group holds an entry


def test_consecutive_failures_stop_the_executor_with_the_causes() -> None:
    with make(ScriptedEngine(), max_consecutive_failures=3, consumer_batch_size=2) as ex:
        ex.pause()  # every group submitted before the first can fail and stop the executor
        for _ in range(6):
            ex.submit("boom", Flaky())
        ex.resume()
        with pytest.raises(RolloutError, match=r"3 groups failed in a row.*error:RuntimeError"):
            ex.wait(2, timeout=20)
        with pytest.raises(RolloutError):
            ex.submit("ok", Flaky())
        s = ex.statistics()
        assert s.stopped is not None and s.failed_groups == 3 and s.running_groups == 0


def test_a_workflow_that_is_not_async_fails_its_group_cleanly() -> None:
    class Sync:
        def arun_episode(self, engine: Any, data: Any) -> Any:
            return {"data": data}

    with make(ScriptedEngine(), max_consecutive_failures=1) as ex:
        ex.submit("x", Sync())
        with pytest.raises(RolloutError, match="error:TypeError"):
            ex.wait(1, timeout=20)


def test_destroy_cancels_running_episodes() -> None:
    engine = ScriptedEngine()
    ex = make(engine, consumer_batch_size=2)
    ex.submit("a", Generate())
    ex.submit("b", Generate())
    engine.wait_calls(2)
    ex.destroy()
    assert all(c.cancelled for c in engine.calls)
    s = ex.statistics()
    assert s.policy.aborted == {"shutdown": 2} and s.cancelled_members == {"shutdown": 2}


# ---------------------------------------------------------------------------- configuration


def test_data_parallel_size_divides_concurrency_and_batch_not_eta() -> None:
    engine = ScriptedEngine(auto=True)
    config = RolloutConfig(
        max_head_offpolicyness=3, consumer_batch_size=8, max_concurrent_rollouts=16, group_size=1
    )
    with WorkflowExecutor(config, engine).initialize(train_data_parallel_size=4) as ex:
        s = ex.statistics()
        assert s.policy.staleness_bound == 3
        assert ex.get_capacity() == 4  # concurrency 16 / 4, below (η + 1)·B = 4·2
        assert len(ex.rollout_batch([1, 2], Generate())) == 2  # B = 8 / 4 groups per batch

    config = RolloutConfig(
        staleness_policy="capacity",
        max_head_offpolicyness=3,
        consumer_batch_size=8,
        max_concurrent_rollouts=16,
    )
    with WorkflowExecutor(config, engine).initialize(train_data_parallel_size=2) as ex:
        m = ex.staleness_manager
        assert m is not None
        assert (m.max_concurrent_rollouts, m.consumer_batch_size, m.max_staleness) == (8, 4, 3)


def test_unset_concurrency_falls_back_as_areal_under_capacity_and_to_the_window_under_buffer() -> (
    None
):
    engine = ScriptedEngine(auto=True)
    capacity = RolloutConfig(
        staleness_policy="capacity", max_head_offpolicyness=3, consumer_batch_size=8, group_size=1
    )
    with WorkflowExecutor(capacity, engine).initialize(train_data_parallel_size=2) as ex:
        m = ex.staleness_manager
        assert m is not None and m.strict  # the executor's own manager refuses misuse
        # AReaL: max_concurrent_rollouts or consumer_batch_size, per data-parallel rank
        assert (m.max_concurrent_rollouts, m.consumer_batch_size) == (4, 4)
        assert ex.get_capacity() == 4
    buffer = RolloutConfig(
        max_head_offpolicyness=3, consumer_batch_size=8, buffer_size=10, group_size=1
    )
    with WorkflowExecutor(buffer, engine).initialize(train_data_parallel_size=2) as ex:
        assert ex.staleness_manager is None
        assert ex.get_capacity() == (3 + 1) * 5  # (η + 1)·B′ per rank: the whole window


def test_indivisible_settings_are_reported_together() -> None:
    config = RolloutConfig(consumer_batch_size=6, max_concurrent_rollouts=10)
    with pytest.raises(ConfigError) as info:
        WorkflowExecutor(config, ScriptedEngine()).initialize(train_data_parallel_size=4)
    assert len(info.value.problems) == 2
    assert "consumer_batch_size=6" in str(info.value) and "max_concurrent_rollouts=10" in str(
        info.value
    )
    with pytest.raises(ConfigError, match="train_data_parallel_size=0"):
        WorkflowExecutor(RolloutConfig(), ScriptedEngine()).initialize(train_data_parallel_size=0)
    with pytest.raises(ConfigError) as bad_policy:
        WorkflowExecutor(
            RolloutConfig(staleness_policy="fifo"),  # type: ignore[arg-type]
            ScriptedEngine(),
        ).initialize()
    assert bad_policy.value.problems == (  # what loading rollout.staleness_policy=fifo says
        "rollout.staleness_policy=fifo: must be one of buffer, capacity, deadline; use one of them",
    )


# ---------------------------------------------------------------------------- prepare_batch


def test_prepare_batch_keeps_generating_from_the_loader() -> None:
    engine = ScriptedEngine(auto=True)
    loader = [["a", "b"], ["c", "d"]]  # AReaL-style: each element a batch of items
    with make(engine, consumer_batch_size=2, max_head_offpolicyness=1) as ex:
        seen = []
        for _ in range(4):
            batch = ex.prepare_batch(loader, Generate())
            assert len(batch) == 2
            seen += [t.data["data"] for t in batch]
            ex.set_version(ex.version)
        # The loader is cycled: every item comes round again. Completion order decides which of
        # the groups in flight are trained first, so counts may differ by the window (4 groups).
        counts = Counter(seen)
        assert set(counts) == {"a", "b", "c", "d"} and sum(counts.values()) == 8
        assert max(counts.values()) - min(counts.values()) <= 2
    with make(engine) as ex, pytest.raises(ConfigError, match="yielded no items"):
        ex.prepare_batch([], Generate())


class OnePass:
    """A loader that gives its items once, then says it is used up (as ``data.epochs`` does)."""

    def __init__(self, items: list[str]) -> None:
        self.items, self.passes = items, 0

    def __iter__(self) -> Iterator[str]:
        if self.passes:
            raise DataExhausted("the one pass is over")
        self.passes += 1
        return iter(self.items)


def test_a_used_up_loader_trains_what_was_drawn_then_says_so() -> None:
    # five items, batches of two: two batches, then the fifth item's group cannot complete a batch
    engine = ScriptedEngine(auto=True)
    loader = OnePass(["a", "b", "c", "d", "e"])
    with make(engine, consumer_batch_size=2, max_head_offpolicyness=4) as ex:
        seen = []
        for _ in range(2):
            seen += [t.data["data"] for t in ex.prepare_batch(loader, Generate())]
            ex.set_version(ex.version + 1)
        with pytest.raises(DataExhausted, match="the one pass is over"):
            ex.prepare_batch(loader, Generate())
        with pytest.raises(DataExhausted):  # and again on every later call
            ex.prepare_batch(loader, Generate())
        assert len(seen) == 4 and len(set(seen)) == 4 and set(seen) < set("abcde")
        assert ex.statistics().completed_groups == 5


# ---------------------------------------------------------------------------- the seed's examples


class Trainer:
    """Stands in for the seed's trainer: a training step, then the new weights are published."""

    def __init__(self, executor: WorkflowExecutor) -> None:
        self.executor = executor
        self.batches: list[list[Trajectory]] = []

    def update(self, results: list[Trajectory]) -> None:
        if results:
            self.batches.append(results)
            self.executor.set_version(self.executor.version)


@pytest.mark.parametrize("policy", ["buffer", "capacity"])
def test_seed_monitoring_capacity_loop(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The seed's "Monitoring capacity" loop as written, with a trainer and a counter step."""
    config = RolloutConfig(
        staleness_policy=policy,  # type: ignore[arg-type]
        consumer_batch_size=4,
        max_head_offpolicyness=1,
        group_size=2,
    )
    inference_engine = ScriptedEngine(auto=True)
    executor = WorkflowExecutor(config, inference_engine)
    trainer = Trainer(executor)
    buffer = iter(range(10**6))
    generation_workflow = Generate()
    training_step, max_steps = 0, 5

    executor.initialize()

    while training_step < max_steps:
        # Check current capacity before submitting

        available_slots = executor.get_capacity()
        print(f"Step {training_step}: Available rollout slots: {available_slots}")

        # Submit up to available capacity

        for _ in range(available_slots):
            executor.submit(data=next(buffer), workflow=generation_workflow)

        # Collect results and train

        results = executor.collect_results()
        trainer.update(results)
        training_step += bool(results)  # the seed leaves the step counter to the reader

    executor.destroy()
    assert len(trainer.batches) == 5
    assert [b[0].consumed_version for b in trainer.batches] == [0, 1, 2, 3, 4]
    assert all(len(b) == 4 * 2 for b in trainer.batches)
    assert "Available rollout slots" in capsys.readouterr().out


def test_seed_custom_staleness_manager_with_smooth_version_provider() -> None:
    """The seed's custom VersionProvider and StalenessManager, passed to the executor."""

    class SmoothVersionProvider:
        def __init__(self, engine, smoothing_factor=0.9):  # type: ignore[no-untyped-def]
            self.engine = engine
            self.smooth_version = 0.0
            self.alpha = smoothing_factor

        def get_version(self) -> int:
            raw_version = self.engine.get_version()
            self.smooth_version = self.alpha * self.smooth_version + (1 - self.alpha) * raw_version
            return int(self.smooth_version)

    inference_engine = ScriptedEngine(auto=True)
    # Create custom manager

    custom_manager = StalenessManager(
        version_provider=SmoothVersionProvider(inference_engine),
        max_concurrent_rollouts=64,
        consumer_batch_size=32,
        max_staleness=10,
    )

    for policy in ("buffer", "capacity"):
        config = RolloutConfig(staleness_policy=policy, group_size=1, consumer_batch_size=8)
        # Pass to executor

        executor = WorkflowExecutor(config, inference_engine, staleness_manager=custom_manager)
        executor.initialize()
        try:
            # capacity: the manager's own batch size (32); buffer: the config's (8)
            batch_size = 32 if policy == "capacity" else 8
            for _ in range(3):
                batch = executor.prepare_batch([list(range(100))], Generate())
                assert len(batch) == batch_size
                executor.set_version(executor.version)
            stats = executor.statistics()  # one snapshot, taken on the loop: consistent
            assert stats.manager is not None
            assert stats.manager.running == stats.policy.running
            assert stats.manager.accepted >= stats.consumed_groups == 3 * batch_size
        finally:
            executor.destroy()
        inference_engine.version = 0
        custom_manager = StalenessManager(SmoothVersionProvider(inference_engine), 64, 32, 10)


def test_a_wait_blocked_during_destroy_is_released_with_an_error() -> None:
    engine = ScriptedEngine()
    ex = make(engine)
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            ex.wait(1)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    ex.submit("never answered", Generate())
    engine.wait_calls(1)
    ex.destroy()
    t.join(timeout=20)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ProtocolError)
    assert "destroyed" in str(outcome[0])


def test_wait_timeout_says_what_is_missing() -> None:
    engine = ScriptedEngine(auto=True)
    with make(engine, max_head_offpolicyness=0, consumer_batch_size=1) as ex:
        ex.submit("a", Generate())
        ex.submit("b", Generate())
        assert len(ex.wait(1, timeout=20)) == 1
        # version 1 is training; the engine was never told about new weights
        with pytest.raises(TimeoutError, match=r"call set_version\(1\)"):
            ex.wait(1, timeout=0.05)
        assert ex.statistics().queued == 1  # nothing was lost by the timeout
        ex.set_version(1)
        assert [t.data["data"] for t in ex.wait(1, timeout=20)] == ["b"]


def test_versions_from_the_future_fail_the_group_and_are_counted() -> None:
    class FromTheFuture:
        async def arun_episode(self, engine: Any, data: Any) -> Any:
            return {"data": data, "versions": [-1, 0, 99]}  # -1: a prompt token (AReaL's mark)

    with make(ScriptedEngine(), max_consecutive_failures=1) as ex:
        ex.submit("x", FromTheFuture())
        with pytest.raises(RolloutError, match="segment version 99"):
            ex.wait(1, timeout=20)
        s = ex.statistics()
        assert s.policy.aborted == {"bad_versions": 1} and s.policy.running == 0


def test_submissions_from_many_threads_are_all_trained() -> None:
    engine = ScriptedEngine(auto=True)
    with make(engine, consumer_batch_size=10, max_head_offpolicyness=3, queue_size=1000) as ex:
        barrier = threading.Barrier(4)

        def submitter(k: int) -> None:
            barrier.wait()
            for i in range(50):
                ex.submit((k, i), Generate())

        pool = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
        for t in pool:
            t.start()
        trained: list[Trajectory] = []
        while len(trained) < 200:
            trained += ex.wait(10, timeout=20)
            ex.set_version(ex.version)
        for t in pool:
            t.join()
        assert sorted(t.data["data"] for t in trained) == sorted(
            (k, i) for k in range(4) for i in range(50)
        )
        assert all(t.staleness <= 3 for t in trained)


def test_a_trajectory_whose_versions_cannot_be_read_stops_the_executor_naming_the_member() -> None:
    class Unreadable:
        async def arun_episode(self, engine: Any, data: Any) -> Any:
            return {"data": data, "versions": 5}  # not a sequence

    with make(ScriptedEngine()) as ex:
        ex.submit("x", Unreadable())
        with pytest.raises(RolloutError, match=r"handling the outcome of .* failed: TypeError"):
            ex.wait(1, timeout=20)


def test_an_engine_that_dies_while_a_member_fails_stops_the_executor() -> None:
    """The generation version of a relaunch is read from the engine when a member fails: an
    engine that cannot answer then stops the executor, naming the member (nothing hangs)."""

    class Dying(ScriptedEngine):
        dead = False

        def get_version(self) -> int:
            if self.dead:
                raise ConnectionError("engine gone")
            return super().get_version()

    class DiesThenFails:
        async def arun_episode(self, engine: Any, data: Any) -> Any:
            engine.dead = True
            raise RuntimeError("boom")

    with make(Dying()) as ex:
        ex.submit("x", DiesThenFails())
        with pytest.raises(RolloutError, match=r"handling the outcome of .* ConnectionError"):
            ex.wait(1, timeout=20)


def test_a_failure_handling_a_published_version_stops_the_executor() -> None:
    """set_version() does not wait for the loop: what goes wrong there reaches the trainer."""

    def log(event: Any, actions: Any) -> None:
        if type(event).__name__ == "VersionPublished":
            raise RuntimeError("log broken")

    config = RolloutConfig(group_size=1)
    with WorkflowExecutor(config, ScriptedEngine(), action_log=log).initialize() as ex:
        ex.set_version(1)
        with pytest.raises(RolloutError, match=r"set_version\(1\) failed: RuntimeError"):
            ex.wait(1, timeout=20)

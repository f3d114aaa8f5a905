"""The deadline policy through the real executor, driven by a scripted engine.

The engine (:class:`scripted.ProtocolEngine`) holds every request until the test answers it, so the
test chooses who straggles; ``abort`` returns the tokens generated so far
(``RequestCall.progress``) with ``finish_reason="abort"``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import pytest

from scripted import Episode, ProtocolEngine, quiesce
from stalebound.config import DeadlineConfig, RolloutConfig
from stalebound.core import ConfigError
from stalebound.runtime import EpisodeTruncated, WorkflowExecutor, interruptible
from stalebound.runtime.cut import CutSignal


def make(
    engine: Any,
    action: Literal["truncate", "abort"] = "truncate",
    at: Literal["consume", "head"] = "consume",
    group_size: int = 1,
    grace: float | None = None,
) -> WorkflowExecutor:
    """B = 1, η_s = η_h = 1, one spare entry per buffer, no admission margin: g0 and g1 are admitted
    at version 0 and both reserve in buffer 1 (their deadline)."""
    config = RolloutConfig(
        staleness_policy="deadline",
        staleness=1,
        consumer_batch_size=1,
        group_size=group_size,
        deadline=DeadlineConfig(target=1, slack=1, margin=0, action=action, at=at, grace_s=grace),
    )
    return WorkflowExecutor(config, engine).initialize()


@pytest.mark.parametrize("at", ["consume", "head"])
def test_a_straggler_is_truncated_at_its_deadline_and_its_partial_tokens_are_trained(
    at: Literal["consume", "head"],
) -> None:
    engine = ProtocolEngine()
    with make(engine, at=at) as ex:
        for name in ["g0", "g1"]:
            ex.submit(name, Episode())
        quiesce(ex, engine)
        slow = engine.call("g1")
        slow.progress = 3  # what it has generated when it is cut short
        engine.answer(engine.call("g0"), tokens=5)
        quiesce(ex, engine)
        assert engine.aborts == []  # buffer 0 is not g1's deadline: nothing is cut yet
        first = ex.wait(1, timeout=60)  # consumes buffer 0: buffer 1, g1's deadline, is the head
        assert [t.data["prompt"] for t in first] == ["g0"] and not first[0].truncated
        quiesce(ex, engine)
        if at == "consume":  # g1 generates on while the trainer trains on batch 0
            assert engine.aborts == [] and ex.statistics().deadline_groups == 0
        else:
            assert engine.aborts == [slow.rid]
        (cut,) = ex.wait(1, timeout=60)  # the trainer asks for buffer 1: g1's deadline
        s = quiesce(ex, engine)
        assert engine.aborts == [slow.rid]
        assert s.deadline_groups == 1 and s.truncated_trajectories == 1
        assert s.aborted_requests == {"deadline": 1} and s.aborted_tokens == {}  # kept
        assert cut.data["prompt"] == "g1" and cut.truncated
        assert cut.data["finish_reason"] == "abort" and cut.data["tokens"] == 3
        assert cut.version == 0 and cut.staleness == 1  # trained at its deadline, not later
        assert s.policy.violations == 0 and s.consumed_trajectories == 2


def test_abort_at_the_deadline_throws_the_straggler_away_and_counts_it() -> None:
    engine = ProtocolEngine()
    with make(engine, action="abort") as ex:
        for name in ["g0", "g1"]:
            ex.submit(name, Episode())
        quiesce(ex, engine)
        engine.answer(engine.call("g0"))
        quiesce(ex, engine)
        ex.wait(1, timeout=60)
        with pytest.raises(TimeoutError):  # asks for buffer 1: g1 is aborted, nothing to train
            ex.wait(1, timeout=0.01)
        s = quiesce(ex, engine)
        assert s.deadline_groups == 1 and s.truncated_trajectories == 0
        assert s.cancelled_members == {"deadline": 1}
        assert ex.drain_outcomes()[-1][1] == "deadline"


def test_a_group_aborted_at_its_deadline_counts_its_finished_members_as_discarded() -> None:
    engine = ProtocolEngine()
    with make(engine, action="abort", group_size=2) as ex:
        for name in ["g0", "g1"]:
            ex.submit(name, Episode())
        quiesce(ex, engine)
        for name in ["g0", "g0", "g1"]:  # one member of g1 finishes; the other straggles
            engine.answer(engine.call(name))
            quiesce(ex, engine)  # the answer lands before the next call is looked up
        ex.wait(1, timeout=60)
        with pytest.raises(TimeoutError):  # asks for buffer 1: g1 is aborted, nothing to train
            ex.wait(1, timeout=0.01)
        s = quiesce(ex, engine)
        assert s.deadline_groups == 1 and s.cancelled_members == {"deadline": 1}
        assert s.discarded_members == {"deadline": 1}  # the finished member, thrown away


class ToolEpisode(Episode):
    """A tool call, then one engine request."""

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        await engine.tool(str(data))
        return await super().arun_episode(engine, data)


def test_a_group_waiting_on_a_tool_at_its_deadline_is_aborted_after_the_grace() -> None:
    """Truncation cuts a generation, not a wait for a tool (or a reward): after the grace the
    trainer stops waiting for the group and it is aborted."""
    engine = ProtocolEngine()
    with make(engine, grace=0.05) as ex:
        ex.submit("g0", Episode())
        ex.submit("g1", ToolEpisode())
        quiesce(ex, engine)
        engine.answer(engine.call("g0"))
        quiesce(ex, engine)
        ex.wait(1, timeout=60)  # buffer 0; buffer 1, g1's deadline, is the head
        with pytest.raises(TimeoutError):  # the trainer asks for buffer 1: g1 is cut, in its tool
            ex.wait(1, timeout=0.2)
        deadline = time.monotonic() + 20
        while ex.statistics().overdue_groups == 0:  # the grace's timer fires on the loop
            assert time.monotonic() < deadline
            time.sleep(0.005)
        s = quiesce(ex, engine)
        assert (s.deadline_groups, s.overdue_groups) == (1, 1)
        assert s.cancelled_members == {"deadline": 1} and s.consumed_trajectories == 1
        assert ex.drain_outcomes()[-1][1] == "deadline"


class CuttableToolEpisode(Episode):
    """A tool call awaited through ``interruptible``, then one engine request; cut during the
    tool, the episode ends with what it has."""

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        try:
            await interruptible(engine.tool(str(data)))
        except EpisodeTruncated:
            return {"prompt": str(data), "tokens": 0, "finish_reason": "cut in its tool"}
        return await super().arun_episode(engine, data)


def test_a_tool_awaited_through_interruptible_is_cut_at_the_deadline_and_trained() -> None:
    """The workflow's own wait ends at the truncation: the group lands in its deadline buffer at
    once and is trained, truncated — the trainer does not wait out the grace (a minute here)."""
    engine = ProtocolEngine()
    with make(engine, grace=60.0) as ex:
        ex.submit("g0", Episode())
        ex.submit("g1", CuttableToolEpisode())
        quiesce(ex, engine)
        tool = engine.call("g1")
        engine.answer(engine.call("g0"))
        quiesce(ex, engine)
        ex.wait(1, timeout=60)  # buffer 0; buffer 1, g1's deadline, is the head
        assert not tool.done  # consume: the tool runs on while the trainer trains
        (cut,) = ex.wait(1, timeout=20)  # the trainer asks for buffer 1: g1 is cut in its tool
        s = quiesce(ex, engine)
        assert tool.done and engine.pending() == []  # the tool call itself was cancelled
        assert cut.data == {"prompt": "g1", "tokens": 0, "finish_reason": "cut in its tool"}
        assert cut.truncated and cut.staleness == 1
        assert (s.deadline_groups, s.overdue_groups, s.truncated_trajectories) == (1, 0, 1)
        assert s.cancelled_members == {} and s.policy.violations == 0


def test_interruptible_outside_an_episode_just_awaits() -> None:
    async def main() -> int:
        async def value() -> int:
            await asyncio.sleep(0)
            return 7

        return await interruptible(value())

    assert asyncio.run(main()) == 7


@pytest.mark.parametrize("inside", [False, True])
def test_interruptible_refuses_what_cannot_be_awaited_naming_it(inside: bool) -> None:
    async def call_tool() -> int:
        return 7

    async def main() -> None:
        if inside:
            CutSignal().enter()
        await interruptible(call_tool)  # type: ignore[arg-type]  # the tool, not its call

    with pytest.raises(
        TypeError,
        match=r"^interruptible\(<function .*call_tool.*\): needs an "
        r"awaitable .* e\.g\. interruptible\(call_tool\(x\)\)$",
    ):
        asyncio.run(main())


def test_interruptible_ends_the_wait_under_way_or_refuses_a_new_one_once_cut() -> None:
    async def main() -> list[str]:
        signal = CutSignal()
        seen: list[str] = []
        forever = asyncio.get_running_loop().create_future()

        async def episode() -> None:
            try:
                await interruptible(forever)
            except EpisodeTruncated as e:
                seen.append(str(e))
            never = asyncio.sleep(3600)
            try:
                await interruptible(never)
            except EpisodeTruncated as e:
                seen.append(str(e))

        async def run() -> None:
            signal.enter()  # what the executor does in each member's task
            await episode()

        task = asyncio.ensure_future(run())
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the episode waits on `forever`
        assert seen == [] and not forever.done()
        signal.cut()
        await task
        assert forever.cancelled()  # the wait's awaitable is cancelled, not left running
        return seen

    assert asyncio.run(main()) == [
        "the episode was truncated during this wait",
        "the episode was truncated before this wait",
    ]


def test_truncation_needs_an_engine_that_can_abort() -> None:
    class NoAbort:
        async def agenerate(self, request: Any) -> Any:
            raise AssertionError("never called")

    with pytest.raises(ConfigError, match=r"deadline.action='truncate'.*NoAbort has no abort"):
        make(NoAbort())

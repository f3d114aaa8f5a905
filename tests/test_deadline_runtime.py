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

from scripted import Episode, GenerateRequest, ProtocolEngine, quiesce
from stalebound.config import DeadlineConfig, RolloutConfig
from stalebound.core import ConfigError
from stalebound.runtime import EpisodeTruncated, RolloutError, WorkflowExecutor, interruptible
from stalebound.runtime.cut import CutSignal


def make(
    engine: Any,
    action: Literal["truncate", "abort", "continue"] = "truncate",
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


class SwappingWeights:
    """One request whose first two tokens come from the version the engine held when it began and
    the rest from the version it holds when the test answers (the engine swapped weights between
    tokens); the second token is a tool's (out of the loss already). ``versions=False``: the
    trajectory tells no token versions."""

    def __init__(self, versions: bool = True) -> None:
        self.versions = versions

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        start = engine.get_version()
        response = await engine.agenerate(GenerateRequest(f"r-{data}", str(data)))
        n, end = len(response.output_ids), engine.get_version()
        out = {"prompt": data, "loss_mask": [1, 0] + [1] * (n - 2)}
        if self.versions:
            out["versions"] = [start] * 2 + [end] * (n - 2)
        return out


def continued_straggler(workflow: SwappingWeights) -> list[Any]:
    """η_h = 1: g1 (V = 0) is still generating when buffer 1, its deadline, is wanted; it continues
    into buffer 2, finishes under version 2 and is handed over at version 2 (the third batch)."""
    engine = ProtocolEngine()
    batches = []
    with make(engine, action="continue") as ex:
        for name in ["g0", "g1"]:
            ex.submit(name, workflow)
        quiesce(ex, engine)
        engine.answer(engine.call("g0"), tokens=4)
        quiesce(ex, engine)
        batches += ex.wait(1, timeout=60)
        ex.set_version(1)
        ex.submit("g2", workflow)
        quiesce(ex, engine)
        engine.answer(engine.call("g2"), tokens=4)
        quiesce(ex, engine)
        batches += ex.wait(1, timeout=60)  # buffer 1: g1 is due and running: it continues
        assert batches[-1].data["prompt"] == "g2" and ex.statistics().continuations == 1
        assert engine.aborts == []  # it goes on generating
        ex.set_version(2)
        engine.answer(engine.call("g1"), tokens=5)
        quiesce(ex, engine)
        batches += ex.wait(1, timeout=60)
    return batches


def test_continue_masks_a_continued_groups_stale_tokens_before_the_executor_hands_it_over() -> None:
    """g1's two tokens from version 0 are staler than 2 − η_h: they leave the loss before any
    caller of the executor sees the trajectory (one was a tool's token, out of the loss already:
    counted once)."""
    first, second, late = continued_straggler(SwappingWeights())
    assert late.data["prompt"] == "g1" and late.continued
    assert (late.version, late.consumed_version, late.staleness) == (0, 2, 2)
    assert late.data["versions"] == [0, 0, 2, 2, 2]
    assert late.data["loss_mask"] == [0, 0, 1, 1, 1] and late.masked_tokens == 1
    for fresh in (first, second):  # within the bound: untouched
        assert not fresh.continued and fresh.masked_tokens == 0
        assert fresh.data["loss_mask"] == [1, 0, 1, 1]


def test_a_continued_trajectory_without_token_versions_stops_the_executor_naming_the_fix() -> None:
    with pytest.raises(
        RolloutError,
        match="handing over batch 2 failed: a continued trajectory reports no token versions",
    ):
        continued_straggler(SwappingWeights(versions=False))


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


def test_stale_tokens_leave_a_loss_mask_of_any_form_the_trajectory_carries() -> None:
    """A list under a key, a missing mask (all ones), a ``[1, seqlen]`` tensor in place (AReaL's
    TensorDict rows) and an attribute: each loses exactly the positions given, counted once."""
    import torch

    from stalebound.runtime.episodes import mask_tokens

    keyed = {"loss_mask": (1, 0, 1, 1)}
    assert mask_tokens(keyed, (0, 1), 4) == 1 and keyed["loss_mask"] == [0, 0, 1, 1]
    missing: dict[str, Any] = {}
    assert mask_tokens(missing, (2,), 3) == 1 and missing["loss_mask"] == [1, 1, 0]
    rows = torch.ones(1, 4, dtype=torch.int64)
    tensor = {"loss_mask": rows}
    assert mask_tokens(tensor, (0, 3), 4) == 2 and tensor["loss_mask"] is rows
    assert rows.tolist() == [[0, 1, 1, 0]]

    columns = torch.ones(4, 2, dtype=torch.int64)
    strided = {"loss_mask": columns.t()}  # [2, 4], not contiguous: its flat form is a copy
    assert mask_tokens(strided, (0, 5), 8) == 2
    assert columns.t().tolist() == [[0, 1, 1, 1], [1, 0, 1, 1]]

    class Record:
        loss_mask = None

    record = Record()
    assert mask_tokens(record, (), 2) == 0 and record.loss_mask == [1, 1]


def test_a_trajectory_whose_loss_mask_cannot_be_set_is_refused_naming_the_fix() -> None:
    from types import MappingProxyType

    from stalebound.core import ProtocolError
    from stalebound.runtime.episodes import mask_tokens

    with pytest.raises(ProtocolError) as e:
        mask_tokens(MappingProxyType({"loss_mask": [1, 1]}), (0,), 2)
    assert str(e.value) == (
        "a continued trajectory's loss_mask cannot be set on a mappingproxy ('mappingproxy' "
        "object does not support item assignment): the executor masks the tokens staler than "
        "the bound in it, so return a dict or an object whose loss_mask can be assigned"
    )


def test_a_loss_mask_that_cannot_be_lined_up_with_the_token_versions_is_refused() -> None:
    from stalebound.core import ProtocolError
    from stalebound.runtime.episodes import mask_tokens

    with pytest.raises(ProtocolError) as e:
        mask_tokens({"loss_mask": [1, 1]}, (0,), 3)
    assert str(e.value) == (
        "a continued trajectory reports 3 token versions and a loss_mask of 2 tokens: the "
        "executor masks the tokens staler than the bound by position, so give loss_mask and "
        "token_versions (or versions) one entry per token each"
    )

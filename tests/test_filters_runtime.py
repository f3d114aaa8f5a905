"""Filters, stragglers and redundancy through the real executor, driven by a scripted engine.

The engine (:class:`scripted.ProtocolEngine`) speaks the inference-engine protocol. Every request
waits until the test answers it, so the completion order — and who straggles — is chosen by the
test. ``abort`` ends a request with the tokens generated so far (``RequestCall.progress``, set by
the test) and ``finish_reason="abort"``, and is recorded, so the tests can check what reached the
engine.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from scripted import (
    Episode,
    ProtocolEngine,
    RequestCall,
    armed_timers,
    parked_in_wait,
    quiesce,
    settle,
)
from stalebound.config import (
    FilterGroupsConfig,
    GroupPostProcessConfig,
    ProactiveFilterConfig,
    RolloutConfig,
)
from stalebound.core import BufferState, ConfigError
from stalebound.runtime import ExecutorStatistics, RolloutError, Trajectory, WorkflowExecutor

SECTIONS = {
    "proactive_filter": ProactiveFilterConfig,
    "group_post_process": GroupPostProcessConfig,
    "filter_groups": FilterGroupsConfig,
}


def config(**settings: Any) -> RolloutConfig:
    """A RolloutConfig; sections may be given as dicts."""
    settings.setdefault("group_size", 1)
    for key, cls in SECTIONS.items():
        if isinstance(settings.get(key), dict):
            settings[key] = cls(**settings[key])
    return RolloutConfig(**settings)


def make(engine: Any, **settings: Any) -> WorkflowExecutor:
    return WorkflowExecutor(config(**settings), engine).initialize()


def head_state(ex: WorkflowExecutor) -> BufferState:
    def state(policy: Any) -> BufferState:
        return policy.buffer.state(policy.version)  # type: ignore[no-any-return]

    return ex.inspect_policy(state)


def ended(s: ExecutorStatistics) -> int:
    """Every way a dispatched group can end, plus the groups still in flight or waiting."""
    return (
        s.consumed_groups
        + s.filtered_groups
        + s.retried_groups
        + s.failed_groups
        + s.surplus_groups
        + s.dropped_groups
        + s.running_groups
        + s.policy.waiting
    )


# ---------------------------------------------------------------------------- stragglers


def straggler(engine: ProtocolEngine, ex: WorkflowExecutor) -> RequestCall:
    """η = 1, B = 2: g0, g1 reserve in buffer 1, g2, g3 in buffer 0 (the head). Answer all but
    g3: the head buffer is then STUCK on g3 alone, the straggler.

    g3's request is picked (and its progress set) before the others are answered: a proactive
    filter acts on it the moment g2 lands, and from then on ``engine.call("g3")`` would find the
    re-dispatched request, or none."""
    for name in ["g0", "g1", "g2", "g3"]:
        ex.submit(name, Episode())
    quiesce(ex, engine)
    slow = engine.call("g3")
    slow.progress = 3
    for name in ["g0", "g1", "g2"]:
        engine.answer(engine.call(name), score=1.0)
    return slow


def test_null_waits_for_the_straggler_and_training_is_blocked() -> None:
    engine = ProtocolEngine()
    with make(engine, max_head_offpolicyness=1, consumer_batch_size=2) as ex:
        slow = straggler(engine, ex)
        s = quiesce(ex, engine)
        assert head_state(ex) is BufferState.STUCK
        assert ex.collect_results() == []  # without an answer for g3, never a batch
        assert engine.aborts == [] and s.retried_groups == s.truncated_groups == 0
        assert s.stuck_seconds > 0 and s.stuck_seconds_by_buffer.keys() == {0}
        engine.answer(slow)
        quiesce(ex, engine)
        assert sorted(t.data["prompt"] for t in ex.collect_results()) == ["g2", "g3"]


def test_retry_aborts_the_straggler_pulls_forward_and_redispatches() -> None:
    engine = ProtocolEngine()
    with make(
        engine,
        max_head_offpolicyness=1,
        consumer_batch_size=2,
        proactive_filter={"method": "retry", "threshold": 1},
    ) as ex:
        slow = straggler(engine, ex)
        s = quiesce(ex, engine)
        assert engine.aborts == [slow.rid]  # the engine was told
        assert s.retried_groups == 1 and s.pulled_forward_groups == 1
        assert s.aborted_requests == {"retried": 1} and s.aborted_tokens == {"retried": 3}
        assert s.cancelled_members == {"retried": 1}
        batch = ex.collect_results()  # g2 plus g0, pulled forward from buffer 1
        assert sorted(t.data["prompt"] for t in batch) == ["g0", "g2"]
        assert all(t.staleness == 0 and not t.truncated for t in batch)
        ex.set_version(1)
        # g3's prompt went out again as a new group, in buffer 1, now the head; nothing has
        # overtaken it there (g1 landed before it was reserved), so it is waited for.
        again = engine.call("g3")
        assert again.rid != slow.rid
        s = quiesce(ex, engine)
        assert s.retried_groups == 1 and head_state(ex) is BufferState.STUCK
        engine.answer(again, score=1.0)
        quiesce(ex, engine)
        batch = ex.collect_results()
        assert sorted(t.data["prompt"] for t in batch) == ["g1", "g3"]
        assert max(t.staleness for t in batch) <= 1
        s = quiesce(ex, engine)
        assert s.dispatched_groups == 5 == ended(s)
        assert s.policy.violations == 0


def test_truncate_force_completes_the_straggler_with_its_partial_output() -> None:
    engine = ProtocolEngine()
    with make(
        engine,
        max_head_offpolicyness=1,
        consumer_batch_size=2,
        proactive_filter={"method": "truncate", "threshold": 1},
    ) as ex:
        slow = straggler(engine, ex)
        s = quiesce(ex, engine)
        assert engine.aborts == [slow.rid]
        assert s.truncated_groups == 1 and s.truncated_trajectories == 1
        assert s.aborted_requests == {"truncated": 1} and s.aborted_tokens == {}  # kept
        batch = {t.data["prompt"]: t for t in ex.collect_results()}
        assert sorted(batch) == ["g2", "g3"]
        cut = batch["g3"]
        assert cut.truncated and cut.data["finish_reason"] == "abort" and cut.data["tokens"] == 3
        assert not batch["g2"].truncated and cut.staleness == 0
        s = quiesce(ex, engine)
        assert s.dispatched_groups == 4 == ended(s)


class ToolEpisode(Episode):
    """A tool call, then one engine request."""

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        await engine.tool(str(data))
        return await super().arun_episode(engine, data)


@contextlib.contextmanager
def truncated_in_its_tool_call(engine: ProtocolEngine) -> Iterator[WorkflowExecutor]:
    """g0–g3 submitted (η = 1, B = 2, truncate at threshold 1); g0–g2 finish while g3 waits on
    its tool call, so the head is truncated with g3 in it and no request to abort; then g3's tool
    returns, and its next request is issued after the truncation."""
    with make(
        engine,
        max_head_offpolicyness=1,
        consumer_batch_size=2,
        proactive_filter={"method": "truncate", "threshold": 1},
    ) as ex:
        for name in ["g0", "g1", "g2", "g3"]:
            ex.submit(name, ToolEpisode())
        quiesce(ex, engine)
        for name in ["g0", "g1", "g2"]:
            engine.answer(engine.call(name))  # the tool call
            quiesce(ex, engine)
            engine.answer(engine.call(name), score=1.0)  # the generation
        s = quiesce(ex, engine)
        assert s.truncated_groups == 1 and engine.aborts == []  # g3 is in its tool call
        engine.answer(engine.call("g3"))  # the tool returns
        quiesce(ex, engine)
        yield ex


def test_truncate_cuts_a_member_in_a_tool_call_on_its_next_request() -> None:
    engine = ProtocolEngine()
    with truncated_in_its_tool_call(engine) as ex:  # g3's request is aborted at once
        batch = {t.data["prompt"]: t for t in ex.collect_results()}
        assert sorted(batch) == ["g2", "g3"]
        assert batch["g3"].truncated and batch["g3"].data["finish_reason"] == "abort"
        assert len(engine.aborts) == 1 and engine.aborts[0].startswith("r")
        assert ex.statistics().aborted_requests == {"truncated": 1}


def test_stuck_timeout_acts_on_a_timer_without_any_other_event() -> None:
    engine = ProtocolEngine()
    with make(
        engine,
        max_head_offpolicyness=1,
        consumer_batch_size=2,
        proactive_filter={"method": "truncate", "threshold": 1, "stuck_timeout_s": 0.05},
    ) as ex:
        slow = straggler(engine, ex)
        quiesce(ex, engine)
        # nothing else happens from here: only the STUCK timer can act
        deadline = time.monotonic() + 20
        while ex.statistics().truncated_groups == 0:
            assert time.monotonic() < deadline, "the STUCK timeout never fired"
            time.sleep(0.005)
        quiesce(ex, engine)
        assert engine.aborts == [slow.rid]
        s = ex.statistics()
        assert s.stuck_seconds >= 0.05  # STUCK at least the timeout before acting
        assert sorted(t.data["prompt"] for t in ex.collect_results()) == ["g2", "g3"]


def test_threshold_leaves_a_buffer_with_many_stragglers_alone() -> None:
    engine = ProtocolEngine()
    with make(
        engine,
        max_head_offpolicyness=0,
        consumer_batch_size=3,
        proactive_filter={"method": "retry", "threshold": 1},
    ) as ex:
        for name in ["a", "b", "c"]:
            ex.submit(name, Episode())
        quiesce(ex, engine)
        engine.answer(engine.call("a"))
        s = quiesce(ex, engine)
        assert head_state(ex) is BufferState.STUCK  # on two reservations: more than 1
        assert s.retried_groups == 0 and engine.aborts == []


def test_proactive_filter_needs_the_buffer_policy_and_truncate_an_engine_abort() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^rollout.proactive_filter.method=retry: acts on STUCK buffers, which only staleness_policy=buffer has \(not 'capacity'\); set it to null",
    ):
        make(ProtocolEngine(), staleness_policy="capacity", proactive_filter={"method": "retry"})

    class NoAbort:
        async def agenerate(self, request: Any) -> Any:
            raise NotImplementedError

    with pytest.raises(ConfigError, match=r"method='truncate'.*NoAbort has no abort"):
        make(NoAbort(), proactive_filter={"method": "truncate"})


# ---------------------------------------------------------------------------- the dynamic filter


def flat_or_mixed(call: RequestCall) -> tuple[int, float]:
    """``flat-*`` prompts score 1 on every member; ``mixed-*`` alternate 0, 1, 0, ..."""
    if call.request.prompt.startswith("flat"):
        return 5, 1.0
    return 5, float(int(call.request.request_id[1:]) % 2)


def test_zero_variance_groups_are_dropped_and_replaced() -> None:
    engine = ProtocolEngine(auto=flat_or_mixed)
    loader = [["flat-0", "mixed-0"], ["flat-1", "flat-2"], ["mixed-1", "mixed-2"]]
    with make(
        engine,
        consumer_batch_size=2,
        group_size=2,
        max_head_offpolicyness=0,
        group_post_process={"enable": True},
    ) as ex:
        for _ in range(3):
            batch = ex.prepare_batch(loader, Episode())
            assert len(batch) == 4
            assert all(t.data["prompt"].startswith("mixed") for t in batch)
            ex.set_version(ex.version)
        s = ex.statistics()
        assert s.filtered_groups >= 3 and s.policy.aborted["filtered"] == s.filtered_groups
        assert s.consecutive_filtered < s.filtered_groups
        assert s.discarded_members == {"filtered": 2 * s.filtered_groups}


def test_an_all_filtered_dataset_stops_with_a_clear_error() -> None:
    engine = ProtocolEngine(auto=flat_or_mixed)
    with make(
        engine,
        consumer_batch_size=2,
        group_size=2,
        group_post_process={"enable": True},
        max_consecutive_filtered=5,
    ) as ex:
        with pytest.raises(
            RolloutError,
            match=r"5 groups in a row were filtered out by group_post_process "
            r"'dynamic_sampling_filter' on filter_groups.metric='score' "
            r"\(rollout.max_consecutive_filtered=5; the last: dynamic_sampling_filter: zero "
            r"variance: every score = 1\).*group_post_process.enable=false",
        ):
            ex.prepare_batch([["flat-0", "flat-1"]], Episode())
        assert ex.statistics().consecutive_filtered == 5


def test_a_metric_the_trajectories_lack_stops_with_the_fix() -> None:
    engine = ProtocolEngine(auto=flat_or_mixed)
    with (
        make(
            engine,
            consumer_batch_size=1,
            group_size=2,
            group_post_process={"enable": True},
            filter_groups={"metric": "acc"},
        ) as ex,
        pytest.raises(RolloutError, match=r"filter_groups.metric='acc': a trajectory has no"),
    ):
        ex.prepare_batch(["mixed-0"], Episode())


def test_an_unknown_post_processor_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"group_post_process.name='nope': no such"):
        make(ProtocolEngine(), group_post_process={"enable": True, "name": "nope"})


# ---------------------------------------------------------------------------- redundancy


def test_group_surplus_is_aborted_on_the_engine_and_its_tokens_counted() -> None:
    engine = ProtocolEngine()
    with make(engine, consumer_batch_size=1, group_size=2, group_redundancy=3) as ex:
        ex.submit("p", Episode())
        quiesce(ex, engine)
        first, second, third = engine.pending()
        second.progress = 7
        engine.answer(third)
        engine.answer(first)
        s = quiesce(ex, engine)
        assert engine.aborts == [second.rid]
        assert s.aborted_requests == {"surplus": 1} and s.aborted_tokens == {"surplus": 7}
        assert s.cancelled_members == {"surplus": 1}
        assert len(ex.collect_results()) == 2


def test_batch_surplus_reservation_is_aborted_on_the_engine_at_consume() -> None:
    engine = ProtocolEngine()
    with make(engine, max_head_offpolicyness=0, consumer_batch_size=1, buffer_size=2) as ex:
        ex.submit("fast", Episode())
        ex.submit("slow", Episode())
        quiesce(ex, engine)
        slow = engine.call("slow")
        slow.progress = 11
        engine.answer(engine.call("fast"))
        quiesce(ex, engine)
        assert [t.data["prompt"] for t in ex.collect_results()] == ["fast"]
        s = quiesce(ex, engine)
        assert engine.aborts == [slow.rid]
        assert s.surplus_groups == 1 and s.aborted_tokens == {"surplus": 11}
        assert s.dispatched_groups == 2 == ended(s)


# ---------------------------------------------------------------------------- watchdog


def test_watchdog_names_silent_groups_and_progress_lines_stop_when_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stalebound.runtime.executor")
    engine = ProtocolEngine()
    with make(engine, consumer_batch_size=1, watchdog_timeout_s=0.02, progress_log_s=0.02) as ex:
        ex.submit("quiet", Episode())
        call = engine.call("quiet")
        deadline = time.monotonic() + 20
        while ex.statistics().watchdog_stalls == 0 or not any(
            r.getMessage().startswith("buffers") for r in list(caplog.records)
        ):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        engine.answer(call)
        quiesce(ex, engine)
        assert len(ex.collect_results()) == 1
        stalls = [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]
        assert len(stalls) == 1  # reported once per stall, not on every tick
        assert "group 0 (V=0" in stalls[0] and call.rid in stalls[0]
        assert "running on ProtocolEngine" in stalls[0]
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("buffers")]
        # η = 2, B = 1: the group reserved the latest buffer, b2
        assert lines and lines[0].startswith("buffers version 0: b0 PENDING occ 0 res 0 emp 1")
        assert "b2 STUCK occ 0 res 1 emp 0; 1 groups (1 members) running" in lines[0]
        # idle: each timer fires once more, finds nothing running and is not re-armed; after
        # that nothing can log without a new event
        deadline = time.monotonic() + 20
        while ex._call(lambda: (ex._timers.get("watchdog"), ex._progress_handle)) != (None, None):
            assert time.monotonic() < deadline, "the timers keep re-arming while idle"
            time.sleep(0.005)
        assert armed_timers(ex) == []


# ---------------------------------------------------------------------------- conservation


ETA = 1


def random_mix(method: str, seed: int) -> tuple[ExecutorStatistics, list[Trajectory], list[str]]:
    """A random mix of answers, failures, zero-variance groups, both redundancies and the
    proactive filter, with the oldest requests tending to straggle; six batches are trained.
    Returns the final statistics, the trained trajectories and the engine's aborts."""
    rng = random.Random(seed)
    engine = ProtocolEngine()
    loader = [f"p{i}" for i in range(40)]
    trained: list[Trajectory] = []
    with make(
        engine,
        max_head_offpolicyness=ETA,
        consumer_batch_size=2,
        buffer_size=2 + seed % 2,
        group_size=2,
        group_redundancy=3,
        group_post_process={"enable": True},
        proactive_filter={"method": method, "threshold": 1 + seed % 2},
        max_consecutive_filtered=1000,
        max_consecutive_failures=1000,
    ) as ex:
        box: list[Any] = []

        def trainer() -> None:
            try:
                for _ in range(6):
                    box.append(ex.prepare_batch(loader, Episode()))
                    settle(ex)
                    ex.set_version(ex.version)
                    settle(ex)
            except BaseException as e:
                box.append(e)

        thread = threading.Thread(target=trainer)
        thread.start()
        # Act only while the trainer is parked in prepare_batch and the loop has nothing to run:
        # the pending list is then the same on every run with this seed.
        parked = parked_in_wait(ex, thread)
        while True:
            quiesce(ex, engine, until=parked)
            if not thread.is_alive():
                break
            pending = engine.pending()
            assert pending, f"the trainer waits and nothing runs: {ex.statistics()}"
            for c in pending:
                c.progress += rng.randint(0, 2)
            # the newest requests tend to finish first: the oldest straggle
            call = rng.choice(pending[-3:] if rng.random() < 0.8 else pending)
            if rng.random() < 0.15:
                engine.answer(call, error=ValueError("engine hiccup"))
            else:
                engine.answer(call, tokens=rng.randint(1, 8), score=rng.choice([0.0, 1.0]))
        thread.join()
        errors = [b for b in box if isinstance(b, BaseException)]
        assert not errors, errors
        for batch in box:
            trained.extend(batch)
        return quiesce(ex, engine), trained, list(engine.aborts)


@pytest.mark.parametrize("method", ["null", "retry", "truncate"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_dispatched_group_ends_exactly_once(method: str, seed: int) -> None:
    """Every dispatched group ends exactly one way, counted, and no trained trajectory is staler
    than η."""
    s, trained, aborts = random_mix(method, seed)
    assert s.consumed_batches == 6
    assert s.dispatched_groups == ended(s), s
    assert all(t.staleness <= ETA for t in trained)
    assert s.policy.violations == 0
    assert s.policy.aborted.get("retried", 0) == s.retried_groups
    assert s.policy.aborted.get("filtered", 0) == s.filtered_groups
    assert sum(t.truncated for t in trained) <= s.truncated_trajectories
    assert s.filtered_groups > 0 and s.cancelled_members.get("surplus", 0) > 0
    assert sum(s.aborted_requests.values()) == len(aborts)
    if method == "retry":
        assert s.retried_groups > 0 and s.truncated_groups == 0
    elif method == "truncate":
        assert s.truncated_groups > 0 and s.retried_groups == 0
        assert any(t.truncated for t in trained)
    else:
        assert s.retried_groups == s.truncated_groups == 0


@pytest.mark.parametrize("method", ["null", "retry", "truncate"])
def test_a_seed_replays_the_same_run(method: str) -> None:
    def outcome() -> tuple[Any, ...]:
        s, trained, aborts = random_mix(method, 2)
        counts = (s.dispatched_groups, s.retried_groups, s.truncated_groups, s.filtered_groups)
        batches = [(t.data["prompt"], t.version, t.data["tokens"]) for t in trained]
        return counts, dict(s.aborted_tokens), s.dispatch_wakeups, len(aborts), batches

    assert outcome() == outcome()


def test_timed_out_members_are_aborted_on_the_engine() -> None:
    engine = ProtocolEngine()
    with make(engine, consumer_batch_size=1, request_timeout=0.05) as ex:
        ex.submit("never", Episode())  # never answered: times out, is relaunched, times out
        deadline = time.monotonic() + 20
        while ex.statistics().failed_groups == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        s = quiesce(ex, engine)
        assert len(engine.aborts) == 2 == s.member_failures["timeout"]
        assert s.aborted_requests == {"timeout": 2}
        assert s.dispatched_groups == 1 == ended(s)


def test_a_failed_abort_of_a_truncated_members_request_lets_it_finish_uncounted() -> None:
    """An abort the engine refuses (it may have finished the request) is logged, not counted,
    and the member gets the request's answer: the workflow does not fail for it."""

    class RefusesAborts(ProtocolEngine):
        async def abort(self, request_id: str) -> Any:
            self.aborts.append(request_id)
            raise ConnectionError("abort refused")

    engine = RefusesAborts()
    with truncated_in_its_tool_call(engine) as ex:  # the abort of g3's request fails
        assert len(engine.aborts) == 1
        engine.answer(engine.call("g3"), tokens=6)  # the request runs on, to its end
        quiesce(ex, engine)
        batch = {t.data["prompt"]: t for t in ex.collect_results()}
        assert sorted(batch) == ["g2", "g3"]
        assert batch["g3"].data["finish_reason"] == "stop" and batch["g3"].data["tokens"] == 6
        s = ex.statistics()
        assert s.aborted_requests == {} and s.member_failures == {}

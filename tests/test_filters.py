"""Pure filter decisions: the dynamic sampling filter and the proactive filter."""

from __future__ import annotations

import pytest

from stalebound import BufferState, ConfigError, StalenessBuffer
from stalebound.core.filters import (
    PostProcessDecision,
    StragglerClock,
    StuckTimer,
    buffer_progress,
    dynamic_sampling_filter,
    eligible_targets,
    get_group_post_process,
    proactive_filter_targets,
    register_group_post_process,
)


def test_dynamic_sampling_filter_drops_zero_variance_groups() -> None:
    same = [{"score": 1.0}, {"score": 1.0}, {"score": 1.0}]
    mixed = [{"score": 1.0}, {"score": 0.0}]
    assert dynamic_sampling_filter(same) == PostProcessDecision(
        False, "zero variance: every score = 1"
    )
    assert dynamic_sampling_filter(mixed).keep
    assert dynamic_sampling_filter([{"score": 0.0}]).keep  # one member: no variance to judge


def test_metric_by_name_nested_attribute_or_callable() -> None:
    class Traj:
        def __init__(self, acc: float) -> None:
            self.metrics = {"acc": acc}

    assert not dynamic_sampling_filter([Traj(0.0), Traj(0.0)], "acc").keep
    assert dynamic_sampling_filter(
        [{"metrics": {"seq_reward": 1}}, {"seq_reward": 2}], "seq_reward"
    ).keep
    assert not dynamic_sampling_filter([{"r": 3}, {"r": 3}], lambda t: t["r"]).keep
    with pytest.raises(
        ConfigError, match=r"filter_groups.metric='acc': a trajectory has no such metric"
    ):
        dynamic_sampling_filter([{"score": 1}, {"score": 2}], "acc")


def test_registry_finds_builtins_and_user_post_processors() -> None:
    assert get_group_post_process("dynamic_sampling_filter") is dynamic_sampling_filter

    @register_group_post_process("drop_long")
    def drop_long(members, metric):  # type: ignore[no-untyped-def]
        return PostProcessDecision(all(len(m["text"]) < 5 for m in members), "too long")

    assert get_group_post_process("drop_long") is drop_long
    with pytest.raises(
        ConfigError,
        match=r"group_post_process.name='nope': no such post-processor \(registered: .*drop_long.*dynamic_sampling_filter",
    ):
        get_group_post_process("nope")
    with pytest.raises(ConfigError, match="already registered"):
        register_group_post_process("drop_long")(lambda m, k: PostProcessDecision(True))


def stuck_buffer() -> StalenessBuffer:
    buf = StalenessBuffer(batch_size=3, staleness=0)
    for g in "abc":
        buf.try_reserve(g)
    buf.occupy("a")
    assert buf.state(0) is BufferState.STUCK
    return buf


@pytest.mark.parametrize("stuck_for", [None, -1.0, float("nan"), "5"])
def test_proactive_filter_refuses_a_stuck_time_that_is_not_a_duration(stuck_for: object) -> None:
    buf = stuck_buffer()
    with pytest.raises(ConfigError) as e:
        proactive_filter_targets(buf, 2, stuck_for=stuck_for, stuck_timeout_s=5.0)  # type: ignore[arg-type]
    assert str(e.value) == (
        f"stuck_for={stuck_for!r}: must be a number ≥ 0; give the seconds the head buffer has "
        "been STUCK (0.0 when unknown)"
    )


def test_proactive_filter_names_the_stragglers_of_a_stuck_head_within_threshold() -> None:
    buf = stuck_buffer()
    assert proactive_filter_targets(buf, threshold=2) == ("b", "c")
    assert proactive_filter_targets(buf, threshold=1) == ()  # too many still running
    assert proactive_filter_targets(buf, threshold=2, stuck_for=1.0, stuck_timeout_s=5.0) == ()
    assert proactive_filter_targets(buf, threshold=2, stuck_for=5.0, stuck_timeout_s=5.0) == (
        "b",
        "c",
    )
    buf.occupy("b")
    buf.occupy("c")
    assert proactive_filter_targets(buf, threshold=2) == ()  # READY, nothing to do


def test_stuck_timer_measures_stuck_intervals() -> None:
    buf = stuck_buffer()
    timer = StuckTimer()
    assert timer.observe(buf, 10.0) == 0.0
    assert timer.observe(buf, 12.5) == 2.5
    buf.occupy("b")
    buf.occupy("c")
    assert timer.observe(buf, 13.0) == 0.0
    assert timer.stuck_seconds(20.0) == 3.0


def test_straggler_clock_names_only_overtaken_groups() -> None:
    buf = StalenessBuffer(2, 0)
    clock = StragglerClock()
    for g in ["a", "b"]:
        buf.try_reserve(g)
        clock.reserved(g)
    assert clock.overtaken(["a", "b"], 0) == ()  # nothing landed yet
    clock.forget("a")
    clock.landed(buf.occupy("a"))
    assert clock.overtaken(buf.reserved_groups(0), 0) == ("b",)  # a finished after b started
    buf.abort("b", "retried")
    clock.forget("b")
    buf.try_reserve("b2")
    clock.reserved("b2")
    assert clock.overtaken(["b2"], 0) == ()  # a fresh retry is not a straggler yet
    assert clock.overtaken(["unknown"], 0) == ()
    clock.consumed(1)
    assert clock.overtaken(["b2"], 0) == ()


def test_eligible_targets_counts_attempts() -> None:
    assert eligible_targets(["a", "b", "c"], {"a": 2, "b": 1}, 2) == ("b", "c")
    assert eligible_targets(["a"], {}, 0) == ()


def test_retry_pulls_finished_groups_forward_into_the_freed_entries() -> None:
    """η = 1, B = 2: the head (0) is STUCK on one straggler while buffer 1 holds finished groups;
    aborting the straggler and pulling forward makes the head READY at once, staleness 0."""
    buf = StalenessBuffer(2, 1)
    for g in ["late-0", "late-1", "head-0", "straggler"]:
        buf.try_reserve(g)
    assert [buf.lookup(g)[1] for g in ["late-0", "head-0"]] == [1, 0]  # type: ignore[index]
    for g in ["late-0", "late-1", "head-0"]:
        buf.occupy(g)
    assert buf.state(0) is BufferState.STUCK
    assert proactive_filter_targets(buf, 1) == ("straggler",)
    buf.abort("straggler", "retried")
    assert buf.pull_forward() == ("late-0",)
    assert buf.state(0) is BufferState.READY
    batch = buf.consume()
    assert [g.group_id for g in batch.groups] == ["late-0", "head-0"]
    assert batch.staleness() == [0, 0]


def test_buffer_progress_line_and_open_stuck_intervals() -> None:
    buf = StalenessBuffer(1, 1)
    buf.try_reserve("a")
    buf.try_reserve("b")
    assert buffer_progress(buf) == (
        "version 0: b0 STUCK occ 0 res 1 emp 0 | b1 STUCK occ 0 res 1 emp 0"
    )
    timer = StuckTimer()
    timer.observe(buf, 2.0)
    assert timer.open_intervals() == {0: 2.0}
    buf.occupy("b")
    timer.observe(buf, 5.0)
    assert timer.open_intervals() == {} and timer.total_stuck_s == {0: 3.0}

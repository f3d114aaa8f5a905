"""The event queue and the batched replica model."""

from __future__ import annotations

import pytest

from stalebound.core import InvariantError
from stalebound.sim.engine import EventQueue, Replica


def test_events_pop_in_time_then_schedule_order() -> None:
    q = EventQueue()
    q.schedule(2.0, "late")
    q.schedule(1.0, "first")
    q.schedule(1.0, "second")  # same time: scheduled later, runs later
    order = []
    while (event := q.pop()) is not None:
        order.append((q.now, event))
    assert order == [(1.0, "first"), (1.0, "second"), (2.0, "late")]
    assert q.now == 2.0


def test_scheduling_into_the_past_is_refused() -> None:
    q = EventQueue()
    q.schedule(5.0, "due")
    q.pop()
    with pytest.raises(InvariantError, match="before the clock"):
        q.schedule(4.0, "late")


def test_replica_finish_times_follow_the_step_time_model() -> None:
    # step = 0.01 + 0.001 × active: two sequences of 11 and 21 tokens start together; the first
    # token of each comes with its prefill (free here), the rest take 10 and 20 decode steps
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.001)
    r.advance(0.0)
    r.join("short", 11)
    r.join("long", 21)
    t1 = r.next_finish(0.0)
    assert t1 == pytest.approx(10 * 0.012)
    r.advance(t1)
    assert [s.owner for s in r.pop_finished()] == ["short"]
    t2 = r.next_finish(t1)  # 10 tokens left, now alone: 0.011 s a step
    assert t2 == pytest.approx(0.12 + 10 * 0.011)
    r.advance(t2)
    assert [s.owner for s in r.pop_finished()] == ["long"]
    assert r.tokens == pytest.approx(30)  # decoded in steps
    assert r.next_finish(t2) is None


def test_a_one_token_answer_is_done_when_its_prefill_ends() -> None:
    # its token comes with the prefill: no decode step, and the other sequence's steps wait
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.0, prefill=0.05)
    r.advance(0.0)
    long = r.join("long", 11)
    r.join("one", 1)
    t = r.next_finish(0.0)
    assert t == pytest.approx(0.10)  # both prefills
    r.advance(t)
    assert [s.owner for s in r.pop_finished()] == ["one"]
    assert (r.tokens, r.decoded(long)) == (0, 1)  # the long one has its prefill's token
    assert r.next_finish(t) == pytest.approx(0.10 + 10 * 0.01)


def test_cancel_returns_the_tokens_decoded_so_far() -> None:
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.0)
    r.advance(0.0)
    s = r.join("x", 100)
    r.advance(0.25)  # 25 steps
    assert r.cancel(s) == pytest.approx(26)  # the prefill's token, then one a step
    assert r.active == 0
    assert r.next_finish(0.25) is None


def test_a_full_batch_queues_and_each_join_pays_its_prefill() -> None:
    # one place in the batch, 0.05 s prefill per joining sequence, 0.01 s per step
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.0, prefill=0.05, max_batch=1)
    r.advance(0.0)
    first = r.join("first", 11)  # the first token with the prefill, then 10 steps
    second = r.join("second", 11)
    assert (r.active, r.waiting) == (1, 1) and second.waiting
    assert r.decoded(second) == 0
    t1 = r.next_finish(0.0)  # its prefill, then 10 steps
    assert t1 == pytest.approx(0.05 + 0.10)
    r.advance(t1)
    assert [s.owner for s in r.pop_finished()] == ["first"]
    assert (r.active, r.waiting) == (1, 0) and not second.waiting
    t2 = r.next_finish(t1)  # the second joins now: its own prefill, then 10 steps
    assert t2 == pytest.approx(t1 + 0.05 + 0.10)
    assert r.busy_time == pytest.approx(t1)
    assert first.finish - first.start == 10


def test_a_stall_pauses_decoding_and_a_waiting_sequence_cancels_with_nothing_decoded() -> None:
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.0, max_batch=1)
    r.advance(0.0)
    r.join("a", 11)
    queued = r.join("b", 11)
    r.stall(0.5)  # installing weights
    assert r.next_finish(0.0) == pytest.approx(0.6)
    r.advance(0.3)
    assert r.tokens == 0  # nothing decoded during the stall
    assert r.cancel(queued) == 0
    assert r.waiting == 0
    r.advance(0.6)
    assert [s.owner for s in r.pop_finished()] == ["a"]
    assert r.active == 0 and r.next_finish(0.6) is None  # the cancelled one never joins


def test_a_contended_trainer_slows_while_the_replicas_work_and_moves_its_end() -> None:
    from stalebound.sim.config import workload_from_dict
    from stalebound.sim.simulator import TrainerModel

    cfg = workload_from_dict(
        {"trainer": {"step_time": 1.0, "publish": 0.25, "handoff": 0.5, "contention": 1.0}}
    )
    t = TrainerModel(cfg)
    assert t.start(0.0, tokens=0, share=0.0) == 1.75  # hand-over, training, publishing
    first = t.ticket
    assert t.reshare(0.25, 1.0) == 2.75  # still handing over: all of the training runs slow
    assert t.ticket > first
    assert t.reshare(1.5, 0.5) == 2.5  # half the training done by 1.5; the rest 1.5× slower
    assert t.reshare(1.5, 0.5) is None  # no change
    assert t.reshare(2.3, 0.0) is None  # training over (at 2.25): publishing is not slowed
    t.done(2.5)
    assert t.reshare(3.0, 1.0) is None  # no step
    alone = TrainerModel(workload_from_dict({"trainer": {"step_time": 1.0}}))
    alone.start(0.0, tokens=0)
    assert alone.reshare(0.5, 1.0) is None  # no contention: the end never moves


def test_a_step_costs_more_as_the_oldest_sequences_context_grows() -> None:
    # step = 0.01 + 0.001 × active × context, context = tokens the oldest active one decoded:
    # alone, 10 steps (11 tokens, one with the prefill) take ∫₀¹⁰ (0.01 + 0.001 x) dx = 0.15 s
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.0, per_ctx=0.001)
    r.advance(0.0)
    r.join("old", 11)
    t = r.next_finish(0.0)
    assert t == pytest.approx(0.15)
    r.advance(0.078)  # 0.01 n + 0.0005 n² = 0.078: n = 6 steps
    assert r.progress == pytest.approx(6.0)
    young = r.join("young", 11)  # joins at context 6: each step costs 0.002 × (6 + x) more
    assert r.next_finish(0.078) == pytest.approx(0.078 + 4 * 0.01 + 0.002 * (6 * 4 + 4 * 4 / 2))
    r.advance(r.next_finish(0.078) or 0.0)
    assert [s.owner for s in r.pop_finished()] == ["old"]
    # the old one left: the context is the young one's 4 tokens, not 10
    left = r.next_finish(r.last)
    assert left == pytest.approx(r.last + 6 * 0.01 + 0.001 * (4 * 6 + 6 * 6 / 2))
    assert r.decoded(young) == pytest.approx(5.0)  # the prefill's token and 4 steps


@pytest.mark.parametrize(("budget", "passes"), [(None, 1), (19, 2), (20, 1)])
def test_with_cohorts_a_step_pays_its_fixed_cost_once_per_cohort(
    budget: int | None, passes: int
) -> None:
    # step = 0.01 × cohorts + 0.001 × active. One sequence decodes 10 steps alone (0.011 s a
    # step), then 2 join: merged they would pad 2 × 10 = 20 cache slots, so a budget of 20
    # keeps one cohort and 19 two; the 2 finish after 5 steps, and the first decodes alone again
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.001, cohort_padding=budget)
    r.advance(0.0)
    r.join("old", 31)  # 30 decode steps: a token comes with each prefill
    t = 10 * 0.011
    r.advance(t)
    assert r.progress == pytest.approx(10.0)
    r.join("young", 6)
    r.join("young", 6)
    step = 0.01 * passes + 0.003
    t_young = r.next_finish(t)
    assert t_young == pytest.approx(t + 5 * step)
    r.advance(t_young)
    assert [s.owner for s in r.pop_finished()] == ["young", "young"]
    assert r.next_finish(t_young) == pytest.approx(t_young + 15 * 0.011)


def test_with_cohorts_each_cohort_attends_its_own_width() -> None:
    # step = 0.01 × cohorts + 0.001 × (cache positions attended), the positions growing by one
    # per row and step (continuously: n steps of one row attend n²/2). One sequence decodes 10
    # steps alone (10 × 0.01 + 0.001 × 50 = 0.15 s), then 2 join in a cohort of their own (a
    # budget of 19 keeps them apart): over the next 5 steps the old row attends 10 + x positions
    # and each young one x (50 + 3 × 12.5 in all), not 3 × (10 + x) as in one padded batch
    r = Replica(0, max_slots=4, step_base=0.01, per_seq=0.0, per_ctx=0.001, cohort_padding=19)
    r.advance(0.0)
    r.join("old", 31)  # 30 decode steps: a token comes with each prefill
    assert r.next_finish(0.0) == pytest.approx(30 * 0.01 + 0.001 * 30 * 30 / 2)
    t = 10 * 0.01 + 0.001 * 50
    r.advance(t)
    assert r.progress == pytest.approx(10.0)
    r.join("young", 6)
    r.join("young", 6)
    assert r.next_finish(t) == pytest.approx(t + 5 * 0.02 + 0.001 * (50 + 3 * 12.5))

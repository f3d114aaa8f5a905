"""Saving the executor's state and continuing from it in a new executor: nothing lost, nothing twice.

A trainer takes batches while the test answers engine requests in random order (some fail), then
saves ``state_dict()`` with groups still running, carries on for a while (work a crash would lose),
and starts a second executor from the saved state. Every item the first run had taken in must end
exactly once in the lineage checkpoint → second run: trained, ended (filtered, failed, ...) or
still pending at the end, with the data it was drawn with.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import threading
from typing import Any

import pytest

from scripted import Generate, ScriptedEngine, parked_in_wait, quiesce, settle
from stalebound.config import RolloutConfig
from stalebound.core import ProtocolError
from stalebound.runtime import Trajectory, WorkflowExecutor

PROMPTS = [f"p{i}" for i in range(13)]


def reject_sevens(trajectories: list[Any]) -> bool:
    return not trajectories[0]["data"].endswith("7")


class Ledger:
    def __init__(self) -> None:
        self.trained: list[tuple[int, str]] = []
        self.ended: list[tuple[int, str]] = []
        self.batches: list[list[Trajectory]] = []

    def copy(self) -> Ledger:
        other = Ledger()
        other.trained, other.ended = list(self.trained), list(self.ended)
        other.batches = list(self.batches)
        return other


def step(ex: WorkflowExecutor, engine: ScriptedEngine, rng: random.Random, ledger: Ledger) -> None:
    """One training step: answer requests in random order until prepare_batch returns."""
    out: list[list[Trajectory]] = []
    errors: list[BaseException] = []

    def take() -> None:
        try:
            out.append(ex.prepare_batch(PROMPTS, Generate(), reject_sevens))
        except BaseException as e:
            errors.append(e)

    settle(ex)  # the last set_version's wake-up has run before prepare_batch is called
    t = threading.Thread(target=take)
    t.start()
    # answer only while prepare_batch waits and the loop has nothing to run: a seed replays a run
    parked = parked_in_wait(ex, t)
    while True:
        quiesce(ex, engine, until=parked)
        if not t.is_alive():
            break
        pending = engine.pending()
        assert pending, f"prepare_batch waits and nothing runs: {ex.statistics()}"
        call = rng.choice(pending)
        engine.answer(call, RuntimeError("engine hiccup") if rng.random() < 0.1 else "ok")
    t.join()
    assert not errors and out, f"no batch: {errors} {ex.statistics()}"
    batch = out[0]
    ledger.batches.append(batch)
    for traj in batch:
        if traj.member == min(u.member for u in batch if u.group_id == traj.group_id):
            ledger.trained.append((traj.sample_index, traj.data["data"]))
    ledger.ended.extend((i, o) for i, o in ex.drain_outcomes())
    engine.set_version(ex.version)
    ex.set_version(ex.version)


def start(policy: str, version: int) -> tuple[WorkflowExecutor, ScriptedEngine]:
    engine = ScriptedEngine(version=version)
    config = RolloutConfig(
        staleness_policy=policy,
        max_head_offpolicyness=1,
        consumer_batch_size=3,
        group_size=2,
        max_concurrent_rollouts=8,
        max_consecutive_failures=50,
    )
    return WorkflowExecutor(config, engine).initialize(), engine


@pytest.mark.parametrize("policy", ["buffer", "capacity"])
@pytest.mark.parametrize("seed", range(4))
def test_resume_accounts_for_every_item_exactly_once(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    ex, engine = start(policy, 0)
    ledger = Ledger()
    try:
        for _ in range(rng.randint(2, 5)):
            step(ex, engine, rng, ledger)
        quiesce(ex, engine)  # the next groups are dispatched and waiting at the engine
        state = pickle.loads(pickle.dumps(ex.state_dict()))  # as a checkpoint holds it
        saved = ledger.copy()
        for _ in range(2):  # work lost in the crash
            step(ex, engine, rng, ledger)
    finally:
        ex.destroy()
    assert state["running_groups"], "save with groups running, or nothing is re-dispatched"

    ex, engine = start(policy, state["version"])
    ledger, resumed_at = saved, len(saved.batches)
    try:
        ex.load_state_dict(state, Generate(), reject_sevens)
        for _ in range(4):
            step(ex, engine, rng, ledger)
        final = ex.state_dict()
        stats = ex.statistics()
    finally:
        ex.destroy()

    assert stats.resumed_groups == len(state["running_groups"])
    first = ledger.batches[resumed_at]
    assert first[0].consumed_version == state["version"]  # the version series continues
    pending = [i for i, _, _ in final["pending"]] + list(final["samples"].values())
    pending += [t[0].sample_index for t in final["waiting"]]
    seen = [i for i, _ in ledger.trained] + [i for i, _ in ledger.ended] + pending
    assert sorted(seen) == list(range(final["next_sample"])), "an item lost or counted twice"
    for index, data in ledger.trained:  # each index keeps the data it was drawn with
        assert data == PROMPTS[index % len(PROMPTS)]
    assert {i for i, o in ledger.ended if o == "filtered"} <= {
        i for i in range(final["next_sample"]) if PROMPTS[i % len(PROMPTS)].endswith("7")
    }
    if policy == "buffer":
        assert max(t.staleness for b in ledger.batches for t in b) <= 1


def test_load_state_dict_refuses_a_foreign_or_late_state() -> None:
    ex, _ = start("buffer", 0)
    other, _ = start("capacity", 0)
    try:
        state = ex.state_dict()
        before = other.state_dict()
        with pytest.raises(ProtocolError, match=r"staleness_policy='buffer'.*'capacity'"):
            other.load_state_dict(state, Generate())
        with pytest.raises(ProtocolError, match="format 99 is not supported"):
            other.load_state_dict({**before, "format": 99}, Generate())
        with pytest.raises(ProtocolError, match="damaged or not an executor state"):
            other.load_state_dict({"format": 1, "policy": "capacity"}, Generate())
        assert other.state_dict() == before  # refused: nothing changed
        ex.submit("x", Generate())
        with pytest.raises(ProtocolError, match="already taken work"):
            ex.load_state_dict(state, Generate())
    finally:
        ex.destroy()
        other.destroy()


@pytest.mark.parametrize("policy", ["buffer", "capacity"])
def test_a_saved_state_is_checked_by_restoring_it_into_a_throwaway_coordinator(
    policy: str,
) -> None:
    # what a resume checks before it writes anything: the state loads into the settings' own
    # coordinator, with no executor (no thread, no engine) involved
    from stalebound.runtime.checkpoint import check_state

    rng = random.Random(0)
    ex, engine = start(policy, 0)
    try:
        for _ in range(3):
            step(ex, engine, rng, Ledger())
        quiesce(ex, engine)
        state = pickle.loads(pickle.dumps(ex.state_dict()))
    finally:
        ex.destroy()
    assert state["running_groups"]
    config = ex.config
    saved = check_state(state, config, state["version"])
    assert saved.running == state["running_groups"] and saved.next_sample == state["next_sample"]

    damaged = pickle.loads(pickle.dumps(state))
    damaged["policy_state"]["admitted"] = "many"
    with pytest.raises(ProtocolError, match=r"damaged"):
        check_state(damaged, config, state["version"])
    other = "capacity" if policy == "buffer" else "buffer"
    with pytest.raises(ProtocolError, match=rf"written under rollout.staleness_policy='{policy}'"):
        check_state(state, dataclasses.replace(config, staleness_policy=other), state["version"])

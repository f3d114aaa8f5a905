"""``stalebound doctor`` on simulated runs: one cause injected into the workload at a time.

The simulator writes its run as a run directory (``stalebound.sim.rundir``); on its clock every
injected delay is exact, so the doctor must name the injected cause the largest and give it a
share of the trainer's idle time within 0.1 of the injected delay's share.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from stalebound.core.errors import ConfigError
from stalebound.obs.doctor import Diagnosis, diagnose
from stalebound.sim.config import (
    AgentConfig,
    BatchConfig,
    DistributionConfig,
    EngineConfig,
    RunConfig,
    TrainerConfig,
    WorkloadConfig,
)
from stalebound.sim.rundir import write_run_dir

STEPS = 10
BASE = WorkloadConfig(
    lengths=DistributionConfig("fixed", value=50),  # 50 tokens: about a second per episode
    engine=EngineConfig(replicas=2, max_concurrency=16, step_base=0.02, step_per_seq=0.0001),
    batch=BatchConfig(4, 4),
    trainer=TrainerConfig(step_time=2.0),
    run=RunConfig(steps=STEPS),
)
"""The trainer is the bottleneck: a batch generates in about a second, a step trains in 2 s."""


def simulated(tmp_path: Path, name: str, staleness: int = 2, **changes: Any) -> Path:
    cfg = dataclasses.replace(BASE, **changes)
    write_run_dir(cfg, "capacity", staleness, tmp_path / name)
    return tmp_path / name


def steps(run: Path, key: str, first: int = 1) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sum(r[key] for r in rows if r["step"] >= first)


def idle(d: Diagnosis) -> float:
    return d.movable_idle_s


def test_the_uninjected_simulated_run_is_trainer_bound(tmp_path: Path) -> None:
    d = diagnose(simulated(tmp_path, "base"))
    assert [s.step for s in d.steps] == list(range(1, STEPS + 1))
    assert d.trainer_idle_s + d.trainer_busy_s == pytest.approx(d.window_s, abs=1e-6)
    assert d.trainer_bound and d.largest is None, d.trainer


@pytest.mark.parametrize(
    ("cause", "staleness", "changes", "injected"),
    [
        # a 6 s reward at η = 0: each step after the first waits for it whole
        (
            "reward wait",
            0,
            {"agent": AgentConfig(reward_latency=DistributionConfig("fixed", value=6.0))},
            lambda run, base: 6.0 * (STEPS - 1),
        ),
        # η = 0: each step waits for its batch's generation, which η = 2 overlapped
        ("admission bound", 0, {}, lambda run, base: steps(run, "wait_s", 2) - steps(base, "wait_s", 2)),
        # a heavy tail of lengths: the steps wait for their stragglers
        (
            "generation",
            2,
            {"lengths": DistributionConfig("lognormal", median=50, p99=3000, cap=4000)},
            lambda run, base: steps(run, "wait_s", 2) - steps(base, "wait_s", 2),
        ),
        # a 3 s publication after every step
        (
            "publication",
            2,
            {"trainer": TrainerConfig(step_time=2.0, publish=3.0)},
            lambda run, base: 3.0 * STEPS,
        ),
        # the training runs 3× slower while the engines generate (the CPU they share)
        (
            "CPU contention",
            2,
            {"trainer": TrainerConfig(step_time=2.0, contention=2.0)},
            lambda run, base: steps(run, "step_time_s") - steps(base, "step_time_s"),
        ),
    ],
)  # fmt: skip
def test_an_injected_cause_is_named_the_largest_with_its_share(
    tmp_path: Path, cause: str, staleness: int, changes: dict[str, Any], injected: Any
) -> None:
    base = simulated(tmp_path, "base")
    run = simulated(tmp_path, "injected", staleness, **changes)
    d = diagnose(run)
    assert d.largest == cause, d.trainer
    share = d.trainer[cause] / idle(d)
    assert share == pytest.approx(injected(run, base) / idle(d), abs=0.1), d.trainer


def test_a_run_directory_is_written_once(tmp_path: Path) -> None:
    simulated(tmp_path, "run")
    with pytest.raises(ConfigError, match="exists; give a new directory"):
        simulated(tmp_path, "run")

"""``stalebound doctor``: a run's idle time split into causes that sum to it, the largest named.

The attribution's definitions are pinned on a hand-made run directory whose every interval is
known; then real short runs of the embedded default, each with one cause injected (a slow reward,
a tight admission bound, a slow weight publication), must be diagnosed with that cause as the
largest, and a resumed run is diagnosed as one history.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stalebound.cli import main
from stalebound.obs.doctor import CAUSES, DOCTOR_PNG, Diagnosis, diagnose
from stalebound.obs.records import load_run
from stalebound.obs.trace import TraceHeader, TraceRecorder, TrajectoryRecord
from stalebound.train.recipe import TrainRecipe

SHORT = Path(__file__).resolve().parent.parent / "bench" / "doctor_short.yaml"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def train(run_dir: Path, models: Path, *overrides: str) -> Path:
    code = main(
        ["train", str(SHORT), f"engine.cache_dir={models}", f"run.run_dir={run_dir}", *overrides]
    )
    assert code == 0
    return run_dir


def assert_sums_hold(d: Diagnosis) -> None:
    """The trainer's causes sum to the time it did not train; the engines' (with what the trace
    does not place) to their meter's idle time; each step's to its own."""
    assert d.trainer_idle_s + d.trainer_busy_s == pytest.approx(d.window_s, abs=1e-6)
    assert d.engines_measured_s is not None
    assert d.engine_idle_s == pytest.approx(d.engines_measured_s, abs=1e-6)
    # What no cause explains is the engines' meter against the trace: a pause of the whole
    # process (the scheduler, a collection of the test process's heap) between an episode's
    # start in the trace and its request reaching the engine can land in it, so a short run's
    # window of 2 s leaves room for one such pause of up to 0.3 s beside the 10 %.
    assert abs(d.engines.get("unexplained", 0.0)) < 0.1 * d.window_s + 0.3
    assert sum(s.span_s for s in d.steps) == pytest.approx(d.window_s, abs=1e-6)
    assert set(d.trainer) | set(d.engines) <= set(CAUSES)


# -- the definitions, on a hand-made run --------------------------------------------------------


def write_run(
    run_dir: Path, steps: list[dict[str, Any]], episodes: list[tuple[float, ...]]
) -> Path:
    run_dir.mkdir()
    lines = [
        {"version": row["step"], "wall_time": float(row["step"]), "timestamp": 0.0, **row}
        for row in steps
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with TraceRecorder(run_dir / "trace.jsonl", TraceHeader(group_size=1)) as trace:
        for number, (start, end, reward) in enumerate(episodes):
            trace.record(TrajectoryRecord(number, number, 0, start, end, 8, reward_latency=reward))
    return run_dir


def test_each_interval_of_idle_time_gets_the_cause_its_definition_gives(tmp_path: Path) -> None:
    # step 1: waits [0, 1], trains [1, 2], publishes [2, 2.3]; bookkeeping [2.3, 2.5];
    # checkpoint [2.5, 2.6]; step 2: waits [2.6, 3.6], trains [3.6, 4.6], publishes nothing.
    # Episodes: one generates [0, 0.7] and waits for its reward to 0.9; one starts after the
    # publication (the engines idled through step 1's training), generates [2.6, 3.0] and waits
    # for its reward to 3.5; the batch reaches the trainer at 3.6.
    run = write_run(
        tmp_path / "run",
        [
            {
                "step": 1,
                "wait_start_s": 0.0,
                "wait_s": 1.0,
                "step_and_publish_s": 1.3,
                "publish_s": 0.3,
                "checkpoint_s": 0.0,
                "engine_idle_fraction": 0.5,
            },
            {
                "step": 2,
                "wait_start_s": 2.6,
                "wait_s": 1.0,
                "step_and_publish_s": 1.0,
                "publish_s": 0.0,
                "checkpoint_s": 0.1,
                "engine_idle_fraction": 3.6 / 4.6,  # the meter: 3.6 s idle of 4.6
            },
        ],
        [(0.0, 0.9, 0.2), (2.6, 3.5, 0.5)],
    )

    d = diagnose(run)

    assert d.window_s == pytest.approx(4.6)
    assert d.trainer_busy_s == pytest.approx(2.0)
    assert d.trainer == pytest.approx(
        {
            "start-up": 1.0,
            "reward wait": 0.5,
            "admission bound": 0.4,
            "publication": 0.3,
            "checkpoint": 0.1,
            "executor loop": 0.1,
            "bookkeeping": 0.2,
        }
    )
    assert d.engines == pytest.approx(
        {
            "start-up": 0.1,
            "reward wait": 0.7,
            "admission bound": 2.0,
            "publication": 0.3,
            "checkpoint": 0.1,
            "executor loop": 0.1,
            "bookkeeping": 0.2,
            "unexplained": 0.1,
        }
    )
    assert [s.trainer for s in d.steps] == [
        pytest.approx({"start-up": 1.0, "publication": 0.3}),
        pytest.approx(
            {
                "bookkeeping": 0.2,
                "checkpoint": 0.1,
                "admission bound": 0.4,
                "reward wait": 0.5,
                "executor loop": 0.1,
            }
        ),
    ]
    assert d.largest == "reward wait"
    assert d.engines_largest == "admission bound"
    assert_sums_hold(d)


def test_training_time_the_trainer_thread_did_not_run_is_cpu_contention(tmp_path: Path) -> None:
    # step 1: waits [0, 1], trains [1, 3] of which its thread ran 0.8 s of the 2 s step_time_s;
    # step 2 trained on a GPU (NaN CPU time: no contention measured). One episode generates
    # [0, 1]: the engines idle through both trainings.
    steps = [
        {"step": 1, "wait_start_s": 0.0, "wait_s": 1.0, "step_and_publish_s": 2.0,
         "publish_s": 0.0, "step_time_s": 2.0, "step_cpu_s": 0.8, "engine_idle_fraction": 0.5},
        {"step": 2, "wait_start_s": 3.0, "wait_s": 0.0, "step_and_publish_s": 1.0,
         "publish_s": 0.0, "step_time_s": 1.0, "step_cpu_s": math.nan,
         "engine_idle_fraction": 0.75},
    ]  # fmt: skip
    d = diagnose(write_run(tmp_path / "run", steps, [(0.0, 1.0, 0.0)]))

    assert d.trainer_busy_s == pytest.approx(0.8 + 1.0)
    assert d.trainer == pytest.approx({"start-up": 1.0, "CPU contention": 1.2})
    assert d.steps[1].trainer == {}
    # the engines idle in training for what idles them there, contended or not
    assert d.engines == pytest.approx({"admission bound": 3.0, "unexplained": 0.0})
    assert d.largest == "CPU contention"
    assert_sums_hold(d)


def test_a_run_recorded_before_the_step_start_was_logged_is_placed_by_its_rate() -> None:
    # the recorded calibration run has no wait_start_s: trained ÷ trajectories/s ends each step
    d = diagnose(Path(__file__).parent / "data" / "calibration-run")
    assert [s.step for s in d.steps] == list(range(1, 21))
    assert_sums_hold(d)
    assert abs(d.engines["unexplained"]) < 0.01 * d.engine_idle_s  # the clocks agree


def test_a_run_without_the_step_timing_is_one_error_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = write_run(
        tmp_path / "old", [{"step": 1, "wait_s": 1.0, "step_and_publish_s": 1.0}], [(0, 1, 0)]
    )
    assert main(["doctor", str(old)]) == 2
    assert capsys.readouterr().err == (
        f"stalebound doctor: run_dir={str(old)!r}: step 1 of metrics.jsonl has no "
        "wait_start_s; the doctor reads the step timing stalebound train records: give a run "
        "directory it wrote\n"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["doctor", str(empty)]) == 2
    assert capsys.readouterr().err == (
        f"stalebound doctor: run_dir={str(empty)!r}: no training steps in metrics.jsonl; give "
        "the directory of a run of stalebound train that trained at least one step\n"
    )
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == (
        f"stalebound doctor: run directory {str(tmp_path / 'missing')!r} does not exist; pass "
        "the directory a run wrote\n"
    )


# -- injected causes, on real runs -------------------------------------------------------------


def test_a_slow_reward_is_named_the_largest_cause(tmp_path: Path, models: Path) -> None:
    run = train(
        tmp_path / "run",
        models,
        "run.steps=4",
        "rollout.staleness=1",
        "task.reward_latency.distribution=constant",
        # well above a batch's generation, even on a loaded machine
        "task.reward_latency.median_s=2.0",
        "task.reward_latency.cap_s=2.0",
    )
    d = diagnose(run)
    assert d.largest == "reward wait", d.trainer
    assert_sums_hold(d)


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Path:
    """η = 0: no episode starts before the weights it will be trained at are published; 8
    episodes in flight at most, so a batch's generation takes well above the training's CPU
    contention on a loaded machine."""
    return train(
        tmp_path_factory.mktemp("tight") / "run",
        models,
        "run.steps=4",
        "rollout.staleness=0",
        "rollout.max_concurrent_rollouts=8",
    )


def test_a_tight_admission_bound_is_named_the_largest_cause(tight: Path) -> None:
    d = diagnose(tight)
    assert d.largest == "admission bound", d.trainer
    assert d.engines_largest == "admission bound", d.engines
    assert_sums_hold(d)


def test_the_table_names_the_largest_cause_and_its_setting(
    tight: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", str(tight), "--steps", "--no-plot"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the lines
    assert "largest cause of the trainer's idle time: admission bound" in out
    assert f"the setting that moves it: {CAUSES['admission bound'].setting}" in out
    assert "no predicted gain: pass --predict to simulate it on the run's calibration" in out


def test_a_slow_publication_is_named_the_largest_cause(
    tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    send = TrainRecipe._send_weights

    def slow(self: TrainRecipe, state_dict: Any, version: int) -> None:
        time.sleep(1.0)  # well above the publication's own time, even on a loaded machine
        send(self, state_dict, version)

    monkeypatch.setattr(TrainRecipe, "_send_weights", slow)
    d = diagnose(train(tmp_path / "run", models, "run.steps=4"))
    assert d.largest == "publication", d.trainer
    assert d.trainer["publication"] >= 4 * 1.0
    assert_sums_hold(d)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins threads to a core (Linux)")
def test_a_hog_on_the_trainer_core_is_named_the_largest_cause(
    tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location(
        "doctor_injected", SHORT.with_name("doctor_injected.py")
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look themselves up
    spec.loader.exec_module(bench)
    with bench.hog_on_trainer_core(hogs=2):  # the training thread runs at most a third of the time
        run = train(tmp_path / "run", models, "run.steps=4")
    d = diagnose(run)
    assert d.largest == "CPU contention", d.trainer
    ran = sum(float(r["step_cpu_s"]) for r in load_run(run).steps)
    # two hogs: twice its running time, or more
    assert d.trainer["CPU contention"] > 1.5 * ran, (ran, d.trainer)
    assert_sums_hold(d)


def test_a_resumed_run_is_diagnosed_as_one_history_from_the_cli(
    tight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(tight, run)
    assert main(["train", f"resume={run}", "run.steps=6", "run.live=false"]) == 0
    capsys.readouterr()

    assert main(["doctor", str(run), "--json", "--predict"]) == 0
    report = json.loads(capsys.readouterr().out)

    d = diagnose(run)
    assert report["resumed_at"] == [4] == d.resumed_at
    assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4, 5, 6]
    assert "start-up" in d.steps[4].trainer  # the resumed first step waits from nothing again
    # on an idle machine the admission bound; with every core busy (make stress) the engines slow
    # the training steps more than the bound holds the trainer
    assert report["largest"] == d.largest in ("admission bound", "CPU contention")
    assert report["setting"] == CAUSES[d.largest].setting
    predicted = report["predictions"]["admission bound"]  # the simulator on the run, at η = 1
    assert predicted["change"] == "rollout.staleness=1 rollout.deadline.target=1"
    assert predicted["trajectories_per_s"] > 0 and predicted["baseline_trajectories_per_s"] > 0
    assert predicted["gain"] == pytest.approx(
        predicted["trajectories_per_s"] / predicted["baseline_trajectories_per_s"] - 1, abs=1e-5
    )
    # every cause of the trainer's idle time a setting moves gets its setting simulated, or null
    causes = {k for k, v in d.trainer.items() if v > 0} - {"start-up"}
    assert set(report["predictions"]) == causes
    if d.largest == "admission bound":
        assert report["predicted_gain"] == predicted
    assert report["predictions"]["publication"]["change"] == (
        "publications that take no time (the most any engine.weight_transfer gains)"
    )
    assert all(report["predictions"][c] is None for c in causes & {"executor loop", "bookkeeping"})
    assert (run / DOCTOR_PNG).stat().st_size > 0
    assert_sums_hold(d)

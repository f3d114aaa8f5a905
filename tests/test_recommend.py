"""`stalebound simulate --calibrate RUN --recommend`: the sweep on a calibrated workload.

The sweeps run on the recorded run of ``tests/data/calibration-run`` (the train recipe, 20
steps), narrowed by policy and bound and shortened to a few simulated steps, so each takes a
second or two; the full sweep is what ``bench/recommend_check.py`` exercises.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from stalebound.cli import main
from stalebound.config import dump_yaml, load_config
from stalebound.core import ConfigError
from stalebound.sim.calibrate import Calibration, calibrate, read_run_info
from stalebound.sim.recommend import (
    TIE,
    Candidate,
    Setting,
    _choose,
    default_setting,
    pareto_front,
    recommend,
    simulate_settings,
    steps_to_target,
)

RECORDED = Path(__file__).parent / "data" / "calibration-run"
STEPS = 8
"""Simulated steps per setting: enough for a window after the warm-up step."""


@pytest.fixture(scope="module")
def cal() -> Calibration:
    """The recorded run's workload with a verifier's long tail: one reward in 20 takes 1.5 s,
    the others 50 ms (the recorded run itself is bound by its trainer, where every setting
    trains at about the same pace)."""
    return dataclasses.replace(calibrate(RECORDED), reward_latencies=(0.05,) * 19 + (1.5,))


def _simulate(*args: str) -> list[str]:
    return ["simulate", "--calibrate", str(RECORDED), "--recommend", "--steps", str(STEPS), *args]


def test_the_recommendation_is_the_fastest_setting_within_the_limits(cal: Calibration) -> None:
    limit = 0.5  # the mean staleness the fastest settings exceed
    rec = recommend(
        cal,
        max_staleness=limit,
        policies=["capacity", "deadline"],
        bounds=[0, 1, 2, 4],
        steps=STEPS,
    )
    assert rec.objective == "time-per-step"  # the recorded run keeps no reward
    chosen = rec.recommended
    assert chosen is not None and chosen.staleness_mean <= limit
    within = [c for c in rec.candidates if c.staleness_mean <= limit]
    fastest = min(c.step_s for c in within)
    assert chosen.step_s <= fastest * (1 + TIE)
    assert chosen.staleness_mean == min(
        c.staleness_mean for c in within if c.step_s <= fastest * (1 + TIE)
    )
    # a faster setting exists, but it trains staler data than the limit
    assert min(c.step_s for c in rec.candidates) < fastest
    assert {c.setting.policy for c in rec.candidates} == {"capacity", "deadline"}
    # the second stage varied the concurrency and the grace of the best settings
    assert {c.setting.concurrency for c in rec.candidates} >= {None, 32, 64, 128}
    assert {c.setting.grace_steps for c in rec.candidates} == {0.25, 1.0, None}
    # the run itself, as it ran: the recipe's deadline policy at η_h = 4, η_s = 2
    assert rec.current.setting == Setting("deadline", 4, 2)


def test_a_tie_keeps_the_runs_own_setting_else_the_default_else_the_least_stale() -> None:
    def candidate(setting: Setting, step_s: float, staleness: float) -> Candidate:
        return Candidate(setting, step_s, 256 / step_s, staleness, 0.0, 0.0)

    own, default = Setting("capacity", 2), default_setting()
    fastest = candidate(Setting("capacity", 8), 1.0, 6.0)
    least_stale = candidate(Setting("deadline", 2, 1), 1.0 + TIE, 0.9)
    tied = [fastest, candidate(own, 1.08, 1.9), candidate(default, 1.09, 1.8), least_stale]
    slower = candidate(Setting("capacity", 1), 1.0 + 2 * TIE, 0.5)
    pool = [*tied, slower]
    assert _choose(pool, "time-per-step", keep=(own, default)).setting == own
    # the run's own setting is predicted slower than the tie: the default is kept
    assert _choose(pool, "time-per-step", keep=(slower.setting, default)).setting == default
    assert _choose(pool, "time-per-step", keep=(slower.setting,)) == least_stale
    assert _choose([fastest, slower], "time-per-step", keep=(own, default)) == fastest


def test_the_default_setting_is_the_train_recipes() -> None:
    # configs/train.yaml: deadline, η_h = 4, η_s derived (2), truncate, grace 0.25
    assert default_setting() == Setting("deadline", 4, 2, grace_steps=0.25, concurrency=None)


def test_the_front_holds_exactly_the_settings_no_other_beats(cal: Calibration) -> None:
    rec = recommend(cal, policies=["capacity", "buffer"], bounds=[0, 1, 2], steps=STEPS)

    def figures(c: Candidate) -> tuple[float, ...]:
        return (c.step_s, c.staleness_mean, c.truncated, c.wasted)

    def beaten(c: Candidate) -> bool:
        return any(
            figures(o) != figures(c)
            and all(a <= b for a, b in zip(figures(o), figures(c), strict=True))
            for o in rec.candidates
        )

    front = set(rec.front)
    assert front and all(not beaten(c) for c in front)
    assert {figures(c) for c in rec.candidates if not beaten(c)} == {figures(c) for c in front}
    assert [c.step_s for c in rec.front] == sorted(c.step_s for c in rec.front)
    assert pareto_front(rec.front, "time-per-step") == list(rec.front)
    # synchronous training stales nothing, so it is on every front
    assert any(c.setting == Setting("capacity", 0) for c in rec.front)


@pytest.mark.parametrize(
    "setting",
    [
        Setting("deadline-abort", 6, 3, grace_steps=None, concurrency=64),
        Setting("deadline", 2, 1, grace_steps=1.0),
        Setting("capacity", 0),
        Setting("buffer", 3, concurrency=32),
    ],
)
def test_the_overrides_load_and_read_back_as_the_same_setting(
    setting: Setting, tmp_path: Path
) -> None:
    cfg = load_config(overrides=setting.overrides())
    r = cfg.rollout
    assert r.staleness == setting.staleness
    assert r.max_concurrent_rollouts == setting.concurrency
    if setting.target is not None:
        assert (r.deadline.target, r.deadline.grace_steps) == (setting.target, setting.grace_steps)
    # and a run with that config calibrates as the same policy and bounds
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
    info = read_run_info(tmp_path)
    assert (info.policy, info.staleness, info.target) == (
        setting.policy,
        setting.staleness,
        setting.target,
    )
    assert info.max_concurrent_groups == setting.concurrency


def test_the_command_prints_the_front_and_a_line_to_paste(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "w.yaml"
    args = _simulate("--out", str(out), "--policy", "capacity", "--staleness", "0", "1", "2")
    assert main([*args, "--max-staleness", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "Pareto front of" in text and "predicted time per step" in text
    assert "recommended within --max-staleness 0.5: predicted" in text
    line = text.strip().splitlines()[-1]
    assert line == (
        "rollout.staleness_policy=capacity rollout.staleness=0 rollout.max_concurrent_rollouts=null"
    )
    assert load_config(overrides=line.split()).rollout.staleness == 0
    assert out.is_file()

    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["objective"] == "time-per-step" and doc["workload"] == str(out)
    assert doc["recommended"]["overrides"].startswith("rollout.staleness_policy=capacity")
    assert doc["current"]["policy"] == "deadline" and doc["front"]


def test_the_predictions_are_the_sweeps(cal: Calibration) -> None:
    setting = Setting("capacity", 2)
    rec = recommend(cal, policies=["capacity"], bounds=[2], steps=STEPS)
    [alone] = simulate_settings(cal, [setting], steps=STEPS)
    assert next(c for c in rec.candidates if c.setting == setting) == alone


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--max-staleness", "-1"],
            "max-staleness=-1: the mean staleness of the trained trajectories must be ≥ 0 (0 asks "
            "for synchronous training); give e.g. --max-staleness 1.5",
        ),
        (
            ["--max-truncated", "150"],
            "max-truncated=150: a percentage of the trained trajectories, 0 to 100; give e.g. "
            "--max-truncated 5",
        ),
        (
            ["--target", "1"],
            "target=1: --recommend sweeps the soft target itself; narrow the sweep with --policy "
            "and --staleness only",
        ),
        (
            ["--objective", "time-to-target"],
            f"objective='time-to-target': the run in {RECORDED} never reached its "
            "run.target_reward=0.6 (the mean reward of 5 steps); use --objective time-per-step",
        ),
    ],
)
def test_bad_limits_are_refused_before_anything_is_written(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "w.yaml"
    assert main([*_simulate("--out", str(out)), *args]) == 2
    assert capsys.readouterr().err == f"stalebound simulate: {message}\n"
    if args[0] != "--objective":  # that one is known once the run is read
        assert not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--recommend"], "--recommend needs --calibrate RUN_DIR"),
        (
            ["simulate", "--calibrate", str(RECORDED), "--max-staleness", "1"],
            "--max-staleness needs --recommend",
        ),
    ],
)
def test_recommend_flags_need_their_command(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    assert capsys.readouterr().err == f"stalebound simulate: {message}\n"


def test_a_limit_no_setting_meets_names_the_closest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = _simulate(
        "--out", str(tmp_path / "w.yaml"), "--policy", "capacity", "--policy", "buffer"
    )
    assert main([*args, "--staleness", "2", "4", "--max-staleness", "0.5"]) == 2
    captured = capsys.readouterr()
    assert "Pareto front of" in captured.out  # what was simulated is still shown
    assert captured.err == (
        "stalebound simulate: no setting meets --max-staleness 0.5 among the 16 simulated; the "
        "closest: rollout.staleness_policy=capacity rollout.staleness=2 "
        "rollout.max_concurrent_rollouts=null (mean staleness 1.62, 0.0% truncated); loosen the "
        "limits or widen --policy / --staleness\n"
    )


def test_time_to_target_is_the_runs_steps_to_it_at_the_predicted_pace(
    cal: Calibration, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):  # the target 0.6: the mean of steps 7–11 is 0.66
        row["reward_mean"] = 0.3 if i < 8 else 0.9
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert steps_to_target(run) == 11
    rec = recommend(calibrate(run), policies=["capacity"], bounds=[1, 2], steps=STEPS)
    assert rec.steps_to_target is not None
    assert rec.objective == "time-to-target" and rec.steps_to_target == 11
    assert all(c.time_to_target_s == pytest.approx(11 * c.step_s) for c in rec.candidates)


def test_a_negative_bound_is_refused(cal: Calibration) -> None:
    with pytest.raises(ConfigError, match=r"^staleness=-1: must be ≥ 0"):
        recommend(cal, bounds=[-1, 2])

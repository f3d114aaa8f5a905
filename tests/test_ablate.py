"""``stalebound ablate``: objective names, the per-cell summary, the plot, and one real grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stalebound.cli import main
from stalebound.config import load_config
from stalebound.core.errors import ConfigError
from stalebound.train import ablate
from stalebound.train.ablate import DEFAULT_GRID, Objective, parse_args, plot_grid, summarize


@pytest.mark.parametrize(
    ("name", "prox", "tis", "rejection"),
    [
        ("ppo", "none", False, "none"),
        ("ppo+seq", "none", False, "sequence"),
        ("recompute+tis", "recompute", True, "none"),
        ("loglinear+tis+token", "loglinear", True, "token"),
        ("recompute+seq+tis", "recompute", True, "sequence"),
    ],
)
def test_objective_names_map_to_trainer_settings(
    name: str, prox: str, tis: bool, rejection: str
) -> None:
    o = Objective.parse(name)
    assert (o.prox_mode, o.tis, o.rejection) == (prox, tis, rejection)
    assert Objective.parse(o.name) == o  # the canonical name reads back
    cfg = o.apply(load_config(), tis_cap=3.0)
    assert cfg.train.prox_mode == prox and cfg.train.rejection == rejection
    assert cfg.train.tis_cap == (3.0 if tis else None)
    assert cfg.train.validate() is cfg.train


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("grpo", "objective='grpo': unknown base 'grpo'; use BASE[+tis]"),
        ("recompute+tis+tis", "unknown or repeated part 'tis'"),
        ("loglinear+token+seq", "unknown or repeated part 'seq'"),
        ("ppo+tis", "objective='ppo+tis': TIS caps the weight π_prox/π_behav"),
    ],
)
def test_bad_objective_names_are_refused_with_the_fix(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("+", r"\+").replace("[", r"\[")):
        Objective.parse(name)


def test_only_rejection_against_the_current_policy_differs_from_ppo_at_eta_0() -> None:
    same = {n: Objective.parse(n).same_at_sync for n in ("ppo", "recompute+tis+seq", "ppo+token")}
    assert same == {"ppo": True, "recompute+tis+seq": True, "ppo+token": False}


def test_command_line_flags_shape_the_grid() -> None:
    grid, cap, as_json, rest = parse_args(
        ["a.yaml", "--staleness", "0", "2", "--objective", "recompute+tis", "ppo", "--json",
         "--seeds", "5", "--steps", "3", "--tis-cap", "4", "train.lr=1e-3"]
    )  # fmt: skip
    assert grid.staleness == (0, 2) and grid.objectives == ("recompute+tis", "ppo")
    assert grid.seeds == (5,) and grid.steps == 3 and cap == 4.0 and as_json
    assert rest == ["a.yaml", "train.lr=1e-3"]
    assert parse_args([])[0] == DEFAULT_GRID
    with pytest.raises(ConfigError, match="--staleness: needs at least one value"):
        parse_args(["--staleness", "--json"])
    with pytest.raises(ConfigError, match=r"--seeds x: 'x' is not a whole number >= 0"):
        parse_args(["--seeds", "x"])
    with pytest.raises(ConfigError, match=r"--tis-cap 0.5: '0.5' must be >= 1"):
        parse_args(["--tis-cap", "0.5"])
    with pytest.raises(ConfigError, match="unknown base 'sft'"):
        parse_args(["--objective", "sft"])


def _row(objective: str, eta: int, seed: int, reward: float, **extra: Any) -> dict[str, Any]:
    return {
        "objective": objective,
        "staleness": eta,
        "seed": seed,
        "final_reward": reward,
        "policy_reward": reward + 0.05,
        "greedy_after": reward + 0.1,
        "time_to_target_s": extra.get("ttt"),
        "staleness_mean": eta * 0.9,
        "staleness_max": eta,
        "clip_fraction": 0.01 * eta,
        "ratio_mean": 1.0,
        "ratio_max": 1.0 + eta,
        "ratio_min": 1.0 / (1 + eta),
        "masked_fraction": 0.0,
        "behaviour_weight_mean": 1.0,
    }


def test_a_rerun_reuses_only_a_whole_row_of_the_same_config(tmp_path: Path) -> None:
    row_file = tmp_path / "ppo-eta4-seed0.json"
    assert ablate.finished_row(row_file, "seed: 0\n") is None  # not trained yet
    whole = json.dumps({"objective": "ppo", "final_reward": 0.5, "config": "seed: 0\n"})
    row_file.write_text(whole[: len(whole) // 2])  # a write cut short by a kill
    assert ablate.finished_row(row_file, "seed: 0\n") is None
    row_file.write_text("[]")
    assert ablate.finished_row(row_file, "seed: 0\n") is None
    row_file.write_text(whole)
    assert ablate.finished_row(row_file, "seed: 1\n") is None  # another config: trained again
    assert ablate.finished_row(row_file, "seed: 0\n") == json.loads(whole)


def test_summary_takes_medians_over_seeds_and_the_gap_to_eta_0() -> None:
    rows = [
        _row("ppo", 0, 0, 0.50, ttt=10.0),
        _row("ppo", 0, 1, 0.40),
        _row("ppo", 0, 2, 0.60, ttt=30.0),
        _row("ppo", 4, 0, 0.30),
        _row("ppo", 4, 1, 0.45),
        _row("ppo", 4, 2, 0.35),
    ]
    cells = {c["staleness"]: c for c in summarize(rows)}
    assert cells[0]["final_reward"] == {"median": 0.50, "min": 0.40, "max": 0.60}
    assert cells[0]["time_to_target_s"] == 20.0 and cells[0]["reached_target"] == 2
    assert cells[4]["time_to_target_s"] is None and cells[4]["reached_target"] == 0
    assert cells[4]["gap_to_sync"] == pytest.approx(0.35 - 0.50)
    assert cells[4]["policy_gap_to_sync"] == pytest.approx(0.35 - 0.50)
    assert cells[4]["policy_reward"]["max"] == pytest.approx(0.50)
    assert cells[4]["ratio_max"] == 5.0 and cells[4]["ratio_min"] == 0.2
    assert cells[4]["staleness_max"] == 4 and cells[4]["seeds"] == [0, 1, 2]


def test_plot_draws_one_line_per_objective(tmp_path: Path) -> None:
    rows = [_row(o, e, s, 0.4 + 0.01 * s - 0.01 * e) for o in ("ppo", "recompute") for e in (0, 8)
            for s in (0, 1)]  # fmt: skip
    path = plot_grid(summarize(rows), tmp_path / "grid.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_ablate_trains_the_grid_shares_eta_0_and_reuses_finished_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ablate, "POLICY_EVAL_PROMPTS", 16)  # a smaller evaluation, same code
    out = tmp_path / "grid"
    argv = [
        "ablate",
        "--staleness",
        "0",
        "--objective",
        "ppo",
        "recompute+tis",
        "--seeds",
        "3",
        "--steps",
        "2",
        "--json",
        "train.warm_start_steps=5",
        "run.eval_prompts=8",
        "rollout.consumer_batch_size=8",
        "task.reward_latency.median_s=0.01",
        f"run.run_dir={out}",
        f"engine.cache_dir={tmp_path / 'models'}",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads((out / "ablate.json").read_text()) == report
    assert (out / "ablate.png").read_bytes()[:4] == b"\x89PNG"
    rows = report["rows"]
    # at η = 0 both objectives are the same loss: trained once, listed for each
    assert [(r["objective"], r["trained_as"]) for r in rows] == [
        ("ppo", "ppo"),
        ("recompute+tis", "ppo"),
    ]
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["sync-eta0-seed3.json"]
    cfg = load_config([out / "runs" / "sync-eta0-seed3" / "config.yaml"])
    assert (cfg.seed, cfg.run.steps, cfg.rollout.max_head_offpolicyness) == (3, 2, 0)
    assert cfg.train.minibatches == 4 and cfg.task.reward_latency.distribution == "lognormal"
    for r in rows:
        assert r["violations"] == 0 and r["staleness_max"] == 0
        assert 0 <= r["clip_fraction"] <= 1 and 0 <= r["masked_fraction"] <= 1
    assert [c["gap_to_sync"] for c in report["cells"]] == [0.0, 0.0]
    assert 0 <= rows[0]["policy_reward"] <= 1
    # the same grid again: the finished row is reused, nothing is trained
    mtime = (out / "rows" / "sync-eta0-seed3.json").stat().st_mtime_ns
    assert main(argv[:-2] + argv[-2:]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == rows
    assert (out / "rows" / "sync-eta0-seed3.json").stat().st_mtime_ns == mtime

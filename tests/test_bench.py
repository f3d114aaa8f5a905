"""``stalebound bench`` end to end: one short run per η on the bench workload, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stalebound.cli import main
from stalebound.config import load_config

pytestmark = pytest.mark.slow

KEYS = {
    "staleness",
    "target",
    "mean_staleness",
    "max_staleness",
    "violations",
    "truncated_fraction",
    "wasted_token_fraction",
    "policy",
    "time_to_target_s",
    "trajectories_per_s",
    "final_reward",
    "trainer_idle_fraction",
    "engine_idle_fraction",
}


def bench_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[Path, list[dict[str, Any]]]:
    """``stalebound bench FLAGS --json`` for a few steps, written to ``tmp_path/bench`` (models
    cached beside it): the run directory and the printed rows."""
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            *flags,
            "--json",
            "run.steps=4",
            "train.warm_start_steps=5",
            "run.eval_prompts=8",
            "rollout.consumer_batch_size=8",
            "task.reward_latency.median_s=0.01",
            f"run.run_dir={out}",
            f"engine.cache_dir={tmp_path / 'models'}",
        ]
    )
    assert code == 0
    runs: list[dict[str, Any]] = json.loads(capsys.readouterr().out)["runs"]
    return out, runs


def test_bench_runs_each_bound_on_the_long_tail_workload_and_prints_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, runs = bench_json(tmp_path, capsys, "--staleness", "0", "2")
    assert [r["staleness"] for r in runs] == [0, 2]
    assert json.loads((out / "bench.json").read_text())["runs"] == runs
    for r in runs:
        assert set(r) >= KEYS
        # the recipe's policy: --staleness is its hard bound η_h, the soft target η_s = η_h // 2
        assert r["policy"] == "deadline" and r["violations"] == 0
        assert r["target"] == r["staleness"] // 2 and r["max_staleness"] <= r["staleness"]
        assert r["trajectories_per_s"] > 0 and 0 <= r["trainer_idle_fraction"] <= 1
        cfg = load_config([out / f"eta{r['staleness']}" / "config.yaml"])
        assert (cfg.rollout.deadline.target, cfg.rollout.staleness) == (None, r["staleness"])
        # the bench recipe's verifier latency, with the command line's median on top
        assert cfg.task.reward_latency.distribution == "lognormal"
        assert cfg.task.reward_latency.median_s == 0.01
        metrics = (out / f"eta{r['staleness']}" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4]


def test_bench_rejects_a_staleness_flag_without_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--staleness", "--json"]) == 2
    assert "--staleness needs integers, e.g. --staleness 0 2" in capsys.readouterr().err


def test_bench_longtail_runs_sync_beside_a_policy_with_the_data_audit_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, runs = bench_json(
        tmp_path,
        capsys,
        "--workload",
        "longtail",
        "--policy",
        "sync",
        "deadline",
        "--staleness",
        "2",
    )
    assert [(r["policy"], r["staleness"]) for r in runs] == [("sync", 0), ("deadline", 2)]
    for r, where in zip(runs, ("sync", "deadline-eta2"), strict=True):
        cfg = load_config([out / where / "config.yaml"])
        assert (cfg.task.name, cfg.task.strings.lengths) == ("strings", "lognormal")
        audit = json.loads((out / where / "summary.json").read_text())["data_audit"]
        assert r["audit_ks"] == audit["ks"] and 0 <= r["audit_ks"] <= 1
        assert r["audit_never_trained_fraction"] == audit["never_trained_fraction"]
        assert r["audit_worst_share_ratio"] == audit["worst_share_ratio"]
        assert r["audit_steps_to_target_offered_mix"] == audit["steps_to_target_offered_mix"]
    # synchronous training ends nothing untrained: every decided prompt is trained
    assert runs[0]["audit_never_trained_fraction"] == 0.0


def test_bench_runs_policies_side_by_side_with_their_staleness_and_waste(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, runs = bench_json(
        tmp_path, capsys, "--policy", "capacity", "deadline", "--soft-staleness", "1"
    )
    assert [(r["policy"], r["staleness"], r["target"]) for r in runs] == [
        ("capacity", 1, 1),
        ("deadline", 2, 1),  # the former meaning: η_s = 1 admits as capacity does; η_h = 2η_s
    ]
    for r in runs:
        assert set(r) >= KEYS
        cfg = load_config([out / f"{r['policy']}-eta1" / "config.yaml"])
        assert cfg.rollout.staleness_policy == r["policy"]
        assert 0 <= r["mean_staleness"] <= r["max_staleness"]
        assert 0 <= r["truncated_fraction"] <= 1 and 0 <= r["wasted_token_fraction"] <= 1
    deadline = runs[1]
    assert (cfg.rollout.staleness, cfg.rollout.deadline.target) == (2, 1)
    assert deadline["violations"] == 0 and deadline["max_staleness"] <= 2


@pytest.mark.parametrize("args", [["--policy"], ["--policy", "fifo"], ["--policy", "buffer", "x"]])
def test_bench_rejects_an_unknown_policy(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert "not a policy; name one or more of sync, buffer, capacity, deadline" in err

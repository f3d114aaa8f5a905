"""``stalebound doctor`` on a run directory of ``backend=ray`` (two engine actors, two trainer
ranks): the same records, the same sums."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

pytest.importorskip("torch")
pytest.importorskip("ray")

from stalebound.cli import main  # noqa: E402
from stalebound.obs.doctor import CAUSES, diagnose  # noqa: E402


def test_the_doctor_reads_a_ray_run_directory(
    ray_instance: Any, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path_factory.mktemp("ray-doctor") / "r"
    code = main(
        [
            "train",
            "backend=ray",
            "engine.replicas=2",
            "ray.train_data_parallel_size=2",
            "ray.engine_num_cpus=0.25",
            "ray.trainer_num_cpus=0.25",
            "run.steps=4",
            f"run.run_dir={run}",
            "run.live=false",
            "run.eval_prompts=8",
            "run.plots=false",
            "train.warm_start_steps=2",
            f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        ]
    )
    assert code == 0
    capsys.readouterr()

    assert main(["doctor", str(run), "--json", "--no-plot"]) == 0
    report = json.loads(capsys.readouterr().out)

    d = diagnose(run)
    assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4]
    assert report["largest"] == d.largest and report["trainer_bound"] == d.trainer_bound
    assert d.trainer_idle_s + d.trainer_busy_s == pytest.approx(d.window_s, abs=1e-6)
    assert d.engines_measured_s is not None  # the engine actors' meter, summed by the driver
    assert d.engine_idle_s == pytest.approx(d.engines_measured_s, abs=1e-6)
    assert abs(d.engines.get("unexplained", 0.0)) < 0.1 * d.window_s
    assert set(d.trainer) | set(d.engines) <= set(CAUSES)
    assert d.trainer["start-up"] > 0  # the first step waited for a batch generated from nothing
    # two ranks wait for each other in the collectives: their CPU time is no measure of
    # contention, so none is placed
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step_cpu_s"] is None for r in rows), rows  # NaN, written as null
    assert "CPU contention" not in d.trainer

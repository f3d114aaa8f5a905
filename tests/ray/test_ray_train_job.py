"""``stalebound train backend=ray``: two engine actors and two trainer rank actors (FSDP2 over gloo)
learn within the bound; a killed rank leaves a checkpoint the run resumes from."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

pytest.importorskip("torch")
pytest.importorskip("ray")

from stalebound.cli import main  # noqa: E402
from stalebound.config import load_config  # noqa: E402


def test_two_engine_actors_and_two_fsdp_ranks_learn_within_the_bound(
    ray_instance: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from stalebound.train.parallel.checkpoint import has_sharded_optimizer

    run = tmp_path_factory.mktemp("ray-run") / "r"
    code = main(
        [
            "train",
            "backend=ray",
            "engine.replicas=2",
            "train.parallel=fsdp",
            "ray.train_data_parallel_size=2",
            "ray.engine_num_cpus=0.25",
            "ray.trainer_num_cpus=0.25",
            "run.steps=30",
            f"run.run_dir={run}",
            "run.live=false",
            "run.eval_prompts=200",
            "run.plots=false",
            "--rollout.staleness",
            "2",
            "--max-head-offpolicyness",  # AReaL's admission bound: the deadline policy's η_s
            "1",
            f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        ]
    )
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["violations"] == 0 and summary["max_staleness"] <= 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # learning: the sampled reward of the last ten steps (2,560 trajectories) clearly above the
    # first ten's, and greedy accuracy on 200 held-out prompts up by 0.05 or more (seven runs
    # rose by 0.115 to 0.265). One step's reward, or accuracy on 60 prompts, moves with the
    # order the two engines finish in: 60 prompts once read 0.45 before and 0.42 after.
    first, last = (
        sum(r["reward_mean"] for r in part) / 10 for part in (records[:10], records[-10:])
    )
    assert last >= first + 0.05, (first, last, summary)
    assert summary["eval_after"] >= summary["eval_before"] + 0.05, summary
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(r["traj_staleness_max"] <= 2 for r in records)
    batch = load_config([run / "config.yaml"]).rollout.consumer_batch_size
    assert all(r["num_groups"] == batch for r in records)  # the whole batch, across both ranks
    assert (run / "checkpoints" / "step-000030" / "trainer_state.pt").is_file()
    assert has_sharded_optimizer(run / "checkpoints" / "step-000030")  # each rank its shards


def test_a_killed_trainer_rank_leaves_a_checkpoint_the_run_resumes_from(
    ray_instance: Any,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stalebound.distributed.trainer import RayTrainerGroup
    from stalebound.train.ledger import audit_run

    run = tmp_path_factory.mktemp("ray-kill") / "r"
    args = [
        "train",
        "backend=ray",
        "ray.train_data_parallel_size=2",
        "ray.engine_num_cpus=0.25",
        "ray.trainer_num_cpus=0.25",
        "run.steps=8",
        "run.checkpoint_every_steps=2",
        f"run.run_dir={run}",
        "run.live=false",
        "run.eval_prompts=20",
        "run.plots=false",
        "run.trace=false",
        "rollout.consumer_batch_size=16",
        "rollout.group_size=4",
        f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
    ]
    real_step = RayTrainerGroup.step

    def step_then_lose_a_rank(self: RayTrainerGroup, groups: Any, **kw: Any) -> Any:
        if self.version == 3:  # after the checkpoint of step 2, during step 4
            ray_instance.kill(self.actors[1])
        return real_step(self, groups, **kw)

    monkeypatch.setattr(RayTrainerGroup, "step", step_then_lose_a_rank)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "rank 1" in err and f"stalebound train resume={run}" in err, err
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    monkeypatch.setattr(RayTrainerGroup, "step", real_step)
    assert main(["train", f"resume={run}"]) == 0
    audit = audit_run(run)
    assert audit.ok and audit.step == 8, audit.describe()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))

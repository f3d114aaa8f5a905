"""Trainer ranks on torch.distributed (gloo on the CPU): two FSDP or DDP ranks take the step one
trainer takes on the same batch, for every objective; checkpoints resume across world sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from parallel_helpers import PAD, make_batch, objectives_rank, same_step  # noqa: E402
from stalebound.config import load_config  # noqa: E402
from stalebound.core.errors import ConfigError  # noqa: E402
from stalebound.engines.models import build_default_model, load_model  # noqa: E402
from stalebound.train import TrainConfig, Trainer  # noqa: E402

torch.set_num_threads(1)

# Every objective of stalebound.train.losses, each on its own switches.
OBJECTIVES: dict[str, dict[str, Any]] = {
    "ppo-behaviour": {},
    "seq-mean": {"loss_agg": "seq-mean-token-mean"},
    "recompute-tis-2-minibatches": {"prox_mode": "recompute", "tis_cap": 2.0, "minibatches": 2},
    "loglinear-2-minibatches": {"prox_mode": "loglinear", "minibatches": 2},
    "token-rejection-masked-truncation": {
        "rejection": "token",
        "rejection_low": 0.8,
        "rejection_high": 1.25,
        "mask_truncated": True,
    },
    "sequence-rejection-seq-mean": {
        "rejection": "sequence",
        "rejection_low": 0.8,
        "rejection_high": 1.25,
        "loss_agg": "seq-mean-token-mean",
    },
    "entropy-bonus-clipped": {"entropy_coef": 0.01, "grad_clip": 0.05},
    "dr-grpo-clip-higher-micro-batches": {
        "adv_scale_by_std": False,
        "clip_eps_high": 0.28,
        "micro_batch_tokens": 40,
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_default_model(tmp_path_factory.mktemp("parallel-model"), seed=0)


def same_weights(expected: Any, got: Any, what: str = "") -> None:
    assert set(got) == set(expected)
    worst = max(float((got[k] - v).abs().max()) for k, v in expected.items())
    assert worst <= 1e-5, (what, worst)


def config(parallel: str, **switches: Any) -> TrainConfig:
    # AdamW divides each gradient by its own running scale, so float rounding in a near-zero
    # gradient moves that weight by a fraction of the learning rate: 1e-4 keeps it below 1e-5
    # (the gradients themselves are compared through the loss and the gradient norm).
    return TrainConfig(lr=1e-4, num_threads=1, parallel=parallel, world_size=2, **switches)  # type: ignore[arg-type]


def test_two_ranks_take_one_trainers_step_for_every_objective(model_dir: Path) -> None:
    import multiprocessing

    from stalebound.train.parallel.launch import free_port

    cases = [
        (f"{parallel}/{name}", config(parallel, **switches))
        for parallel in ("fsdp", "ddp")
        for name, switches in OBJECTIVES.items()
    ]
    base = load_model(model_dir)
    batches = [make_batch(base, groups=4, size=3, seed=s, shift=0.3) for s in range(2)]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    master = f"127.0.0.1:{free_port()}"
    ranks = [
        context.Process(
            target=objectives_rank, args=(r, master, str(model_dir), cases, batches, out)
        )
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    try:
        for name, cfg in cases:
            got_name, got_stats, got_weights = out.get(timeout=240)
            assert got_name == name
            alone = Trainer(load_model(model_dir), None, cfg, pad_token_id=PAD)
            for i, (batch, got) in enumerate(zip(batches, got_stats, strict=True)):
                same_step(alone.step(batch, batch_version=i + 1), got)
            got_tensors = {k: torch.from_numpy(v) for k, v in got_weights.items()}
            same_weights(alone.state_dict_for_engines(), got_tensors, name)
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]


def test_a_checkpoint_resumes_at_another_world_size_both_ways(
    model_dir: Path, tmp_path: Path
) -> None:
    """One trainer's checkpoint → two FSDP ranks (1 → 2); their sharded checkpoint → one trainer
    (2 → 1); each continues as a trainer that never stopped."""
    from stalebound.train.parallel.checkpoint import has_sharded_optimizer
    from stalebound.train.parallel.driver import ShardedTrainer
    from stalebound.train.parallel.launch import ProcessRanks
    from stalebound.train.parallel.rank import RankSpec

    cfg = config("fsdp", prox_mode="loglinear", minibatches=2)
    batches = [
        make_batch(load_model(model_dir), groups=4, size=3, seed=s, shift=0.3) for s in range(3)
    ]
    reference = Trainer(load_model(model_dir), None, cfg, pad_token_id=PAD)
    expected = [reference.step(b, batch_version=i + 1) for i, b in enumerate(batches)]

    # step 1 alone, then its checkpoint: the policy and the whole optimizer state
    alone = Trainer(load_model(model_dir), None, cfg, pad_token_id=PAD)
    alone.step(batches[0], batch_version=1)
    one = tmp_path / "written-by-one"
    alone.model.save_pretrained(one)
    state = alone.optimizer_state()

    ranks = ShardedTrainer(
        ProcessRanks(RankSpec(str(one), cfg, PAD, 1, 2), ["cpu", "cpu"]), cfg, version=1
    )
    try:
        ranks.load_optimizer(one, state)  # 1 → 2
        same_step(expected[1], ranks.step(batches[1], batch_version=2))
        two = tmp_path / "written-by-two"
        model = load_model(model_dir)
        model.load_state_dict(dict(ranks.state_dict_for_engines()))
        model.save_pretrained(two)
        ranks.save_optimizer(two)
    finally:
        ranks.close()
    assert has_sharded_optimizer(two)

    again = Trainer(load_model(two), None, cfg, pad_token_id=PAD, version=2)
    again.load_optimizer(two, None)  # 2 → 1
    same_step(expected[2], again.step(batches[2], batch_version=3))
    same_weights(reference.state_dict_for_engines(), again.state_dict_for_engines())


def test_rank_settings_are_checked_with_the_fix() -> None:
    from stalebound.train.parallel.settings import parallel_problems

    overrides = ["train.parallel=fsdp", "train.world_size=3", "rollout.consumer_batch_size=8"]
    assert parallel_problems(load_config(overrides=overrides)) == [
        "train.world_size=3: rollout.consumer_batch_size=8 groups per step do not split evenly "
        "across 3 ranks; use a world size that divides 8, or a consumer_batch_size that is a "
        "multiple of 3"
    ]
    with pytest.raises(ConfigError, match=r"FSDP keeps its reductions in float32 .*=bfloat16"):
        load_config(overrides=["train.parallel=fsdp", "train.dtype=float16"])
    with pytest.raises(ConfigError, match=r"train.parallel=zero: must be one of ddp, fsdp"):
        load_config(overrides=["train.parallel=zero"])
    # the Ray backend's own spelling of the ranks' count still works
    assert load_config(overrides=["ray.train_data_parallel_size=2"]).train.world_size == 2
    # on Ray a rank's device is the GPU Ray gives its actor, or the CPU
    on_gpu = load_config(overrides=["backend=ray", "train.parallel=fsdp"])
    on_gpu.train.device = "cuda"  # (the loader refuses it first on a machine without a GPU)
    assert parallel_problems(on_gpu) == [
        "train.device=cuda: with backend=ray a rank trains on the GPU Ray gives its actor, and "
        "ray.trainer_num_gpus=0 gives none; set ray.trainer_num_gpus=1 (a GPU per rank), or "
        "train.device=auto"
    ]
    assert parallel_problems(
        load_config(overrides=["backend=ray", "train.device=cpu", "ray.trainer_num_gpus=1"])
    ) == [
        "ray.trainer_num_gpus=1.0: each rank would hold a GPU and train on the CPU "
        "(train.device=cpu); set ray.trainer_num_gpus=0, or train.device=auto"
    ]
    assert parallel_problems(load_config(overrides=["backend=ray", "train.parallel=fsdp"])) == []


def test_stalebound_train_refuses_uneven_ranks_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.cli import main

    run = tmp_path / "r"
    args = ["train", "train.world_size=3", f"run.run_dir={run}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "train.world_size=3: rollout.consumer_batch_size=32 groups per step" in err, err
    assert "Traceback" not in err and not run.exists()


@pytest.mark.slow
def test_stalebound_train_with_two_fsdp_ranks_learns_within_the_bound(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import json

    from stalebound.cli import main
    from stalebound.train.ledger import audit_run
    from stalebound.train.parallel.checkpoint import has_sharded_optimizer

    run = tmp_path_factory.mktemp("fsdp-run") / "r"
    code = main(
        [
            "train",
            "train.parallel=fsdp",
            "train.world_size=2",
            "run.steps=30",
            f"run.run_dir={run}",
            "run.live=false",
            "run.eval_prompts=200",
            "run.plots=false",
            f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        ]
    )
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["violations"] == 0 and summary["max_staleness"] <= summary["staleness"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # learning: the sampled reward of the last ten steps (2,560 trajectories) above the first
    # ten's, and greedy accuracy on 200 held-out prompts up by 0.05 or more. The sampled reward
    # alone rises by about 0.05 in 30 steps (once 0.049), too close to any fixed margin.
    first, last = (
        sum(r["reward_mean"] for r in part) / 10 for part in (records[:10], records[-10:])
    )
    assert last >= first + 0.02, (first, last, summary)
    assert summary["eval_after"] >= summary["eval_before"] + 0.05, summary
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(r["num_groups"] == 32 for r in records)  # the whole batch, across both ranks
    assert has_sharded_optimizer(run / "checkpoints" / "step-000030")
    assert audit_run(run).ok

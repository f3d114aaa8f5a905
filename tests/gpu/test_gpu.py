"""The GPU tier: training and serving on a CUDA device (skipped without one; see conftest.py).

Figures these tests print are recorded in docs/models.md with the machine they were measured on.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from stalebound.cli import main


def test_end_to_end_on_cuda_learns_and_holds_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "train.device=cuda",
            "engine.device=cuda",
            "run.steps=40",
            "run.live=false",
            "run.eval_prompts=60",
            f"run.run_dir={run_dir}",
            f"engine.cache_dir={tmp_path / 'models'}",
        ]
    )
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    # the recipe's hard bound (the deadline policy's η_h = 4)
    assert summary["staleness"] == 4 and summary["violations"] == 0
    assert summary["max_staleness"] <= summary["staleness"]
    assert summary["reward_last"] > summary["reward_first"] + 0.05, summary
    with capsys.disabled():
        print(f"\nCUDA end to end: {json.dumps(summary)}")


def test_weights_reach_an_engine_on_the_same_gpu_without_the_cpu(qwen2_dir: Path) -> None:
    import torch

    from stalebound.engines import GenerateRequest, LocalEngine, SamplingParams
    from stalebound.engines.models import load_model

    model = load_model(qwen2_dir, device="cuda")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])  # greedy → id 0, a stop

    async def scenario() -> None:
        async with LocalEngine(qwen2_dir, device="cuda") as engine:
            await engine.update_weights(state, 1)
            stats = engine.statistics()
            assert stats.weight_updates_on_device == 1 and stats.version == 1
            greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
            response = await engine.agenerate(GenerateRequest("r", (1, 5, 6), greedy))
            assert response.output_ids == (0,) and response.output_versions == (1,)

    asyncio.run(scenario())


def test_bfloat16_matches_float32_losses_on_a_fixed_batch(qwen2_dir: Path) -> None:
    from byom_checks import fixed_batch_losses

    fp32, bf16 = fixed_batch_losses(qwen2_dir, "cuda")
    assert bf16 == pytest.approx(fp32, rel=0.02)


def test_continuous_batching_against_batched_generate_on_the_gpu(
    qwen2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine_vs_generate import compare

    result = asyncio.run(compare(qwen2_dir, device="cuda", requests=64, tokens=64, repeats=3))
    with capsys.disabled():
        print(f"\nengine vs batched generate on the GPU: {json.dumps(result)}")
    assert result["engine_tokens_per_s"] > 0 and result["generate_tokens_per_s"] > 0
    # a gross-regression guard only (speed targets live in bench/): continuous batching should
    # not fall far behind one static batch of the same requests
    assert result["ratio"] > 0.25, result


def test_fsdp_on_one_gpu_in_bfloat16_trains_and_publishes_to_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "train.parallel=fsdp",
            "train.world_size=1",
            "train.device=cuda",
            "train.dtype=bfloat16",
            "engine.device=cuda",
            "run.steps=20",
            "run.live=false",
            "run.eval_prompts=60",
            f"run.run_dir={run_dir}",
            f"engine.cache_dir={tmp_path / 'models'}",
        ]
    )
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["violations"] == 0 and summary["steps"] == 20
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every step's weights reached the engine: the versions it sampled with kept up
    assert records[-1]["staleness_max"] <= summary["staleness"]
    assert (run_dir / "checkpoints" / "step-000020" / "optimizer" / ".metadata").is_file()
    with capsys.disabled():
        print(f"\nFSDP bfloat16 on one GPU: {json.dumps(summary)}")


def test_ray_rank_actor_holding_a_gpu_trains_fsdp_in_bfloat16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray", reason="the Ray extra is not installed (make test-gpu installs it)")
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "backend=ray",
            "train.parallel=fsdp",
            "train.world_size=1",
            "ray.trainer_num_gpus=1",
            "ray.engine_num_cpus=0.5",
            "ray.trainer_num_cpus=0.5",
            "train.dtype=bfloat16",
            "run.steps=10",
            "run.live=false",
            "run.eval_prompts=60",
            f"run.run_dir={run_dir}",
            f"engine.cache_dir={tmp_path / 'models'}",
        ]
    )
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["violations"] == 0 and summary["steps"] == 10
    assert (run_dir / "checkpoints" / "step-000010" / "optimizer" / ".metadata").is_file()
    with capsys.disabled():
        print(f"\nFSDP bfloat16 in a Ray rank actor on a GPU: {json.dumps(summary)}")

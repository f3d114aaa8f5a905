"""Trainer ranks as Ray actors (torch.distributed, DDP or FSDP2) against one trainer on the same batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

torch = pytest.importorskip("torch")
pytest.importorskip("ray")

from parallel_helpers import PAD, make_batch, same_step  # noqa: E402
from stalebound.engines.models import load_model  # noqa: E402
from stalebound.train import TrainConfig, Trainer  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("parallel", "overrides"),
    [
        ("ddp", {}),
        (
            "ddp",
            {
                "rejection": "token",
                "rejection_low": 0.8,
                "rejection_high": 1.25,
                "mask_truncated": True,
            },
        ),
        ("fsdp", {"loss_agg": "seq-mean-token-mean", "prox_mode": "loglinear", "grad_clip": 0.05}),
        ("fsdp", {"prox_mode": "recompute", "tis_cap": 2.0, "minibatches": 2}),
    ],
    ids=["ddp-default", "ddp-token-rejection", "fsdp-seq-mean-loglinear-clip", "fsdp-recompute"],
)
def test_two_rank_actors_match_the_local_trainer(
    ray_instance: Any, model_dir: Path, parallel: str, overrides: dict[str, Any]
) -> None:
    """Two rank actors (torch.distributed over gloo, DDP or FSDP2) take one trainer's step."""
    from stalebound.distributed import PublishedWeights, RayTrainerGroup

    # AdamW divides each gradient by its own running scale, so float rounding in a near-zero
    # gradient moves that weight by a fraction of the learning rate: 1e-4 keeps it below 1e-5
    # (the gradients themselves are compared through the loss and the gradient norm).
    config = TrainConfig(lr=1e-4, num_threads=1, parallel=parallel, world_size=2, **overrides)  # type: ignore[arg-type]
    local = Trainer(load_model(model_dir), None, config, pad_token_id=PAD)
    batches = [make_batch(local.model, groups=4, size=3, seed=s, shift=0.3) for s in range(2)]
    group = RayTrainerGroup(str(model_dir), config, world_size=2, pad_token_id=PAD, num_cpus=0.25)
    published: list[tuple[Any, int]] = []
    group.publish(lambda weights, version: published.append((weights, version)))
    try:
        for i, batch in enumerate(batches):
            expected = local.step(batch, batch_version=i + 1)
            got = group.step(batch, batch_version=i + 1)
            same_step(expected, got)
            assert group.version == local.version == i + 1
        weights = group.state_dict_for_engines()
        assert isinstance(weights, PublishedWeights)  # an object-store reference, not a copy
        assert [v for _, v in published] == [1, 2] and published[-1][0] is weights
        expected_weights = local.state_dict_for_engines()
        assert set(weights) == set(expected_weights)
        worst = max(float((weights[k] - v).abs().max()) for k, v in expected_weights.items())
        assert worst <= 1e-5, worst
    finally:
        group.close()


def test_a_dead_rank_stops_the_group_naming_it(ray_instance: Any, model_dir: Path) -> None:
    from stalebound.distributed import RayTrainerGroup, TrainerRankError

    group = RayTrainerGroup(
        str(model_dir), TrainConfig(num_threads=1), world_size=2, pad_token_id=PAD, num_cpus=0.25
    )
    batch = make_batch(load_model(model_dir), groups=2, size=2, seed=7, shift=0.0)
    try:
        ray_instance.kill(group.actors[1])
        with pytest.raises(TrainerRankError, match=r"trainer rank 1 failed: .*Actor") as info:
            group.step(batch)
        assert info.value.rank == 1
        with pytest.raises(TrainerRankError, match="stopped"):
            group.step(batch)
    finally:
        group.close()


def test_a_batch_smaller_than_the_ranks_is_a_config_error() -> None:
    from stalebound.core.errors import ConfigError
    from stalebound.distributed import split_groups

    assert split_groups([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    with pytest.raises(ConfigError, match=r"train\.world_size=3: a batch of 2 groups"):
        split_groups([1, 2], 3)

"""Data-parallel trainer ranks as Ray actors against the single-process trainer on the same batch."""

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
    "overrides",
    [
        {},
        {
            "rejection": "token",
            "rejection_low": 0.8,
            "rejection_high": 1.25,
            "mask_truncated": True,
        },
        {"loss_agg": "seq-mean-token-mean", "prox_mode": "loglinear", "grad_clip": 0.05},
    ],
    ids=["default", "token-rejection", "seq-mean-loglinear-clip"],
)
def test_two_ranks_match_the_local_trainer(
    ray_instance: Any, model_dir: Path, overrides: dict[str, Any]
) -> None:
    from stalebound.distributed import PublishedWeights, RayTrainerGroup

    config = TrainConfig(lr=1e-2, num_threads=1, **overrides)
    local = Trainer(load_model(model_dir), None, config, pad_token_id=PAD)
    batches = [make_batch(local.model, groups=4, size=3, seed=s, shift=0.3) for s in range(2)]
    group = RayTrainerGroup(str(model_dir), config, world_size=2, pad_token_id=PAD, num_cpus=0.25)
    published: list[tuple[Any, int]] = []
    group.publish(lambda weights, version: published.append((weights, version)))
    try:
        for i, batch in enumerate(batches):
            expected = local.step(batch, batch_version=i + 1)
            got = group.step(batch, batch_version=i + 1)
            same_step(expected, got, rel=1e-4)
            assert group.version == local.version == i + 1
        weights = group.state_dict_for_engines()
        assert isinstance(weights, PublishedWeights)
        assert [v for _, v in published] == [1, 2] and published[-1][0] is weights
        # Adam divides each gradient by its running scale, so float rounding in a near-zero
        # gradient can move that one weight by a few percent of a step (lr); every other weight
        # agrees to float precision. The gradient itself is compared above (grad_norm, loss).
        moved, total = 0.0, 0
        for name, value in local.state_dict_for_engines().items():
            diff = (weights[name] - value).abs()
            assert float(diff.max()) <= 0.05 * config.lr, name
            moved += float(diff.sum())
            total += diff.numel()
        assert moved / total <= 1e-4 * config.lr
    finally:
        group.close()


def test_a_dead_rank_stops_the_group_naming_it(ray_instance: Any, model_dir: Path) -> None:
    from stalebound.distributed import RayTrainerGroup, TrainerRankError

    group = RayTrainerGroup(
        str(model_dir), TrainConfig(num_threads=1), world_size=2, pad_token_id=PAD, num_cpus=0.25
    )
    batch = make_batch(load_model(model_dir), groups=2, size=2, seed=7, shift=0.0)
    try:
        ray_instance.kill(group.ranks[1])
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

"""Batches for comparing trainer ranks with one trainer, and the body of a test rank process."""

from __future__ import annotations

import random
from typing import Any

PAD, BOS, EOS = 0, 1, 2


def make_batch(model: Any, *, groups: int, size: int, seed: int, shift: float) -> list[list[Any]]:
    """Groups of random answers whose behaviour log-probs are the model's own (plus noise, so
    ratios differ from 1), rewarded unevenly within each group; some truncated, one stale."""
    import torch

    from stalebound.tasks import Trajectory
    from stalebound.train.trainer import token_logprobs

    rng = random.Random(seed)
    batch = []
    for g in range(groups):
        prompt = [BOS, *(rng.randrange(4, 60) for _ in range(rng.randrange(2, 6)))]
        members = []
        for m in range(size):
            out = [rng.randrange(4, 60) for _ in range(rng.randrange(2, 9))] + [EOS]
            full = torch.tensor([prompt + out])
            with torch.no_grad():
                lp, _ = token_logprobs(model, full, torch.ones_like(full), with_entropy=False)
            behav = [x + shift * rng.uniform(-1, 1) for x in lp[0, len(prompt) - 1 :].tolist()]
            members.append(
                Trajectory(
                    prompt_ids=prompt,
                    output_ids=out,
                    behaviour_logprobs=behav,
                    versions=[0 if g else 1] * len(out),
                    reward=float((g + m) % 2) + 0.25 * m,
                    truncated=(g + m) % 5 == 4,
                    metrics={"acc": float((g + m) % 2)},
                )
            )
        batch.append(members)
    return batch


def same_step(expected: Any, got: Any, rel: float = 1e-5) -> None:
    """Two steps' statistics agree (NaN where the other is NaN), the step's times aside."""
    import math

    import pytest

    for key, x in expected.as_dict().items():
        y = got.as_dict()[key]
        if key in ("step_time_s", "step_cpu_s"):
            continue
        if math.isnan(x):
            assert math.isnan(y), key
        else:
            assert y == pytest.approx(x, rel=rel, abs=1e-5), key


def shard_of(batch: list[list[Any]], rank: int, world_size: int) -> tuple[list[list[Any]], Any]:
    """Rank ``rank``'s groups of ``batch`` and where its rows sit, as the driver splits them."""
    from stalebound.train.parallel.driver import split_groups
    from stalebound.train.trainer import RowSpan

    shards = split_groups(batch, world_size)
    start = sum(len(g) for shard in shards[:rank] for g in shard)
    return shards[rank], RowSpan(start, sum(len(g) for g in batch))


def objectives_rank(
    rank: int, master: str, model_path: str, cases: list[Any], batches: Any, out: Any
) -> None:
    """One rank of a 2-rank gloo group: for each ``(name, TrainConfig)`` case, build the rank's
    share of the model as a launched rank does and train on its shard of every batch; rank 0
    puts ``(name, [stats...], full weights)`` on ``out``."""
    import torch

    from stalebound.train.parallel.rank import RankSpec, TrainerRank

    torch.set_num_threads(1)
    body = None
    for name, config in cases:
        fresh = TrainerRank(rank, RankSpec(model_path, config, PAD, 0, 2), "cpu")
        if body is None:
            fresh.join(master)
        else:
            fresh._build()  # the group is joined already
        body = fresh
        stats = []
        weights = None
        for i, batch in enumerate(batches):
            shard, rows = shard_of(batch, rank, 2)
            step, weights = body.step(shard, i + 1, rows, True)
            stats.append(step)
        if rank == 0:
            # as arrays: shared tensors would need this process alive until they are read
            out.put((name, stats, {k: v.numpy().copy() for k, v in weights.items()}))
    if body is not None:
        body.close()

"""Trainer ranks on torch.distributed: FSDP2 or DDP, launched as local processes or Ray actors.

``import stalebound.train.parallel`` loads no torch; the names below load their modules on first
use. See docs/scale-out.md.
"""

from __future__ import annotations

from stalebound._lazy import lazy_attributes

__all__ = [
    "ProcessRanks",
    "RankContext",
    "RankSpec",
    "ShardedTrainer",
    "TrainerRank",
    "TrainerRankError",
    "parallelize",
    "split_groups",
]

_LAZY = {
    "ProcessRanks": "launch",
    "RankContext": "context",
    "parallelize": "context",
    "RankSpec": "rank",
    "TrainerRank": "rank",
    "ShardedTrainer": "driver",
    "TrainerRankError": "driver",
    "split_groups": "driver",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

"""Training: GRPO losses with off-policy corrections, the built-in trainer and warm start.

``import stalebound.train`` loads only the pure :class:`TrainConfig`; the torch parts load on first
use of their names (``Trainer``, ``policy_loss``, ``warm_start``, ...).
"""

from __future__ import annotations

import importlib
from typing import Any

from stalebound.train.config import TrainConfig

__all__ = [
    "LocalGenerateFn",
    "PolicyLossStats",
    "StepStats",
    "TrainConfig",
    "Trainer",
    "WarmStartStats",
    "evaluate",
    "generate_batch",
    "group_advantages",
    "loglinear_proximal_logprobs",
    "policy_loss",
    "rejection_mask",
    "rollout_groups",
    "warm_start",
]

_LAZY = {
    "PolicyLossStats": "losses",
    "group_advantages": "losses",
    "loglinear_proximal_logprobs": "losses",
    "policy_loss": "losses",
    "rejection_mask": "losses",
    "StepStats": "trainer",
    "Trainer": "trainer",
    "WarmStartStats": "warmstart",
    "warm_start": "warmstart",
    "LocalGenerateFn": "rollout",
    "evaluate": "rollout",
    "generate_batch": "rollout",
    "rollout_groups": "rollout",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"stalebound.train.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'stalebound.train' has no attribute {name!r}")

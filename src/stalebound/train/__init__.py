"""Training: GRPO losses with off-policy corrections, the built-in trainer and warm start.

``import stalebound.train`` loads only the pure :class:`TrainConfig`; the torch parts load on first
use of their names (``Trainer``, ``policy_loss``, ``warm_start``, ...).
"""

from __future__ import annotations

from stalebound._lazy import lazy_attributes
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


__getattr__ = lazy_attributes(__name__, _LAZY)

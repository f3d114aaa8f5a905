"""Reward functions: the interface (``reward(prompt, completion, **columns)``), the built-in
verifiers, and the runner that turns every failure into a counted outcome."""

from stalebound.rewards.builtin import (
    exact_match,
    extract_answer,
    numeric_match,
    parse_number,
    regex_match,
)
from stalebound.rewards.runner import (
    BUILTIN_REWARDS,
    FAILURES,
    RewardFunction,
    RewardOutcome,
    load_reward,
    outcome_of,
)

__all__ = [
    "BUILTIN_REWARDS",
    "FAILURES",
    "RewardFunction",
    "RewardOutcome",
    "exact_match",
    "extract_answer",
    "load_reward",
    "numeric_match",
    "outcome_of",
    "parse_number",
    "regex_match",
]

"""Waits drawn from heavy-tailed latency distributions: tool calls and the reward service.

Pure Python (no torch). :func:`sample_latency` draws one wait from a :class:`LatencyConfig`;
:func:`latency_problems` lists what is wrong with one, naming the config key.
"""

from __future__ import annotations

import math
import random
from typing import get_args

from stalebound.core.errors import ConfigError
from stalebound.tasks.config import LatencyConfig, LatencyLaw

__all__ = ["latency_problems", "sample_latency"]

DISTRIBUTIONS: tuple[str, ...] = get_args(LatencyLaw)


def sample_latency(config: LatencyConfig, rng: random.Random) -> float:
    """One latency in seconds, drawn from ``config`` (see :class:`LatencyConfig`)."""
    if config.distribution == "none":
        return 0.0
    if config.distribution == "constant":
        x = config.median_s
    elif config.distribution == "lognormal":
        x = config.median_s * math.exp(config.sigma * rng.gauss(0.0, 1.0))
    elif config.distribution == "pareto":
        # Pareto with scale x_m has median x_m · 2^(1/alpha); choose x_m so the median is median_s.
        x_m = config.median_s * 2.0 ** (-1.0 / config.alpha)
        x = x_m * (1.0 - rng.random()) ** (-1.0 / config.alpha)
    else:
        raise ConfigError(latency_problems(config, "latency"))
    return min(x, config.cap_s)


def latency_problems(c: LatencyConfig, key: str) -> list[str]:
    """What is wrong with ``c``, each problem naming ``key`` (e.g. ``task.reward_latency``)."""
    problems = []
    if c.distribution not in DISTRIBUTIONS:
        problems.append(
            f"{key}.distribution={c.distribution!r}: use one of {', '.join(DISTRIBUTIONS)}"
        )
    if not (0 <= c.median_s < math.inf and 0 <= c.cap_s < math.inf):
        problems.append(
            f"{key}.median_s={c.median_s}, cap_s={c.cap_s}: must be finite numbers >= 0 (seconds)"
        )
    if not 0 <= c.sigma < math.inf:
        problems.append(f"{key}.sigma={c.sigma}: must be a finite number >= 0")
    if not 0 < c.alpha < math.inf:
        problems.append(f"{key}.alpha={c.alpha}: must be a finite number > 0 (1.5 is typical)")
    return problems

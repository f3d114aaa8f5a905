"""Task settings: pure dataclasses (no torch), one docstring per field.

``TaskConfig`` selects a registered task and its data; the sub-sections hold the settings of the
built-in tasks (a task ignores the sections of the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from stalebound.typedconfig import bounds

__all__ = [
    "ArithmeticConfig",
    "CalculatorConfig",
    "LatencyConfig",
    "LatencyLaw",
    "RewardLatencyConfig",
    "StringsConfig",
    "TaskConfig",
]


LatencyLaw: TypeAlias = Literal["none", "constant", "lognormal", "pareto"]
"""The latency distributions a :class:`LatencyConfig` can name."""


@dataclass
class LatencyConfig:
    """How long one tool call takes: a heavy-tailed distribution, capped.

    ``lognormal``: ``median_s · exp(sigma · Z)``, Z standard normal. ``pareto``: ``median_s ·
    2^(-1/alpha) · U^(-1/alpha)`` (a Pareto law whose median is ``median_s``; smaller ``alpha``,
    heavier tail). ``constant``: always ``median_s``. ``none``: no wait. Every draw is capped at
    ``cap_s``. Draws are seeded from the task seed and the sample id, so a replayed run waits the
    same.
    """

    distribution: LatencyLaw = "lognormal"
    """The shape of the latency distribution."""
    median_s: float = 0.05
    """The median latency in seconds (the scale of the distribution)."""
    sigma: float = 1.0
    """``lognormal`` only: the standard deviation of the log latency (1.0 gives a p99 about 10×
    the median)."""
    alpha: float = 1.5
    """``pareto`` only: the tail index (> 0); below 2 the variance is infinite."""
    cap_s: float = 2.0
    """No call waits longer than this (seconds); keeps a run's worst case bounded."""


@dataclass
class RewardLatencyConfig(LatencyConfig):
    """How long the reward takes to arrive, as when a sandbox runs the answer or a judge model
    grades it: each trajectory's episode waits this long (a real ``asyncio.sleep``) after its last
    model turn, before its reward counts. Off by default; the same laws as the tool latency."""

    distribution: LatencyLaw = "none"
    """The shape of the latency distribution (``none``: the reward is computed at once)."""


@dataclass
class ArithmeticConfig:
    """The ``arithmetic`` task: ``a+b=`` → the result. The default (one-digit operands, answers of
    one or two digits) is what a tiny model learns in a couple of minutes on two cores; raise
    ``max_digits`` for multi-digit arithmetic."""

    min_digits: int = 1
    """Fewest digits of an operand."""
    max_digits: int = 1
    """Most digits of an operand (answers vary in length with it)."""
    operators: str = "+"
    """Operators to draw from, any of ``+ - *`` (``-`` keeps results non-negative)."""


@dataclass
class StringsConfig:
    """The ``strings`` task: ``reverse abc?`` → ``cba`` (and the other operations)."""

    operations: tuple[str, ...] = ("reverse",)
    """Any of ``reverse``, ``sort`` (letters in alphabetical order), ``double`` (each letter
    twice), ``copy`` (the word unchanged)."""
    min_length: int = 1
    """Shortest word."""
    max_length: int = 6
    """Longest word (answers vary in length with it); at most 16, or 200 with ``lengths:
    lognormal``."""
    lengths: Literal["uniform", "lognormal"] = "uniform"
    """How word lengths are drawn: ``uniform`` over ``min_length`` … ``max_length``, or
    ``lognormal`` (``median_length · exp(sigma · Z)``, rounded and clipped to that range): a
    heavy tail of long answers among mostly short ones, the long tail of generation lengths."""
    median_length: float = field(default=2.0, metadata=bounds(gt=0, fix="e.g. 2 letters"))
    """``lognormal`` only: the median word length in letters."""
    sigma: float = field(default=1.4, metadata=bounds(gt=0, fix="e.g. 1.4"))
    """``lognormal`` only: the standard deviation of the log length (1.4 with a median of 2 gives
    a p99 answer about 17× the median answer, in tokens)."""


@dataclass
class CalculatorConfig:
    """The agentic ``calculator`` task: ``a*b+c?`` solved by calling a calculator tool.

    The model writes ``[x*y]`` and ends its turn; the tool answers ``=result;`` after a latency
    drawn from ``latency``; the model writes the final answer (no brackets) and ends its turn.
    """

    max_turns: int = 4
    """Model turns per episode; an episode still calling tools after this many is truncated."""
    max_operand: int = 99
    """Operands are drawn from 2 … ``max_operand``."""
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    """The tool's latency distribution."""


@dataclass
class TaskConfig:
    """Which task to train on and where its prompts come from."""

    name: str = "arithmetic"
    """A registered task (``stalebound.tasks.list_tasks()``): built in are ``arithmetic``,
    ``strings`` and ``calculator``."""
    data_path: str | None = None
    """A JSONL (or, with ``pyarrow`` installed, Parquet) file of samples with ``question`` and
    ``answer`` fields; ``"builtin"`` uses the file shipped for the task; ``None`` generates
    ``num_prompts`` samples from ``seed``."""
    num_prompts: int = field(default=2000, metadata=bounds(ge=1, fix="generate at least one"))
    """How many samples to generate when ``data_path`` is ``None``."""
    seed: int = 0
    """Seed of the generated samples and of the tool and reward latencies."""
    partial_credit: bool = False
    """Give a wrong answer partial reward (each task documents its rule); off means exact match
    1.0, anything else 0.0."""
    max_new_tokens: int = field(
        default=12,
        metadata=bounds(ge=1, fix="e.g. 12 (the default): a turn needs room for its end token"),
    )
    """Tokens the model may generate per turn (the end-of-turn token included); a turn that
    reaches it without ending is truncated."""
    reward: str = "exact"
    """With ``data.path``: the reward function, ``module:function`` or ``path/to/file.py:function``
    (called as ``reward(prompt, completion, **columns)``), or a built-in verifier: ``exact``,
    ``numeric`` (GSM8K's ``#### n`` and ``\\boxed{n}``), ``regex`` (the answer column is the
    pattern)."""
    reward_timeout_s: float | None = field(
        default=60.0, metadata=bounds(gt=0, fix="e.g. 60 seconds, or null to wait forever")
    )
    """A reward call that takes longer fails with cause ``reward:timeout`` (the run goes on)."""
    reward_workers: int = field(
        default=0, metadata=bounds(ge=0, fix="0 runs the reward in threads; N > 0 in N processes")
    )
    """Processes for CPU-heavy synchronous rewards (0: threads of the rollout process)."""
    reward_latency: RewardLatencyConfig = field(default_factory=RewardLatencyConfig)
    """How long each reward takes to arrive (a remote verifier's latency; off by default)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    strings: StringsConfig = field(default_factory=StringsConfig)
    calculator: CalculatorConfig = field(default_factory=CalculatorConfig)

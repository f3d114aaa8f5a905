"""Workload models: what each trajectory costs to generate.

A :class:`TrajectorySpec` is one trajectory's cost: the tokens of each decode segment (one per turn),
the tool latency after each segment but the last, and whether it fails at the end of its last
segment. A :class:`TrajectorySource` hands out specs by (prompt, attempt, member):

* :class:`SampledSource` draws them from the workload's distributions. Common random numbers: the
  first attempt of prompt k always gets the same N′ members, whatever the policy, because they are
  drawn from one stream in prompt order; relaunches and retries draw from a second stream.
  Lengths from an ``empirical`` file of groups (several values on a line) are drawn a line per
  prompt: its members take the line's values in turn, so a prompt's answers are long or short
  together, as a real run's are.
* :class:`stalebound.sim.replay.ReplaySource` reads them from a recorded trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

from stalebound.core.errors import ConfigError
from stalebound.sim.config import DistributionConfig, WorkloadConfig
from stalebound.userfiles import label, read_lines

__all__ = [
    "SampledSource",
    "Sampler",
    "TrajectorySource",
    "TrajectorySpec",
    "distribution_mean",
    "group_sampler",
    "make_sampler",
]

Z99 = 2.3263478740408408  # the standard normal's 99th percentile

Sampler = Callable[[random.Random], float]


class TrajectorySpec(NamedTuple):
    """One trajectory: decode ``segments`` (tokens) with ``tools[i]`` seconds after segment i.
    With ``reward_wait``, the last pause is the wait for the reward (followed by an empty
    segment): a truncation never cuts it.

    (A named tuple: the simulator makes one per trajectory, and tuples are the cheapest.)"""

    segments: tuple[int, ...]
    tools: tuple[float, ...] = ()
    failed: bool = False
    reward_wait: bool = False

    @property
    def tokens(self) -> int:
        return sum(self.segments)


class TrajectorySource(Protocol):
    """Hands out trajectory specs; deterministic for a given call sequence."""

    def spec(self, prompt: int, attempt: int, member: int) -> TrajectorySpec: ...


def _lognormal_params(d: DistributionConfig) -> tuple[float, float]:
    mu = math.log(d.median)
    return mu, (math.log(d.p99) - mu) / Z99


def _read_rows(d: DistributionConfig, base_dir: str, groups: bool) -> list[tuple[float, ...]]:
    """The file's lines, each as its values: one, or with ``groups`` (the lengths) one group's,
    separated by spaces."""
    path = Path(base_dir) / str(d.file)
    rows: list[tuple[float, ...]] = []
    lines = read_lines(path, label("file", d.file), fix=f"give a file of values ({path})")
    for number, line, _ in lines:
        row = []
        for text in line.split("#", 1)[0].split():
            try:
                x = float(text)
            except ValueError:
                raise ConfigError(
                    f"file={d.file!r} line {number}={text!r}: not a number; one value per line, "
                    "or one group's values separated by spaces"
                ) from None
            if not 0 < x < math.inf:
                raise ConfigError(
                    f"file={d.file!r} line {number}={x!r}: values must be finite and > 0; "
                    "positive numbers only"
                )
            row.append(x)
        if len(row) > 1 and not groups:
            raise ConfigError(
                f"file={d.file!r} line {number}={line.strip()!r}: several values on one line; "
                "one value per line (only lengths take one group's values a line)"
            )
        if row:
            rows.append(tuple(row))
    if not rows:
        raise ConfigError(f"file={d.file!r}: holds no values; one positive number per line")
    return rows


def _read_values(d: DistributionConfig, base_dir: str, groups: bool) -> list[float]:
    return [x for row in _read_rows(d, base_dir, groups) for x in row]


def group_sampler(
    d: DistributionConfig, base_dir: str = "."
) -> Callable[[random.Random], tuple[float, ...]] | None:
    """For an ``empirical`` file whose lines hold several values (each line one prompt's group):
    a function drawing one line, its values capped. ``None`` for any other distribution, and for
    a file of one value per line (each value is then drawn on its own, :func:`make_sampler`)."""
    if d.distribution != "empirical":
        return None
    rows = _read_rows(d, base_dir, groups=True)
    if all(len(row) == 1 for row in rows):
        return None
    cap = math.inf if d.cap is None else d.cap
    rows = [tuple(min(cap, x) for x in row) for row in rows]
    n = len(rows)
    return lambda rng: rows[int(rng.random() * n)]


def make_sampler(d: DistributionConfig, base_dir: str = ".", *, groups: bool = False) -> Sampler:
    """A function drawing one value of the distribution (capped) from a ``random.Random``. With
    ``groups`` (the lengths) an empirical file's lines may hold one group's values; they are
    drawn one by one here (:func:`group_sampler` draws them a line at a time)."""
    cap = math.inf if d.cap is None else d.cap
    if d.distribution == "lognormal":
        mu, sigma = _lognormal_params(d)
        exp = math.exp  # gauss() is the stdlib's fastest normal draw
        return lambda rng: min(cap, exp(rng.gauss(mu, sigma)))
    if d.distribution == "pareto":
        scale, alpha = d.minimum, d.alpha
        return lambda rng: min(cap, scale * rng.paretovariate(alpha))
    if d.distribution == "fixed":
        value = min(cap, d.value)
        return lambda rng: value
    values = [min(cap, x) for x in _read_values(d, base_dir, groups)]
    n = len(values)
    return lambda rng: values[int(rng.random() * n)]


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def distribution_mean(d: DistributionConfig, base_dir: str = ".", *, groups: bool = False) -> float:
    """The exact mean of the capped distribution (``inf`` for an uncapped Pareto with α ≤ 1);
    ``groups`` as for :func:`make_sampler`."""
    cap = math.inf if d.cap is None else d.cap
    if d.distribution == "lognormal":
        mu, sigma = _lognormal_params(d)
        full = math.exp(mu + sigma * sigma / 2)
        if math.isinf(cap):
            return full
        lc = math.log(cap)
        return full * _phi((lc - mu - sigma * sigma) / sigma) + cap * (1 - _phi((lc - mu) / sigma))
    if d.distribution == "pareto":
        m, a = d.minimum, d.alpha
        if cap <= m:
            return cap
        if math.isinf(cap):
            return math.inf if a <= 1 else a * m / (a - 1)
        if a == 1:
            return m + m * math.log(cap / m)
        return float(m + m**a * (cap ** (1 - a) - m ** (1 - a)) / (1 - a))
    if d.distribution == "fixed":
        return min(cap, d.value)
    values = [min(cap, x) for x in _read_values(d, base_dir, groups)]
    return sum(values) / len(values)


def split_turns(tokens: int, turns: int) -> list[int]:
    """``tokens`` split over at most ``turns`` segments as evenly as possible (each ≥ 1 token)."""
    turns = max(1, min(turns, tokens))
    q, r = divmod(tokens, turns)
    return [q + 1 if i < r else q for i in range(turns)]


class SampledSource:
    """Specs drawn from a workload's distributions, seeded (see the module docstring)."""

    def __init__(self, cfg: WorkloadConfig, seed: int, group_launch: int) -> None:
        self._length = make_sampler(cfg.lengths, cfg.base_dir, groups=True)
        self._groups = group_sampler(cfg.lengths, cfg.base_dir)
        self._rows: dict[int, tuple[float, ...]] = {}  # each prompt's group of lengths, if any
        self._tool = make_sampler(cfg.agent.tool_latency, cfg.base_dir)
        reward = cfg.agent.reward_latency
        self._reward = None if reward is None else make_sampler(reward, cfg.base_dir)
        self._turns = cfg.agent.turns
        self._fail_rate = cfg.failures.rate
        self._launch = group_launch
        self._first = random.Random(seed)
        self._extra = random.Random(seed * 7919 + 1)
        self._next_prompt = 0
        self._plain = self._fail_rate == 0 and self._turns == 1 and self._reward is None

    def spec(self, prompt: int, attempt: int, member: int) -> TrajectorySpec:
        first_draw = attempt == 0 and member < self._launch and prompt >= self._next_prompt
        rng = self._first if first_draw else self._extra
        if first_draw and member == self._launch - 1:
            self._next_prompt = prompt + 1
        if self._groups is None:
            tokens = round(self._length(rng))
        else:  # the prompt's group, drawn with its first member; the others take its next values
            row = self._rows.get(prompt)
            if row is None:
                row = self._rows[prompt] = self._groups(rng)
            tokens = round(row[(attempt * self._launch + member) % len(row)])
        if self._plain:  # no failures, one turn: the common case, kept short
            return TrajectorySpec((tokens if tokens > 1 else 1,), (), False)
        return self._draw(rng, max(1, tokens))

    def _draw(self, rng: random.Random, tokens: int) -> TrajectorySpec:
        failed = self._fail_rate > 0 and rng.random() < self._fail_rate
        if failed:
            tokens = max(1, math.ceil(tokens * rng.random()))
        segments = split_turns(tokens, self._turns) if self._turns > 1 else [tokens]
        tools = [self._tool(rng) for _ in range(len(segments) - 1)]
        reward = None if failed else self._reward
        if reward is not None:
            # the reward's wait: a tool-like pause, then an empty segment that ends at once
            tools.append(reward(rng))
            segments.append(0)
        return TrajectorySpec(tuple(segments), tuple(tools), failed, reward is not None)

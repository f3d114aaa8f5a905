"""What a simulation measures: the physical bound, the counters of a run and its result.

:func:`compute_bound` gives the workload's physical limit (:class:`Bound`); a :class:`Meter`
counts what a run does and measures it over the window after the warm-up steps; a
:class:`SimResult` is what one run reports (:meth:`SimResult.to_json` gives the documented keys).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from stalebound.core import BufferState
from stalebound.sim.config import WorkloadConfig
from stalebound.sim.engine_model import EngineModel
from stalebound.sim.trainer import TrainerModel
from stalebound.sim.workload import distribution_mean

__all__ = ["Bound", "Meter", "SimResult", "compute_bound"]


@dataclass(frozen=True)
class Bound:
    """The physical limit in trajectories per second: min(generation, training) capacity.

    ``generation`` = engine slots ÷ slot-seconds per usable trajectory, at full concurrency C per
    replica: ``R·C ÷ ((E[decode steps per attempt]·(a + b·C) + E[tool seconds per attempt]) ÷
    (1 − p))`` with p the failure rate (a failed attempt stops at a uniform point, E[tokens] =
    E[L]·(1 − p/2)). Each turn's first token comes with its prefill, whose cost the bound leaves
    out, so an attempt decodes at least E[tokens] − turns steps (the replica model,
    :mod:`stalebound.sim.engine`).
    ``training`` = ``B·N ÷ (step_time + per_token·B·N·E[L])``. Redundancy, drops and filters only
    lower what a policy achieves, never the bound.
    """

    generation: float
    training: float
    mean_length: float
    token_rate: float
    """Decode tokens per second of all replicas at full concurrency."""

    @property
    def value(self) -> float:
        return min(self.generation, self.training)


def compute_bound(
    cfg: WorkloadConfig,
    *,
    attempt_tokens: float | None = None,
    attempt_steps: float | None = None,
    attempt_tool: float | None = None,
    failure_rate: float | None = None,
) -> Bound:
    """The :class:`Bound` of a workload. A replayed trace supplies its own per-attempt means
    (tokens, decode steps, tool seconds) and failure rate in place of the workload's
    distributions."""
    e = cfg.engine
    batch = min(e.max_concurrency, e.max_batch or e.max_concurrency)
    step = e.step_base + e.step_per_seq * batch
    mean_l = distribution_mean(cfg.lengths, cfg.base_dir, groups=True)
    p = cfg.failures.rate if failure_rate is None else failure_rate
    if attempt_tokens is None:
        attempt_tokens = mean_l * (1 - p / 2)
    else:
        mean_l = attempt_tokens
    if attempt_tool is None:
        attempt_tool = 0.0
        if cfg.agent.turns > 1:
            tool_mean = distribution_mean(cfg.agent.tool_latency, cfg.base_dir)
            attempt_tool = (cfg.agent.turns - 1) * tool_mean
    if attempt_steps is None:  # a turn's tokens past its first, one a step
        attempt_steps = max(0.0, attempt_tokens - cfg.agent.turns)
    slots = e.replicas * batch
    per_success = (attempt_steps * step + attempt_tool) / (1 - p) if p < 1 else math.inf
    generation = slots / per_success if per_success > 0 else math.inf
    traj = cfg.batch.groups * cfg.batch.group_size
    training = traj / (cfg.trainer.step_time + cfg.trainer.per_token * traj * mean_l)
    return Bound(generation, training, mean_l, slots / step)


@dataclass
class SimResult:
    """What one run measured; :meth:`to_json` gives the documented keys."""

    policy: str
    staleness: int
    throughput: float
    bound: Bound
    trainer_util: float
    engine_util: float
    staleness_histogram: dict[int, int]
    violations: int
    wasted_fraction: float
    stuck_fraction: float | None
    blocked_fraction: float | None
    """Time the head buffer was STUCK while the trainer waited (buffer policies)."""
    truncated_fraction: float
    """Trained trajectories that were truncated by the proactive filter."""
    steps: int
    sim_time: float
    window: float
    events: int
    counts: dict[str, int]
    tokens: dict[str, float]
    timeline: list[tuple[float, str]] = field(default_factory=list)
    engine_idle: float = 0.0
    """Fraction of the window the replicas had no sequence (decoding or waiting), averaged."""
    trainer_waits: list[float] = field(default_factory=list)
    """Each measured step's wait: from the trainer asking for the batch (the end of the step
    before) to its training starting (hand-over included), as ``wait_s`` in a real run's
    metrics."""
    target: int | None = None
    """The soft admission target η_s of the ``deadline`` kinds (``staleness`` is the hard bound
    η_h); ``None`` for the others, which admit at the bound itself."""

    @property
    def admission(self) -> int:
        """η_s: the staleness admission aims at (the target, else the bound itself)."""
        return self.staleness if self.target is None else self.target

    @property
    def efficiency(self) -> float:
        return self.throughput / self.bound.value if self.bound.value > 0 else 0.0

    @property
    def staleness_mean(self) -> float:
        n = sum(self.staleness_histogram.values())
        return sum(k * c for k, c in self.staleness_histogram.items()) / n if n else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness_histogram, default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "staleness": self.staleness,
            "target": self.admission,
            "throughput": self.throughput,
            "bound": self.bound.value,
            "efficiency": self.efficiency,
            "trainer_util": self.trainer_util,
            "engine_util": self.engine_util,
            "engine_idle": self.engine_idle,
            "staleness_mean": self.staleness_mean,
            "staleness_max": self.staleness_max,
            "violations": self.violations,
            "wasted_fraction": self.wasted_fraction,
            "stuck_fraction": self.stuck_fraction,
            "blocked_fraction": self.blocked_fraction,
            "truncated_fraction": self.truncated_fraction,
            "bound_generation": self.bound.generation,
            "bound_training": self.bound.training,
            "steps": self.steps,
            "sim_time": self.sim_time,
            "events": self.events,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            "counts": dict(self.counts),
        }


class Meter:
    """What a run counts and measures: every member's fate (``counts``), tokens by fate, the
    staleness histogram of what was trained, the head buffer's STUCK and blocked time (buffer
    policies, with its state over time when ``record_timeline``), and the counters at the start
    of the measuring window (:meth:`open_window`), from which :meth:`result` reports."""

    def __init__(self, buffered: bool, record_timeline: bool) -> None:
        self.counts: Counter[str] = Counter()
        self.tokens: dict[str, float] = {
            "generated": 0.0,
            "wasted": 0.0,
            "trained": 0.0,
            "truncated": 0.0,  # trained tokens of truncated trajectories
        }
        self.histogram: Counter[int] = Counter()
        self.continued: Counter[int] = Counter()
        """The trained trajectories of :attr:`histogram` whose group the deadline action
        ``continue`` let run past its deadline (their too-old tokens masked: not violations)."""
        # the head buffer's state over time (buffer policies)
        self._head = BufferState.PENDING
        self._head_since = 0.0
        self._stuck = 0.0
        self._blocked = False
        self._blocked_since = 0.0
        self._blocked_time = 0.0
        self.record_timeline = record_timeline
        self.timeline: list[tuple[float, str]] = (
            [(0.0, BufferState.PENDING.name)] if record_timeline and buffered else []
        )
        self._mark: dict[str, float] = {}

    def track_head(self, state: BufferState, trainer_idle: bool, now: float) -> None:
        """The head buffer is in ``state`` at ``now``; it blocks while STUCK with the trainer
        idle."""
        blocked = state is BufferState.STUCK and trainer_idle
        if blocked is not self._blocked:
            if self._blocked:
                self._blocked_time += now - self._blocked_since
            self._blocked = blocked
            self._blocked_since = now
        if state is not self._head:
            if self._head is BufferState.STUCK:
                self._stuck += now - self._head_since
            self._head = state
            self._head_since = now
            if self.record_timeline:
                self.timeline.append((now, state.name))

    def _stuck_until(self, now: float) -> float:
        if self._head is BufferState.STUCK:
            return self._stuck + now - self._head_since
        return self._stuck

    def _blocked_until(self, now: float) -> float:
        if self._blocked:
            return self._blocked_time + now - self._blocked_since
        return self._blocked_time

    def open_window(self, now: float, trainer: TrainerModel, engines: EngineModel) -> None:
        """The measuring window starts at ``now`` (replacing an earlier start)."""
        self._mark = {
            "time": now,
            "trained": float(self.counts["trained"]),
            "busy": trainer.busy_until(now),
            "tokens": engines.generated(now),
            "engine_busy": engines.busy(now),
            "stuck": self._stuck_until(now),
            "blocked": self._blocked_until(now),
            "truncated": float(self.counts["truncated_trained"]),
        }

    def result(
        self,
        now: float,
        trainer: TrainerModel,
        engines: EngineModel,
        *,
        bound: Bound,
        buffered: bool,
        counts: dict[str, int],
        hard: int,
        warmup: int,
        **run: Any,
    ) -> SimResult:
        """The :class:`SimResult` over the window: ``counts`` are the run's counts with the
        coordinator's and the conservation's added, ``hard`` the bound violations are counted
        against, ``run`` the result's identifying fields (policy, staleness, ...)."""
        mark = self._mark
        window = now - mark["time"]
        trained = self.counts["trained"] - mark["trained"]
        throughput = trained / window if window > 0 else 0.0
        trainer_util = (trainer.busy_until(now) - mark["busy"]) / window if window > 0 else 0.0
        tokens = engines.generated(now) - mark["tokens"]
        engine_util = tokens / (bound.token_rate * window) if window > 0 else 0.0
        engine_busy = engines.busy(now) - mark["engine_busy"]
        engine_idle = 1.0 - engine_busy / window if window > 0 else 0.0
        stuck = blocked = None
        if buffered and window > 0:
            stuck = (self._stuck_until(now) - mark["stuck"]) / window
            blocked = (self._blocked_until(now) - mark["blocked"]) / window
        truncated = self.counts["truncated_trained"] - mark["truncated"]
        decided = self.tokens["wasted"] + self.tokens["trained"]
        return SimResult(
            throughput=throughput,
            bound=bound,
            trainer_util=trainer_util,
            engine_util=engine_util,
            staleness_histogram=dict(sorted(self.histogram.items())),
            violations=sum(n for k, n in self.histogram.items() if k > hard)
            - sum(n for k, n in self.continued.items() if k > hard),
            wasted_fraction=self.tokens["wasted"] / decided if decided else 0.0,
            stuck_fraction=stuck,
            blocked_fraction=blocked,
            truncated_fraction=truncated / trained if trained else 0.0,
            sim_time=now,
            window=window,
            counts=counts,
            tokens=dict(self.tokens),
            timeline=self.timeline,
            engine_idle=engine_idle,
            trainer_waits=trainer.waits[warmup:],
            **run,
        )

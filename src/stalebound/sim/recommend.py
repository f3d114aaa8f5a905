"""Recommendations: the settings a run can change, swept on its calibrated workload.

:func:`recommend` simulates a calibrated run (:mod:`stalebound.sim.calibrate`) under every
policy the runtime offers (``capacity``, ``buffer``, ``deadline`` with either action), a range of
hard bounds η_h and, under ``deadline``, soft targets η_s, then varies the best settings' group
concurrency (``rollout.max_concurrent_rollouts``) and deadline grace
(``rollout.deadline.grace_steps``). It returns the Pareto front of predicted time (per step, or
to the run's target reward) against mean staleness, truncated trajectories and wasted tokens, and
the fastest setting that meets the caller's limits, as ``key=value`` overrides for
``stalebound train``.

The grid is pruned in two stages: policy × η_h × η_s at the run's concurrency and the default
grace first; then, for the fastest few settings overall and within the limits, the other
concurrencies and graces. Each setting is simulated on the same seeded workload.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalebound.core.errors import ConfigError
from stalebound.obs.records import TARGET_WINDOW, steps_to_target, target_reward
from stalebound.sim.calibrate import Calibration, deadline_spec, write_workload
from stalebound.sim.config import WorkloadConfig, load_workload
from stalebound.sim.policies import coordinator_settings, policy_spec
from stalebound.sim.simulator import SimResult, simulate

__all__ = [
    "HARD_BOUNDS",
    "OBJECTIVES",
    "Candidate",
    "Recommendation",
    "Setting",
    "check_limits",
    "default_setting",
    "pareto_front",
    "recommend",
    "simulate_settings",
    "steps_to_target",
    "target_reward",
]

OBJECTIVES = ("time-per-step", "time-to-target")
"""What the sweep minimises: the predicted seconds per training step, or to the run's
``run.target_reward`` (its steps to the target × the predicted seconds per step)."""

SWEPT_POLICIES = ("capacity", "buffer", "deadline", "deadline-abort")
"""The simulator's policies the sweep covers: each is a ``rollout`` section of
``stalebound train`` (:meth:`Setting.overrides`)."""

HARD_BOUNDS = (0, 1, 2, 3, 4, 6, 8)
"""The hard bounds η_h swept; 0 (synchronous training) under ``capacity`` only, where it is
``stalebound bench``'s ``sync``."""

GRACES: tuple[float | None, ...] = (0.25, 1.0, None)
"""``rollout.deadline.grace_steps`` swept under ``deadline``: the default first; ``None`` waits
for every due group."""

CONCURRENCY_FACTORS = (1, 2, 4)
"""``rollout.max_concurrent_rollouts`` swept as these multiples of B, beside the default."""

REFINED = 4
"""How many of the first stage's fastest settings (overall, and within the limits) the second
stage varies."""

TIE = 0.10
"""Settings predicted within this share of the fastest within the limits count as tied: the
simulator cannot tell them apart. A calibrated prediction is good to about 10 % (more where the
run overlapped generation and training less than the setting would), so of tied settings the
recommendation keeps the run's own, else the shipped default (:func:`default_setting`), else takes
the least stale: a few percent of predicted speed is worth neither a change nobody measured nor
staler data."""

MIN_STEPS = 20
"""The fewest training steps each setting is simulated for (a shorter run's warm-up would weigh
on its time per step)."""


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: a simulator policy at the hard bound η_h, with the soft target
    η_s and the grace (``deadline`` kinds), and the group concurrency (``None``: the runtime's
    default)."""

    policy: str
    staleness: int
    target: int | None = None
    grace_steps: float | None = 0.25
    concurrency: int | None = None

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides of ``stalebound train`` that run this setting."""
        spec = policy_spec(self.policy)
        out = [
            f"rollout.staleness_policy={spec.kind}",
            f"rollout.staleness={self.staleness}",
        ]
        if spec.kind == "deadline":
            grace = "null" if self.grace_steps is None else f"{self.grace_steps:g}"
            out += [
                f"rollout.deadline.target={self.target}",
                f"rollout.deadline.action={spec.deadline_action}",
                f"rollout.deadline.grace_steps={grace}",
            ]
        concurrency = "null" if self.concurrency is None else str(self.concurrency)
        return [*out, f"rollout.max_concurrent_rollouts={concurrency}"]

    def label(self) -> dict[str, str]:
        """The setting's columns as printed."""
        deadline = policy_spec(self.policy).kind == "deadline"
        return {
            "policy": self.policy,
            "η_h": str(self.staleness),
            "η_s": str(self.target) if deadline else "–",
            "grace": ("wait" if self.grace_steps is None else f"{self.grace_steps:g}")
            if deadline
            else "–",
            "concurrency": "default" if self.concurrency is None else str(self.concurrency),
        }


@dataclass(frozen=True)
class Candidate:
    """A :class:`Setting` and what the simulator predicts of it."""

    setting: Setting
    step_s: float
    """Seconds per training step over the measuring window."""
    trajectories_per_s: float
    staleness_mean: float
    truncated: float
    """Share of the trained trajectories cut short."""
    wasted: float
    """Share of the generated tokens thrown away."""
    time_to_target_s: float | None = None
    """The run's steps to its target × :attr:`step_s`; ``None`` without a target."""

    def objective(self, name: str) -> float:
        if name == "time-to-target" and self.time_to_target_s is not None:
            return self.time_to_target_s
        return self.step_s

    def meets(self, max_staleness: float | None, max_truncated: float | None) -> bool:
        """Within the limits (``max_truncated`` a share, as :attr:`truncated`)."""
        return (max_staleness is None or self.staleness_mean <= max_staleness + 1e-9) and (
            max_truncated is None or self.truncated <= max_truncated + 1e-9
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.setting),
            "overrides": " ".join(self.setting.overrides()),
            "step_s": self.step_s,
            "trajectories_per_s": self.trajectories_per_s,
            "staleness_mean": self.staleness_mean,
            "truncated_fraction": self.truncated,
            "wasted_fraction": self.wasted,
            "time_to_target_s": self.time_to_target_s,
        }


@dataclass(frozen=True)
class Recommendation:
    """The sweep's outcome: every candidate, the Pareto front, the run as it ran (predicted) and
    the recommended candidate (``None`` when no setting meets the limits; :attr:`closest` is
    then the one nearest to meeting them)."""

    objective: str
    candidates: tuple[Candidate, ...]
    front: tuple[Candidate, ...]
    current: Candidate
    recommended: Candidate | None
    closest: Candidate | None
    max_staleness: float | None
    max_truncated: float | None
    steps_to_target: int | None
    """The run's steps to its ``run.target_reward``; ``None`` when it has none or never got there."""

    def within(self, c: Candidate) -> bool:
        """Whether ``c`` meets the limits."""
        return c.meets(self.max_staleness, _share(self.max_truncated))

    def to_json(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "max_staleness": self.max_staleness,
            "max_truncated": self.max_truncated,
            "steps_to_target": self.steps_to_target,
            "simulated": len(self.candidates),
            "current": self.current.to_json(),
            "front": [c.to_json() for c in self.front],
            "recommended": None if self.recommended is None else self.recommended.to_json(),
            "closest": None if self.closest is None else self.closest.to_json(),
        }


def _share(percent: float | None) -> float | None:
    return None if percent is None else percent / 100


def check_limits(
    max_staleness: float | None, max_truncated: float | None, objective: str | None
) -> None:
    """Raise one :class:`ConfigError` naming every limit that cannot be a limit
    (``max_truncated`` in percent)."""
    problems = []
    if max_staleness is not None and not 0 <= max_staleness < math.inf:
        problems.append(
            f"max-staleness={max_staleness:g}: the mean staleness of the trained trajectories "
            "must be ≥ 0 (0 asks for synchronous training); give e.g. --max-staleness 1.5"
        )
    if max_truncated is not None and not 0 <= max_truncated <= 100:
        problems.append(
            f"max-truncated={max_truncated:g}: a percentage of the trained trajectories, "
            "0 to 100; give e.g. --max-truncated 5"
        )
    if objective is not None and objective not in OBJECTIVES:
        problems.append(f"objective={objective!r}: use one of {', '.join(OBJECTIVES)}")
    if problems:
        raise ConfigError(problems)


def _first_stage(cal: Calibration, policies: Sequence[str], bounds: Sequence[int]) -> list[Setting]:
    concurrency = cal.run.max_concurrent_groups
    out = []
    for policy in policies:
        deadline = policy_spec(policy).kind == "deadline"
        for eta in bounds:
            if eta == 0 and policy != "capacity" and "capacity" in policies:
                continue  # synchronous training is one setting, whatever the policy
            targets = sorted({eta // 2, max(0, eta - 1), eta}) if deadline else [None]
            for target in targets:
                out.append(Setting(policy, eta, target, concurrency=concurrency))
    return out


def _second_stage(best: Iterable[Setting], groups: int) -> list[Setting]:
    out = []
    for s in best:
        for factor in (None, *CONCURRENCY_FACTORS):
            concurrency = None if factor is None else factor * groups
            graces = GRACES if policy_spec(s.policy).kind == "deadline" else (s.grace_steps,)
            for grace in graces:
                out.append(dataclasses.replace(s, concurrency=concurrency, grace_steps=grace))
    return out


def simulate_settings(
    cal: Calibration, settings: Sequence[Setting], *, steps: int | None = None, seed: int = 0
) -> list[Candidate]:
    """What the simulator predicts of each of ``settings`` on the calibrated workload ``cal``
    (``steps`` as in :func:`recommend`)."""
    with tempfile.TemporaryDirectory(prefix="stalebound-recommend-") as tmp:
        cfg = load_workload(write_workload(cal, Path(tmp) / "workload.yaml"))
        return _Sweep(cfg, _steps(cal, steps), seed, None).run(settings)


def _steps(cal: Calibration, steps: int | None) -> int:
    return steps or max(MIN_STEPS, cal.workload.run.steps)


class _Sweep:
    """Simulates settings on one calibrated workload, each once."""

    def __init__(self, cfg: WorkloadConfig, steps: int, seed: int, to_target: int | None) -> None:
        self.cfg, self.steps, self.seed, self.to_target = cfg, steps, seed, to_target
        self.done: dict[Setting, Candidate] = {}

    def run(self, settings: Iterable[Setting]) -> list[Candidate]:
        return [self.one(s) for s in settings]

    def one(self, s: Setting) -> Candidate:
        if s not in self.done:
            self.done[s] = self._simulate(s)
        return self.done[s]

    def _simulate(self, s: Setting) -> Candidate:
        spec = policy_spec(s.policy)
        batch = dataclasses.replace(self.cfg.batch, max_concurrent_groups=s.concurrency)
        cfg = dataclasses.replace(self.cfg, batch=batch)
        settings = dataclasses.replace(
            coordinator_settings(cfg, spec, s.staleness, s.target),
            deadline_grace_steps=s.grace_steps,
        )
        r = simulate(
            cfg, s.policy, s.staleness, target=s.target, seed=self.seed, steps=self.steps,
            settings=settings,
        )  # fmt: skip
        step_s = _step_s(r, cfg.run.warmup_fraction)
        return Candidate(
            setting=s,
            step_s=step_s,
            trajectories_per_s=r.throughput,
            staleness_mean=r.staleness_mean,
            truncated=r.truncated_fraction,
            wasted=r.wasted_fraction,
            time_to_target_s=None if self.to_target is None else self.to_target * step_s,
        )


def _step_s(r: SimResult, warmup_fraction: float) -> float:
    measured = r.steps - min(r.steps - 1, int(r.steps * warmup_fraction))
    return r.window / measured


def pareto_front(candidates: Sequence[Candidate], objective: str) -> list[Candidate]:
    """The candidates no other one beats on every figure (the objective, mean staleness,
    truncated, wasted) and betters on one; sorted by the objective."""

    def key(c: Candidate) -> tuple[float, float, float, float]:
        return (c.objective(objective), c.staleness_mean, c.truncated, c.wasted)

    keys = [key(c) for c in candidates]
    front = [
        c
        for c, k in zip(candidates, keys, strict=True)
        if not any(o != k and all(a <= b for a, b in zip(o, k, strict=True)) for o in keys)
    ]
    unique = {key(c): c for c in reversed(front)}  # one of equal figures: the first swept
    return sorted(unique.values(), key=key)


def default_setting() -> Setting:
    """The setting ``stalebound train`` runs without overrides (``configs/train.yaml``)."""
    from stalebound.config import TRAIN_RECIPE, load_config  # the recipe, only when asked

    rollout = load_config([TRAIN_RECIPE]).rollout
    deadline = rollout.staleness_policy == "deadline"
    policy, staleness, target = str(rollout.staleness_policy), rollout.staleness, None
    if deadline:
        section = {"target": rollout.deadline.target, "action": rollout.deadline.action}
        policy, target, staleness = deadline_spec(section, staleness)
    return Setting(
        policy,
        staleness,
        target,
        grace_steps=rollout.deadline.grace_steps if deadline else 0.25,
        concurrency=rollout.max_concurrent_rollouts,
    )


def _choose(
    candidates: Sequence[Candidate], objective: str, keep: Sequence[Setting] = ()
) -> Candidate:
    """The fastest, or of those within :data:`TIE` of it the first of ``keep`` (the run's own
    setting, the default), else the least stale, least truncated, least wasteful."""
    fastest = min(c.objective(objective) for c in candidates)
    tied = [c for c in candidates if c.objective(objective) <= fastest * (1 + TIE)]
    for setting in keep:
        kept = [c for c in tied if c.setting == setting]
        if kept:
            return kept[0]
    return min(
        tied, key=lambda c: (c.staleness_mean, c.truncated, c.wasted, c.objective(objective))
    )


def _excess(c: Candidate, max_staleness: float | None, max_truncated: float | None) -> float:
    """How far ``c`` is from the limits: the sum of its excesses, each relative to its limit
    (plus one where the limit is 0)."""
    total = 0.0
    for value, limit in ((c.staleness_mean, max_staleness), (c.truncated, max_truncated)):
        if limit is not None and value > limit:
            total += (value - limit) / (limit or 1.0)
    return total


def recommend(
    cal: Calibration,
    *,
    max_staleness: float | None = None,
    max_truncated: float | None = None,
    objective: str | None = None,
    policies: Sequence[str] | None = None,
    bounds: Sequence[int] | None = None,
    steps: int | None = None,
    seed: int = 0,
) -> Recommendation:
    """Sweep the settings on the calibrated workload ``cal`` (see the module docstring).

    ``max_truncated`` is a percentage of the trained trajectories. ``objective`` ``None`` is
    time to the target when the run reached its ``run.target_reward``, else time per step.
    The run's steps to its target are read from its ``metrics.jsonl`` and ``config.yaml``.
    ``policies`` and ``bounds`` narrow the sweep (default :data:`SWEPT_POLICIES`,
    :data:`HARD_BOUNDS`); ``steps`` (default the run's, at least 20) is each simulation's
    length."""
    check_limits(max_staleness, max_truncated, objective)
    policies = list(dict.fromkeys(policies or SWEPT_POLICIES))
    bounds = sorted(set(HARD_BOUNDS if bounds is None else bounds))
    bad = [b for b in bounds if b < 0]
    if bad:
        raise ConfigError(f"staleness={bad[0]}: must be ≥ 0; 0 is synchronous training")
    share = _share(max_truncated)
    to_target = steps_to_target(cal.source) if cal.source else None
    if objective == "time-to-target" and to_target is None:
        raise ConfigError(
            f"objective='time-to-target': the run in {cal.source} never reached its "
            f"run.target_reward={target_reward(cal.source)} (the mean reward of "
            f"{TARGET_WINDOW} steps); use --objective time-per-step"
        )
    objective = objective or ("time-to-target" if to_target is not None else "time-per-step")
    steps = _steps(cal, steps)

    with tempfile.TemporaryDirectory(prefix="stalebound-recommend-") as tmp:
        cfg = load_workload(write_workload(cal, Path(tmp) / "workload.yaml"))
        sweep = _Sweep(cfg, steps, seed, to_target)
        first = sweep.run(_first_stage(cal, policies, bounds))
        fast = sorted(first, key=lambda c: c.objective(objective))
        ok = [c for c in fast if c.meets(max_staleness, share)]
        best = dict.fromkeys(c.setting for c in [*fast[:REFINED], *ok[:REFINED]])
        sweep.run(_second_stage(best, cal.run.groups))
        default = default_setting()
        if default.policy in policies and default.staleness in bounds:
            sweep.one(default)
        candidates = tuple(sweep.done.values())
        run = cal.run  # predicted beside the others, a candidate only where the sweep has it
        current = sweep.one(
            Setting(run.policy, run.staleness, run.target, concurrency=run.max_concurrent_groups)
        )
    meeting = [c for c in candidates if c.meets(max_staleness, share)]
    chosen = _choose(meeting, objective, keep=(current.setting, default)) if meeting else None
    closest = None
    if not meeting:
        closest = min(
            candidates,
            key=lambda c: (_excess(c, max_staleness, share), c.objective(objective)),
        )
    return Recommendation(
        objective=objective,
        candidates=candidates,
        front=tuple(pareto_front(candidates, objective)),
        current=current,
        recommended=chosen,
        closest=closest,
        max_staleness=max_staleness,
        max_truncated=max_truncated,
        steps_to_target=to_target,
    )

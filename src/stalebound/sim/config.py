"""Workload configuration for the simulator: a typed dataclass tree loaded from YAML.

A workload file names every knob of the modelled cluster; anything left out keeps the default shown
in the dataclasses below. Unknown keys and invalid values raise :class:`ConfigError` listing every
problem at once, each as ``path=value: why; the fix``.

Presets ship as YAML files in ``stalebound/sim/presets/``; :func:`load_preset` reads them by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from stalebound.core.errors import ConfigError
from stalebound.typedconfig import Problems, read_yaml
from stalebound.userfiles import label

__all__ = [
    "AgentConfig",
    "BatchConfig",
    "DistributionConfig",
    "EngineConfig",
    "FailureConfig",
    "ProactiveConfig",
    "RedundancyConfig",
    "RunConfig",
    "TrainerConfig",
    "WorkloadConfig",
    "list_presets",
    "load_preset",
    "load_workload",
    "workload_from_dict",
]

DISTRIBUTIONS = ("lognormal", "pareto", "empirical", "fixed")


@dataclass(frozen=True)
class DistributionConfig:
    """A positive random quantity (tokens, or seconds of tool latency).

    * ``lognormal``: ``median`` and ``p99`` (p99 > median) fix μ and σ.
    * ``pareto``: ``minimum`` (the scale) and ``alpha`` (the tail index; α ≤ 2 has infinite variance).
    * ``empirical``: ``file``, a text file with one value per line (``#`` comments allowed),
      sampled uniformly; a relative path is taken from the workload file's folder.
    * ``fixed``: always ``value``.

    ``cap`` (optional) clips every sample, as a generation length limit does.
    """

    distribution: str = "lognormal"
    median: float = 2000.0
    p99: float = 20000.0
    minimum: float = 1.0
    alpha: float = 1.5
    value: float = 1.0
    file: str | None = None
    cap: float | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Inference replicas with continuous batching.

    One decode step takes ``step_base + step_per_seq × active`` seconds and advances every active
    sequence of the replica by one token. A replica holds at most ``max_concurrency`` sequences
    and decodes at most ``max_batch`` of them at once (the rest wait their turn).
    """

    replicas: int = 16
    max_concurrency: int = 128
    step_base: float = 0.020
    step_per_seq: float = 0.0001
    sync_delay: float = 0.0
    """Seconds between the end of a train step and the engines serving the new version."""
    max_batch: int | None = None
    """Sequences decoded at once per replica; ``None``: all it holds (``max_concurrency``)."""
    prefill: float = 0.0
    """Seconds each sequence joining the batch stalls its replica (its prefill)."""
    update_stall: float = 0.0
    """Seconds every replica stops decoding when new weights arrive (installing them)."""


@dataclass(frozen=True)
class BatchConfig:
    """B groups of N trajectories per training step."""

    groups: int = 32
    group_size: int = 8
    max_concurrent_groups: int | None = None
    """A limit on groups generating at once (AReaL's ``max_concurrent_rollouts``); ``None``
    leaves only the engine slots and the staleness bound."""


@dataclass(frozen=True)
class TrainerConfig:
    """One train step takes ``step_time + per_token × trained tokens`` seconds, then ``publish``
    seconds to hand the weights to the engines (both busy). ``handoff`` seconds pass between a
    batch being ready and the step starting (idle: the batch is collated and handed over)."""

    step_time: float = 15.0
    per_token: float = 0.0
    publish: float = 0.0
    handoff: float = 0.0


@dataclass(frozen=True)
class AgentConfig:
    """Agentic episodes: ``turns`` decode segments separated by tool calls.

    A trajectory's tokens are split evenly over its turns; after every turn but the last the
    sequence leaves the decode batch (keeping its slot) for a tool call drawn from ``tool_latency``.
    """

    turns: int = 1
    tool_latency: DistributionConfig = field(
        default_factory=lambda: DistributionConfig("lognormal", median=1.0, p99=20.0)
    )
    reward_latency: DistributionConfig | None = None
    """Seconds from the end of generation to the trajectory being complete (a reward service's
    wait); it holds the engine slot but not a batch place. ``None``: no wait."""


@dataclass(frozen=True)
class FailureConfig:
    """Each trajectory fails with probability ``rate`` at a uniform point of its length."""

    rate: float = 0.0
    max_relaunches: int | None = None
    """Relaunches per group after failures; ``None`` means up to N (the group tracker's default)."""


@dataclass(frozen=True)
class RedundancyConfig:
    """What the ``buffer+redundancy`` policy adds: B′ = ceil(batch_factor × B), N′ = N + group_extra."""

    batch_factor: float = 1.25
    group_extra: int = 0


@dataclass(frozen=True)
class ProactiveConfig:
    """The proactive filter of ``buffer+retry`` / ``buffer+truncate``.

    It acts on a STUCK head buffer that blocks an idle trainer, when the head holds at most
    ``threshold`` RESERVED entries and has been STUCK for at least ``stuck_time`` seconds.
    """

    threshold: int = 4
    stuck_time: float = 0.0


@dataclass(frozen=True)
class RunConfig:
    """How long to run: ``steps`` train steps; the first ``warmup_fraction`` are not measured."""

    steps: int = 200
    warmup_fraction: float = 0.1


@dataclass(frozen=True)
class WorkloadConfig:
    """The whole modelled cluster and workload."""

    name: str = "custom"
    lengths: DistributionConfig = field(
        default_factory=lambda: DistributionConfig("lognormal", 2000.0, 20000.0, cap=32768.0)
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    redundancy: RedundancyConfig = field(default_factory=RedundancyConfig)
    proactive: ProactiveConfig = field(default_factory=ProactiveConfig)
    run: RunConfig = field(default_factory=RunConfig)
    base_dir: str = field(default=".", compare=False)
    """Folder that relative ``file`` paths are taken from (the workload file's folder)."""


# --------------------------------------------------------------------------- loading


def list_presets() -> list[str]:
    """Names of the presets shipped with stalebound."""
    folder = resources.files("stalebound.sim").joinpath("presets")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> WorkloadConfig:
    """The preset ``name`` (for example ``reference``)."""
    names = list_presets()
    if name not in names:
        raise ConfigError(
            f"preset={name!r}: no such preset; use one of {', '.join(names)} or --workload FILE"
        )
    text = resources.files("stalebound.sim").joinpath("presets", f"{name}.yaml").read_text()
    return _from_text(text, f"preset {name}", ".")


def load_workload(path: str | Path) -> WorkloadConfig:
    """A workload from a YAML file; relative ``file`` paths are taken from its folder."""
    p = Path(path)
    data = read_yaml(
        p,
        label("workload", path),
        fix="give an existing YAML file",
        large_fix="a workload is a few kilobytes of settings; give measured lengths as a file "
        "of values (lengths.file)",
    )
    return _from_data(data, str(p), str(p.parent))


def _from_text(text: str, where: str, base_dir: str) -> WorkloadConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"workload {where}: not valid YAML ({exc}); fix the syntax") from None
    return _from_data(data, where, base_dir)


def _from_data(data: Any, where: str, base_dir: str) -> WorkloadConfig:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"workload {where}={type(data).__name__}: the top level must be a mapping of sections "
            "(lengths, engine, batch, trainer, ...)"
        )
    return workload_from_dict(data, base_dir=base_dir)


def workload_from_dict(data: Mapping[str, Any], *, base_dir: str = ".") -> WorkloadConfig:
    """Build and validate a :class:`WorkloadConfig` from plain data (as YAML gives it)."""
    problems = Problems()  # a file of thousands of unknown keys lists the first and counts all
    built: WorkloadConfig = _build(WorkloadConfig, data, "", problems)
    cfg = dataclasses.replace(built, base_dir=base_dir)
    problems.extend(validate(cfg))  # a value of the wrong type kept its default: check the rest
    if problems:
        raise ConfigError(problems, omitted=problems.omitted)
    return cfg


_NESTED: dict[str, type[Any]] = {
    "lengths": DistributionConfig,
    "tool_latency": DistributionConfig,
    "reward_latency": DistributionConfig,
    "engine": EngineConfig,
    "batch": BatchConfig,
    "trainer": TrainerConfig,
    "agent": AgentConfig,
    "failures": FailureConfig,
    "redundancy": RedundancyConfig,
    "proactive": ProactiveConfig,
    "run": RunConfig,
}


def _build(cls: type[Any], data: Any, prefix: str, problems: list[str]) -> Any:
    if not isinstance(data, Mapping):
        problems.append(
            f"{prefix.rstrip('.') or 'workload'}={data!r}: must be a mapping of "
            f"{cls.__name__} fields"
        )
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "base_dir"}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            problems.append(
                f"{path}={value!r}: unknown key; known keys here are {', '.join(sorted(fields))}"
            )
            continue
        if key in _NESTED and value is None and "None" in str(fields[key].type):
            kwargs[key] = None
            continue
        if key in _NESTED:
            kwargs[key] = _build(_NESTED[key], value, f"{path}.", problems)
            continue
        value = _coerce(path, value, str(fields[key].type), problems)
        if value is not _BAD:
            kwargs[key] = value
    return cls(**kwargs)


_BAD = object()  # what _coerce returns for a value of the wrong type


def _coerce(path: str, value: Any, annotation: str, problems: list[str]) -> Any:
    """Check a scalar against its field's annotation (``float``, ``int``, ``str``, ``X | None``);
    ints are accepted where floats are expected."""
    base, _, rest = annotation.partition(" | ")
    if value is None:
        if rest != "None":
            problems.append(f"{path}=None: a value is required here; give a {base}")
            return _BAD
        return None
    if isinstance(value, bool):
        problems.append(f"{path}={value!r}: must be a {base}, not a boolean; write a {base}")
        return _BAD
    if base == "float":
        if not isinstance(value, int | float):
            problems.append(f"{path}={value!r}: must be a number; write it without quotes or units")
            return _BAD
        return float(value)
    if base == "int":
        if not isinstance(value, int):
            problems.append(f"{path}={value!r}: must be an integer; write a whole number like 8")
            return _BAD
        return value
    if not isinstance(value, str):
        problems.append(f"{path}={value!r}: must be a string; quote it")
        return _BAD
    return value


# ------------------------------------------------------------------------ validation


def validate(cfg: WorkloadConfig) -> list[str]:
    """Every problem of a built config, each ``path=value: why; the fix``."""
    problems: list[str] = []

    def need(ok: bool, path: str, value: Any, why: str) -> None:
        if not ok:
            problems.append(f"{path}={value!r}: {why}")

    _validate_distribution(cfg.lengths, "lengths", cfg.base_dir, problems)
    _validate_distribution(cfg.agent.tool_latency, "agent.tool_latency", cfg.base_dir, problems)
    if cfg.agent.reward_latency is not None:
        _validate_distribution(
            cfg.agent.reward_latency, "agent.reward_latency", cfg.base_dir, problems
        )
    e = cfg.engine
    need(e.replicas >= 1, "engine.replicas", e.replicas, "must be ≥ 1; set the replica count")
    need(
        e.max_concurrency >= 1,
        "engine.max_concurrency",
        e.max_concurrency,
        "must be ≥ 1; set the sequences one replica decodes at once",
    )
    need(e.step_base > 0, "engine.step_base", e.step_base, "must be > 0 seconds per decode step")
    need(e.step_per_seq >= 0, "engine.step_per_seq", e.step_per_seq, "must be ≥ 0 seconds")
    need(e.sync_delay >= 0, "engine.sync_delay", e.sync_delay, "must be ≥ 0 seconds")
    need(
        e.max_batch is None or e.max_batch >= 1,
        "engine.max_batch",
        e.max_batch,
        "must be ≥ 1, or null to decode every sequence a replica holds",
    )
    need(e.prefill >= 0, "engine.prefill", e.prefill, "must be ≥ 0 seconds per joining sequence")
    need(e.update_stall >= 0, "engine.update_stall", e.update_stall, "must be ≥ 0 seconds")
    b = cfg.batch
    need(b.groups >= 1, "batch.groups", b.groups, "must be ≥ 1 (B, groups per train step)")
    need(b.group_size >= 1, "batch.group_size", b.group_size, "must be ≥ 1 (N per group)")
    slots = e.replicas * e.max_concurrency
    need(
        slots < 1 or b.group_size + cfg.redundancy.group_extra <= slots,
        "batch.group_size",
        b.group_size,
        f"a group of N′={b.group_size + cfg.redundancy.group_extra} must fit on the {slots} "
        "engine slots; add replicas or lower the group size",
    )
    need(
        b.max_concurrent_groups is None or b.max_concurrent_groups >= 1,
        "batch.max_concurrent_groups",
        b.max_concurrent_groups,
        "must be ≥ 1, or null for no limit beyond the engine slots",
    )
    t = cfg.trainer
    need(t.step_time >= 0, "trainer.step_time", t.step_time, "must be ≥ 0 seconds")
    need(t.per_token >= 0, "trainer.per_token", t.per_token, "must be ≥ 0 seconds per token")
    need(t.publish >= 0, "trainer.publish", t.publish, "must be ≥ 0 seconds per step")
    need(t.handoff >= 0, "trainer.handoff", t.handoff, "must be ≥ 0 seconds per step")
    need(
        t.step_time > 0 or t.per_token > 0,
        "trainer.step_time",
        t.step_time,
        "step_time and per_token are both 0; give the trainer some cost",
    )
    need(cfg.agent.turns >= 1, "agent.turns", cfg.agent.turns, "must be ≥ 1 (1 = no tool calls)")
    f = cfg.failures
    need(0 <= f.rate < 1, "failures.rate", f.rate, "must be in [0, 1); use 0 for no failures")
    need(
        f.max_relaunches is None or f.max_relaunches >= 0,
        "failures.max_relaunches",
        f.max_relaunches,
        "must be ≥ 0, or null for the default (N)",
    )
    r = cfg.redundancy
    need(r.batch_factor >= 1, "redundancy.batch_factor", r.batch_factor, "must be ≥ 1 (B′ ≥ B)")
    need(r.group_extra >= 0, "redundancy.group_extra", r.group_extra, "must be ≥ 0 (N′ ≥ N)")
    p = cfg.proactive
    need(p.threshold >= 1, "proactive.threshold", p.threshold, "must be ≥ 1 reserved entries")
    need(p.stuck_time >= 0, "proactive.stuck_time", p.stuck_time, "must be ≥ 0 seconds")
    need(cfg.run.steps >= 1, "run.steps", cfg.run.steps, "must be ≥ 1 train steps")
    need(
        0 <= cfg.run.warmup_fraction < 1,
        "run.warmup_fraction",
        cfg.run.warmup_fraction,
        "must be in [0, 1); 0.1 skips the first tenth of the steps",
    )
    return problems


def _validate_distribution(
    d: DistributionConfig, path: str, base_dir: str, problems: list[str]
) -> None:
    def need(ok: bool, key: str, value: Any, why: str) -> None:
        if not ok:
            problems.append(f"{path}.{key}={value!r}: {why}")

    if d.distribution not in DISTRIBUTIONS:
        need(False, "distribution", d.distribution, f"use one of {', '.join(DISTRIBUTIONS)}")
        return
    if d.distribution == "lognormal":
        need(d.median > 0, "median", d.median, "must be > 0")
        need(d.p99 > d.median, "p99", d.p99, f"must be > median={d.median}; raise p99")
    elif d.distribution == "pareto":
        need(d.minimum > 0, "minimum", d.minimum, "must be > 0 (the smallest value)")
        need(d.alpha > 0, "alpha", d.alpha, "must be > 0 (the tail index; 1.5 is heavy)")
    elif d.distribution == "fixed":
        need(d.value > 0, "value", d.value, "must be > 0")
    elif d.file is None:
        need(False, "file", None, "the empirical distribution needs a file of values, one a line")
    else:
        file = Path(base_dir) / d.file
        if not file.is_file():
            need(False, "file", d.file, f"no such file ({file}); give a file of values, one a line")
    if d.cap is not None:
        need(d.cap > 0 and math.isfinite(d.cap), "cap", d.cap, "must be > 0, or null for no cap")

"""Workload configuration for the simulator: a typed dataclass tree loaded from YAML.

A workload file names every knob of the modelled cluster; anything left out keeps the default shown
in the dataclasses below. It loads through :mod:`stalebound.typedconfig`, the machinery of the rest
of the configuration: unknown keys, wrong types and invalid values raise :class:`ConfigError`
listing every problem at once, each as ``path=value: why; the fix``. Ranges are declared next to
the fields (``bounds``), rules between fields in ``_validate`` hooks.

Presets ship as YAML files in ``stalebound/sim/presets/``; :func:`load_preset` reads them by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from stalebound.core.errors import ConfigError
from stalebound.core.proactive import DEFAULT_THRESHOLD
from stalebound.typedconfig import Invalid, Layer, Problems, Schema, bounds, read_yaml
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

Distribution = Literal["lognormal", "pareto", "empirical", "fixed"]


def _ge(value: float, fix: str) -> Any:
    return field(default=value, metadata=bounds(ge=0, fix=fix))


@dataclass(frozen=True)
class DistributionConfig:
    """A positive random quantity (tokens, or seconds of tool latency).

    * ``lognormal``: ``median`` and ``p99`` (p99 > median) fix μ and σ.
    * ``pareto``: ``minimum`` (the scale) and ``alpha`` (the tail index; α ≤ 2 has infinite variance).
    * ``empirical``: ``file``, a text file with one value per line (``#`` comments allowed),
      sampled uniformly; a relative path is taken from the workload file's folder. For ``lengths``
      a line may hold one group's values (separated by spaces): each prompt then draws a line,
      and its members take the line's values in turn.
    * ``fixed``: always ``value``.

    ``cap`` (optional) clips every sample, as a generation length limit does.
    """

    distribution: Distribution = "lognormal"
    median: float = 2000.0
    p99: float = 20000.0
    minimum: float = 1.0
    alpha: float = 1.5
    value: float = 1.0
    file: str | None = None
    cap: float | None = None

    def _validate(self) -> Iterator[Invalid]:
        # the file's existence is checked by workload_from_dict, which knows the base folder
        if self.distribution == "lognormal":
            if not self.median > 0:
                yield Invalid("median", "must be > 0", "give the median value")
            elif not self.p99 > self.median:
                yield Invalid("p99", f"must be > median={self.median}", "raise p99")
        elif self.distribution == "pareto":
            if not self.minimum > 0:
                yield Invalid("minimum", "must be > 0", "give the smallest value")
            if not self.alpha > 0:
                yield Invalid("alpha", "must be > 0", "give the tail index; 1.5 is heavy")
        elif self.distribution == "fixed":
            if not self.value > 0:
                yield Invalid("value", "must be > 0", "give the value")
        elif self.file is None:
            yield Invalid(
                "file", "the empirical distribution needs a file of values", "one value a line"
            )
        if self.cap is not None and not (self.cap > 0 and math.isfinite(self.cap)):
            yield Invalid("cap", "must be > 0", "or null for no cap")


@dataclass(frozen=True)
class EngineConfig:
    """Inference replicas with continuous batching.

    One decode step takes ``step_base × cohorts + step_per_seq × active + step_per_ctx × active ×
    context`` seconds (``context``: the tokens the oldest active sequence has decoded in its
    segment; ``cohorts``: 1 unless ``cohort_padding`` is set, and then each cohort's rows pay for
    its own oldest context) and advances every active sequence of the replica by one token. A replica holds at most ``max_concurrency`` sequences
    and decodes at most ``max_batch`` of them at once (the rest wait their turn).
    """

    replicas: int = field(default=16, metadata=bounds(ge=1, fix="set the replica count"))
    max_concurrency: int = field(
        default=128, metadata=bounds(ge=1, fix="set the sequences one replica holds at once")
    )
    step_base: float = field(
        default=0.020, metadata=bounds(gt=0, fix="give the seconds of one decode step")
    )
    step_per_seq: float = _ge(0.0001, "give the seconds each active sequence adds to a step")
    step_per_ctx: float = _ge(0.0, "give the seconds per active sequence and token of context, 0")
    """Seconds each active sequence adds to a step per token of the batch's longest live context
    (an engine that pads its batch's KV cache to the longest context, as the embedded one does;
    with ``cohort_padding``, of its cohort's longest)."""
    sync_delay: float = _ge(0.0, "give seconds, 0 for none")
    """Seconds between the end of a train step and the engines serving the new version."""
    max_batch: int | None = field(
        default=None,
        metadata=bounds(ge=1, fix="or null to decode every sequence a replica holds"),
    )
    """Sequences decoded at once per replica; ``None``: all it holds (``max_concurrency``)."""
    prefill: float = _ge(0.0, "give seconds per joining sequence, 0 for none")
    """Seconds each sequence joining the batch stalls its replica (its prefill)."""
    update_stall: float = _ge(0.0, "give seconds, 0 for none")
    """Seconds every replica stops decoding when new weights arrive (installing them)."""
    cohort_padding: int | None = field(
        default=None,
        metadata=bounds(
            ge=0, fix="give cache slots (1024 for the embedded engine on a CPU), or null"
        ),
    )
    """Decode in cohorts as the embedded engine on a CPU does: sequences that join together form
    one, neighbouring cohorts merge while the padding a merge adds is at most this many cache
    slots (and always while there are more than 8), and a step pays ``step_base`` once per
    cohort. ``None``: one batch, one ``step_base`` a step (vLLM, a GPU)."""


@dataclass(frozen=True)
class BatchConfig:
    """B groups of N trajectories per training step."""

    groups: int = field(default=32, metadata=bounds(ge=1, fix="B, groups per train step"))
    group_size: int = field(default=8, metadata=bounds(ge=1, fix="N, trajectories per group"))
    max_concurrent_groups: int | None = field(
        default=None, metadata=bounds(ge=1, fix="or null for no limit beyond the engine slots")
    )
    """A limit on groups generating at once (AReaL's ``max_concurrent_rollouts``); ``None``
    leaves only the engine slots and the staleness bound, or with ``runtime_default``, what
    ``stalebound train`` enforces for ``max_concurrent_rollouts: null``."""
    runtime_default: bool = False
    """``max_concurrent_groups: null`` stands for ``stalebound train``'s default: B under the
    ``capacity`` policy (AReaL's), the admission window ``(η + 1)·B`` (at most 8 batches)
    under the others. Calibrated workloads set it, to predict a run as it ran."""


@dataclass(frozen=True)
class TrainerConfig:
    """One train step takes ``step_time + per_token × trained tokens`` seconds, then ``publish``
    seconds to hand the weights to the engines (both busy). ``handoff`` seconds pass between a
    batch being ready and the step starting (idle: the batch is collated and handed over).
    ``contention`` slows the training while the engines generate."""

    step_time: float = _ge(15.0, "give seconds")
    per_token: float = _ge(0.0, "give seconds per trained token")
    publish: float = _ge(0.0, "give seconds per step")
    handoff: float = _ge(0.0, "give seconds per step")
    contention: float = _ge(0.0, "give the slow-down, 0 for a trainer on its own hardware")
    """Training runs ``1 + contention × s`` times slower while a share ``s`` of the replicas has
    work (engines and trainer sharing processors, as on one machine); publishing does not."""
    publish_per_start: float = _ge(0.0, "give seconds per episode, 0 for none")
    """Seconds the publication lasts longer per episode the new weights let start: the executor
    starts them on the event loop that also carries the publication back to the trainer. With
    ``engine.sync_delay`` the engines take the weights after the step, and nothing is charged."""

    def _validate(self) -> Iterator[Invalid]:
        if self.step_time == 0 and self.per_token == 0:
            yield Invalid(
                "step_time", "step_time and per_token are both 0", "give the trainer some cost"
            )


@dataclass(frozen=True)
class AgentConfig:
    """Agentic episodes: ``turns`` decode segments separated by tool calls.

    A trajectory's tokens are split evenly over its turns; after every turn but the last the
    sequence leaves the decode batch (keeping its slot) for a tool call drawn from ``tool_latency``.
    """

    turns: int = field(default=1, metadata=bounds(ge=1, fix="1 = no tool calls"))
    tool_latency: DistributionConfig = field(
        default_factory=lambda: DistributionConfig("lognormal", median=1.0, p99=20.0)
    )
    reward_latency: DistributionConfig | None = None
    """Seconds from the end of generation to the trajectory being complete (a reward service's
    wait); it holds the engine slot but not a batch place. ``None``: no wait."""
    cut_tools: bool = True
    """A truncation ends a tool call at once, as it does in the runtime when the workflow awaits
    its tools through :func:`stalebound.runtime.interruptible` (the ``calculator`` task does);
    ``false``: the truncated episode returns when its tool answers."""


@dataclass(frozen=True)
class FailureConfig:
    """Each trajectory fails with probability ``rate`` at a uniform point of its length."""

    rate: float = _ge(0.0, "use 0 for no failures")
    max_relaunches: int | None = field(
        default=None, metadata=bounds(ge=0, fix="or null for the default (N)")
    )
    """Relaunches per group after failures; ``None`` means up to N (the group tracker's default)."""

    def _validate(self) -> Iterator[Invalid]:
        if not self.rate < 1:
            yield Invalid("rate", "must be < 1", "use a probability below 1; 0 for no failures")


@dataclass(frozen=True)
class RedundancyConfig:
    """What the ``buffer+redundancy`` policy adds: B′ = ceil(batch_factor × B), N′ = N + group_extra."""

    batch_factor: float = field(default=1.25, metadata=bounds(ge=1, fix="B′ ≥ B"))
    group_extra: int = field(default=0, metadata=bounds(ge=0, fix="N′ ≥ N"))


@dataclass(frozen=True)
class ProactiveConfig:
    """The proactive filter of ``buffer+retry`` / ``buffer+truncate``.

    It acts on a STUCK head buffer that holds at most ``threshold`` RESERVED entries: at once on
    overtaken groups (``stuck_time = 0``), else once the head has been STUCK ``stuck_time``
    seconds — ``rollout.proactive_filter`` of ``stalebound train``.
    """

    threshold: int = field(
        default=DEFAULT_THRESHOLD, metadata=bounds(ge=1, fix="give reserved entries")
    )
    stuck_time: float = _ge(0.0, "give seconds")


@dataclass(frozen=True)
class RunConfig:
    """How long to run: ``steps`` train steps; the first ``warmup_fraction`` are not measured."""

    steps: int = field(default=200, metadata=bounds(ge=1, fix="give train steps"))
    warmup_fraction: float = _ge(0.1, "0.1 skips the first tenth of the steps")

    def _validate(self) -> Iterator[Invalid]:
        if not self.warmup_fraction < 1:
            yield Invalid(
                "warmup_fraction", "must be < 1", "0.1 skips the first tenth of the steps"
            )


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
    """Folder that relative ``file`` paths are taken from (the workload file's folder; set by the
    loader, not a key of the file)."""

    def _validate(self) -> Iterator[Invalid]:
        slots = self.engine.replicas * self.engine.max_concurrency
        launch = self.batch.group_size + self.redundancy.group_extra
        if launch > slots:
            yield Invalid(
                "batch.group_size",
                f"a group of N′={launch} must fit on the {slots} engine slots",
                "add replicas or lower the group size",
            )


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
    problems = Problems()
    if "base_dir" in data:
        problems.append(
            f"base_dir={data['base_dir']!r}: unknown key; relative files are taken from the "
            "workload file's folder"
        )
        data = {k: v for k, v in data.items() if k != "base_dir"}
    try:
        built: WorkloadConfig = _SCHEMA.load([Layer(data)])
    except ConfigError as exc:
        raise ConfigError([*problems, *exc.problems], omitted=exc.omitted) from None
    cfg = dataclasses.replace(built, base_dir=base_dir)
    problems.extend(_missing_files(cfg))
    if problems:
        raise ConfigError(problems, omitted=problems.omitted)
    return cfg


_SCHEMA = Schema(WorkloadConfig, reference_hint="the keys are listed in docs/simulator.md")


def _missing_files(cfg: WorkloadConfig) -> list[str]:
    """The empirical distributions whose file is not there (relative to ``cfg.base_dir``)."""
    problems = []
    for path, d in (
        ("lengths", cfg.lengths),
        ("agent.tool_latency", cfg.agent.tool_latency),
        ("agent.reward_latency", cfg.agent.reward_latency),
    ):
        if d is None or d.distribution != "empirical" or d.file is None:
            continue
        file = Path(cfg.base_dir) / d.file
        if not file.is_file():
            problems.append(
                f"{path}.file={d.file!r}: no such file ({file}); give a file of values, one a line"
            )
    return problems

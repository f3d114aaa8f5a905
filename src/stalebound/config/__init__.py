"""One typed configuration tree, composed of the layers' own sections.

Each layer declares its section next to its code (``rollout`` in :mod:`stalebound.runtime.config`,
``engine`` in :mod:`stalebound.engines.config`, ``train`` and ``run`` in
:mod:`stalebound.train.config`, ``task`` in :mod:`stalebound.tasks.config`, ``obs`` in
:mod:`stalebound.obs.config`, ``ray`` in
:mod:`stalebound.distributed.config`); this module puts them together under
:class:`StaleboundConfig` with the seeds' aliases. The loader (:mod:`stalebound.typedconfig`: YAML
files, ``key.path=value`` overrides, validation that reports every problem at once) is generic
over the tree. Each field's docstring is its reference documentation. ``python -m
stalebound.config`` prints what ``stalebound train`` runs with (:mod:`stalebound.config.cli`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Literal, TypeVar, overload

from stalebound import typedconfig
from stalebound.core.errors import ConfigError
from stalebound.data.config import DataConfig
from stalebound.distributed.config import RayConfig
from stalebound.engines.config import EngineConfig
from stalebound.obs.config import ObsConfig
from stalebound.runtime.config import (
    AREAL_SWITCHED_ALIASES,
    STALENESS_ALIASES,
    DeadlineConfig,
    FilterGroupsConfig,
    GroupPostProcessConfig,
    ProactiveFilterConfig,
    RolloutConfig,
)
from stalebound.tasks.config import TaskConfig
from stalebound.train.config import RunConfig, TrainConfig
from stalebound.typedconfig import Invalid, problems_as_invalid

__all__ = [
    "ALIASES",
    "BENCH_RECIPE",
    "SYNONYMS",
    "TRAIN_RECIPE",
    "USER_MODEL_RECIPE",
    "DeadlineConfig",
    "EngineConfig",
    "FilterGroupsConfig",
    "GroupPostProcessConfig",
    "ObsConfig",
    "ProactiveFilterConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "StaleboundConfig",
    "config_reference",
    "dump_yaml",
    "load_config",
    "parse_cli_overrides",
]


@dataclass
class TrainSection(TrainConfig):
    """The trainer: GRPO with PPO clipping and the off-policy corrections (see docs/training.md)."""

    def _validate(self) -> Iterator[Invalid]:
        yield from problems_as_invalid(self.problems(), "train")


ALIASES: Mapping[str, str] = MappingProxyType(
    {
        # The staleness bound's spellings (rollout.max_head_offpolicyness, max_head_offpolicyness,
        # psrl.staleness): kept with the bound in stalebound.runtime.config, the one place that
        # maps them.
        **STALENESS_ALIASES,
        # AReaL's top-level names (also the --max-concurrent-rollouts style flags).
        "max_concurrent_rollouts": "rollout.max_concurrent_rollouts",
        "consumer_batch_size": "rollout.consumer_batch_size",
        # PSRL's names.
        "psrl.rollout_n": "rollout.group_size",
        "psrl.proactive_filter_strategy.method": "rollout.proactive_filter.method",
        "psrl.proactive_filter_strategy.threshold": "rollout.proactive_filter.threshold",
        "psrl.rollout_coordination.proactive_filter_strategy.method": (
            "rollout.proactive_filter.method"
        ),
        "psrl.rollout_coordination.proactive_filter_strategy.threshold": (
            "rollout.proactive_filter.threshold"
        ),
        "psrl.group_post_process.enable": "rollout.group_post_process.enable",
        "psrl.group_post_process.name": "rollout.group_post_process.name",
        "algorithm.filter_groups.metric": "rollout.filter_groups.metric",
        # PSRL's two redundancy levels: entries per buffer (B′) and members per group (N′).
        "psrl.redundant_rollout.buffer_size": "rollout.buffer_size",
        "psrl.redundant_rollout.rollout_n": "rollout.group_redundancy",
        # The trainer ranks' count and timeout, once the Ray backend's own settings.
        "ray.train_data_parallel_size": "train.world_size",
        "ray.rank_timeout_s": "train.rank_timeout_s",
        # `stalebound train resume=RUN_DIR` and `--resume RUN_DIR`.
        "resume": "run.resume",
    }
)
"""The seeds' spellings, each mapped to its canonical key (accepted in YAML, overrides and flags)."""

SYNONYMS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "lr": ("learning_rate",),
        "consumer_batch_size": ("batch_size", "train_batch_size", "rollout_batch_size"),
        "max_batch_size": ("batch_size",),
        "group_size": ("n", "num_samples", "n_samples", "num_generations"),
        "staleness": ("max_staleness", "eta", "offpolicyness", "max_offpolicyness"),
        "steps": ("num_steps", "max_steps", "total_steps", "train_steps"),
        "run_dir": ("output_dir", "out_dir", "save_dir", "log_dir"),
        "model_path": ("model", "model_name", "model_name_or_path", "model_dir"),
        "temperature": ("temp",),
        "grad_clip": ("max_grad_norm", "grad_norm", "clip_grad_norm"),
        "clip_eps": ("clip_range", "cliprange", "clip_ratio", "eps_clip", "epsilon"),
        "max_new_tokens": ("max_tokens", "max_response_length", "response_length"),
        "replicas": ("num_replicas", "num_engines", "num_workers"),
        "max_concurrent_rollouts": ("max_concurrency", "concurrency"),
        "checkpoint_every_steps": ("save_steps", "save_every", "save_freq", "checkpoint_interval"),
        "keep_checkpoints": ("save_total_limit", "max_checkpoints"),
        "entropy_coef": ("ent_coef", "entropy_coeff"),
        "data_path": ("dataset", "data_file", "train_file"),
        "staleness_policy": ("policy",),
    }
)
"""A key's last name → what users of other trainers write for it. Not accepted as keys (a wrong
key stays an error); an unknown key whose last name is one of them is answered with the key it
means: ``train.learning_rate`` → "did you mean train.lr?"."""


@dataclass
class StaleboundConfig:
    """The root of the tree."""

    config_aliases: ClassVar[Mapping[str, str]] = ALIASES
    config_switched_aliases: ClassVar[Mapping[str, typedconfig.Switch]] = AREAL_SWITCHED_ALIASES
    config_synonyms: ClassVar[Mapping[str, tuple[str, ...]]] = SYNONYMS

    seed: int = 0
    """Seed of every random choice (sampling, data order, simulated durations)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainSection = field(default_factory=TrainSection)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    """A user's dataset (``data.path``); when set, its rows replace the task's prompts and
    ``task.reward`` scores the answers (docs/data.md)."""
    run: RunConfig = field(default_factory=RunConfig)
    obs: ObsConfig = field(default_factory=ObsConfig)
    """Where the step metrics and the resolved config are logged besides the run directory's
    records: TensorBoard, Weights & Biases, MLflow (docs/observability.md)."""
    backend: Literal["local", "ray"] = "local"
    """``local``: engines and trainer in this machine's processes. ``ray``: as Ray actors, on a
    local instance or the cluster at ``ray.address`` (see docs/scale-out.md)."""
    ray: RayConfig = field(default_factory=RayConfig)


C = TypeVar("C")

_REFERENCE_HINT = "python -m stalebound.config --reference lists every key"


def _schema(base: type) -> typedconfig.Schema:
    return typedconfig.Schema(
        base,
        getattr(base, "config_aliases", None),
        switched=getattr(base, "config_switched_aliases", None),
        synonyms=getattr(base, "config_synonyms", None),
        reference_hint=_REFERENCE_HINT,
    )


@overload
def load_config(
    paths: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    *,
    data: Sequence[Mapping[str, Any]] = (),
) -> StaleboundConfig: ...


@overload
def load_config(
    paths: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    *,
    data: Sequence[Mapping[str, Any]] = (),
    base: type[C],
) -> C: ...


def load_config(
    paths: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    *,
    data: Sequence[Mapping[str, Any]] = (),
    base: type[Any] = StaleboundConfig,
) -> Any:
    """The config tree rooted at ``base``: its defaults, then each YAML file in ``paths``, then each
    mapping in ``data``, then the ``key.path=value`` overrides (values parsed as YAML).

    Aliases (``base.config_aliases``) are accepted everywhere. Raises one
    :class:`~stalebound.core.errors.ConfigError` listing every problem found, each as
    ``name=value: why; the fix``.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if isinstance(overrides, str):
        overrides = [overrides]
    schema = _schema(base)
    problems: list[str] = []
    layers = [typedconfig.file_layer(p, problems) for p in paths]
    given: Sequence[object] = data  # callers outside the type checker may pass anything
    for i, d in enumerate(given):
        if isinstance(d, Mapping):
            layers.append(typedconfig.Layer(d))
        else:
            problems.append(
                f"data[{i}]={typedconfig.show(d, 80)}: not a mapping; pass each layer as a "
                "mapping of keys to values"
            )
    layers.append(typedconfig.override_layer(overrides, problems))
    try:
        config = schema.load(layer for layer in layers if layer is not None)
    except ConfigError as exc:
        raise ConfigError([*problems, *exc.problems], omitted=exc.omitted) from None
    if problems:
        raise ConfigError(problems)
    return config


TRAIN_RECIPE = Path(__file__).parents[1] / "configs" / "train.yaml"
"""The main job's recipe: the base layer of ``stalebound train`` and ``stalebound bench``."""

USER_MODEL_RECIPE = Path(__file__).parents[1] / "configs" / "user_model.yaml"
"""What ``stalebound train`` adds on top of :data:`TRAIN_RECIPE` when ``engine.model_path`` names a
user's checkpoint: a learning rate for pretrained models, no warm start, micro-batches."""

BENCH_RECIPE = Path(__file__).parents[1] / "configs" / "bench.yaml"
"""What ``stalebound bench`` adds on top of :data:`TRAIN_RECIPE`: a heavy-tailed reward latency."""


def parse_cli_overrides(
    argv: Sequence[str], *, base: type[Any] = StaleboundConfig
) -> tuple[list[str], list[str]]:
    """Split a command line into ``(yaml_paths, overrides)`` for :func:`load_config`.

    Accepts positional ``CONFIG.yaml`` files (or ``--config CONFIG.yaml``), ``key.path=value``
    tokens, and AReaL-style flags ``--some-name VALUE`` / ``--a.b-c=VALUE`` (dashes become
    underscores), for every key and alias of the tree. Unknown flags raise one ConfigError.
    """
    return typedconfig.parse_argv(argv, _schema(base))


def dump_yaml(config: Any) -> str:
    """The resolved config as YAML; :func:`load_config` reads it back to an equal config."""
    return typedconfig.dump_yaml(config)


_REFERENCE_HEAD = """\
# Configuration reference

<!-- Generated by `python -m stalebound.config --reference`; do not edit by hand. -->

stalebound has one typed configuration tree, `stalebound.config.StaleboundConfig`. A run's settings
are, in order: the defaults below, then each YAML file, then `key.path=value` overrides, then
command-line flags. A later source replaces what an earlier one set, key by key.

```
stalebound train my.yaml rollout.group_size=8 engine.urls=[http://a:8000,http://b:8000] \\
    --max-head-offpolicyness 4 --max-concurrent-rollouts=64
python -m stalebound.config my.yaml --consumer-batch-size 16   # print what train runs with
```

* **Overrides** are `key.path=value`; the value is read as YAML (`8`, `true`, `null`, `[a, b]`,
  `{k: v}`). Quote a value to keep it a string: `name='"8"'`.
* **Flags** are `--key VALUE` or `--key=VALUE` for every key and alias below, with `-` for `_`
  (`--max-head-offpolicyness 1000`, `--rollout.group-size 8`). `--config FILE` names a YAML file.
* **Aliases**: the spellings of AReaL and PSRL configs (table at the end) are accepted in YAML files,
  overrides and flags. Giving one key under two spellings with different values in the same file, or
  in the same command line, is an error naming both. PSRL's two redundancy levels are spelled
  `psrl.redundant_rollout.buffer_size` (entries per buffer, B′ → `rollout.buffer_size`) and
  `psrl.redundant_rollout.rollout_n` (trajectories launched per group, N′ →
  `rollout.group_redundancy`), after PSRL's own `rollout_n` for N. AReaL's
  `max_head_offpolicyness` keeps AReaL's meaning, the admission bound: `rollout.deadline.target`
  under `staleness_policy: deadline` (wherever the policy is set), `rollout.staleness` otherwise.
* **Errors**: every problem is reported at once, one per line, as `name=value: why; the fix` (the
  first 20 spelt out, then how many more). Types are checked strictly: `"abc"` is not an integer,
  `4.0` is not an integer (an integer is a valid float), `null` is accepted only where the type
  says `or null`. An unknown key is answered with the key it most likely means: one whose last
  name is the same or means the same (`train.learning_rate` → `train.lr`, `rollout.n` →
  `rollout.group_size`; the words other trainers use are in `stalebound.config.SYNONYMS`), else
  the closest spelling in its own section, else anywhere.
* **Limits**: a YAML file may hold at most 1 MiB and 10,000 values, each alias counted as the
  whole value it names (a configuration holds a few hundred); larger files, and alias bombs, are
  refused before they are built.

Why dataclasses with our own validation rather than pydantic or OmegaConf's structured configs: the
tree stays plain typed Python (mypy checks every use of a setting, and each field's docstring is its
documentation, read into this page), the only runtime dependency is PyYAML for parsing, and the
loader reports all problems at once with a fix for each instead of stopping at the first. Rules sit
next to their fields (`bounds(...)` metadata, a `_validate` method for rules across fields), so a
new section gets loading, validation, aliases, flags and this page without code of its own.

## Keys

"""


def config_reference(base: type[Any] = StaleboundConfig) -> str:
    """Markdown documentation of every key (path, type, default, docstring) and every alias."""
    return _REFERENCE_HEAD + typedconfig.reference_tables(_schema(base))

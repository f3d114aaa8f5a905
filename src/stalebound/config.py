"""One typed configuration tree.

The loader (YAML files, ``key.path=value`` overrides, the seeds' aliases, validation that reports
every problem at once) is built around these dataclasses. Each field's docstring is its reference
documentation.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Literal, TypeVar, overload

from stalebound import typedconfig
from stalebound.core.errors import ConfigError
from stalebound.engines.devices import device_problems
from stalebound.runtime.config import (
    STALENESS_ALIASES,
    DeadlineConfig,
    FilterGroupsConfig,
    GroupPostProcessConfig,
    ProactiveFilterConfig,
    RolloutConfig,
)
from stalebound.tasks.config import TaskConfig
from stalebound.train.config import TrainConfig
from stalebound.typedconfig import Invalid, bounds

__all__ = [
    "ALIASES",
    "BENCH_RECIPE",
    "TRAIN_RECIPE",
    "DeadlineConfig",
    "EngineConfig",
    "FilterGroupsConfig",
    "GroupPostProcessConfig",
    "ProactiveFilterConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "StaleboundConfig",
    "config_reference",
    "dump_yaml",
    "load_config",
    "main",
    "parse_cli_overrides",
]


@dataclass
class EngineConfig:
    """The inference engines that generate rollouts."""

    kind: Literal["local", "vllm", "sglang"] = "local"
    """``local``: the embedded engine (a Hugging Face model in worker processes). ``vllm`` /
    ``sglang``: OpenAI-compatible servers at ``urls``."""
    model_path: str | None = None
    """A local Hugging Face checkpoint directory; ``None`` builds the default tiny model in
    ``cache_dir``. Nothing is downloaded."""
    cache_dir: str = ".stalebound/models"
    """Where the default model is built and reused."""
    replicas: int = field(default=1, metadata=bounds(ge=1, fix="run at least one engine"))
    """Local engine worker processes behind the router."""
    urls: list[str] = field(default_factory=list)
    """Server base URLs for ``vllm`` / ``sglang`` (one replica each)."""
    max_batch_size: int = field(default=256, metadata=bounds(ge=1, fix="e.g. 256 (the default)"))
    """Requests decoded together per local worker."""
    max_in_flight_per_engine: int | None = field(
        default=None, metadata=bounds(ge=1, fix="give a count, or null for no limit")
    )
    """The router's per-replica limit; further requests queue, oldest V_traj first."""
    interrupt_mode: Literal["continue", "resubmit"] = "continue"
    """On a weight update: ``continue`` in-flight requests with the new weights (partial rollout;
    every token keeps its version), or abort and ``resubmit`` prompt + partial output."""
    num_threads: int = field(default=1, metadata=bounds(ge=1, fix="e.g. 1 per worker"))
    """torch threads per local worker."""
    device: str = "auto"
    """Where local engine workers run: ``auto`` (a CUDA GPU when there is one, else the CPU),
    ``cpu``, ``cuda`` or ``cuda:N``. On the trainer's CUDA device, weights are published to the
    worker device to device (no copy through the CPU)."""
    weight_transfer: Literal["disk", "cuda_ipc"] = "disk"
    """How a step's weights reach ``vllm`` servers: ``disk`` writes a checkpoint directory the
    servers reload; ``cuda_ipc`` hands the trainer's GPU tensors to a server on the same GPU
    without the CPU (the server needs ``--worker-extension-cls
    stalebound.engines.vllm_ipc.WeightIPC``; see docs/models.md)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the local engines' weights and KV cache. Log-probabilities are computed in
    float32 from the logits either way; lower precision makes them differ more from the
    trainer's (see docs/models.md). ``float16`` needs a CUDA device."""
    temperature: float = field(default=1.0, metadata=bounds(ge=0, fix="0 is greedy, 1 samples"))
    """Sampling temperature of rollouts."""
    top_p: float = field(default=1.0, metadata=bounds(gt=0, le=1, fix="1 keeps every token"))
    """Nucleus sampling of rollouts."""

    def _validate(self) -> Iterator[Invalid]:
        if self.kind == "local":
            yield from _adapt_problems(device_problems("engine", self.device, self.dtype), "engine")
        if self.weight_transfer == "cuda_ipc" and self.kind != "vllm":
            yield Invalid(
                "weight_transfer",
                f"cuda_ipc is for vllm servers (kind={self.kind}); local engines on the trainer's "
                "GPU take its tensors device to device already",
                "set engine.weight_transfer=disk, or engine.kind=vllm",
            )
        if self.kind != "local" and not self.urls:
            yield Invalid(
                "urls",
                f"kind={self.kind} needs at least one server URL",
                "set engine.urls=[http://127.0.0.1:8000], or use engine.kind=local",
            )


@dataclass
class RunConfig:
    """The main job: how long it trains, where it writes, what it shows."""

    steps: int = field(default=60, metadata=bounds(ge=1, fix="train at least one step"))
    """Training steps (one consumed batch each)."""
    run_dir: str | None = None
    """The run directory; ``None`` makes ``runs/<date>-<time>``."""
    live: bool | None = None
    """The live terminal view: ``true`` always draws it, ``false`` prints a line per step, ``null``
    draws it on a terminal only."""
    eval_prompts: int = field(default=100, metadata=bounds(ge=1, fix="e.g. 100"))
    """Prompts of the greedy evaluation before and after RL."""
    target_reward: float = 0.6
    """The training reward (mean over the last 5 steps) that counts as reached for
    ``time_to_target_s``."""
    checkpoint: bool = True
    """Write checkpoints into ``RUN_DIR/checkpoints``: every ``checkpoint_every_steps`` steps and
    ``checkpoint_every_s`` seconds, at the end, and on SIGTERM/SIGINT (see docs/checkpoints.md)."""
    checkpoint_every_steps: int = field(
        default=20,
        metadata=bounds(ge=0, fix="e.g. 20; 0 writes one only at the end and on a signal"),
    )
    """Steps between periodic checkpoints (0: none)."""
    checkpoint_every_s: float = field(
        default=600.0, metadata=bounds(ge=0, fix="give seconds, e.g. 600; 0 turns the timer off")
    )
    """Seconds between periodic checkpoints, checked after each step (0: no timer)."""
    keep_checkpoints: int = field(
        default=2, metadata=bounds(ge=1, fix="keep at least one; 2 (the default) leaves a spare")
    )
    """How many of the newest checkpoints to keep; older ones are deleted once a new one is
    written, so a damaged newest one still leaves an intact one to resume from."""
    resume: str | None = None
    """Continue a run: its directory (the newest checkpoint in it) or one checkpoint directory
    (``RUN_DIR/checkpoints/step-000040``; later checkpoints move to ``RUN_DIR/abandoned/``).
    ``stalebound train resume=RUN_DIR`` reads the run's ``config.yaml`` first; overrides given
    with it (``run.steps=100``) still apply. A run with no checkpoint yet starts again."""
    plots: bool = True
    """Draw the PNG plots into the run directory at the end."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    trace: bool = True
    """Write ``trace.jsonl``: each episode's timing and tokens, for ``stalebound simulate
    --replay``."""


def _adapt_problems(problems: list[str], section: str) -> Iterator[Invalid]:
    """Turn a section's own ``name=value: why; fix`` strings into the loader's problems."""
    for text in problems:
        head, _, rest = text.partition(": ")
        key = head.split("=", 1)[0].removeprefix(section + ".").split(",")[0]
        why, _, fix = rest.partition("; ")
        yield Invalid(key, why, fix or "see docs/config.md")


@dataclass
class TrainSection(TrainConfig):
    """The trainer: GRPO with PPO clipping and the off-policy corrections (see docs/training.md)."""

    def _validate(self) -> Iterator[Invalid]:
        yield from _adapt_problems(self.problems(), "train")


@dataclass
class RayConfig:
    """The Ray backend (``backend: ray``): engine replicas and trainer ranks as Ray actors."""

    address: str | None = None
    """A cluster to join (``auto`` finds the one ``ray start`` runs on this node, or
    ``HOST:PORT``); ``None`` starts a local instance bound to 127.0.0.1."""
    num_cpus: int | None = field(
        default=None, metadata=bounds(ge=1, fix="give a count, or null for every core")
    )
    """CPUs of a local instance; ``None`` lets Ray count the cores."""
    object_store_memory: int | None = field(
        default=None,
        metadata=bounds(ge=78643200, fix="give bytes (at least 75 MiB), or null for Ray's default"),
    )
    """Object store size of a local instance in bytes; weights are published through it."""
    engine_num_cpus: float = field(
        default=1.0, metadata=bounds(ge=0, fix="e.g. 1 (a core per replica) or 0.5")
    )
    """CPUs reserved per engine actor (``engine.replicas`` of them)."""
    trainer_num_cpus: float = field(
        default=1.0, metadata=bounds(ge=0, fix="e.g. 1 (a core per rank) or 0.5")
    )
    """CPUs reserved per trainer rank."""
    train_data_parallel_size: int = field(
        default=1, metadata=bounds(ge=1, fix="use 1 for a single trainer rank")
    )
    """Trainer ranks; each step's groups are split across them and their gradients averaged."""
    rank_timeout_s: float = field(
        default=600.0, metadata=bounds(gt=0, fix="give seconds, e.g. 600 (the default)")
    )
    """How long a trainer rank waits for the others in a collective before failing."""


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
        # `stalebound train resume=RUN_DIR` and `--resume RUN_DIR`.
        "resume": "run.resume",
    }
)
"""The seeds' spellings, each mapped to its canonical key (accepted in YAML, overrides and flags)."""


@dataclass
class StaleboundConfig:
    """The root of the tree."""

    config_aliases: ClassVar[Mapping[str, str]] = ALIASES

    seed: int = 0
    """Seed of every random choice (sampling, data order, simulated durations)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainSection = field(default_factory=TrainSection)
    task: TaskConfig = field(default_factory=TaskConfig)
    run: RunConfig = field(default_factory=RunConfig)
    backend: Literal["local", "ray"] = "local"
    """``local``: engines and trainer in this machine's processes. ``ray``: as Ray actors, on a
    local instance or the cluster at ``ray.address`` (see docs/scale-out.md)."""
    ray: RayConfig = field(default_factory=RayConfig)


C = TypeVar("C")

_REFERENCE_HINT = "python -m stalebound.config --reference lists every key"


def _schema(base: type) -> typedconfig.Schema:
    return typedconfig.Schema(
        base, getattr(base, "config_aliases", None), reference_hint=_REFERENCE_HINT
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


TRAIN_RECIPE = Path(__file__).parent / "configs" / "train.yaml"
"""The main job's recipe: the base layer of ``stalebound train`` and ``stalebound bench``."""

BENCH_RECIPE = Path(__file__).parent / "configs" / "bench.yaml"
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
python -m stalebound.config my.yaml --consumer-batch-size 16   # print the resolved config
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
  `rollout.group_redundancy`), after PSRL's own `rollout_n` for N.
* **Errors**: every problem is reported at once, one per line, as `name=value: why; the fix` (the
  first 20 spelt out, then how many more). Types are checked strictly: `"abc"` is not an integer,
  `4.0` is not an integer (an integer is a valid float), `null` is accepted only where the type
  says `or null`.
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stalebound.config --reference`` prints the reference; otherwise the arguments
    are loaded like ``stalebound train``'s and the resolved config is printed as YAML."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--reference"]:
        sys.stdout.write(config_reference())
        return 0
    try:
        paths, overrides = parse_cli_overrides(args)
        config = load_config(paths, overrides)
    except ConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    sys.stdout.write(dump_yaml(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every check of ``stalebound train`` that can be made before anything is written or started.

The recipe calls :func:`preflight` first. It reads the settings, the checkpoint to resume, the
task's prompts and the paths, and returns the :class:`Plan` the recipe carries out; whatever is
wrong is raised as one :class:`~stalebound.core.errors.ConfigError` (or a
:class:`~stalebound.train.checkpoint.CheckpointError`) while the run directory is untouched and no
model, engine or trainer has started. A new check belongs here, in :func:`preflight`.

:func:`train_config` resolves the settings ``stalebound train`` runs with (what ``python -m
stalebound.config`` prints); :func:`refuse_a_held_run_dir` is the one check that needs the run
directory's lock, so the recipe calls it once it holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from stalebound.config import (
    TRAIN_RECIPE,
    USER_MODEL_RECIPE,
    StaleboundConfig,
    load_config,
    parse_cli_overrides,
)
from stalebound.core.deadline import deadline_bounds, default_margin
from stalebound.core.errors import ConfigError
from stalebound.engines.models import (
    CHARSET,
    SPECIAL_TOKENS,
    build_default_model,
    checkpoint_info,
    checkpoint_problem,
    is_default_model,
    load_tokenizer,
)
from stalebound.obs.loggers import logger_problems
from stalebound.runtime.config import STALENESS_ALIASES
from stalebound.tasks.base import Task
from stalebound.tasks.dataset import build_task
from stalebound.tasks.episode import Sample
from stalebound.tasks.workflow import context_problems, vocabulary_problems
from stalebound.train.backends import check_servers
from stalebound.train.checkpoint import (
    CHECKPOINTS,
    Checkpoint,
    checkpoint_dirs,
    find_checkpoint,
    run_config_of,
    run_dir_of,
)
from stalebound.train.jobstate import SavedJob, resume_settings
from stalebound.train.ledger import record_problems
from stalebound.train.limits import available_memory, memory_problems
from stalebound.train.verify import (
    VerifiedCheckpoint,
    ignored_on_resume,
    run_dir_problem,
    verify_checkpoint,
)
from stalebound.userfiles import label, writable_dir_problem

__all__ = [
    "Plan",
    "base_model_dir",
    "check_memory",
    "check_run_paths",
    "default_run_dir",
    "preflight",
    "refuse_a_held_run_dir",
    "train_config",
    "users_model",
    "verify_resume",
]


def train_config(argv: Sequence[str]) -> StaleboundConfig:
    """The settings ``stalebound train ARGV`` runs with, fully resolved: the train recipe
    (:data:`~stalebound.config.TRAIN_RECIPE`), then, when ``engine.model_path`` names a user's
    checkpoint, :data:`~stalebound.config.USER_MODEL_RECIPE`, then the YAML files, overrides and
    flags of ``argv``; the deadline policy's soft target and margin are filled in where left null.
    With ``resume=RUN``, the run's own ``config.yaml`` takes the recipes' place (what ``argv``
    says still applies on top) and the run keeps its directory."""
    paths, overrides = parse_cli_overrides(argv)
    cfg = load_config([TRAIN_RECIPE, *paths], overrides)
    if cfg.run.resume:
        saved = run_config_of(cfg.run.resume)
        problem = run_dir_problem(cfg.run.run_dir, saved.parent)
        if problem:
            raise ConfigError(problem)
        cfg = load_config([saved, *paths], [*overrides, f"run.run_dir={saved.parent}"])
    elif users_model(cfg):
        cfg = load_config([TRAIN_RECIPE, USER_MODEL_RECIPE, *paths], overrides)
    return _resolved(cfg)


def users_model(cfg: StaleboundConfig) -> bool:
    """Whether ``engine.model_path`` names a user's checkpoint rather than none or the embedded
    default model (whose recipe values are tuned for it)."""
    path = cfg.engine.model_path
    if not path:
        return False
    return not is_default_model(path, seed=cfg.seed)


def _resolved(cfg: StaleboundConfig) -> StaleboundConfig:
    """``cfg`` with what the deadline policy's nulls stand for written out: the soft target
    (η_h // 2) and the admission margin (⌈η_s / 4⌉)."""
    rollout = cfg.rollout
    if rollout.staleness_policy != "deadline":
        return cfg
    deadline = rollout.deadline
    soft, _ = deadline_bounds(deadline.target, rollout.staleness)
    margin = default_margin(soft) if deadline.margin is None else deadline.margin
    deadline = dataclasses.replace(deadline, target=soft, margin=margin)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(rollout, deadline=deadline))


@dataclass(frozen=True)
class Plan:
    """What the checks found: the run the recipe carries out."""

    cfg: StaleboundConfig
    """The settings, with ``run.run_dir`` decided."""
    run_dir: Path
    task: Task
    samples: list[Sample]
    """The task's prompts, read and checked against the model's context length."""
    base_dir: Path
    """The checkpoint the policy loads from: the one resumed from, ``engine.model_path``, or
    the default model."""
    resume: Checkpoint | None = None
    """The verified checkpoint the run continues from."""
    saved: SavedJob | None = None
    """The job's state in :attr:`resume`."""
    restart: bool = False
    """The run stopped before its first checkpoint and starts again from the beginning."""
    verified: VerifiedCheckpoint | None = None
    """:attr:`resume` read whole and checked, with the states the run loads."""


def preflight(cfg: StaleboundConfig, *, on_wait: Callable[[str], None] | None = None) -> Plan:
    """Every check before the run directory is touched, in order: the trainer ranks' settings,
    the loggers' packages, the checkpoint to resume (every
    file's checksum, the job's state, the settings it was written with, every file read whole,
    the records it cuts back to), the run directory, the task and its prompts, the paths, the
    size settings against the memory, the servers of ``engine.urls`` (they answer, within
    ``engine.startup_timeout_s``; ``on_wait`` hears of each one that is waited for), and the
    prompts against the model's context length. Raises ConfigError (or a CheckpointError) with
    nothing written."""
    from stalebound.train.parallel.settings import parallel_problems

    # the trainer ranks' settings across sections; the loggers' packages
    problems = parallel_problems(cfg) + logger_problems(cfg.obs.loggers)
    if problems:
        raise ConfigError(problems)
    resume = find_checkpoint(cfg.run.resume) if cfg.run.resume else None
    restart = bool(cfg.run.resume) and resume is None
    saved = SavedJob.read(resume) if resume is not None else None
    if restart:
        gone = run_config_of(cfg.run.resume or "").parent
        if (gone / "summary.json").is_file():  # starting it again would throw results away
            raise ConfigError(
                f"resume={cfg.run.resume!r}: the run finished without a checkpoint "
                "(run.checkpoint=false), so there is nothing to continue from; start a new "
                "run in another directory"
            )
    verified = None
    if resume is not None and saved is not None:
        check_resume_settings(cfg, resume, saved)
        verified = verify_resume(cfg, resume)
    if cfg.run.run_dir:
        run_dir = Path(cfg.run.run_dir)
    elif cfg.run.resume:
        run_dir = run_dir_of(resume.path if resume is not None else cfg.run.resume)
    else:
        run_dir = default_run_dir()
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
    # the task's own checks (and its prompt file) before the run directory is touched
    task = build_task(cfg)
    samples = list(task.samples())
    check_run_paths(cfg, run_dir, resuming=resume is not None)
    check_memory(cfg, resume)
    servers = check_servers(cfg, on_wait=on_wait)  # they answer, before the model loads
    if servers:
        raise ConfigError(servers)
    # the checkpoint's own vocabulary and limits (context length, chat template) against the
    # task's prompts
    base_dir = resume.path if resume is not None else base_model_dir(cfg)
    tokenizer = load_tokenizer(base_dir)
    problems = vocabulary_problems(tokenizer, samples) or context_problems(
        task, tokenizer, samples, checkpoint_info(base_dir).max_positions
    )
    if problems:
        raise ConfigError(problems)
    return Plan(cfg, run_dir, task, samples, base_dir, resume, saved, restart, verified)


def verify_resume(cfg: StaleboundConfig, resume: Checkpoint) -> VerifiedCheckpoint:
    """The checkpoint read whole and checked (:mod:`stalebound.train.verify`), the records it
    cuts back to checked, and no setting given that a resumed run would ignore."""
    run_dir = run_dir_of(resume.path)
    problem = run_dir_problem(cfg.run.run_dir, run_dir)
    problems = [problem] if problem else []
    problems += ignored_on_resume(cfg, load_config([run_config_of(str(resume.path))]))
    if problems:
        raise ConfigError(problems)
    verified = verify_checkpoint(resume, cfg.rollout)
    damaged = record_problems(run_dir, resume.step)
    if damaged:
        raise ConfigError(
            f"resume={cfg.run.resume!r}: the run's records up to step {resume.step} are "
            f"damaged ({'; '.join(damaged)}); repair them (remove the extra lines, or restore "
            "the files from a copy), then resume"
        )
    return verified


def check_memory(cfg: StaleboundConfig, resume: Checkpoint | None) -> None:
    """Refuse sizes the machine's memory cannot hold (:mod:`stalebound.train.limits`)."""
    from stalebound.engines.devices import resolve_device

    available = available_memory()
    if available is None:
        return
    model = resume.path if resume is not None else cfg.engine.model_path
    vocab = checkpoint_info(model).vocab_size if model else len(SPECIAL_TOKENS) + len(CHARSET)
    on_cpu = resolve_device(cfg.train.device) == "cpu"
    problems = memory_problems(cfg, available, vocab_size=vocab, trains_on_cpu=on_cpu)
    if problems:
        raise ConfigError(problems)


def check_resume_settings(cfg: StaleboundConfig, resume: Checkpoint, saved: SavedJob) -> None:
    """The settings the checkpoint was written with (:func:`resume_settings`) are ``cfg``'s, and
    ``run.steps`` reaches at least its step."""
    now = resume_settings(cfg)
    # checkpoints written before the bound had one name store it under AReaL's
    then = {STALENESS_ALIASES.get(k, k): v for k, v in saved.settings.items()}
    # a setting added since the checkpoint was written counts as unchanged at its default
    default = resume_settings(StaleboundConfig())
    changed = [
        f"{k}: {then.get(k)!r} → {now[k]!r}"
        for k in now
        if _differs(then.get(k, _ABSENT), now[k], default[k])
    ]
    if changed:
        raise ConfigError(
            f"resume={cfg.run.resume!r}: the checkpoint was written with other settings "
            f"({'; '.join(changed)}); resume with the run's own settings (its config.yaml) "
            "or start a new run"
        )
    if cfg.run.steps < resume.step:
        raise ConfigError(
            f"run.steps={cfg.run.steps}: the run is already at step {resume.step} "
            f"({resume.path}); give run.steps={resume.step} or more to continue it, or "
            "resume from an earlier checkpoint"
        )


_ABSENT = object()


def _differs(saved: Any, now: Any, default: Any) -> bool:
    """Whether a resumed run changes a setting: what the checkpoint lacks (a setting added
    since) is compared with its default."""
    if saved is _ABSENT:
        return bool(now != default)
    if isinstance(saved, dict) and isinstance(now, dict) and isinstance(default, dict):
        return any(_differs(saved.get(k, _ABSENT), v, default.get(k)) for k, v in now.items())
    return bool(saved != now)


def check_run_paths(cfg: StaleboundConfig, run_dir: Path, *, resuming: bool) -> None:
    """The paths ``stalebound train`` writes or reads: the run directory can be written, and
    (unless it resumes from a checkpoint) ``engine.model_path`` is a checkpoint whose config
    loads, or ``engine.cache_dir`` holds the default model or can be written. All problems at
    once, as one ConfigError."""
    problems = []
    problem = writable_dir_problem(
        run_dir,
        label("run.run_dir", run_dir),
        fix="choose a writable directory with free space (and names under 255 bytes)",
    )
    if problem:
        problems.append(problem)
    model_path = cfg.engine.model_path
    if resuming:
        pass  # the checkpoint holds the model
    elif model_path:
        problem = checkpoint_problem(model_path, "engine.model_path") or _config_problem(model_path)
        if problem:
            problems.append(problem)
    else:
        built = Path(cfg.engine.cache_dir) / f"default-seed{cfg.seed}"
        if not is_default_model(built, seed=cfg.seed):
            problem = writable_dir_problem(
                built,
                label("engine.cache_dir", cfg.engine.cache_dir),
                fix="give a writable directory for the default model, or engine.model_path="
                "a checkpoint directory",
            )
            if problem:
                problems.append(problem)
    if problems:
        raise ConfigError(problems)


def _config_problem(model_path: str) -> str | None:
    """Why Hugging Face cannot read the checkpoint's config (an unknown model type, say)."""
    from transformers import AutoConfig  # transformers loads on first use

    try:
        AutoConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = " ".join(str(exc).split())[:300]
        return (
            f"{label('engine.model_path', model_path)}: its config.json does not load ({why}); "
            "give a directory written by save_pretrained"
        )
    return None


def refuse_a_held_run_dir(run_dir: Path) -> None:
    """A new run never writes into a directory that holds another run (ConfigError naming how to
    continue that one). Checked under the run directory's lock, where no other process can
    start a run there in between."""
    held = [n for n in ("metrics.jsonl", "ledger.jsonl", CHECKPOINTS) if (run_dir / n).exists()]
    if not held:
        return
    if checkpoint_dirs(run_dir / CHECKPOINTS):
        raise ConfigError(
            f"run.run_dir={str(run_dir)!r}: already holds a run ({', '.join(held)}); continue "
            f"it with resume={run_dir}, or choose a new directory"
        )
    raise ConfigError(
        f"run.run_dir={str(run_dir)!r}: already holds a run that stopped before its first "
        f"checkpoint ({', '.join(held)}); start it again from the beginning with "
        f"resume={run_dir}, or choose a new directory"
    )


def base_model_dir(cfg: StaleboundConfig) -> Path:
    """The checkpoint a new run starts from: ``engine.model_path``, or the default tiny model
    (built once into ``engine.cache_dir``)."""
    if cfg.engine.model_path:
        return Path(cfg.engine.model_path)
    return build_default_model(Path(cfg.engine.cache_dir) / f"default-seed{cfg.seed}")


def default_run_dir() -> Path:
    """``runs/<date>-<time>``: where a run goes when ``run.run_dir`` names no directory."""
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S-%f")

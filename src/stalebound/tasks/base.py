"""Samples, trajectories, the task interface and the task registry.

A *task* turns samples (a question and its reference answer) into prompts, scores a model's answer
(the reward) and reports per-trajectory metrics — ``score``, ``acc``, ``seq_reward`` and
``seq_final_reward``, the names the dynamic sampling filter reads. Users add tasks with
:func:`register_task`::

    @register_task("copy")
    class CopyTask(Task):
        ...

    task = make_task(TaskConfig(name="copy"))
"""

from __future__ import annotations

import abc
import importlib
import math
import random
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from stalebound.core.errors import ConfigError
from stalebound.tasks.charset import check_text
from stalebound.tasks.config import TaskConfig
from stalebound.tasks.episode import Sample, TokenizerLike, Trajectory, Turn, Workflow
from stalebound.tasks.latency import latency_problems, sample_latency
from stalebound.tasks.workflow import SingleTurnWorkflow, as_workflow, await_reward, encode_prompt
from stalebound.userfiles import json_line, label, read_lines

__all__ = [
    "Sample",
    "Task",
    "TaskFactory",
    "Trajectory",
    "Turn",
    "builtin_data_path",
    "list_tasks",
    "load_samples",
    "make_task",
    "register_task",
]


class Task(abc.ABC):
    """A verifiable task. Subclasses implement generation of samples, prompt formatting, the
    reference solution and the reward; :meth:`metrics` and :meth:`workflow` have defaults."""

    name: str = ""
    """The registry name (set by :func:`register_task`)."""

    def __init__(self, config: TaskConfig) -> None:
        self.config = config

    # -- what a task defines -------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, rng: random.Random, index: int) -> Sample:
        """Draw sample number ``index`` from ``rng`` (deterministic given the rng state)."""

    @abc.abstractmethod
    def prompt(self, sample: Sample) -> str:
        """The prompt text the model continues (within the charset)."""

    @abc.abstractmethod
    def demonstration(self, sample: Sample) -> tuple[Turn, ...]:
        """A correct episode, turn by turn: what supervised warm start trains on."""

    @abc.abstractmethod
    def reward(self, sample: Sample, response: str) -> float:
        """The reward of the final answer ``response``: 1.0 for exact match; below 1.0 for partial
        credit if the task documents one and ``config.partial_credit`` is on; else 0.0."""

    # -- defaults ------------------------------------------------------------------------------
    def difficulty(self, sample: Sample) -> float:
        """How hard ``sample`` is, on the task's own scale (larger is harder): what the data audit
        (:mod:`stalebound.obs.audit`) buckets prompts by. By default the length of the reference
        answer in characters; a task with a better measure overrides it."""
        return float(len(sample.answer))

    def metrics(
        self, sample: Sample, response: str, *, truncated: bool = False
    ) -> dict[str, float]:
        """Per-trajectory metrics: ``score`` (the reward), ``acc`` (exact match), ``seq_reward``
        (the sum of rewards over the sequence) and ``seq_final_reward`` (the reward of the final
        answer). For outcome-reward tasks the last three coincide with ``score`` except ``acc``,
        which ignores partial credit. A truncated episode scores 0."""
        if truncated:
            return {"score": 0.0, "acc": 0.0, "seq_reward": 0.0, "seq_final_reward": 0.0}
        score = float(self.reward(sample, response))
        acc = 1.0 if response == sample.answer else 0.0
        return {"score": score, "acc": acc, "seq_reward": score, "seq_final_reward": score}

    async def score(
        self, sample: Sample, response: str, *, truncated: bool = False
    ) -> dict[str, float]:
        """:meth:`metrics` of the final answer ``response``, after the reward's latency
        (``config.reward_latency``; a real sleep, recorded as ``reward_wait_s``)."""
        metrics = self.metrics(sample, response, truncated=truncated)
        await await_reward(self, sample, metrics)
        return metrics

    def reward_delay(self, sample: Sample) -> float:
        """Seconds the reward of one answer to ``sample`` takes to arrive
        (``config.reward_latency``; 0.0 when it is off). Each call draws anew, so the members of a
        group wait different times; a draw is seeded by the task seed, the sample id and how many
        draws that sample had before, so a replayed run waits the same."""
        latency = self.config.reward_latency
        if latency.distribution == "none":
            return 0.0
        draws: dict[str, int] = self.__dict__.setdefault("_reward_draws", {})
        k = draws.get(sample.id, 0)
        draws[sample.id] = k + 1
        return sample_latency(latency, random.Random(f"{self.config.seed}:{sample.id}:reward:{k}"))

    def encode(self, tokenizer: TokenizerLike, sample: Sample) -> list[int]:
        """The token ids of the first prompt of an episode on ``sample``."""
        return encode_prompt(tokenizer, self.prompt(sample))

    def workflow(self, tokenizer: TokenizerLike) -> Workflow:
        """The episode runner for this task: one model turn by default."""
        return SingleTurnWorkflow(self, tokenizer)

    user_workflow: Workflow | None = None
    """The workflow the run names (``rollout.workflow``), used in place of :meth:`workflow`."""

    def episode_workflow(self, tokenizer: TokenizerLike) -> Workflow:
        """The workflow episodes of this task run: :attr:`user_workflow` if set, else
        :meth:`workflow` (one written for the earlier ``run(generate, sample)`` interface is
        adapted, with a DeprecationWarning)."""
        if self.user_workflow is not None:
            return self.user_workflow
        return as_workflow(self.workflow(tokenizer))

    def samples(self) -> list[Sample]:
        """The task's samples as ``config`` says: from ``data_path``, the shipped file
        (``"builtin"``), or ``num_prompts`` generated from ``seed``."""
        path = self.config.data_path
        if path is None:
            return self.generate_samples(self.config.num_prompts, self.config.seed)
        if path == "builtin":
            return load_samples(builtin_data_path(self.name))
        return load_samples(path)

    def data_plan(
        self, samples: list[Sample], eval_prompts: int, rng: random.Random
    ) -> tuple[list[Sample], Iterable[Sample]]:
        """The evaluation prompts and the training data loader: ``eval_prompts`` samples drawn
        with ``rng``, and all of ``samples`` in an order shuffled with it (the executor cycles the
        loader, epoch after epoch)."""
        eval_set = rng.sample(samples, min(eval_prompts, len(samples)))
        order = list(samples)
        rng.shuffle(order)
        return eval_set, order

    def loader_metrics(self, order: Iterable[Sample]) -> dict[str, float]:
        """Step metrics of the training loader :meth:`data_plan` returned (none here)."""
        return {}

    def generate_samples(self, n: int, seed: int) -> list[Sample]:
        """``n`` samples drawn from ``random.Random(seed)``; the same seed gives the same list."""
        if n < 1:
            raise ConfigError(f"num_prompts={n}: must be >= 1; ask for at least one sample")
        rng = random.Random(seed)
        out = [self.generate(rng, i) for i in range(n)]
        for s in out:
            check_text(self.prompt(s), what=f"{self.name} prompt")
            check_text(s.answer, what=f"{self.name} answer")
        return out


TaskFactory = Callable[[TaskConfig], Task]
"""Anything that builds a task from its config (a :class:`Task` subclass qualifies)."""

_REGISTRY: dict[str, TaskFactory] = {}
_F = TypeVar("_F", bound=TaskFactory)

_BUILTINS = ("arithmetic", "strings", "calculator")
"""The modules of the built-in tasks, imported (and so registered) on the registry's first use:
importing the task settings (``stalebound.config``) loads no task."""
_BUILTIN_MODULES = frozenset(f"stalebound.tasks.{m}" for m in _BUILTINS)
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # first: their own register_task calls come back here
    for module in sorted(_BUILTIN_MODULES):
        importlib.import_module(module)


def register_task(name: str) -> Callable[[_F], _F]:
    """Class or factory decorator: make the task available as ``TaskConfig(name=name)``.

    Registering a name twice raises :class:`ConfigError` (pick another name)."""

    def deco(factory: _F) -> _F:
        if getattr(factory, "__module__", None) not in _BUILTIN_MODULES:
            _load_builtins()  # the built-in names are taken before a user's task can claim one
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ConfigError(
                f"task name={name!r}: already registered by {_REGISTRY[name]!r}; choose another name"
            )
        _REGISTRY[name] = factory
        if isinstance(factory, type) and issubclass(factory, Task):
            factory.name = name
        return factory

    return deco


def list_tasks() -> list[str]:
    """The registered task names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def make_task(config: TaskConfig) -> Task:
    """Build the task ``config.name`` (raises :class:`ConfigError` for an unknown name)."""
    _load_builtins()
    try:
        factory = _REGISTRY[config.name]
    except KeyError:
        raise ConfigError(
            f"task.name={config.name!r}: not a registered task; use one of {list_tasks()} or "
            "register yours with @stalebound.tasks.register_task"
        ) from None
    problems = latency_problems(config.reward_latency, "task.reward_latency")
    try:
        task = factory(config)
    except ConfigError as exc:  # report the task's problems and these together
        raise ConfigError([*problems, *exc.problems]) from None
    if problems:
        raise ConfigError(problems)
    task.name = config.name
    return task


def builtin_data_path(name: str) -> Path:
    """The JSONL file shipped for built-in task ``name`` (see ``scripts/make_task_data.py``)."""
    path = Path(str(resources.files("stalebound.tasks") / "data" / f"{name}.jsonl"))
    if not path.is_file():
        raise ConfigError(
            f"task.data_path='builtin' for task {name!r}: no shipped file {path}; set "
            "task.data_path to your own JSONL file or to null to generate samples"
        )
    return path


def load_samples(path: str | Path) -> list[Sample]:
    """Read samples from a JSONL file (one JSON object per line) or a Parquet file (needs
    ``pyarrow``). Each record needs string-convertible ``question`` and ``answer``; ``id`` is
    optional (default: the record's index); other fields go to :attr:`Sample.data`."""
    p = Path(path)
    head = label("task.data_path", path)
    fix = "give a JSONL or Parquet file of question/answer records"
    records: list[dict[str, Any]]
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            raise ConfigError(
                f"task.data_path={str(path)!r}: reading Parquet needs pyarrow; "
                "`pip install pyarrow` or convert the file to JSONL"
            ) from None
        try:
            records = list(pq.read_table(p).to_pylist())
        except Exception as e:  # pyarrow's errors (a missing or damaged file) share no base
            raise ConfigError(f"{head}: cannot read it as Parquet ({e}); {fix}") from None
    else:
        records = []
        # streamed line by line: a record longer than MAX_LINE_BYTES or a binary file is refused
        # at its first line, without reading the rest into memory
        for lineno, line, _ in read_lines(p, head, fix=fix):
            if not line.strip():
                continue
            rec = json_line(
                line,
                f"task.data_path={str(path)!r} line {lineno}",
                fix="write one JSON object per line",
            )
            if not isinstance(rec, dict):
                raise ConfigError(
                    f"task.data_path={str(path)!r} line {lineno}: {str(rec)[:80]!r} is not an "
                    'object; write records like {"question": "1+2", "answer": "3"}'
                )
            records.append(rec)
    samples = []
    for i, rec in enumerate(records):
        missing = [k for k in ("question", "answer") if k not in rec]
        if missing:
            raise ConfigError(
                f"task.data_path={str(path)!r} record {i}: missing {missing}; every record needs "
                "'question' and 'answer'"
            )
        for key in ("question", "answer"):
            value = rec[key]
            usable = (isinstance(value, str) and value.strip()) or (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
            if not usable:
                raise ConfigError(
                    f"task.data_path={str(path)!r} record {i}: {key}={value!r} is not a prompt "
                    f"one can train on; give every record a non-empty {key} (text or a finite "
                    "number), or remove the record"
                )
        # any text: what the model's tokenizer cannot encode is refused once it is known
        # (stalebound.tasks.workflow.vocabulary_problems)
        question, answer = str(rec["question"]), str(rec["answer"])
        extra = {k: v for k, v in rec.items() if k not in ("id", "question", "answer")}
        samples.append(Sample(str(rec.get("id", i)), question, answer, extra))
    if not samples:
        raise ConfigError(f"task.data_path={str(path)!r}: the file holds no records")
    return samples

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
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from stalebound.core.errors import ConfigError
from stalebound.tasks.charset import check_text
from stalebound.tasks.config import TaskConfig
from stalebound.tasks.latency import latency_problems, sample_latency
from stalebound.userfiles import json_line, label, read_lines

if TYPE_CHECKING:
    from stalebound.tasks.workflow import TokenizerLike, Workflow

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


@dataclass(frozen=True)
class Sample:
    """One prompt of a task: ``question`` is what the task formats into a prompt, ``answer`` the
    reference answer the reward compares against; ``data`` holds any other fields of the record."""

    id: str
    question: str
    answer: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    """One turn of a reference solution: ``model`` turns are what the policy should write (each
    ends with the end-of-sequence token), ``tool`` turns are inserted by the environment."""

    text: str
    role: Literal["model", "tool"] = "model"


@dataclass
class Trajectory:
    """One finished episode, in tokens, as the trainer consumes it.

    ``output_ids`` are everything after the prompt: the model's tokens and, in multi-turn episodes,
    the tool results inserted between its turns (``loss_mask`` 0: they are not trained on).
    ``behaviour_logprobs[i]`` and ``versions[i]`` are the log-probability and policy version of
    ``output_ids[i]`` as reported by the engine (tool tokens carry 0.0 and the version of the model
    token before them). ``version`` is V_traj, the policy version when generation started; ``None``
    means ``min(versions)``. ``truncated`` is true when the episode did not finish (length limit,
    turn limit or abort); the loss may mask it.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float
    truncated: bool = False
    loss_mask: list[int] | None = None
    version: int | None = None
    sample_id: str = ""
    response: str = ""
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        lengths = {
            "behaviour_logprobs": len(self.behaviour_logprobs),
            "versions": len(self.versions),
        }
        if self.loss_mask is not None:
            lengths["loss_mask"] = len(self.loss_mask)
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ConfigError(
                f"trajectory {self.sample_id!r}: output_ids has {n} tokens but {bad}; every "
                "per-token list must have one entry per output token"
            )

    @property
    def v_traj(self) -> int:
        """V_traj: ``version`` if set, else the smallest per-token version (0 if no tokens)."""
        if self.version is not None:
            return self.version
        return min(self.versions, default=0)

    @property
    def num_trained_tokens(self) -> int:
        """Output tokens the loss sees (``loss_mask`` 1)."""
        return len(self.output_ids) if self.loss_mask is None else sum(self.loss_mask)


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

    def workflow(self, tokenizer: TokenizerLike) -> Workflow:
        """The episode runner for this task: one model turn by default."""
        from stalebound.tasks.workflow import SingleTurnWorkflow

        return SingleTurnWorkflow(self, tokenizer)

    def samples(self) -> list[Sample]:
        """The task's samples as ``config`` says: from ``data_path``, the shipped file
        (``"builtin"``), or ``num_prompts`` generated from ``seed``."""
        path = self.config.data_path
        if path is None:
            return self.generate_samples(self.config.num_prompts, self.config.seed)
        if path == "builtin":
            return load_samples(builtin_data_path(self.name))
        return load_samples(path)

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


def register_task(name: str) -> Callable[[_F], _F]:
    """Class or factory decorator: make the task available as ``TaskConfig(name=name)``.

    Registering a name twice raises :class:`ConfigError` (pick another name)."""

    def deco(factory: _F) -> _F:
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
    return sorted(_REGISTRY)


def make_task(config: TaskConfig) -> Task:
    """Build the task ``config.name`` (raises :class:`ConfigError` for an unknown name)."""
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
        question = check_text(str(rec["question"]), what=f"record {i} question")
        answer = check_text(str(rec["answer"]), what=f"record {i} answer")
        extra = {k: v for k, v in rec.items() if k not in ("id", "question", "answer")}
        samples.append(Sample(str(rec.get("id", i)), question, answer, extra))
    if not samples:
        raise ConfigError(f"task.data_path={str(path)!r}: the file holds no records")
    return samples

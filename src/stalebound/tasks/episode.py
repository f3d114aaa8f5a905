"""What a task and its workflows share: samples, turns, trajectories, and the interfaces an
episode runs against (the tokenizer, the engine a workflow generates with, the workflow, the task
as a workflow sees it).

Kept apart from :mod:`stalebound.tasks.base` (the task interface and registry) and
:mod:`stalebound.tasks.workflow` (the episode runners) so that those two import this module and
not each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from stalebound.core.errors import ConfigError

if TYPE_CHECKING:
    from stalebound.tasks.config import TaskConfig

__all__ = [
    "EpisodeTask",
    "GenerateFn",
    "Generation",
    "LegacyWorkflow",
    "Prompt",
    "PromptedGeneration",
    "Sample",
    "TokenizerLike",
    "Trajectory",
    "Turn",
    "Workflow",
    "WorkflowEngine",
]


@dataclass(frozen=True)
class Sample:
    """One prompt of a task: ``question`` is what the task formats into a prompt, ``answer`` the
    reference answer the reward compares against; ``data`` holds any other fields of the record."""

    id: str
    question: str
    answer: str
    data: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """The row read as a mapping: a dataset's column (``row["answer"]``, ``row["topic"]``),
        ``row["prompt"]`` (the text or the chat messages), else a field of ``data`` or of the
        sample itself (``id``, ``question``, ``answer``). A missing name is a ``KeyError``."""
        columns = self.data.get("columns", {})
        if key in columns:
            return columns[key]
        if key in self.data:
            return self.data[key]
        if key in ("id", "question", "answer"):
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


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


class Generation(Protocol):
    """What one ``generate`` call returns (the engines' ``GenerateResponse`` fits)."""

    @property
    def output_ids(self) -> Sequence[int]: ...
    @property
    def output_logprobs(self) -> Sequence[float]: ...
    @property
    def output_versions(self) -> Sequence[int]: ...
    @property
    def finish_reason(self) -> str: ...


class GenerateFn(Protocol):
    """``await generate(input_ids, max_new_tokens, stop_token_ids)`` → :class:`Generation`: one
    model turn on an engine (what :class:`WorkflowEngine` is built over)."""

    async def __call__(
        self, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]
    ) -> Generation: ...


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the workflows and the trainer use."""

    eos_token_id: Any
    bos_token_id: Any
    pad_token_id: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> Any: ...


Prompt = Sequence[int] | Sequence[Mapping[str, str]]
"""What a workflow generates from: token ids, or chat messages (``{"role", "content"}`` mappings)
that the tokenizer's chat template renders with the generation prompt appended."""


class WorkflowEngine(Protocol):
    """The engine as a workflow's ``arun_episode`` sees it (one object per episode).

    ``agenerate`` runs one model turn: ``prompt`` is token ids or chat messages;
    ``max_new_tokens`` defaults to ``task.config.max_new_tokens`` and ``stop_token_ids`` to
    :attr:`stop_token_ids`. The answer carries ``input_ids`` (the prompt as the model saw it),
    ``output_ids``, ``output_logprobs``, ``output_versions`` (the policy version of each token) and
    ``finish_reason`` (``stop`` | ``length`` | ``abort``); the stop token is part of
    ``output_ids``. ``encode_row(row)`` is the row's prompt as token ids, rendered as the task
    renders it; ``get_version()`` the policy version the engine generates with now. ``score`` is
    the run's reward of a final answer: a mapping with ``score`` (the reward) and other metrics;
    a user's reward that fails raises :class:`~stalebound.tasks.EpisodeFailed`, which ends the
    episode as failed with its cause.
    """

    @property
    def tokenizer(self) -> TokenizerLike: ...
    @property
    def task(self) -> EpisodeTask: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    def get_version(self) -> int: ...
    def encode_row(self, row: Sample) -> list[int]: ...
    async def agenerate(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> PromptedGeneration: ...
    async def score(
        self, row: Sample, completion: str, *, truncated: bool = False
    ) -> dict[str, float]: ...


class PromptedGeneration(Generation, Protocol):
    """One model turn with the prompt it continued (``input_ids``)."""

    @property
    def input_ids(self) -> Sequence[int]: ...


class Workflow(Protocol):
    """Runs one episode: ``await workflow.arun_episode(engine, row)`` → :class:`Trajectory`
    (``None`` rejects the episode). ``row`` is the :class:`Sample` the episode is on."""

    async def arun_episode(self, engine: WorkflowEngine, row: Sample) -> Trajectory | None: ...


class LegacyWorkflow(Protocol):
    """The interface before :class:`Workflow` (``run(generate, sample)``); still run, through
    :func:`stalebound.tasks.workflow.as_workflow`, with a DeprecationWarning."""

    async def run(self, generate: GenerateFn, sample: Sample) -> Trajectory: ...


class EpisodeTask(Protocol):
    """The part of a :class:`~stalebound.tasks.base.Task` a workflow uses."""

    @property
    def config(self) -> TaskConfig: ...
    def prompt(self, sample: Sample) -> str: ...
    def encode(self, tokenizer: TokenizerLike, sample: Sample) -> list[int]: ...
    def metrics(
        self, sample: Sample, response: str, *, truncated: bool = False
    ) -> dict[str, float]: ...
    def reward_delay(self, sample: Sample) -> float: ...
    async def score(
        self, sample: Sample, response: str, *, truncated: bool = False
    ) -> dict[str, float]: ...

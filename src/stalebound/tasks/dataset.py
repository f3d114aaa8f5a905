"""A user's data and reward as a task: rows in, the user's reward function out.

:class:`DataTask` turns the rows of ``data.path`` into samples and scores answers with the
function ``task.reward`` names (a built-in verifier by default: ``exact``). Its workflow renders a
prompt through the tokenizer's chat template when the row is a conversation or a system prompt is
set, generates one model turn, and awaits the reward. A reward that fails (raises, outlives
``task.reward_timeout_s``, returns None, NaN or no number) ends the episode as failed with the
cause ``reward:<why>``, counted per cause like every other failure; the run goes on.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from stalebound.core.errors import ConfigError, DataExhausted
from stalebound.data import DataConfig, DataPosition, Message, Row, RowStream
from stalebound.plugins import load_workflow
from stalebound.rewards import RewardFunction
from stalebound.tasks.base import Task, make_task
from stalebound.tasks.config import TaskConfig
from stalebound.tasks.episode import Sample, TokenizerLike, Turn
from stalebound.tasks.workflow import SingleTurnWorkflow, encode_chat, encode_prompt

__all__ = ["DataTask", "DataWorkflow", "EpisodeFailed", "build_task", "encode_messages"]


class EpisodeFailed(Exception):
    """An episode that ended without a usable trajectory; ``cause`` is how it is counted."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


def encode_messages(tokenizer: TokenizerLike, messages: Sequence[Message]) -> list[int]:
    """A row's conversation as token ids, rendered by the tokenizer's chat template with the
    generation prompt appended; a tokenizer without a template is a ConfigError naming the data
    settings."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.messages_key / data.system_prompt: the tokenizer has no chat template to "
            "render a conversation with; use a checkpoint whose tokenizer has one "
            "(tokenizer_config.json's chat_template), or plain text prompts without a system "
            "prompt"
        )
    return encode_chat(tokenizer, [{"role": m.role, "content": m.content} for m in messages])


def _sample(row: Row) -> Sample:
    """A row as a :class:`Sample` holding plain data only (samples go into checkpoints)."""
    prompt: str | list[dict[str, str]]
    if isinstance(row.prompt, str):
        question, prompt = row.prompt, row.prompt
    else:  # what a person reads as the question: the last user turn
        question = next(m.content for m in reversed(row.prompt) if m.role == "user")
        prompt = [{"role": m.role, "content": m.content} for m in row.prompt]
    columns = dict(row.columns)
    if row.answer is not None:
        columns["answer"] = row.answer
    return Sample(row.id, question, row.answer or "", {"prompt": prompt, "columns": columns})


def _messages(sample: Sample, system: str | None) -> tuple[Message, ...]:
    prompt = sample.data["prompt"]
    turns = (
        (Message("user", prompt),)
        if isinstance(prompt, str)
        else tuple(Message(m["role"], m["content"]) for m in prompt)
    )
    if system and turns[0].role != "system":
        turns = (Message("system", system), *turns)
    return turns


class DataTask(Task):
    """The rows of ``data`` scored by ``config.reward`` (see the module docstring)."""

    name = "data"

    def __init__(self, config: TaskConfig, data: DataConfig, *, seed: int = 0) -> None:
        super().__init__(config)
        self.data = data
        self.seed = seed
        self.stream = RowStream(data, seed=seed)
        self.stream.check()
        first = self.stream.head(1)
        columns = ["answer", *first[0].columns] if first else None
        self.reward_fn = RewardFunction(
            config.reward,
            timeout_s=config.reward_timeout_s,
            workers=config.reward_workers,
            columns=columns,
        )

    def samples(self) -> list[Sample]:
        """The first ``data.check_rows`` rows (what is checked before the run, and what a
        supervised warm start draws from); training streams the whole data (:meth:`data_plan`)."""
        return [_sample(row) for row in self.stream.head(self.data.check_rows)]

    def data_plan(
        self, samples: list[Sample], eval_prompts: int, rng: random.Random
    ) -> tuple[list[Sample], Iterable[Sample]]:
        """Evaluation on the held-out rows (``data.eval_path`` or ``data.eval_fraction``), else on
        ``eval_prompts`` of the first rows; training on every row of ``data.path``, streamed,
        shuffled anew each epoch with the run's seed."""
        if self.data.eval_path is not None or self.data.eval_fraction > 0:
            n = min(eval_prompts, self.data.eval_rows)
            held = RowStream(self.data, seed=self.seed, split="eval")
            eval_set = [_sample(row) for row in held.head(n)]
        else:
            eval_set = rng.sample(samples, min(eval_prompts, len(samples)))
        return eval_set, _Epochs(self.data, self.seed)

    def loader_metrics(self, order: Iterable[Sample]) -> dict[str, float]:
        return order.metrics() if isinstance(order, _Epochs) else {}

    def generate(self, rng: random.Random, index: int) -> Sample:
        raise ConfigError(
            "task.num_prompts: a dataset's task does not generate samples; its rows come from "
            "data.path"
        )

    def prompt(self, sample: Sample) -> str:
        return sample.question

    def demonstration(self, sample: Sample) -> tuple[Turn, ...]:
        if not sample.answer:
            raise ConfigError(
                "train.warm_start_steps: a supervised warm start trains on the reference "
                "answers, and data.answer_key names none; set train.warm_start_steps=0"
            )
        return (Turn(sample.answer),)

    def reward(self, sample: Sample, response: str) -> float:
        raise NotImplementedError("a dataset's reward is awaited: see DataTask.score")

    async def score(
        self, sample: Sample, response: str, *, truncated: bool = False
    ) -> dict[str, float]:
        """The user's reward of ``response`` (0 when ``truncated``), with its extra metrics as
        ``reward/<name>``; a reward that fails raises :class:`EpisodeFailed` (``reward:<why>``)."""
        outcome = await self.reward_fn.score(
            sample.data["prompt"], response, sample.data["columns"]
        )
        if outcome.reward is None:
            raise EpisodeFailed(f"reward:{outcome.failure}", outcome.detail)
        reward = 0.0 if truncated else outcome.reward
        return {
            "score": reward,
            "acc": 1.0 if reward >= 1.0 else 0.0,
            "seq_reward": reward,
            "seq_final_reward": reward,
            **{f"reward/{k}": v for k, v in outcome.metrics.items()},
        }

    def workflow(self, tokenizer: TokenizerLike) -> DataWorkflow:
        return DataWorkflow(self, tokenizer)

    def encode(self, tokenizer: TokenizerLike, sample: Sample) -> list[int]:
        """The prompt's token ids (the chat template when the row needs it)."""
        prompt, system = sample.data["prompt"], self.data.system_prompt
        if isinstance(prompt, str) and not system:
            return encode_prompt(tokenizer, prompt)
        return encode_messages(tokenizer, _messages(sample, system))


class _Epochs:
    """The training rows as samples, one epoch per pass (each pass shuffled with the next
    epoch's seed), for the executor's loader: a resumed run draws again from the first pass and
    skips what was drawn, which gives the same rows in the same order. After ``data.epochs``
    passes it raises :class:`DataExhausted`, which ends the run once what was drawn is trained."""

    def __init__(self, data: DataConfig, seed: int) -> None:
        self.data = data
        self.seed = seed
        self.passes = 0
        self.skipped = 0  # rows found bad after the check, in the passes so far

    def __iter__(self) -> Iterator[Sample]:
        epochs = self.data.epochs
        if epochs is not None and self.passes >= epochs:
            raise DataExhausted(
                f"data.epochs={epochs}: every row of {self.data.path!r} was drawn {epochs} "
                f"time{'s' if epochs > 1 else ''}"
            )
        stream = RowStream(self.data, seed=self.seed)
        stream.seek(DataPosition(self.passes, 0))
        self.passes += 1
        before = self.skipped
        for row in stream:
            if stream.position.epoch != self.passes - 1:
                return
            self.skipped = before + stream.skipped
            yield _sample(row)
        self.skipped = before + stream.skipped

    def metrics(self) -> dict[str, float]:
        """Step metrics of the data: the rows skipped so far."""
        return {"data/skipped_rows": float(self.skipped)}

    def __repr__(self) -> str:
        return f"data.path={self.data.path!r}"


class DataWorkflow(SingleTurnWorkflow):
    """Prompt (the chat template when the row needs it) → one model turn → the user's reward
    (awaited)."""

    def _encode_prompt(self, sample: Sample) -> list[int]:
        return self.task.encode(self.tokenizer, sample)


def build_task(cfg: Any) -> Task:
    """The run's task: a :class:`DataTask` over ``cfg.data`` when ``data.path`` is set, else the
    registered task ``cfg.task.name``; its episodes run the workflow ``rollout.workflow`` names
    when set (loaded, checked and constructed here, before the run writes anything).
    (``cfg`` is a :class:`~stalebound.config.StaleboundConfig`.)"""
    task = (
        DataTask(cfg.task, cfg.data, seed=cfg.seed)
        if cfg.data.path is not None
        else make_task(cfg.task)
    )
    if cfg.rollout.workflow is not None:
        task.user_workflow = load_workflow(cfg.rollout.workflow, cfg.rollout.workflow_args)
    elif cfg.rollout.workflow_args:
        raise ConfigError(
            f"rollout.workflow_args={cfg.rollout.workflow_args!r}: arguments for a workflow "
            "class, and rollout.workflow names none; name the class (rollout.workflow=module:Class) "
            "or drop the arguments"
        )
    return task

"""A rollout workflow for the executor over any engine: a task's episode with unique request ids."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from stalebound.engines import GenerateRequest, SamplingParams
from stalebound.tasks.workflow import EpisodeEngine


class TaskEpisodes:
    """``arun_episode(engine, sample)`` runs ``task``'s workflow on ``engine``."""

    def __init__(self, task: Any, tokenizer: Any, *, temperature: float = 1.0) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.workflow = task.episode_workflow(tokenizer)
        self.temperature = temperature
        self.ids = itertools.count()

    async def arun_episode(self, engine: Any, sample: Any) -> Any:
        rid = f"{sample.id}#{next(self.ids)}"

        async def generate(ids: Sequence[int], max_new_tokens: int, stop: Sequence[int]) -> Any:
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=self.temperature,
                stop_token_ids=tuple(stop),
            )
            return await engine.agenerate(GenerateRequest(rid, tuple(ids), sampling))

        episode = EpisodeEngine(generate, self.tokenizer, self.task, engine.get_version)
        return await self.workflow.arun_episode(episode, sample)

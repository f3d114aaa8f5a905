"""Sampling from a Hugging Face model in this process: for warm start, evaluation and tests.

This is not an inference engine (no continuous batching, no weight updates mid-request); the
engines in :mod:`stalebound.engines` are. It reports what an engine reports — per-token raw
log-probabilities (temperature 1) and versions — so its output feeds the trainer the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stalebound.tasks.base import Sample, Task, Trajectory
from stalebound.tasks.workflow import (
    EpisodeEngine,
    SingleTurnWorkflow,
    TokenizerLike,
    decode_text,
    encode_prompt,
    eos_id,
    stop_ids,
)

__all__ = ["LocalGenerateFn", "LocalGeneration", "evaluate", "generate_batch", "rollout_groups"]


@dataclass(frozen=True)
class LocalGeneration:
    """One generated sequence (the fields of an engine's response)."""

    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_versions: tuple[int, ...]
    finish_reason: str


@torch.no_grad()
def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    version: int = 0,
) -> list[LocalGeneration]:
    """Sample a continuation of every prompt (left-padded into one batch, KV-cached).

    ``temperature`` 0 is greedy. Each sequence stops after ``eos_token_id`` (one id or several;
    included, finish reason ``stop``) or ``max_new_tokens`` tokens (``length``). Seed with ``torch.manual_seed``.
    """
    was_training = model.training
    model.eval()
    stops = [eos_token_id] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attn[i, width - len(p) :] = 1
    greedy = temperature == 0
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_k=None,
        top_p=None,
        eos_token_id=stops,
        pad_token_id=pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    if was_training:
        model.train()
    new = out.sequences[:, width:]
    logp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], dim=1)
    chosen = logp.gather(-1, new[:, :, None]).squeeze(-1).cpu()
    new = new.cpu()
    results = []
    for i in range(len(prompts)):
        toks = new[i].tolist()
        n = next((j + 1 for j, t in enumerate(toks) if t in stops), len(toks))
        finish = "stop" if n and toks[n - 1] in stops else "length"
        results.append(
            LocalGeneration(tuple(toks[:n]), tuple(chosen[i, :n].tolist()), (version,) * n, finish)
        )
    return results


class LocalGenerateFn:
    """A :class:`~stalebound.tasks.workflow.GenerateFn` over a local model, one call at a time
    (for multi-turn workflows in evaluation and tests)."""

    def __init__(self, model: Any, *, temperature: float = 1.0, version: int = 0) -> None:
        self.model = model
        self.temperature = temperature
        self.version = version

    async def __call__(
        self, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]
    ) -> LocalGeneration:
        eos = int(stop_token_ids[0])
        return generate_batch(
            self.model,
            [input_ids],
            max_new_tokens=max_new_tokens,
            eos_token_id=[int(i) for i in stop_token_ids],
            pad_token_id=eos,
            temperature=self.temperature,
            version=self.version,
        )[0]


def rollout_groups(
    model: Any,
    tokenizer: TokenizerLike,
    task: Task,
    samples: Sequence[Sample],
    group_size: int,
    *,
    temperature: float = 1.0,
    version: int = 0,
    failed: list[str] | None = None,
) -> list[list[Trajectory]]:
    """``group_size`` sampled trajectories per sample, as groups (what a synchronous RL step
    trains on). Single-turn tasks are sampled in one batch; others run their workflow. With
    ``failed``, an episode that fails on its own (raises; the cause of an
    :class:`~stalebound.tasks.EpisodeFailed`, else ``error:<Type>``) is left out of its group and
    its cause appended there."""
    workflow = task.episode_workflow(tokenizer)
    if type(workflow) is not SingleTurnWorkflow:
        gen = LocalGenerateFn(model, temperature=temperature, version=version)
        engine = EpisodeEngine(gen, tokenizer, task, lambda: version)

        async def one(s: Sample) -> Trajectory | None:
            try:
                return await workflow.arun_episode(engine, s)
            except Exception as e:  # a user's reward or workflow failed: counted, not fatal
                if failed is None:
                    raise
                cause = getattr(e, "cause", None)
                failed.append(cause if isinstance(cause, str) else f"error:{type(e).__name__}")
                return None

        async def run_all() -> list[list[Trajectory]]:
            groups = [[await one(s) for _ in range(group_size)] for s in samples]
            return [[t for t in g if t is not None] for g in groups]

        return asyncio.run(run_all())
    eos = eos_id(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = [encode_prompt(tokenizer, task.prompt(s)) for s in samples]
    flat = [p for p in prompts for _ in range(group_size)]
    gens = generate_batch(
        model,
        flat,
        max_new_tokens=task.config.max_new_tokens,
        eos_token_id=stop_ids(tokenizer),
        pad_token_id=int(pad),
        temperature=temperature,
        version=version,
    )
    groups: list[list[Trajectory]] = []
    for i, s in enumerate(samples):
        group = []
        for j in range(group_size):
            g = gens[i * group_size + j]
            truncated = g.finish_reason != "stop"
            response = decode_text(tokenizer, g.output_ids)
            metrics = task.metrics(s, response, truncated=truncated)
            group.append(
                Trajectory(
                    prompt_ids=prompts[i],
                    output_ids=list(g.output_ids),
                    behaviour_logprobs=list(g.output_logprobs),
                    versions=list(g.output_versions),
                    reward=metrics["score"],
                    truncated=truncated,
                    version=version,
                    sample_id=s.id,
                    response=response,
                    metrics=metrics,
                )
            )
        groups.append(group)
    return groups


def evaluate(
    model: Any,
    tokenizer: TokenizerLike,
    task: Task,
    samples: Sequence[Sample],
    *,
    temperature: float = 0.0,
) -> dict[str, float]:
    """Mean ``score`` and ``acc`` of ``model`` on ``samples`` (greedy by default); an episode
    whose reward failed counts 0 and is counted in ``failed``."""
    failed: list[str] = []
    groups = rollout_groups(
        model, tokenizer, task, samples, 1, temperature=temperature, failed=failed
    )
    trajs = [t for g in groups for t in g]
    n = max(len(trajs) + len(failed), 1)
    return {
        "score": sum(t.metrics.get("score", t.reward) for t in trajs) / n,
        "acc": sum(t.metrics.get("acc", float(t.reward >= 1.0)) for t in trajs) / n,
        "response_length": sum(len(t.output_ids) for t in trajs) / max(len(trajs), 1),
        "failed": float(len(failed)),
    }

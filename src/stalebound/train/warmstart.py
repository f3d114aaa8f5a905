"""Warm start: a short supervised phase on a task's reference solutions before RL.

RL from a randomly initialised tiny model would see reward 0 everywhere (every GRPO group has zero
variance, no signal). As in LLM post-training, where RL starts from a pretrained and instruction-
tuned model, :func:`warm_start` first trains the model with cross-entropy on
``prompt → demonstration`` for a few steps: the loss covers the model turns (and their end-of-turn
tokens), never the prompt or the tool replies. It is deliberately short — enough for a non-zero
reward and well-formed answers, far from solving the task — so RL has something left to learn.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stalebound.core.errors import ConfigError
from stalebound.tasks.base import Sample, Task
from stalebound.tasks.workflow import TokenizerLike, encode_prompt, encode_text, eos_id

__all__ = ["WarmStartStats", "demonstration_batch", "demonstration_tokens", "warm_start"]


@dataclass(frozen=True)
class WarmStartStats:
    """What warm start did: steps, the first and last batch loss, time taken."""

    steps: int
    first_loss: float
    last_loss: float
    seconds: float


def demonstration_tokens(
    tokenizer: TokenizerLike, task: Task, sample: Sample
) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of prompt + reference solution: model turns (each followed by the
    end-of-sequence token) have mask 1; the prompt (with its chat template), tool turns and every
    special token other than the end-of-sequence token have mask 0."""
    eos = eos_id(tokenizer)
    ids = encode_prompt(tokenizer, task.prompt(sample))
    mask = [0] * len(ids)
    special = set(getattr(tokenizer, "all_special_ids", ())) - {eos}
    for turn in task.demonstration(sample):
        toks = encode_text(tokenizer, turn.text)
        if turn.role == "model":
            toks.append(eos)
        ids += toks
        mask += [1 if turn.role == "model" and t not in special else 0 for t in toks]
    return ids, mask


def demonstration_batch(
    demonstrations: Sequence[tuple[list[int], list[int]]], pad: int, device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, target_mask)`` of :func:`demonstration_tokens` results,
    right-padded with ``pad``; ``target_mask[:, j]`` says whether token ``j + 1`` is trained."""
    width = max(len(ids) for ids, _ in demonstrations)
    ids = torch.full((len(demonstrations), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(demonstrations), width - 1))
    for i, (toks, m) in enumerate(demonstrations):
        ids[i, : len(toks)] = torch.tensor(toks)
        attn[i, : len(toks)] = 1
        mask[i, : len(toks) - 1] = torch.tensor(m[1:], dtype=torch.float32)
    return ids.to(device), attn.to(device), mask.to(device)


def warm_start(
    model: Any,
    tokenizer: TokenizerLike,
    task: Task,
    steps: int,
    *,
    samples: Sequence[Sample] | None = None,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> WarmStartStats:
    """Train ``model`` for ``steps`` AdamW steps of cross-entropy on ``task``'s demonstrations.

    ``samples`` defaults to ``task.samples()``; batches are drawn from them with
    ``random.Random(seed)``. The model's weights change in place; the optimizer is discarded.
    """
    if steps < 0 or batch_size < 1:
        raise ConfigError(
            f"warm_start steps={steps}, batch_size={batch_size}: need steps >= 0, batch_size >= 1"
        )
    t0 = time.perf_counter()
    pool = list(samples) if samples is not None else task.samples()
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id(tokenizer)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    first = last = float("nan")
    for step in range(steps):
        batch = [demonstration_tokens(tokenizer, task, rng.choice(pool)) for _ in range(batch_size)]
        ids, attn, mask = demonstration_batch(batch, int(pad), device)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).view_as(mask)
        loss = (nll * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = float(loss.detach())
        if step == 0:
            first = last
    return WarmStartStats(steps, first, last, time.perf_counter() - t0)

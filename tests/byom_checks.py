"""Checks shared by the CPU tests and the GPU tier (tests/gpu): the same measurement, any device."""

from __future__ import annotations

from pathlib import Path

import torch

from stalebound.engines.models import load_model, load_tokenizer
from stalebound.tasks import TaskConfig, make_task
from stalebound.train import TrainConfig, Trainer, warm_start
from stalebound.train.warmstart import demonstration_batch, demonstration_tokens


def fixed_batch_losses(model_dir: Path, device: str, *, rows: int = 32) -> tuple[float, float]:
    """The supervised loss (mean NLL of the reference answers) of one fixed batch, computed by
    the trainer in float32 and in bfloat16, after a short warm start (so the loss is not just
    log(vocabulary))."""
    model = load_model(model_dir, device=device)
    tok = load_tokenizer(model_dir)
    task = make_task(TaskConfig())
    warm_start(model, tok, task, 20, batch_size=32, seed=0)
    demos = [demonstration_tokens(tok, task, s) for s in task.samples()[:rows]]
    ids, attn, mask = demonstration_batch(demos, int(tok.pad_token_id), device)
    losses = []
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(model, config=TrainConfig(dtype=dtype), pad_token_id=tok.pad_token_id)  # type: ignore[arg-type]
        with torch.no_grad():
            lp, _ = trainer.logprobs(ids, attn)
        losses.append(float(-(lp * mask).sum() / mask.sum()))
    return losses[0], losses[1]

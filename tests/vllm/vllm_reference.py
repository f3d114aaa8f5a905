"""Reference computations with transformers for the vLLM tier (same weights as the server)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Server:
    """The session's vLLM server: its URL, the checkpoint it serves, its log."""

    url: str
    model_dir: Path
    log: str


def teacher_forced_logprobs(
    model: Any, prompt: Sequence[int], output: Sequence[int]
) -> list[float]:
    """``log_softmax(logits)[output[i]]`` of ``model`` over ``prompt + output`` (one forward pass)."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    start = len(prompt) - 1
    rows = logprobs[start : start + len(output)]
    return rows[torch.arange(len(output)), torch.tensor(output)].tolist()


def greedy_margins(model: Any, prompt: Sequence[int], output: Sequence[int]) -> list[float]:
    """For each output token: max log-prob minus the token's log-prob (0 for an exact argmax)."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    start = len(prompt) - 1
    rows = logprobs[start : start + len(output)]
    chosen = rows[torch.arange(len(output)), torch.tensor(output)]
    return (rows.max(dim=-1).values - chosen).tolist()

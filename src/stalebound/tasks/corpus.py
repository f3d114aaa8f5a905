"""The built-in tasks' text: what a tokenizer built for them learns its vocabulary from."""

from __future__ import annotations

from stalebound.tasks.base import list_tasks, make_task
from stalebound.tasks.config import TaskConfig

__all__ = ["task_corpus"]


def task_corpus() -> list[str]:
    """The prompts and reference solutions of every registered task, with the chat templates'
    role words (what the BPE merges of
    :func:`~stalebound.engines.models.build_bpe_tokenizer` learn from)."""
    texts = ["user", "assistant", "[INST] ", " [/INST]"]
    for name in list_tasks():
        task = make_task(TaskConfig(name=name))
        for sample in task.samples():
            texts.append(task.prompt(sample))
            texts.extend(turn.text for turn in task.demonstration(sample))
    return texts

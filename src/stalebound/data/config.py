"""Dataset settings (the ``data`` section): pure dataclasses, one docstring per field."""

from __future__ import annotations

from dataclasses import dataclass, field

from stalebound.typedconfig import bounds

__all__ = ["DataConfig"]


@dataclass
class DataConfig:
    """Where a user's prompts come from and which columns mean what.

    ``path`` names local files only (nothing is downloaded): one file, a list of files, a glob, or
    a directory written by ``datasets.Dataset.save_to_disk``. JSON Lines, JSON (an array of
    objects), Parquet and CSV are read through Hugging Face ``datasets`` in streaming mode, so a
    file of any size starts at once and is never held in memory whole. Every column other than
    the prompt travels with the row to the reward function and the workflow.
    """

    path: str | list[str] | None = None
    """The training data: a file, a list of files, a glob (``data/*.jsonl``) or a ``save_to_disk``
    directory; ``None`` keeps the task's own prompts."""
    prompt_key: str = "question"
    """The column holding the prompt text (ignored when ``messages_key`` is set)."""
    answer_key: str | None = "answer"
    """The column holding the reference answer (passed to the reward as ``answer``); ``None``
    when the data has none (the reward then judges the completion alone)."""
    messages_key: str | None = None
    """The column holding a chat list of ``{role, content}`` messages (at least one ``user``
    turn); the prompt is then rendered with the tokenizer's chat template."""
    system_prompt: str | None = None
    """A system message put before every prompt (a chat list's own system turn is kept)."""
    eval_path: str | list[str] | None = None
    """Held-out data for evaluation, in the same forms as ``path``."""
    eval_fraction: float = field(
        default=0.0,
        metadata=bounds(
            ge=0.0, le=0.5, fix="e.g. 0.05 holds out 5 % of the rows for evaluation (at most half)"
        ),
    )
    """Without ``eval_path``: hold out this share of ``path``'s rows for evaluation (chosen by a
    hash of the seed and the row's position, so the split is the same on every epoch and resume)."""
    eval_rows: int = field(default=64, metadata=bounds(ge=1, fix="evaluate on at least one row"))
    """Evaluate on at most this many held-out rows."""
    shuffle: bool = True
    """Shuffle the rows with the run's seed (a new order each epoch)."""
    shuffle_buffer: int = field(
        default=10_000, metadata=bounds(ge=1, fix="e.g. 10000 (rows held in memory to shuffle)")
    )
    """Rows held in memory to shuffle a stream (a file smaller than this is shuffled whole)."""
    epochs: int | None = field(default=None, metadata=bounds(ge=1, fix="at least one epoch"))
    """Passes over the data; ``None``: as many as the run's steps take. The run ends when the last
    pass is used up, also before ``run.steps``."""
    check_rows: int = field(
        default=10_000, metadata=bounds(ge=1, fix="e.g. 10000 rows checked before training")
    )
    """Rows checked before anything starts (a column missing, a prompt that is not text); a bad
    row found later is skipped and counted."""

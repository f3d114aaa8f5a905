"""One row of a user's dataset, as the reward and the workflow see it.

A record of the dataset becomes a :class:`Row`: its prompt (text, or a chat list of
``{role, content}`` messages), its reference answer if the data has one, and every other column
unchanged. :func:`make_row` checks a record and says exactly what is wrong with it and how to fix
the data or the setting; it imports nothing heavy, so the checks run before any model loads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from stalebound.data.config import DataConfig

__all__ = ["ROLES", "Message", "Row", "RowError", "make_row"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have."""

_INDEX = "__stalebound_index__"  # the column the source adds: the row's position in the data


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: str
    content: str


@dataclass(frozen=True)
class Row:
    """A dataset record: ``prompt`` is text or a tuple of messages; ``answer`` the reference
    answer (``None`` when the data has none); ``columns`` every other column, read-only.
    ``index`` is the record's position in the data (the same on every epoch and resume) and
    ``id`` the record's ``id`` column if it has one, else the index as text."""

    index: int
    id: str
    prompt: str | tuple[Message, ...]
    answer: str | None
    columns: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def messages(self, system_prompt: str | None = None) -> tuple[Message, ...]:
        """The prompt as chat messages (a text prompt is one user turn), with ``system_prompt``
        first unless the conversation has its own system turn."""
        turns = (Message("user", self.prompt),) if isinstance(self.prompt, str) else self.prompt
        if system_prompt and not (turns and turns[0].role == "system"):
            turns = (Message("system", system_prompt), *turns)
        return turns


class RowError(ValueError):
    """A record that cannot be trained on: the message names the row, the value and the fix."""


def _where(source: str, index: int) -> str:
    return f"{source} row {index}"


def _text(value: Any) -> str | None:
    """A prompt or answer as text: strings as they are, finite numbers written out (CSV readers
    turn ``72`` into an int); anything else is not text."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    return None


def _messages(value: Any, where: str, key: str) -> tuple[Message, ...]:
    fix = f'give {key} as a list like [{{"role": "user", "content": "..."}}]'
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise RowError(f"{where}: {key}={_short(value)} is not a list of messages; {fix}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise RowError(
                f"{where}: {key}[{i}]={_short(m)} is not a {{role, content}} message; {fix}"
            )
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise RowError(
                f"{where}: {key}[{i}] role={role!r} is not one of {list(ROLES)}; use one of them"
            )
        if not isinstance(content, str):
            raise RowError(
                f"{where}: {key}[{i}] content={_short(content)} is not text; write the message "
                "as a string"
            )
        out.append(Message(role, content))
    if not any(m.role == "user" for m in out):
        raise RowError(
            f"{where}: {key} has no user turn ({[m.role for m in out]}); every conversation "
            "needs at least one message with role 'user'"
        )
    if out[-1].role == "assistant":
        raise RowError(
            f"{where}: {key} ends with an assistant turn; the model answers the last turn, so end "
            "the conversation with a user (or tool) message"
        )
    return tuple(out)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def make_row(record: Mapping[str, Any], cfg: DataConfig, *, source: str, index: int) -> Row:
    """The :class:`Row` of one record; raises :class:`RowError` for a record that lacks a column
    the settings name or whose prompt is not text (or not a conversation)."""
    where = _where(source, index)
    columns = [k for k in record if k != _INDEX]
    key = cfg.messages_key or cfg.prompt_key
    setting = "data.messages_key" if cfg.messages_key else "data.prompt_key"
    if key not in record:
        raise RowError(
            f"{setting}={key!r}: {where} has no such column (its columns: {columns}); set "
            f"{setting} to the column that holds the prompt"
        )
    prompt: str | tuple[Message, ...]
    if cfg.messages_key:
        prompt = _messages(record[key], where, key)
    else:
        text = _text(record[key])
        if text is None or not text.strip():
            raise RowError(
                f"{where}: {key}={_short(record[key])} is not a prompt one can train on; give "
                "every row non-empty text (or use data.messages_key for chat lists)"
            )
        prompt = text
    answer = None
    if cfg.answer_key is not None:
        if cfg.answer_key not in record:
            raise RowError(
                f"data.answer_key={cfg.answer_key!r}: {where} has no such column (its columns: "
                f"{columns}); set data.answer_key to the column of reference answers, or null "
                "if the data has none"
            )
        answer = _text(record[cfg.answer_key])
        if answer is None:
            raise RowError(
                f"{where}: {cfg.answer_key}={_short(record[cfg.answer_key])} is not an answer "
                "a reward can compare against; write it as text or a number"
            )
    taken = {key, cfg.answer_key, _INDEX}
    extra = {k: v for k, v in record.items() if k not in taken}
    given_id = record.get("id")
    return Row(
        index=index,
        id=str(given_id) if given_id is not None else str(index),
        prompt=prompt,
        answer=answer,
        columns=MappingProxyType(extra),
    )

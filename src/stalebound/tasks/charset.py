"""The character set every built-in task writes its prompts and answers in.

A character-level tokenizer built from :data:`CHARSET` (plus its own special tokens such as
``<pad>``, ``<bos>``, ``<eos>``) can encode every prompt, answer, tool call and tool result of the
built-in tasks. Tasks check their text against it (:func:`check_text`), so a new task that strays
outside it fails loudly instead of producing unknown tokens.
"""

from __future__ import annotations

from stalebound.core.errors import ConfigError

__all__ = ["CHARSET", "check_text"]

CHARSET: str = "0123456789abcdefghijklmnopqrstuvwxyz +-*=?.,:;()[]"
"""Digits, lowercase letters, space, ``+ - * = ?`` and ``. , : ; ( ) [ ]`` — 50 characters, in a
fixed order (a tokenizer may use the position as the token id offset)."""

_ALLOWED = frozenset(CHARSET)


def check_text(text: str, *, what: str) -> str:
    """Return ``text`` unchanged if every character is in :data:`CHARSET`, else raise
    :class:`~stalebound.core.errors.ConfigError` naming the offending characters."""
    bad = sorted(set(text) - _ALLOWED)
    if bad:
        raise ConfigError(
            f"{what}={text!r}: characters {bad!r} are outside stalebound.tasks.charset.CHARSET; "
            "lowercase the text or extend CHARSET (and rebuild the tokenizer)"
        )
    return text

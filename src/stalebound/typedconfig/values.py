"""Values as a user writes them: in messages (``key=value``, YAML flow style, shortened) and in
the dump of a whole tree (block-style YAML that loads back to an equal tree)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

__all__ = ["dump_yaml", "show", "to_plain", "visible"]


def to_plain(value: Any) -> Any:
    """Dataclasses, tuples and mappings as plain YAML-able dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def show(value: Any, limit: int | None = None) -> str:
    """``value`` as it would be written after ``key=`` (YAML flow style), optionally shortened."""
    if value is None or isinstance(value, bool):  # the common scalars without a YAML dump
        return "null" if value is None else str(value).lower()
    if type(value) is int and -(10**15) < value < 10**15:
        return str(value)
    try:
        text = yaml.safe_dump(
            to_plain(value),
            default_flow_style=True,
            allow_unicode=True,
            width=2**30,
            sort_keys=False,
        ).strip()
    except (yaml.YAMLError, RecursionError, TypeError, ValueError):
        text = _fallback_repr(value)
    if text.endswith("\n..."):
        text = text[: -len("\n...")].strip()
    text = " ".join(text.split("\n"))
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def _fallback_repr(value: Any) -> str:
    # repr() itself fails on an integer beyond Python's digit limit (ValueError) or on a structure
    # nested past the recursion limit; a message must still name something.
    try:
        return repr(value)
    except (ValueError, RecursionError):
        if isinstance(value, int):
            return f"<an integer of {value.bit_length()} bits>"
        return f"<a {type(value).__name__} too large to show>"


def visible(name: str, limit: int = 80) -> str:
    """``name`` for the head of a message: quoted when blank (so the message still names it),
    shortened when long."""
    text = name if name.strip() and name == name.strip() else repr(name)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def dump_yaml(config: Any) -> str:
    """The whole tree as block-style YAML, reloadable to an equal tree."""
    text: str = yaml.safe_dump(
        to_plain(config), sort_keys=False, allow_unicode=True, default_flow_style=False
    )
    return text

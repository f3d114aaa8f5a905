"""The fields of a config dataclass: the rules declared next to them (:func:`bounds`,
:func:`null_means`, the :class:`Invalid` problems of a ``_validate`` hook) and what their type
annotations say (optional or not, a section or a value, the type in words)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from stalebound.typedconfig.values import show

__all__ = [
    "BOUNDS_KEY",
    "NULL_AS_KEY",
    "Bounds",
    "Invalid",
    "KeyPath",
    "bounds",
    "default_of",
    "dotted",
    "field_types",
    "is_section",
    "null_means",
    "phrase",
    "problems_as_invalid",
    "split_optional",
    "type_name",
]

KeyPath = tuple[str, ...]

BOUNDS_KEY = "stalebound.bounds"
NULL_AS_KEY = "stalebound.null_as"


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A numeric range rule for one field (``None`` values of an optional field always pass)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    fix: str = ""

    def violated(self, value: float) -> bool:
        """True when ``value`` is outside the range (NaN is outside every range)."""
        # Written as "not inside" so that NaN, which compares false with everything, fails.
        inside = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )
        return not inside

    def describe(self) -> str:
        """The range in words, e.g. ``≥ 0`` or ``> 0 and ≤ 1``."""
        parts = []
        if self.ge is not None:
            parts.append(f"≥ {show(self.ge)}")
        if self.gt is not None:
            parts.append(f"> {show(self.gt)}")
        if self.le is not None:
            parts.append(f"≤ {show(self.le)}")
        return " and ".join(parts)


def bounds(
    *, ge: float | None = None, gt: float | None = None, le: float | None = None, fix: str
) -> dict[str, Any]:
    """Field metadata: the value must lie in the range; ``fix`` tells the user what to write."""
    return {BOUNDS_KEY: Bounds(ge=ge, gt=gt, le=le, fix=fix)}


def null_means(value: Any) -> dict[str, Any]:
    """Field metadata: a YAML ``null`` given for this field stands for ``value``.

    For settings whose upstream spelling uses ``null`` as a named choice (PSRL writes
    ``method: null`` for "no proactive filter").
    """
    return {NULL_AS_KEY: value}


class Invalid(NamedTuple):
    """One problem found by a dataclass's ``_validate`` hook.

    ``key`` is the field's name relative to the dataclass (``"buffer_size"``, or a dotted path into a
    nested section); the loader prefixes the section path and the current value.
    """

    key: str
    why: str
    fix: str


def problems_as_invalid(
    problems: Iterable[str], section: str, *, fix: str = "see docs/config.md"
) -> Iterator[Invalid]:
    """A section's own checks, written as ``section.key=value: why; the fix`` lines, as the
    loader's problems (``fix`` for a line that gives none)."""
    for text in problems:
        head, _, rest = text.partition(": ")
        key = head.split("=", 1)[0].removeprefix(section + ".").split(",")[0]
        why, _, given_fix = rest.partition("; ")
        yield Invalid(key, why, given_fix or fix)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` → ``(X, True)``; anything else → ``(tp, False)``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = get_args(tp)
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) < len(args):
            return (rest[0] if len(rest) == 1 else Union[rest]), True  # noqa: UP007
    return tp, False


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def phrase(tp: Any) -> str:
    """The type in words, as in "must be <phrase>"."""
    inner, optional = split_optional(tp)
    origin = get_origin(inner)
    if inner is bool:
        text = "true or false"
    elif inner is int:
        text = "an integer"
    elif inner is float:
        text = "a number"
    elif inner is str:
        text = "a string"
    elif origin is Literal:
        text = "one of " + ", ".join(show(a) for a in get_args(inner))
    elif origin in (list, tuple, Sequence):
        text = "a list"
    elif origin in (dict, Mapping):
        text = "a mapping"
    elif origin in (Union, types.UnionType):
        text = " or ".join(phrase(a) for a in get_args(inner))
    elif is_section(inner):
        text = "a mapping of its fields"
    else:
        text = "any value"
    return text + (" or null" if optional else "")


def type_name(tp: Any) -> str:
    """The type as the reference documents it."""
    inner, optional = split_optional(tp)
    origin = get_origin(inner)
    if isinstance(inner, type) and not is_section(inner) and origin is None:
        text = inner.__name__
    elif origin is Literal:
        text = "one of " + ", ".join(f"`{show(a)}`" for a in get_args(inner))
    elif origin in (list, tuple, Sequence):
        text = f"list of {type_name(get_args(inner)[0])}"
    elif origin in (dict, Mapping):
        text = f"mapping of str to {type_name(get_args(inner)[1])}"
    elif is_section(inner):
        text = "section"
    elif inner is Any:
        text = "any"
    else:
        text = " or ".join(type_name(a) for a in get_args(inner))
    return text + (" or null" if optional else "")


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def dotted(path: KeyPath) -> str:
    return ".".join(path)

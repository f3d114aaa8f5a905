"""Typed configuration trees: load any tree of dataclasses from YAML layers and dotted overrides.

The machinery behind :mod:`stalebound.config`, generic over the root dataclass so every section of
the tree gets parsing, conversion, validation, aliases, CLI flags, dumping and reference docs without
code of its own.

* A *layer* is one YAML file, one mapping, or the list of ``key.path=value`` overrides. Layers are
  applied in order; a later layer replaces what an earlier one set, key by key.
* Values are parsed by PyYAML; the conversion to each field's declared type is done here and is
  strict: ``"abc"`` is never an integer, ``4.0`` is not an integer, an integer is accepted for a float.
* Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``X | None``,
  unions, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, ``Any``, and nested dataclasses (as
  sections, optional sections, or list items).
* Validation rules live next to the fields: :func:`bounds` and :func:`null_means` in a field's
  ``metadata``, and a ``_validate(self) -> Iterable[Invalid]`` method on a dataclass for rules that
  involve several fields. Every problem is collected and raised at once in one
  :class:`~stalebound.core.errors.ConfigError`, each as ``name=value: why; the fix``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, Union, get_args, get_origin

import yaml

from stalebound.core.errors import MAX_LISTED_PROBLEMS, ConfigError
from stalebound.userfiles import read_text

__all__ = [
    "MAX_YAML_BYTES",
    "MAX_YAML_VALUES",
    "Bounds",
    "Invalid",
    "Layer",
    "Problems",
    "Schema",
    "bounds",
    "check",
    "dump_yaml",
    "field_docs",
    "file_layer",
    "null_means",
    "override_layer",
    "parse_argv",
    "read_yaml",
    "reference_tables",
    "show",
    "suggest",
    "to_plain",
]

_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
"""A number in exponent notation, as YAML 1.1 leaves it a string without a dot (``3e-4``)."""

T = TypeVar("T")
Path_ = tuple[str, ...]

_BOUNDS_KEY = "stalebound.bounds"
_NULL_AS_KEY = "stalebound.null_as"
_FAILED: Any = object()
_INT_LIMIT = 2**63


# -- rules declared next to the fields -------------------------------------------------------------


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
    return {_BOUNDS_KEY: Bounds(ge=ge, gt=gt, le=le, fix=fix)}


def null_means(value: Any) -> dict[str, Any]:
    """Field metadata: a YAML ``null`` given for this field stands for ``value``.

    For settings whose upstream spelling uses ``null`` as a named choice (PSRL writes
    ``method: null`` for "no proactive filter").
    """
    return {_NULL_AS_KEY: value}


class Invalid(NamedTuple):
    """One problem found by a dataclass's ``_validate`` hook.

    ``key`` is the field's name relative to the dataclass (``"buffer_size"``, or a dotted path into a
    nested section); the loader prefixes the section path and the current value.
    """

    key: str
    why: str
    fix: str


# -- values in messages and dumps ------------------------------------------------------------------


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


def _visible(name: str, limit: int = 80) -> str:
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


# -- YAML parsing ----------------------------------------------------------------------------------


MAX_YAML_BYTES = 1 << 20
"""The largest YAML file the loader reads (1 MiB); a configuration is a few kilobytes."""

MAX_YAML_VALUES = 10_000
"""The most values (keys, scalars, lists and mappings) one YAML document may hold, every alias
counted as the whole value it names. A configuration holds a few hundred; the limit stops a file
of countless keys or an alias bomb (each level naming the one below nine times) early, in
bounded time and memory."""

try:  # libyaml's parser when PyYAML has it (several times faster), else PyYAML's own
    from yaml._yaml import CParser as _Parser
except ImportError:  # pragma: no cover - PyYAML built without libyaml

    class _Parser(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            yaml.reader.Reader.__init__(self, stream)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)


class _TooLarge(yaml.YAMLError):
    """The document holds more than :data:`MAX_YAML_VALUES` values."""


class _StrictLoader(
    yaml.composer.Composer,
    _Parser,
    yaml.constructor.SafeConstructor,
    yaml.resolver.Resolver,
):
    """A safe loader that refuses duplicate keys instead of silently keeping the last, and stops
    at :data:`MAX_YAML_VALUES` values (aliases expanded) while composing, before anything is
    built. The composer is PyYAML's Python one, so it can count; the parser is libyaml's."""

    def __init__(self, stream: str) -> None:
        _Parser.__init__(self, stream)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self.values = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its size with aliases expanded
        self._open: set[str] = set()  # anchors of the collections being composed

    def _spend(self, n: int) -> None:
        self.values += n
        if self.values > MAX_YAML_VALUES:
            raise _TooLarge(
                f"holds more than {MAX_YAML_VALUES:,} values (aliases counted as what they name)"
            )

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event: Any = self.peek_event()
            if event.anchor in self._open:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"the alias *{event.anchor} refers to a value that contains it",
                    event.start_mark,
                )
            target = self.anchors.get(event.anchor)
            if target is not None:
                self._spend(self._size(target))
            return super().compose_node(parent, index)
        self._spend(1)
        return super().compose_node(parent, index)

    def compose_sequence_node(self, anchor: Any) -> Any:
        return self._compose_collection(super().compose_sequence_node, anchor)

    def compose_mapping_node(self, anchor: Any) -> Any:
        return self._compose_collection(super().compose_mapping_node, anchor)

    def _compose_collection(self, compose: Callable[[Any], Any], anchor: str | None) -> Any:
        if anchor is None:
            return compose(anchor)
        self._open.add(anchor)
        try:
            return compose(anchor)
        finally:
            self._open.discard(anchor)

    def _size(self, node: yaml.Node) -> int:
        """Values in ``node`` with aliases expanded (memoised, so linear in the composed nodes)."""
        sizes = self._sizes
        stack: list[tuple[yaml.Node, bool]] = [(node, False)]
        while stack:
            current, children_done = stack.pop()
            if id(current) in sizes:
                continue
            if isinstance(current, yaml.ScalarNode):
                sizes[id(current)] = 1
                continue
            kids = _children(current)
            if children_done:
                sizes[id(current)] = 1 + sum(sizes[id(k)] for k in kids)
                continue
            stack.append((current, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
        return sizes[id(node)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value)


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                "found an unhashable key",
                key_node.start_mark,
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found the key {show(key)} twice",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


# (the stubs know only PyYAML's own loader classes)
_StrictLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)  # type: ignore[type-var]


def _yaml_load(text: str) -> Any:
    """Parse YAML text; every failure (a document too large included) is a
    :class:`yaml.YAMLError`."""
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except ValueError as exc:  # an integer past Python's digit limit
        raise yaml.YAMLError(str(exc).split(";")[0]) from None
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):  # libyaml's own limit
            raise yaml.YAMLError("nested too deeply") from None
        raise
    finally:
        loader.dispose()


def _yaml_error(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# -- type introspection ----------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` → ``(X, True)``; anything else → ``(tp, False)``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = get_args(tp)
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) < len(args):
            return (rest[0] if len(rest) == 1 else Union[rest]), True  # noqa: UP007
    return tp, False


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _phrase(tp: Any) -> str:
    """The type in words, as in "must be <phrase>"."""
    inner, optional = _split_optional(tp)
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
        text = " or ".join(_phrase(a) for a in get_args(inner))
    elif _is_section(inner):
        text = "a mapping of its fields"
    else:
        text = "any value"
    return text + (" or null" if optional else "")


def _type_name(tp: Any) -> str:
    """The type as the reference documents it."""
    inner, optional = _split_optional(tp)
    origin = get_origin(inner)
    if isinstance(inner, type) and not _is_section(inner) and origin is None:
        text = inner.__name__
    elif origin is Literal:
        text = "one of " + ", ".join(f"`{show(a)}`" for a in get_args(inner))
    elif origin in (list, tuple, Sequence):
        text = f"list of {_type_name(get_args(inner)[0])}"
    elif origin in (dict, Mapping):
        text = f"mapping of str to {_type_name(get_args(inner)[1])}"
    elif _is_section(inner):
        text = "section"
    elif inner is Any:
        text = "any"
    else:
        text = " or ".join(_type_name(a) for a in get_args(inner))
    return text + (" or null" if optional else "")


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _dotted(path: Path_) -> str:
    return ".".join(path)


# -- the schema ------------------------------------------------------------------------------------


class Problems(list[str]):
    """The problems a load found: the first ``limit`` spelt out, the rest only counted in
    ``omitted`` (so a file of thousands of bad keys costs no more than its first problems)."""

    def __init__(self, limit: int = MAX_LISTED_PROBLEMS) -> None:
        super().__init__()
        self.limit = limit
        self.omitted = 0

    def full(self) -> bool:
        """True (and the problem about to be added is counted) once ``limit`` are listed; call it
        before building a costly message."""
        if len(self) < self.limit:
            return False
        self.omitted += 1
        return True

    def append(self, problem: str) -> None:
        if len(self) < self.limit:
            super().append(problem)
        else:
            self.omitted += 1

    def extend(self, problems: Iterable[str]) -> None:
        for problem in problems:
            self.append(problem)


def _full(problems: list[str]) -> bool:
    """Whether ``problems`` (a :class:`Problems`) takes no more messages; counts the one not
    added. A plain list never is."""
    return isinstance(problems, Problems) and problems.full()


class _Entry(NamedTuple):
    value: Any
    spelling: str


@dataclasses.dataclass(frozen=True)
class Layer:
    """One source of settings: a parsed mapping, or the override list (``overrides=True``).

    Within one file or mapping, two spellings of one key must agree; in the override list the same
    spelling may repeat and the last one wins (so scripts can append flags).
    """

    mapping: Mapping[Any, Any]
    overrides: bool = False


class Schema:
    """Everything the loader needs to know about one root dataclass and its aliases."""

    def __init__(
        self, root: type, aliases: Mapping[str, str] | None = None, *, reference_hint: str = ""
    ) -> None:
        if not _is_section(root):
            raise TypeError(f"the root of a config tree must be a dataclass, not {root!r}")
        self.root = root
        self.aliases: dict[Path_, Path_] = {
            tuple(a.split(".")): tuple(c.split(".")) for a, c in (aliases or {}).items()
        }
        self.reference_hint = reference_hint
        self.fields: dict[Path_, tuple[type, dataclasses.Field[Any], Any]] = {}
        self._walk(root, ())
        self.sections = {
            p for p, (_, _, tp) in self.fields.items() if _is_section(_split_optional(tp)[0])
        }
        self.alias_prefixes = {a[:i] for a in self.aliases for i in range(1, len(a))}
        for alias, canonical in self.aliases.items():
            if canonical not in self.fields or canonical in self.sections:
                raise TypeError(f"alias {_dotted(alias)} targets {_dotted(canonical)}, not a field")
            if alias in self.fields or alias in self.alias_prefixes:
                raise TypeError(f"alias {_dotted(alias)} shadows a field or another alias")

    def _walk(self, cls: type, prefix: Path_) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            path = (*prefix, f.name)
            tp = hints[f.name]
            self.fields[path] = (cls, f, tp)
            inner, _ = _split_optional(tp)
            if _is_section(inner):
                self._walk(inner, path)

    # -- keys --

    def canonical(self, path: Path_) -> Path_:
        """The canonical path of a spelling (aliases resolved)."""
        return self.aliases.get(path, path)

    def is_branch(self, path: Path_) -> bool:
        """True when a mapping given at ``path`` holds sub-keys rather than being the value."""
        return path in self.alias_prefixes or self.canonical(path) in self.sections

    def knows(self, path: Path_) -> bool:
        """True when ``path`` is a canonical key, a section, or an alias."""
        return path in self.fields or path in self.aliases

    def spellings(self) -> list[str]:
        """Every key a user may write: canonical paths and aliases."""
        return [_dotted(p) for p in self.fields] + [_dotted(a) for a in self.aliases]

    def unknown_fix(self, dotted: str) -> str:
        """The fix for an unknown key: the closest known spelling, or where to find them all."""
        match = suggest(dotted, self.spellings())
        if match is not None:
            return f"did you mean {match}?"
        return "remove it" + (f" ({self.reference_hint})" if self.reference_hint else "")

    # -- loading --

    def load(self, layers: Iterable[Layer]) -> Any:
        """Merge the layers and build the root dataclass, or raise one ConfigError listing the
        problems (the first :data:`MAX_LISTED_PROBLEMS` in full, the count of the rest)."""
        problems = Problems()
        merged: dict[Path_, _Entry] = {}
        below: dict[Path_, set[Path_]] = {}  # each proper prefix -> the merged keys under it
        for layer in layers:
            entries = self._layer_entries(layer, problems)
            for path, entry in entries.items():
                empty = _is_empty_mapping(entry.value)
                if empty and path not in self.sections:
                    continue  # an empty mapping under an alias prefix sets nothing
                # A later layer replaces a whole key: drop what an earlier one set at it, above it,
                # or below it; an empty section mapping adds to what is below rather than reset it.
                # (Looked up by prefix, so merging stays linear in the number of keys.)
                doomed = [path[:i] for i in range(1, len(path) + 1) if path[:i] in merged]
                if not empty:
                    doomed += below.get(path, ())
                for old in doomed:
                    del merged[old]
                    for i in range(1, len(old)):
                        below[old[:i]].discard(old)
                merged[path] = entry
                for i in range(1, len(path)):
                    below.setdefault(path[:i], set()).add(path)
        builder = _Builder(merged, problems)
        result = builder.build(self.root, ())
        for path in merged:
            if path not in builder.consumed and not problems.full():
                entry = merged[path]
                problems.append(
                    f"{_visible(entry.spelling)}={show(entry.value, 80)}: unknown key; "
                    f"{self.unknown_fix(entry.spelling)}"
                )
        if problems:
            raise ConfigError(problems, omitted=problems.omitted)
        return result

    def _layer_entries(self, layer: Layer, problems: list[str]) -> dict[Path_, _Entry]:
        flat: list[tuple[Path_, Any]] = []
        _flatten(layer.mapping, (), self.is_branch, flat, problems)
        entries: dict[Path_, _Entry] = {}
        for path, value in flat:
            canonical = self.canonical(path)
            new = _Entry(value, _dotted(path))
            old = entries.get(canonical)
            repeat = layer.overrides and old is not None and old.spelling == new.spelling
            if old is not None and not repeat and not _same(old.value, new.value):
                if _full(problems):
                    continue
                both = "" if old.spelling == new.spelling else f" (both set {_dotted(canonical)})"
                problems.append(
                    f"{new.spelling}={show(new.value, 80)}: conflicts with "
                    f"{old.spelling}={show(old.value, 80)}{both}; keep only one of them"
                )
                continue
            entries[canonical] = new
        return entries


def _is_empty_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and not value


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except RecursionError:
        return False


def _flatten(
    mapping: Mapping[Any, Any],
    prefix: Path_,
    is_branch: Callable[[Path_], bool],
    out: list[tuple[Path_, Any]],
    problems: list[str],
) -> None:
    """Split nested mappings (and dotted keys) into ``(path, leaf value)`` pairs."""
    for key, value in mapping.items():
        if not isinstance(key, str):
            if _full(problems):
                continue
            where = _dotted((*prefix, show(key)))
            problems.append(
                f'{where}={show(value, 80)}: keys must be strings; quote the key: "{show(key)}"'
            )
            continue
        parts = tuple(key.split("."))
        if any(not p or p != p.strip() for p in parts):
            if _full(problems):
                continue
            problems.append(
                f"{_visible(_dotted((*prefix, key)))}={show(value, 80)}: not a valid key; "
                "write dot-separated names without spaces, like rollout.group_size"
            )
            continue
        path = prefix + parts
        if isinstance(value, Mapping) and is_branch(path):
            if not value:
                # Kept so that an empty mapping switches an optional section on with its defaults.
                out.append((path, {}))
            _flatten(value, path, is_branch, out, problems)
        else:
            out.append((path, value))


def suggest(key: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to ``key``: same last name first, then by spelling."""
    if not candidates:
        return None
    last = key.rsplit(".", 1)[-1]
    same_last = [c for c in candidates if c.rsplit(".", 1)[-1] == last and c != key]
    pool = same_last or difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    if not pool:
        lasts = difflib.get_close_matches(last, [c.rsplit(".", 1)[-1] for c in candidates], n=1)
        pool = [c for c in candidates if lasts and c.rsplit(".", 1)[-1] == lasts[0]]
    if not pool:
        return None
    return max(pool, key=lambda c: (difflib.SequenceMatcher(None, key, c).ratio(), -len(c)))


class _Builder:
    """Converts merged entries into dataclass instances, recording every problem."""

    def __init__(self, entries: Mapping[Path_, _Entry], problems: list[str]) -> None:
        self.entries = entries
        self.problems = problems
        self.consumed: set[Path_] = set()
        self.prefixes = {p[:i] for p in entries for i in range(1, len(p))}

    def build(self, cls: type, prefix: Path_) -> Any:
        """An instance of ``cls`` from the entries under ``prefix``, or ``_FAILED``."""
        before = len(self.problems)
        kwargs: dict[str, Any] = {}
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            path = (*prefix, f.name)
            value = self._field(f, hints[f.name], path)
            if value is not _FAILED and value is not dataclasses.MISSING:
                kwargs[f.name] = value
        if len(self.problems) > before:
            return _FAILED
        try:
            instance = cls(**kwargs)
        except ConfigError as exc:
            self.problems.extend(exc.problems)
            return _FAILED
        self._run_hook(instance, prefix)
        return _FAILED if len(self.problems) > before else instance

    def _field(self, f: dataclasses.Field[Any], tp: Any, path: Path_) -> Any:
        entry = self.entries.get(path)
        if entry is not None:
            self.consumed.add(path)
        inner, optional = _split_optional(tp)
        default = _default_of(f)
        if _is_section(inner):
            has_children = path in self.prefixes
            if entry is not None and not _is_empty_mapping(entry.value):
                if entry.value is None and optional and not has_children:
                    return None
                names = [g.name for g in dataclasses.fields(inner)] or ["key"]
                self.problems.append(
                    f"{entry.spelling}={show(entry.value, 80)}: must be a mapping of its fields; "
                    f"set them one by one, like {entry.spelling}.{names[0]}=…"
                )
            if has_children or entry is not None or default is dataclasses.MISSING:
                return self.build(inner, path)
            return dataclasses.MISSING
        if entry is None:
            if default is dataclasses.MISSING:
                self.problems.append(f"{_dotted(path)}=(missing): required; give {_phrase(tp)}")
                return _FAILED
            return dataclasses.MISSING
        value = entry.value
        if value is None and _NULL_AS_KEY in f.metadata:
            value = f.metadata[_NULL_AS_KEY]
        converted = _convert(value, tp, entry.spelling, default, self.problems)
        if converted is _FAILED:
            return _FAILED
        rule: Bounds | None = f.metadata.get(_BOUNDS_KEY)
        if rule is not None and converted is not None and rule.violated(converted):
            noun = "an integer" if inner is int else "a number"
            tail = " or null" if optional else ""
            self.problems.append(
                f"{entry.spelling}={show(entry.value, 80)}: must be {noun} {rule.describe()}{tail}; "
                f"{rule.fix}"
            )
            return _FAILED
        return converted

    def _run_hook(self, instance: Any, prefix: Path_) -> None:
        hook = getattr(instance, "_validate", None)
        if hook is None:
            return
        for invalid in hook():
            rel = tuple(invalid.key.split("."))
            value: Any = instance
            for part in rel:
                value = getattr(value, part)
            path = prefix + rel
            entry = self.entries.get(path)
            name = entry.spelling if entry is not None else _dotted(path)
            self.problems.append(f"{name}={show(value, 80)}: {invalid.why}; {invalid.fix}")


def _convert(value: Any, tp: Any, name: str, default: Any, problems: list[str]) -> Any:
    """``value`` converted to ``tp``, or ``_FAILED`` with the problems appended."""
    inner, optional = _split_optional(tp)
    shown = show(value, 80)
    default_note = (
        f" (default: {show(default)})"
        if default is not dataclasses.MISSING and not _is_section(type(default))
        else ""
    )
    if value is None:
        if optional:
            return None
        keep = (
            f" or remove the key to keep the default ({show(default)})"
            if default is not dataclasses.MISSING
            else ""
        )
        problems.append(f"{name}=null: must not be null; write {_phrase(inner)}{keep}")
        return _FAILED
    origin = get_origin(inner)
    why = f"must be {_phrase(tp)}"
    if inner is Any:
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{name}={shown}: {why}; write {name}=true or {name}=false")
        return _FAILED
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -_INT_LIMIT <= value < _INT_LIMIT:
                problems.append(
                    f"{name}={shown}: must be a 64-bit integer (between -2**63 and 2**63 - 1); "
                    f"write a smaller number{default_note}"
                )
                return _FAILED
            return value
        problems.append(f"{name}={shown}: {why}; write a whole number{default_note}")
        return _FAILED
    if inner is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value):
            value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                problems.append(
                    f"{name}={shown}: too large for a number; write a smaller one{default_note}"
                )
                return _FAILED
            if number != number:  # NaN: every comparison with it is false, so no rule holds
                problems.append(
                    f"{name}={shown}: must be a number, not NaN; write a number{default_note}"
                )
                return _FAILED
            return number
        problems.append(f"{name}={shown}: {why}; write a number{default_note}")
        return _FAILED
    if inner is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (list, dict, set)):
            fix = f"write a string{default_note}"
        else:
            fix = f'quote it: {name}="{shown}"'
        problems.append(f"{name}={shown}: {why}; {fix}")
        return _FAILED
    if origin is Literal:
        choices = get_args(inner)
        for choice in choices:
            if type(value) is type(choice) and value == choice:
                return choice
        match = suggest(str(value), [str(c) for c in choices]) if isinstance(value, str) else None
        fix = f"did you mean {match}?" if match else "use one of them"
        problems.append(f"{name}={shown}: {why}; {fix}")
        return _FAILED
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list):
            fix = (
                "write a list like [a, b]"
                if isinstance(value, (dict, set))
                else f"write a list: {name}=[{shown}]"
            )
            problems.append(f"{name}={shown}: {why}; {fix}")
            return _FAILED
        args = get_args(inner)
        if origin is tuple and args[-1:] != (Ellipsis,):  # a fixed-length tuple[X, Y]
            if len(value) != len(args):
                problems.append(
                    f"{name}={shown}: must be a list of {len(args)} items, not {len(value)}; "
                    f"write {len(args)} values{default_note}"
                )
                return _FAILED
            item_tps = list(args)
        else:
            item_tps = [args[0]] * len(value)
        items = [
            _convert(v, tp_, f"{name}[{i}]", dataclasses.MISSING, problems)
            for i, (v, tp_) in enumerate(zip(value, item_tps, strict=True))
        ]
        if any(item is _FAILED for item in items):
            return _FAILED
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            problems.append(f"{name}={shown}: {why}; write a mapping like {{key: value}}")
            return _FAILED
        value_tp = get_args(inner)[1]
        out: dict[str, Any] = {}
        failed = False
        for k, v in value.items():
            if not isinstance(k, str):
                problems.append(
                    f"{name}.{show(k)}={show(v, 80)}: keys must be strings; "
                    f'quote the key: "{show(k)}"'
                )
                failed = True
                continue
            item = _convert(v, value_tp, f"{name}.{k}", dataclasses.MISSING, problems)
            failed = failed or item is _FAILED
            out[k] = item
        return _FAILED if failed else out
    if origin in (Union, types.UnionType):
        for arm in get_args(inner):
            scratch: list[str] = []
            result = _convert(value, arm, name, default, scratch)
            if not scratch:
                return result
        problems.append(f"{name}={shown}: {why}; write {_phrase(tp)}{default_note}")
        return _FAILED
    if _is_section(inner):
        if not isinstance(value, Mapping):
            problems.append(f"{name}={shown}: {why}; write a mapping like {{key: value}}")
            return _FAILED
        return _build_item(inner, value, name, problems)
    raise TypeError(f"{name}: unsupported config field type {tp!r}")


def check(instance: Any, name: str) -> None:
    """Raise one :class:`ConfigError` if ``instance``, a config section built or changed in
    Python, breaks a rule of its class: the same conversions, bounds and ``_validate`` rules, and
    the same lines, as loading its values from YAML under the key ``name`` would give."""
    if not dataclasses.is_dataclass(instance) or isinstance(instance, type):
        raise ConfigError(
            f"{name}={show(instance, 80)}: must be a config section (a dataclass instance such "
            "as RolloutConfig()); build one and set its fields"
        )
    problems = Problems()
    _build_item(type(instance), to_plain(instance), name, problems)
    if problems:
        raise ConfigError(problems, omitted=problems.omitted)


def _build_item(cls: type, mapping: Mapping[Any, Any], name: str, problems: list[str]) -> Any:
    """A dataclass given whole as a mapping (a list item): built like a section of its own."""
    schema = Schema(cls)
    flat: list[tuple[Path_, Any]] = []
    _flatten(mapping, (), schema.is_branch, flat, problems)
    entries = {(name, *p): _Entry(v, _dotted((name, *p))) for p, v in flat}
    builder = _Builder(entries, problems)
    result = builder.build(cls, (name,))
    candidates = [f"{name}.{s}" for s in schema.spellings()]
    for path, entry in entries.items():
        if path not in builder.consumed:
            result = _FAILED
            if _full(problems):
                continue
            match = suggest(entry.spelling, candidates)
            fix = f"did you mean {match}?" if match else "remove it"
            problems.append(f"{entry.spelling}={show(entry.value, 80)}: unknown key; {fix}")
    return result


# -- reading files and overrides -------------------------------------------------------------------


def read_yaml(path: str | Path, head: str, *, fix: str, large_fix: str) -> Any:
    """The data of a YAML file of at most :data:`MAX_YAML_BYTES` bytes and
    :data:`MAX_YAML_VALUES` values; otherwise one ConfigError headed ``head`` (``config=PATH``)
    saying why, with ``fix`` (``large_fix`` for a file too large)."""
    text = read_text(path, head, limit=MAX_YAML_BYTES, fix=fix, large_fix=large_fix)
    try:
        return _yaml_load(text)
    except _TooLarge as exc:
        raise ConfigError(f"{head}: {exc}; {large_fix}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{head}: not valid YAML ({_yaml_error(exc)}); fix the syntax") from None


_LARGE_FIX = (
    "keep only settings in it (a config is a few kilobytes), and give large data as a file of "
    "its own (task.data_path)"
)


def file_layer(path: str | Path, problems: list[str]) -> Layer | None:
    """The layer of one YAML file, or ``None`` with the problem appended."""
    given: object = path  # callers outside the type checker may pass anything
    if not isinstance(given, (str, Path)):
        problems.append(
            f"config={show(given, 80)}: not a path; give the YAML file's path as a string"
        )
        return None
    try:
        data = read_yaml(path, f"config={path}", fix="check the path", large_fix=_LARGE_FIX)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None
    if data is None:
        return Layer({})
    if not isinstance(data, Mapping):
        problems.append(
            f"config={path}: the file holds {show(data, 40)}, not a mapping; "
            "write one key: value per line at the top level"
        )
        return None
    return Layer(data)


def override_layer(overrides: Iterable[str], problems: list[str]) -> Layer:
    """The layer of ``key.path=value`` overrides; each value is parsed as YAML."""
    pairs: dict[str, Any] = {}
    tokens: Iterable[object] = overrides  # callers outside the type checker may pass anything
    for given in tokens:
        if not isinstance(given, str):
            problems.append(
                f"{show(given, 80)}=(missing): not a key=value override (of type "
                f"{type(given).__name__}, not str); write it as key.path=value"
            )
            continue
        token = given
        key, eq, text = token.partition("=")
        key = key.strip()
        if not eq or not key:
            problems.append(
                f"{_visible(token)}=(missing): not a key=value override; write it as "
                "key.path=value, "
                "like rollout.group_size=8"
            )
            continue
        if not text.strip():
            key = _visible(key)
            problems.append(
                f"{key}=: empty value; write {key}=null for null or {key}='' for an empty string"
            )
            continue
        short = text if len(text) <= 80 else text[:79] + "…"
        try:
            value = _yaml_load(text)
        except _TooLarge as exc:
            problems.append(f"{key}={short}: {exc}; give a shorter value")
            continue
        except yaml.YAMLError as exc:
            problems.append(
                f"{key}={short}: not a valid YAML value ({_yaml_error(exc)}); "
                f"quote it: {key}='{short}'"
            )
            continue
        # A stray '#' starts a YAML comment; treat a value that parses to nothing as literal text
        # unless it is one of YAML's spellings of null.
        if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
            value = text
        # Re-inserting keeps the last occurrence in its latest position (last one wins).
        pairs.pop(key, None)
        pairs[key] = value
    return Layer(pairs, overrides=True)


def parse_argv(argv: Sequence[str], schema: Schema) -> tuple[list[str], list[str]]:
    """Split a command line into YAML paths and ``key=value`` overrides (see config docs)."""
    paths: list[str] = []
    overrides: list[str] = []
    problems: list[str] = []
    flags = [f"--{s.replace('_', '-')}" for s in schema.spellings()]
    i = 0
    while i < len(argv):
        given: object = argv[i]
        i += 1
        if not isinstance(given, str):
            problems.append(
                f"{show(given, 80)}=(missing): a command-line argument must be a string, not of type "
                f"{type(given).__name__}; pass str tokens"
            )
            continue
        token = given
        if token in ("--config", "-c") or token.startswith("--config="):
            if token.startswith("--config="):
                paths.append(token.partition("=")[2])
            elif i < len(argv) and isinstance(argv[i], str):
                paths.append(argv[i])
                i += 1
            else:
                problems.append(f"{token}=(missing): needs a path; write {token} CONFIG.yaml")
            continue
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            if not eq:
                following = argv[i] if i < len(argv) else None
                if isinstance(following, str) and not following.startswith("--"):
                    value = following
                    i += 1
                else:
                    flag = _visible(f"--{name}")
                    problems.append(
                        f"{flag}=(missing): needs a value; write {flag} VALUE or {flag}=VALUE"
                    )
                    continue
            key = name.replace("-", "_")
            if not schema.knows(tuple(key.split("."))):
                match = suggest(f"--{name}", flags)
                fix = (
                    f"did you mean {match}?"
                    if match
                    else (
                        "use a known flag or key.path=value"
                        + (f" ({schema.reference_hint})" if schema.reference_hint else "")
                    )
                )
                problems.append(f"{_visible('--' + name)}={_visible(value)}: unknown flag; {fix}")
                continue
            overrides.append(f"{key}={value}")
        elif "=" in token:
            overrides.append(token)
        elif token.endswith((".yaml", ".yml")) and not token.startswith("-"):
            paths.append(token)
        else:
            problems.append(
                f"{_visible(token)}=(missing): neither a YAML file nor key=value; give a "
                ".yaml/.yml path, "
                "key.path=value, or --flag VALUE"
            )
    if problems:
        raise ConfigError(problems)
    return paths, overrides


# -- reference documentation -----------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal right after each field),
    inherited ones included (a subclass's own docstring for a field wins)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not object and dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    classdef = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    docs: dict[str, str] = {}
    body = classdef.body
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def reference_tables(schema: Schema) -> str:
    """Markdown: one table per section (key, type, default, description), then the aliases."""
    out: list[str] = []
    section_paths: list[tuple[Path_, type]] = [((), schema.root)]
    for path in schema.fields:
        if path in schema.sections:
            section_paths.append((path, _split_optional(schema.fields[path][2])[0]))
    for path, cls in section_paths:
        title = f"`{_dotted(path)}`" if path else "Top level"
        out.append(f"### {title}\n")
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc and not doc.startswith(f"{cls.__name__}("):  # skip dataclass's generated signature
            out.append(" ".join(doc.split()) + "\n")
        out.append("| key | type | default | description |")
        out.append("|---|---|---|---|")
        docs = field_docs(cls)
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            key = _dotted((*path, f.name))
            tp = hints[f.name]
            inner, _ = _split_optional(tp)
            description = docs.get(f.name, "")
            if _is_section(inner):
                default = "see below"
                description = description or " ".join((inner.__doc__ or "").split())
            else:
                d = _default_of(f)
                default = "required" if d is dataclasses.MISSING else f"`{show(d)}`"
            rule: Bounds | None = f.metadata.get(_BOUNDS_KEY)
            if rule is not None:
                description += f" Must be {rule.describe()}."
            if _NULL_AS_KEY in f.metadata:
                description += f" `null` means `{show(f.metadata[_NULL_AS_KEY])}`."
            out.append(
                f"| `{key}` | {_cell(_type_name(tp))} | {_cell(default)} | {_cell(description)} |"
            )
        out.append("")
    if schema.aliases:
        out.append("### Aliases\n")
        out.append("| alias | canonical key | flag |")
        out.append("|---|---|---|")
        for alias, canonical in schema.aliases.items():
            flag = "--" + _dotted(alias).replace("_", "-")
            out.append(f"| `{_dotted(alias)}` | `{_dotted(canonical)}` | `{flag}` |")
        out.append("")
    return "\n".join(out)

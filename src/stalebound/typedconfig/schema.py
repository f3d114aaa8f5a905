"""The schema of a config tree and the loader built on it: the keys a user may write (aliases
included), the layers merged key by key, and each value converted to its field's type and checked
against its rules, every problem collected."""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from stalebound.core.errors import MAX_LISTED_PROBLEMS, ConfigError
from stalebound.typedconfig.fields import (
    BOUNDS_KEY,
    NULL_AS_KEY,
    Bounds,
    KeyPath,
    default_of,
    dotted,
    field_types,
    is_section,
    phrase,
    split_optional,
)
from stalebound.typedconfig.suggest import suggest
from stalebound.typedconfig.values import show, to_plain, visible

__all__ = ["Layer", "Problems", "Schema", "Switch", "check"]

_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
"""A number in exponent notation, as YAML 1.1 leaves it a string without a dot (``3e-4``)."""
_FAILED: Any = object()
_INT_LIMIT = 2**63


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
class Switch:
    """Where a switched alias points while ``setting`` (a dotted key) has one of the values in
    ``keys`` (value → dotted key); under any other value it points at its plain alias's key."""

    setting: str
    keys: Mapping[str, str]


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
        self,
        root: type,
        aliases: Mapping[str, str] | None = None,
        *,
        switched: Mapping[str, Switch] | None = None,
        synonyms: Mapping[str, Iterable[str]] | None = None,
        reference_hint: str = "",
    ) -> None:
        """``aliases`` maps other spellings of a key to the key (``psrl.rollout_n`` →
        ``rollout.group_size``); ``switched`` gives some of those aliases another key while a
        setting has a given value (see :class:`Switch`); ``synonyms`` maps a field's last name to
        words users write for it (``lr`` → ``learning_rate``), which only the suggestions for an
        unknown key read."""
        if not is_section(root):
            raise TypeError(f"the root of a config tree must be a dataclass, not {root!r}")
        self.root = root
        self.aliases: dict[KeyPath, KeyPath] = {
            tuple(a.split(".")): tuple(c.split(".")) for a, c in (aliases or {}).items()
        }
        self.reference_hint = reference_hint
        self.synonyms: dict[str, set[str]] = {}  # a word users write -> the names it may mean
        for name, words in (synonyms or {}).items():
            for word in words:
                self.synonyms.setdefault(word, set()).add(name)
        self.fields: dict[KeyPath, tuple[type, dataclasses.Field[Any], Any]] = {}
        self._walk(root, ())
        self.sections = {
            p for p, (_, _, tp) in self.fields.items() if is_section(split_optional(tp)[0])
        }
        self.alias_prefixes = {a[:i] for a in self.aliases for i in range(1, len(a))}
        for alias, canonical in self.aliases.items():
            if canonical not in self.fields or canonical in self.sections:
                raise TypeError(f"alias {dotted(alias)} targets {dotted(canonical)}, not a field")
            if alias in self.fields or alias in self.alias_prefixes:
                raise TypeError(f"alias {dotted(alias)} shadows a field or another alias")
        self.switched: dict[KeyPath, Switch] = {
            tuple(a.split(".")): sw for a, sw in (switched or {}).items()
        }
        for alias, sw in self.switched.items():
            keys = [sw.setting, *sw.keys.values()]
            if alias not in self.aliases or any(
                tuple(k.split(".")) not in self.fields for k in keys
            ):
                raise TypeError(f"switched alias {dotted(alias)}: not an alias, or not to fields")

    def _walk(self, cls: type, prefix: KeyPath) -> None:
        hints = field_types(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            path = (*prefix, f.name)
            tp = hints[f.name]
            self.fields[path] = (cls, f, tp)
            inner, _ = split_optional(tp)
            if is_section(inner):
                self._walk(inner, path)

    # -- keys --

    def canonical(
        self, path: KeyPath, switches: Mapping[KeyPath, KeyPath] | None = None
    ) -> KeyPath:
        """The canonical path of a spelling (aliases resolved; ``switches`` are the switched
        aliases' keys for the layers being loaded, from :meth:`switched_keys`)."""
        if switches and path in switches:
            return switches[path]
        return self.aliases.get(path, path)

    def switched_keys(self, layers: Sequence[Layer]) -> dict[KeyPath, KeyPath]:
        """Each switched alias whose setting ends up with one of its values (the last layer's that
        sets it, else the default), mapped to that value's key."""
        settings = {tuple(sw.setting.split(".")) for sw in self.switched.values()}
        values = {s: default_of(self.fields[s][1]) for s in settings}
        for layer in layers:
            flat: list[tuple[KeyPath, Any]] = []
            _flatten(layer.mapping, (), self.is_branch, flat, [])  # problems: reported by load
            for path, value in flat:
                if self.canonical(path) in values:
                    values[self.canonical(path)] = value
        out: dict[KeyPath, KeyPath] = {}
        for alias, sw in self.switched.items():
            value = values[tuple(sw.setting.split("."))]
            key = sw.keys.get(value) if isinstance(value, str) else None
            if key is not None:
                out[alias] = tuple(key.split("."))
        return out

    def is_branch(self, path: KeyPath) -> bool:
        """True when a mapping given at ``path`` holds sub-keys rather than being the value."""
        return path in self.alias_prefixes or self.canonical(path) in self.sections

    def knows(self, path: KeyPath) -> bool:
        """True when ``path`` is a canonical key, a section, or an alias."""
        return path in self.fields or path in self.aliases

    def spellings(self) -> list[str]:
        """Every key a user may write: canonical paths and aliases."""
        return [dotted(p) for p in self.fields] + [dotted(a) for a in self.aliases]

    def unknown_fix(self, dotted: str) -> str:
        """The fix for an unknown key: the closest known spelling, or where to find them all."""
        match = suggest(dotted, self.spellings(), self.synonyms)
        if match is not None:
            return f"did you mean {match}?"
        return "remove it" + (f" ({self.reference_hint})" if self.reference_hint else "")

    # -- loading --

    def load(self, layers: Iterable[Layer]) -> Any:
        """Merge the layers and build the root dataclass, or raise one ConfigError listing the
        problems (the first :data:`MAX_LISTED_PROBLEMS` in full, the count of the rest)."""
        problems = Problems()
        merged: dict[KeyPath, _Entry] = {}
        below: dict[KeyPath, set[KeyPath]] = {}  # each proper prefix -> the merged keys under it
        layers = list(layers)
        switches = self.switched_keys(layers) if self.switched else {}
        for layer in layers:
            entries = self._layer_entries(layer, problems, switches)
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
                    f"{visible(entry.spelling)}={show(entry.value, 80)}: unknown key; "
                    f"{self.unknown_fix(entry.spelling)}"
                )
        if problems:
            raise ConfigError(problems, omitted=problems.omitted)
        return result

    def _layer_entries(
        self, layer: Layer, problems: list[str], switches: Mapping[KeyPath, KeyPath]
    ) -> dict[KeyPath, _Entry]:
        flat: list[tuple[KeyPath, Any]] = []
        _flatten(layer.mapping, (), self.is_branch, flat, problems)
        entries: dict[KeyPath, _Entry] = {}
        for path, value in flat:
            canonical = self.canonical(path, switches)
            new = _Entry(value, dotted(path))
            old = entries.get(canonical)
            repeat = layer.overrides and old is not None and old.spelling == new.spelling
            if old is not None and not repeat and not _same(old.value, new.value):
                if _full(problems):
                    continue
                both = "" if old.spelling == new.spelling else f" (both set {dotted(canonical)})"
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
    prefix: KeyPath,
    is_branch: Callable[[KeyPath], bool],
    out: list[tuple[KeyPath, Any]],
    problems: list[str],
) -> None:
    """Split nested mappings (and dotted keys) into ``(path, leaf value)`` pairs."""
    for key, value in mapping.items():
        if not isinstance(key, str):
            if _full(problems):
                continue
            where = dotted((*prefix, show(key)))
            # YAML reads an empty key (a lone "?", "~" or "null") as null: say so, or the
            # user cannot find in the file what the message names
            empty = ' (YAML reads an empty key, "?", "~" or null, as null)' if key is None else ""
            problems.append(
                f"{where}={show(value, 80)}: keys must be strings{empty}; quote the key: "
                f'"{show(key)}"'
            )
            continue
        parts = tuple(key.split("."))
        if any(not p or p != p.strip() for p in parts):
            if _full(problems):
                continue
            problems.append(
                f"{visible(dotted((*prefix, key)))}={show(value, 80)}: not a valid key; "
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


class _Builder:
    """Converts merged entries into dataclass instances, recording every problem."""

    def __init__(self, entries: Mapping[KeyPath, _Entry], problems: list[str]) -> None:
        self.entries = entries
        self.problems = problems
        self.consumed: set[KeyPath] = set()
        self.prefixes = {p[:i] for p in entries for i in range(1, len(p))}

    def build(self, cls: type, prefix: KeyPath) -> Any:
        """An instance of ``cls`` from the entries under ``prefix``, or ``_FAILED``."""
        before = len(self.problems)
        kwargs: dict[str, Any] = {}
        hints = field_types(cls)
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

    def _field(self, f: dataclasses.Field[Any], tp: Any, path: KeyPath) -> Any:
        entry = self.entries.get(path)
        if entry is not None:
            self.consumed.add(path)
        inner, optional = split_optional(tp)
        default = default_of(f)
        if is_section(inner):
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
                self.problems.append(f"{dotted(path)}=(missing): required; give {phrase(tp)}")
                return _FAILED
            return dataclasses.MISSING
        value = entry.value
        if value is None and NULL_AS_KEY in f.metadata:
            value = f.metadata[NULL_AS_KEY]
        converted = _convert(value, tp, entry.spelling, default, self.problems)
        if converted is _FAILED:
            return _FAILED
        rule: Bounds | None = f.metadata.get(BOUNDS_KEY)
        if rule is not None and converted is not None and rule.violated(converted):
            noun = "an integer" if inner is int else "a number"
            tail = " or null" if optional else ""
            self.problems.append(
                f"{entry.spelling}={show(entry.value, 80)}: must be {noun} {rule.describe()}{tail}; "
                f"{rule.fix}"
            )
            return _FAILED
        return converted

    def _run_hook(self, instance: Any, prefix: KeyPath) -> None:
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
            name = entry.spelling if entry is not None else dotted(path)
            self.problems.append(f"{name}={show(value, 80)}: {invalid.why}; {invalid.fix}")


def _convert(value: Any, tp: Any, name: str, default: Any, problems: list[str]) -> Any:
    """``value`` converted to ``tp``, or ``_FAILED`` with the problems appended."""
    inner, optional = split_optional(tp)
    shown = show(value, 80)
    default_note = (
        f" (default: {show(default)})"
        if default is not dataclasses.MISSING and not is_section(type(default))
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
        problems.append(f"{name}=null: must not be null; write {phrase(inner)}{keep}")
        return _FAILED
    origin = get_origin(inner)
    why = f"must be {phrase(tp)}"
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
        problems.append(f"{name}={shown}: {why}; write {phrase(tp)}{default_note}")
        return _FAILED
    if is_section(inner):
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
    flat: list[tuple[KeyPath, Any]] = []
    _flatten(mapping, (), schema.is_branch, flat, problems)
    entries = {(name, *p): _Entry(v, dotted((name, *p))) for p, v in flat}
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

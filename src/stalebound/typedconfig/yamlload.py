"""Reading YAML within limits: a strict safe loader that refuses duplicate keys and stops a
document of too many values (an alias bomb included) while composing it, before anything is
built."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from stalebound.core.errors import ConfigError
from stalebound.typedconfig.values import show
from stalebound.userfiles import read_text

__all__ = ["MAX_YAML_BYTES", "MAX_YAML_VALUES", "TooLarge", "read_yaml", "yaml_error", "yaml_load"]


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


class TooLarge(yaml.YAMLError):
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
            raise TooLarge(
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


def yaml_load(text: str) -> Any:
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


def yaml_error(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def read_yaml(path: str | Path, head: str, *, fix: str, large_fix: str) -> Any:
    """The data of a YAML file of at most :data:`MAX_YAML_BYTES` bytes and
    :data:`MAX_YAML_VALUES` values; otherwise one ConfigError headed ``head`` (``config=PATH``)
    saying why, with ``fix`` (``large_fix`` for a file too large)."""
    text = read_text(path, head, limit=MAX_YAML_BYTES, fix=fix, large_fix=large_fix)
    try:
        return yaml_load(text)
    except TooLarge as exc:
        raise ConfigError(f"{head}: {exc}; {large_fix}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{head}: not valid YAML ({yaml_error(exc)}); fix the syntax") from None

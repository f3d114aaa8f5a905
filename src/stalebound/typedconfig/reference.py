"""The reference documentation of a config tree, read from the code: each field's type, default,
rules and attribute docstring, one Markdown table per section, then the aliases."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap

from stalebound.typedconfig.fields import (
    BOUNDS_KEY,
    NULL_AS_KEY,
    Bounds,
    KeyPath,
    default_of,
    dotted,
    field_types,
    is_section,
    split_optional,
    type_name,
)
from stalebound.typedconfig.schema import Schema
from stalebound.typedconfig.values import show

__all__ = ["field_docs", "reference_tables"]


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
    section_paths: list[tuple[KeyPath, type]] = [((), schema.root)]
    for path in schema.fields:
        if path in schema.sections:
            section_paths.append((path, split_optional(schema.fields[path][2])[0]))
    for path, cls in section_paths:
        title = f"`{dotted(path)}`" if path else "Top level"
        out.append(f"### {title}\n")
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc and not doc.startswith(f"{cls.__name__}("):  # skip dataclass's generated signature
            out.append(" ".join(doc.split()) + "\n")
        out.append("| key | type | default | description |")
        out.append("|---|---|---|---|")
        docs = field_docs(cls)
        hints = field_types(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            key = dotted((*path, f.name))
            tp = hints[f.name]
            inner, _ = split_optional(tp)
            description = docs.get(f.name, "")
            if is_section(inner):
                default = "see below"
                description = description or " ".join((inner.__doc__ or "").split())
            else:
                d = default_of(f)
                default = "required" if d is dataclasses.MISSING else f"`{show(d)}`"
            rule: Bounds | None = f.metadata.get(BOUNDS_KEY)
            if rule is not None:
                description += f" Must be {rule.describe()}."
            if NULL_AS_KEY in f.metadata:
                description += f" `null` means `{show(f.metadata[NULL_AS_KEY])}`."
            out.append(
                f"| `{key}` | {_cell(type_name(tp))} | {_cell(default)} | {_cell(description)} |"
            )
        out.append("")
    if schema.aliases:
        out.append("### Aliases\n")
        out.append("| alias | canonical key | flag |")
        out.append("|---|---|---|")
        for alias, canonical in schema.aliases.items():
            flag = "--" + dotted(alias).replace("_", "-")
            key = f"`{dotted(canonical)}`"
            switch = schema.switched.get(alias)
            if switch is not None:
                key += "".join(
                    f"; with `{switch.setting}={value}`, `{other}`"
                    for value, other in switch.keys.items()
                )
            out.append(f"| `{dotted(alias)}` | {key} | `{flag}` |")
        out.append("")
    return "\n".join(out)

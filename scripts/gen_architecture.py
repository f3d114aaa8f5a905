"""Write the parts of docs/architecture.md that are read from the code.

Between each pair of markers ``<!-- BEGIN GENERATED: name -->`` / ``<!-- END GENERATED: name -->``
the doc holds what this script generates:

* ``entry-transitions`` and ``group-transitions``: the state diagrams and tables of
  ``stalebound.core.transitions`` (every move a buffer entry and a group may make);
* ``events`` and ``actions``: every type of ``stalebound.core.events.Event`` and ``Action``, with
  its fields and what it says.

    python scripts/gen_architecture.py            # rewrite the doc's generated parts
    python scripts/gen_architecture.py --check    # exit 1 when the doc is out of date

tests/test_architecture.py runs the check.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import sys
import typing
from collections.abc import Callable, Mapping
from pathlib import Path

from stalebound.core import events, transitions

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
COMMAND = "python scripts/gen_architecture.py"
_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n).*?(<!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)


def state_diagram(table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum], start: str) -> str:
    """A Mermaid state diagram of a transition table: one arrow per move, labelled with its
    operations; a state no move leaves is an end (``--> [*]``)."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for (state, op), after in table.items():
        arrows.setdefault((state.name, after.name), []).append(op.value)
    leaving = {state.name for state, _ in table}
    ends = sorted({after.name for after in table.values()} - leaving)
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {start}"]
    lines += [f"    {a} --> {b}: {' / '.join(ops)}" for (a, b), ops in arrows.items()]
    lines += [f"    {end} --> [*]" for end in ends]
    return "\n".join([*lines, "```"])


def transition_table(table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum]) -> str:
    """The table as Markdown rows: state, operation, next state, in the table's order."""
    rows = ["| state | operation | next state |", "|---|---|---|"]
    rows += [f"| `{s.name}` | `{o.value}` | `{t.name}` |" for (s, o), t in table.items()]
    return "\n".join(rows)


def _summary(cls: type) -> str:
    """The first paragraph of a class's docstring, on one line."""
    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
    return " ".join(doc.split()).replace("|", "\\|")


def record_table(union: object, noun: str) -> str:
    """Markdown rows for every type of a union of records: its name, its fields, its summary."""
    rows = [f"| {noun} | fields | what it says |", "|---|---|---|"]
    for cls in typing.get_args(union):
        fields = ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls)) or "—"
        rows.append(f"| `{cls.__name__}` | {fields} | {_summary(cls)} |")
    return "\n".join(rows)


GENERATED: Mapping[str, Callable[[], str]] = {
    "entry-transitions": lambda: (
        state_diagram(transitions.ENTRY_TRANSITIONS, "EMPTY")
        + "\n\n"
        + transition_table(transitions.ENTRY_TRANSITIONS)
    ),
    "group-transitions": lambda: (
        state_diagram(transitions.GROUP_TRANSITIONS, "QUEUED")
        + "\n\n"
        + transition_table(transitions.GROUP_TRANSITIONS)
    ),
    "events": lambda: record_table(events.Event, "event"),
    "actions": lambda: record_table(events.Action, "action"),
}
"""Each generated part of the doc, by its marker's name."""


def render(doc: str) -> str:
    """``doc`` with every generated part replaced by what the code says now."""
    found: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATED:
            raise SystemExit(
                f"{DOC}: unknown generated part {name!r}; use one of {list(GENERATED)}"
            )
        found.add(name)
        return f"{match[1]}{GENERATED[name]()}\n{match[3]}"

    text = _BLOCK.sub(fill, doc)
    missing = sorted(set(GENERATED) - found)
    if missing:
        raise SystemExit(f"{DOC}: no markers for {missing}; add <!-- BEGIN/END GENERATED: name -->")
    return text


def main(argv: list[str]) -> int:
    doc = DOC.read_text(encoding="utf-8")
    text = render(doc)
    if argv == ["--check"]:
        if text != doc:
            print(f"{DOC} is out of date; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    if text != doc:
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The did-you-mean of an unknown key, flag or choice."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["suggest"]


def _section_and_name(key: str) -> tuple[str, str]:
    """``("rollout", "group_size")`` for ``rollout.group_size`` (and for the flag
    ``--rollout.group-size``, ``("--rollout", "group_size")``): the section and the last name."""
    section, _, name = key.rpartition(".")
    return section, name.lstrip("-").replace("-", "_")


def suggest(
    key: str, candidates: Sequence[str], synonyms: Mapping[str, Iterable[str]] | None = None
) -> str | None:
    """The candidate closest to ``key``, or ``None``. First one whose last name is ``key``'s or
    means the same (``synonyms`` maps a name users write to the names it may mean:
    ``learning_rate`` → ``lr``); then, in ``key``'s own section, the closest last name; then the
    closest spelling of the whole key, or of its last name anywhere. Among equals, one in the
    same section, then the closest spelling, then the shortest."""
    if not candidates:
        return None
    section, name = _section_and_name(key)
    names = {name, *(synonyms or {}).get(name, ())}
    parts = {c: _section_and_name(c) for c in candidates}
    pool = [c for c in candidates if c != key and parts[c][1] in names]
    if not pool:
        siblings = [c for c in candidates if parts[c][0] == section]
        close = difflib.get_close_matches(name, [parts[c][1] for c in siblings], n=1, cutoff=0.6)
        pool = [c for c in siblings if close and parts[c][1] == close[0]]
    if not pool:
        pool = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    if not pool:
        close = difflib.get_close_matches(name, [p[1] for p in parts.values()], n=1)
        pool = [c for c in candidates if close and parts[c][1] == close[0]]
    if not pool:
        return None
    return max(
        pool,
        key=lambda c: (
            parts[c][0] == section,
            difflib.SequenceMatcher(None, key, c).ratio(),
            -len(c),
        ),
    )

"""The exception hierarchy: one root, split by whose fault it is.

* :class:`ConfigError` — the settings are wrong (the user's to fix). Every problem is reported at
  once, each as ``name=value: why; the fix``.
* :class:`ProtocolError` — a caller broke the protocol (an unknown id, a double occupy, a version from
  the future). The object that raised it is left exactly as it was.
* :class:`InvariantError` — a bug in stalebound itself.

Back-pressure is not an error: ``try_*`` calls return ``None``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "MAX_LISTED_PROBLEMS",
    "ConfigError",
    "DataExhausted",
    "InvariantError",
    "ProtocolError",
    "StaleboundError",
]


class StaleboundError(Exception):
    """Root of every exception stalebound raises on purpose."""


MAX_LISTED_PROBLEMS = 20
"""A :class:`ConfigError`'s message lists at most this many problems, then counts the rest."""


class ConfigError(StaleboundError, ValueError):
    """Invalid settings. ``problems`` lists the problems found, each ``name=value: why; the fix``;
    ``omitted`` counts further ones a loader found but did not spell out (a file of thousands of
    unknown keys is reported by its first problems and the count of the others)."""

    def __init__(self, problems: str | Iterable[str], *, omitted: int = 0) -> None:
        self.problems: tuple[str, ...] = (
            (problems,) if isinstance(problems, str) else tuple(problems)
        )
        self.omitted = omitted
        total = len(self.problems) + omitted
        if total == 1:
            message = self.problems[0]
        else:
            listed = self.problems[:MAX_LISTED_PROBLEMS]
            lines = "\n".join(f"  - {p}" for p in listed)
            message = f"{total} configuration problems:\n{lines}"
            if total > len(listed):
                message += f"\n  ... and {total - len(listed)} more (fix these first)"
        super().__init__(message)


class DataExhausted(StaleboundError):
    """A finite data loader has given every item it holds (``data.epochs`` passes): the run
    trains what is still under way and ends. Raised by such a loader when it is asked for more,
    and by ``prepare_batch`` once no batch can be completed from what was drawn."""


class ProtocolError(StaleboundError, RuntimeError):
    """A caller broke the protocol; the state of the object that raised it is unchanged."""


class InvariantError(StaleboundError, AssertionError):
    """An internal invariant failed: a bug in stalebound, please report it."""

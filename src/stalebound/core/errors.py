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

__all__ = ["ConfigError", "InvariantError", "ProtocolError", "StaleboundError"]


class StaleboundError(Exception):
    """Root of every exception stalebound raises on purpose."""


class ConfigError(StaleboundError, ValueError):
    """Invalid settings. ``problems`` lists every problem found, each ``name=value: why; the fix``."""

    def __init__(self, problems: str | Iterable[str]) -> None:
        self.problems: tuple[str, ...] = (
            (problems,) if isinstance(problems, str) else tuple(problems)
        )
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} configuration problems:\n{lines}"
        super().__init__(message)


class ProtocolError(StaleboundError, RuntimeError):
    """A caller broke the protocol; the state of the object that raised it is unchanged."""


class InvariantError(StaleboundError, AssertionError):
    """An internal invariant failed: a bug in stalebound, please report it."""

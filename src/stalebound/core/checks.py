"""Small argument checks shared by every layer (one definition each)."""

from __future__ import annotations

import numbers

from stalebound.core.errors import ProtocolError

__all__ = ["SYNCHRONOUS_FIX", "check_version", "is_int", "is_integral", "staleness_problems"]

SYNCHRONOUS_FIX = "use 0 for synchronous training"
"""The fix of a bad staleness setting."""


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integral(value: object) -> bool:
    """Like :func:`is_int`, but also admits other integral numbers (numpy's integer scalars, which
    callers of the metrics and records often hold). The exact-type test first skips the slower
    abstract-class check for plain ints."""
    return type(value) is int or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool)
    )


def check_version(op: str, version: object, *, integral: bool = False) -> int:
    """``version`` as an ``int`` when it is one ≥ 0, else :class:`ProtocolError` naming ``op`` and
    the value. ``integral`` also admits numpy's integer scalars (converted)."""
    ok = is_integral(version) if integral else is_int(version)
    if not ok or version < 0:  # type: ignore[operator]
        raise ProtocolError(
            f"{op}(version={version!r}): the version must be an int ≥ 0 (versions count training "
            "steps from 0)"
        )
    return int(version)  # type: ignore[call-overload,no-any-return]


def staleness_problems(name: str, value: object) -> list[str]:
    """The one rule of every staleness setting (the bound η, the hard bound η_h, the soft target
    η_s, AReaL's ``max_staleness``): an ``int`` ≥ 0, 0 being synchronous. ``[]`` when ``value``
    keeps it, else the one line ``name=value: why; fix``."""
    if is_int(value) and value >= 0:  # type: ignore[operator]
        return []
    return [f"{name}={value!r}: must be an integer ≥ 0; {SYNCHRONOUS_FIX}"]

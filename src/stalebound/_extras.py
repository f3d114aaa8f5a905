"""Optional dependencies: import one, or say which extra installs it."""

from __future__ import annotations

import importlib
from typing import Any

from stalebound.core.errors import ConfigError

__all__ = ["import_extra"]


def import_extra(module: str, setting: str, extra: str, otherwise: str = "") -> Any:
    """The module ``module``, or a :class:`ConfigError` for ``setting`` naming the extra that
    installs it (and ``otherwise``, another way out)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{setting}: the {module} package is not installed ({exc}); install the extra: "
            f"pip install 'stalebound[{extra}]'{otherwise}"
        ) from exc

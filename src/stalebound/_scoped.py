"""One ``with`` protocol for the objects that hold something until they are closed."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

__all__ = ["Scoped"]

_S = TypeVar("_S", bound="Scoped")


class Scoped:
    """A context manager mixin: ``with`` calls :meth:`_enter_scope` on entry and returns the object,
    and calls :meth:`_exit_scope` on exit whether or not the block raised (it never swallows)."""

    def _enter_scope(self) -> None:
        """Take what the object holds (nothing by default: it was taken when it was built)."""

    def _exit_scope(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        self._enter_scope()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit_scope()

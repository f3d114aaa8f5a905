"""One process at a time in a run directory: an exclusive lock on ``RUN_DIR/.lock``.

Two processes resuming (or starting) the same run would both append to its records and write its
checkpoints. :class:`RunLock` takes ``fcntl.flock`` on ``RUN_DIR/.lock`` and writes its pid there;
the lock is held while the run goes on and released on exit. The kernel drops the lock when its
holder dies, however it dies, so a lock file left by a killed run (its pid no longer running) is
taken over at once; a live holder is refused with its pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from stalebound._scoped import Scoped
from stalebound.core import ConfigError

__all__ = ["LOCK_FILE", "RunLock"]

LOCK_FILE = ".lock"
_log = logging.getLogger(__name__)


def _pid_in(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode("ascii", "replace").strip())
    return None


class RunLock(Scoped):
    """An exclusive lock on a run directory (a context manager; :meth:`acquire` / :meth:`release`).

    Raises :class:`ConfigError` naming the pid of a live holder; ``OSError`` when the directory
    cannot be written."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            who = f"pid {holder}" if holder is not None else "another process"
            raise ConfigError(
                f"run.run_dir={str(self.path.parent)!r}: {who} is running in this run directory "
                f"(it holds {self.path}); wait for it to end or stop it"
                + (f" (kill -INT {holder})" if holder is not None else "")
                + ", then run this again"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        previous = _pid_in(fd)
        if previous is not None and previous != os.getpid():
            _log.info(
                "%s: taking over the lock of pid %d, which no longer runs", self.path, previous
            )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the file stays, empty: removing it could race a process opening it)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)

    def _enter_scope(self) -> None:
        self.acquire()

    def _exit_scope(self) -> None:
        self.release()

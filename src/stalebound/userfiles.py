"""Files and directories a user names: read within limits, written only where writable.

Every setting or flag that names a path goes through these checks before anything is written, so
a missing, unreadable, binary, oversized or unwritable path is one
:class:`~stalebound.core.errors.ConfigError` naming the setting, the path, why, and the fix —
never a traceback half-way through a run. ``label`` is how the setting is shown at the head of the
message (``"task.data_path='a.jsonl'"``, ``"--plot='figures'"``).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalebound.core.errors import ConfigError

__all__ = [
    "MAX_LINE_BYTES",
    "json_line",
    "label",
    "read_lines",
    "read_text",
    "readable_problem",
    "size_text",
    "writable_dir_problem",
    "writable_file_problem",
]

MAX_LINE_BYTES = 16 << 20
"""The longest line a line-oriented file (JSON Lines) may hold: 16 MiB, far above any record."""


def label(name: str, path: object) -> str:
    """``name='path'``, the head of a message about the path a setting names (long paths cut)."""
    text = repr(str(path))
    return f"{name}={text if len(text) <= 120 else text[:100] + '…' + text[-19:]}"


def size_text(n: int) -> str:
    """A byte count for a message: ``1 MiB`` when it is a whole number of KiB, MiB or GiB, else
    exact (``52,428,801 bytes``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift:,} {unit}"
    return f"{n:,} bytes"


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def read_text(
    path: str | os.PathLike[str], head: str, *, limit: int, fix: str, large_fix: str = ""
) -> str:
    """The UTF-8 text of a file of at most ``limit`` bytes; otherwise a ConfigError headed
    ``head`` that says why (cannot be read, a directory, too large, not UTF-8) and ``fix``
    (``large_fix``, when given, for a file too large)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(limit + 1)
    except IsADirectoryError:
        raise ConfigError(f"{head}: is a directory, not a file; {fix}") from None
    except OSError as exc:
        raise ConfigError(f"{head}: cannot read it ({_why(exc)}); {fix}") from None
    if len(raw) > limit:
        raise ConfigError(
            f"{head}: {size_text(max(size, len(raw)))}, more than the {size_text(limit)} such a "
            f"file may hold; {large_fix or fix}"
        )
    return _decode(raw, head, fix)


def _decode(raw: bytes, head: str, fix: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{head}: not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x}; a binary file?); "
            f"{fix}"
        ) from None


def read_lines(
    path: str | os.PathLike[str], head: str, *, fix: str, limit: int = MAX_LINE_BYTES
) -> Iterator[tuple[int, str, bool]]:
    """``(number, text, ended)`` for each line of a UTF-8 text file, streamed: ``ended`` is
    False for a last line without its newline (one a crash cut short). A line longer than
    ``limit`` bytes, or one that is not UTF-8, is a ConfigError naming its number."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; opening is what may fail
    except IsADirectoryError:
        raise ConfigError(f"{head}: is a directory, not a file; {fix}") from None
    except OSError as exc:
        raise ConfigError(f"{head}: cannot read it ({_why(exc)}); {fix}") from None
    with f:
        number = 0
        while True:
            try:
                raw = f.readline(limit + 1)
            except OSError as exc:
                raise ConfigError(f"{head}: cannot read it ({_why(exc)}); {fix}") from None
            if not raw:
                return
            number += 1
            ended = raw.endswith(b"\n")
            if len(raw) > limit and not (ended and len(raw) == limit + 1):
                raise ConfigError(
                    f"{head} line {number}: longer than {size_text(limit)} (a binary file?); {fix}"
                )
            yield number, _decode(raw, f"{head} line {number}", fix), ended


def readable_problem(path: str | os.PathLike[str], head: str, *, fix: str) -> str | None:
    """Why ``path`` cannot be looked up at all (missing, a name too long, no permission), as a
    problem ``head: cannot read it (why); fix``, or ``None``."""
    try:
        os.stat(path)
    except OSError as exc:
        return f"{head}: cannot read it ({_why(exc)}); {fix}"
    return None


def json_line(text: str, head: str, *, fix: str) -> Any:
    """The value of one JSON line; if it is not JSON, a ConfigError ``head: not JSON (why); fix``
    (``head`` names the file and the line)."""
    try:
        return json.loads(text)
    except ValueError as exc:  # not JSON, or an integer past Python's digit limit
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ConfigError(f"{head}: not JSON ({why}); {fix}") from None


def _nearest_existing(p: Path) -> tuple[Path, list[str]] | str:
    """The nearest existing ancestor of ``p`` (``p`` itself if it exists) and the names below it
    still to be created, or why ``p`` cannot be looked up."""
    missing: list[str] = []
    current = p
    while True:
        try:
            os.stat(current)
            return current, missing
        except FileNotFoundError:
            if current.parent == current:
                return "its root does not exist"
            missing.insert(0, current.name)
            current = current.parent
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                return "File name too long"
            return _why(exc)


def _unwritable(directory: Path) -> str | None:
    """Why no file can be created in the existing ``directory``, or ``None``."""
    if not directory.is_dir():
        return f"{directory} is not a directory"
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        readonly = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        readonly = False
    return "Read-only file system" if readonly else "Permission denied"


def _too_long(anchor: Path, names: list[str], whole: Path) -> str | None:
    try:
        name_max = os.pathconf(anchor, "PC_NAME_MAX")
        path_max = os.pathconf(anchor, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for name in names:
        if len(os.fsencode(name)) > name_max:
            return f"File name too long: a name of {len(os.fsencode(name))} bytes, over {name_max}"
    if len(os.fsencode(str(whole.absolute()))) >= path_max:
        return f"File name too long: the path is over {path_max} bytes"
    return None


def writable_dir_problem(path: str | os.PathLike[str], head: str, *, fix: str) -> str | None:
    """Why a directory could not be created (or written into) at ``path``, as a problem
    ``head: cannot write there (why); fix`` — or ``None``. Nothing is created."""
    p = Path(path)
    found = _nearest_existing(p)
    if isinstance(found, str):
        return f"{head}: cannot write there ({found}); {fix}"
    anchor, missing = found
    why = _too_long(anchor, missing, p) or _unwritable(anchor)
    return None if why is None else f"{head}: cannot write there ({why}); {fix}"


def writable_file_problem(path: str | os.PathLike[str], head: str, *, fix: str) -> str | None:
    """Why a file could not be written at ``path`` (its folder unwritable, the path a directory
    or too long), as a problem ``head: ...; fix``, or ``None``. Nothing is created."""
    p = Path(path)
    found = _nearest_existing(p)
    if isinstance(found, str):
        return f"{head}: cannot write there ({found}); {fix}"
    anchor, missing = found
    if not missing:  # the file is there already: it is replaced
        if anchor.is_dir():
            return f"{head}: is a directory, not a file; {fix}"
        why = _unwritable(anchor.parent) if not os.access(anchor, os.W_OK) else None
    else:
        why = _too_long(anchor, missing, p) or _unwritable(anchor)
    return None if why is None else f"{head}: cannot write there ({why}); {fix}"

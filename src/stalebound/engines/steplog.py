"""What the embedded engine's decode steps cost, as its worker measured them: written during a run,
read by calibration (:mod:`stalebound.sim.calibrate`). Pure and torch-free.

The worker times each step's two parts — admitting the requests that arrived (their prefill) and
decoding one token for every running request (merging cohorts where the rule says so, then one
forward pass per cohort) — and what it spends
on the pipe between steps (receiving requests, sending the finished ones back). It adds them up
over windows of :data:`WINDOW_S` seconds and appends one JSON line per window to its replica's
file in the run's :data:`STEP_LOG_DIR`; a killed worker loses at most its last window. Each line
holds the window's sums:

* ``steps``: decode steps; ``decode_s``: their seconds; ``passes``: forward passes (one per
  cohort per step); ``rows``: requests decoded, summed over the steps; ``slots``: the cache
  positions attended, rows × the cohort's cache width, summed; ``context_slots``: the part of
  ``slots`` the cohort's longest answer so far accounts for (rows × its tokens generated), the
  rest being prompts and padding;
* ``lone_steps``, ``lone_s``, ``lone_slots``: the steps that decoded a single request (one
  pass of one row: a straggler decoding alone), their seconds and cache positions — the regime
  the batched steps cannot tell apart from a row's cost;
* ``admitted``: requests admitted; ``admit_s``: the seconds admitting them took;
* ``pipe_s``: seconds spent receiving and sending on the pipe, the engine decoding nothing;
* ``t``: the wall-clock time (``time.time()``) the window was written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

_log = logging.getLogger(__name__)

__all__ = ["FIELDS", "STEP_LOG_DIR", "WINDOW_S", "StepLog", "read_step_logs"]

STEP_LOG_DIR = "engine-steps"
"""The folder of a run directory that holds each local engine's step log (``<name>.jsonl``)."""

WINDOW_S = 0.25
"""Seconds of engine time summed into one line."""

FIELDS = (
    "steps",
    "decode_s",
    "passes",
    "rows",
    "slots",
    "context_slots",
    "lone_steps",
    "lone_s",
    "lone_slots",
    "admitted",
    "admit_s",
    "pipe_s",
)
"""The sums each line holds (besides ``t``)."""

OPTIONAL = frozenset({"lone_steps", "lone_s", "lone_slots"})
"""Sums a log written before they were kept lacks (read as 0)."""


class StepLog:
    """The running sums of one window, appended to ``path`` as a line once a window is full."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        window: float = WINDOW_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._window = window
        self._clock = clock
        self._since = clock()
        self._sums = dict.fromkeys(FIELDS, 0.0)

    def admitted(self, requests: int, seconds: float) -> None:
        """``requests`` were admitted (prefilled) in ``seconds``."""
        self._sums["admitted"] += requests
        self._sums["admit_s"] += seconds

    def decoded(self, cohorts: list[tuple[int, int, int]], seconds: float) -> None:
        """One decode step of ``cohorts`` (each: rows, cache width, tokens its longest answer
        has generated) took ``seconds``."""
        s = self._sums
        s["steps"] += 1
        s["decode_s"] += seconds
        s["passes"] += len(cohorts)
        for rows, width, generated in cohorts:
            s["rows"] += rows
            s["slots"] += rows * width
            s["context_slots"] += rows * generated
        if len(cohorts) == 1 and cohorts[0][0] == 1:
            s["lone_steps"] += 1
            s["lone_s"] += seconds
            s["lone_slots"] += cohorts[0][1]
        self._maybe_write()

    def piped(self, seconds: float) -> None:
        """``seconds`` went to the pipe (receiving requests, sending answers)."""
        self._sums["pipe_s"] += seconds

    def _maybe_write(self) -> None:
        if self._clock() - self._since >= self._window:
            self.write()

    def write(self) -> None:
        """Append the window's sums (if anything happened in it) and start a new window. A log
        that cannot be written (a full disk) stops, with a warning: the engine goes on."""
        self._since = self._clock()
        if not any(self._sums.values()) or self._file.closed:
            return
        line = {"t": round(time.time(), 3), **{k: _number(v) for k, v in self._sums.items()}}
        self._sums = dict.fromkeys(FIELDS, 0.0)
        try:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
        except OSError as exc:
            _log.warning("the engine's step log %s stops: %s", self._file.name, exc)
            with contextlib.suppress(OSError):
                self._file.close()

    def close(self) -> None:
        """Write what the last window holds and close the file."""
        if not self._file.closed:
            self.write()
            with contextlib.suppress(OSError):
                self._file.close()


def _number(value: float) -> float | int:
    return int(value) if value == int(value) else round(value, 9)


def read_step_logs(folder: str | os.PathLike[str]) -> dict[str, list[dict[str, float]]]:
    """The windows of each step log in ``folder`` by engine name (empty if there is none). The
    unfinished last line of a killed worker is left out (:func:`~stalebound.obs.records.
    numbered_jsonl`); a line that is damaged elsewhere, or a sum that is not a number ≥ 0, is a
    ``ConfigError`` naming the file and line."""
    from stalebound.core.errors import ConfigError, ProtocolError
    from stalebound.obs.records import numbered_jsonl

    fix = (
        "the step log is damaged: remove the file (calibration then fits the engine from the "
        "trace alone)"
    )
    logs: dict[str, list[dict[str, float]]] = {}
    directory = Path(folder)
    if not directory.is_dir():
        return logs
    for path in sorted(directory.glob("*.jsonl")):
        windows = []
        try:
            for number, record in numbered_jsonl(path):
                window = {}
                for key in FIELDS:
                    value = record.get(key, 0 if key in OPTIONAL else None)
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                        raise ConfigError(
                            f"{path}:{number}: {key}={value!r}: must be a number ≥ 0; {fix}"
                        )
                    window[key] = float(value)
                windows.append(window)
        except ProtocolError as exc:  # not JSON: it names the line and the fix
            raise ConfigError(str(exc)) from None
        logs[path.stem] = windows
    return logs

"""Rollout traces: a JSON Lines file that records what each trajectory cost.

Format (``format: stalebound-trace``, ``version: 1``): the first line is a header object, every
following line one trajectory.

Header::

    {"type": "header", "format": "stalebound-trace", "version": 1, "source": "simulator",
     "group_size": 8, "created": "2026-11-29T10:00:00Z", "meta": {...}}

Trajectory::

    {"type": "trajectory", "prompt_id": 17, "group_id": 23, "member": 0, "start": 12.5,
     "end": 80.25, "tokens": 2048, "tool_latencies": [1.2, 0.4], "failed": false, "version": 3,
     "complete": true, "outcome": "trained", "reward_latency": 0.05}

* ``prompt_id`` identifies the prompt (a retried group has a new ``group_id``, the same prompt).
* ``group_id`` and ``member``: the group the trajectory was generated in and its launch index there
  (a trace written before they were recorded has a group per trajectory, each member 0).
* ``start`` / ``end``: seconds from the start of the run (wall-clock for real runs, virtual time for
  simulated ones) when generation began and ended.
* ``tokens``: generated tokens; ``tool_latencies``: seconds of each tool call, in order (a real
  run counts the time between two model turns).
* ``reward_latency`` (optional, 0 when absent): seconds from the end of the last model turn to the
  end of the episode (the reward's wait and scoring); ``end − start`` includes it.
* ``failed``: the trajectory ended in an error after ``tokens`` tokens.
* ``version``: V_traj, the policy version at the start of its generation.
* ``complete``: it ran to its natural end (finished or failed). ``false`` when it was cut short
  (surplus, aborted, truncated): its ``tokens`` are then a lower bound and replay skips it.
* ``outcome`` (optional): ``trained``, ``dropped``, ``surplus``, ``retried``, ``failed`` ...

``stalebound train`` writes one (``trace.jsonl`` in the run directory, and
``trace-from-step-K.jsonl`` for each resume from step K, all on the run's clock: :func:`run_traces`,
:func:`read_run_trace`) and the simulator writes one with ``--record``;
:mod:`stalebound.sim.replay` re-times one under a modelled workload.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stalebound.core.errors import ConfigError
from stalebound.userfiles import json_line, label, read_lines

__all__ = [
    "TRACE_FILE",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "TraceHeader",
    "TraceRecorder",
    "TrajectoryRecord",
    "on_trace_clock",
    "read_run_trace",
    "read_trace",
    "read_trace_header",
    "resumed_trace_name",
    "run_traces",
]

TRACE_FORMAT = "stalebound-trace"
TRACE_VERSION = 1
TRACE_FILE = "trace.jsonl"
"""A run's trace, from its start; each resume from step K writes :func:`resumed_trace_name`."""
_RESUMED = "trace-from-step-"


def resumed_trace_name(step: int) -> str:
    """The trace a run resumed from the checkpoint of ``step`` writes."""
    return f"{_RESUMED}{step}.jsonl"


def run_traces(run_dir: str | Path) -> list[tuple[int, Path]]:
    """A run directory's traces as ``(step, path)``, in the order they were written: ``(0,
    trace.jsonl)`` when there, then each resume's, by the step it resumed from (a resume from
    step 0 after the first)."""
    folder = Path(run_dir)
    found = [(0, folder / TRACE_FILE)] if (folder / TRACE_FILE).is_file() else []
    for path in folder.glob(f"{_RESUMED}*.jsonl"):
        step = path.stem.removeprefix(_RESUMED)
        if step.isdigit():
            found.append((int(step), path))
    return sorted(found, key=lambda found: (found[0], found[1].name != TRACE_FILE))


@dataclass(frozen=True)
class TraceHeader:
    """The first line of a trace."""

    source: str = "runtime"
    group_size: int | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    created: str = ""


def on_trace_clock(seconds: float) -> float:
    """``seconds`` at the resolution a trace keeps its times: the microsecond. What compares a
    run's other records with its trace puts them on it too, so equal moments compare equal."""
    return round(seconds, 6)


@dataclass(frozen=True, slots=True)
class TrajectoryRecord:
    """One trajectory of a trace (see the module docstring for the fields)."""

    prompt_id: Any
    group_id: Any
    member: int
    start: float
    end: float
    tokens: int
    tool_latencies: tuple[float, ...] = ()
    failed: bool = False
    version: int = 0
    complete: bool = True
    outcome: str | None = None
    reward_latency: float = 0.0

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "type": "trajectory",
            "prompt_id": self.prompt_id,
            "group_id": self.group_id,
            "member": self.member,
            "start": on_trace_clock(self.start),
            "end": on_trace_clock(self.end),
            "tokens": self.tokens,
            "tool_latencies": [on_trace_clock(t) for t in self.tool_latencies],
            "failed": self.failed,
            "version": self.version,
            "complete": self.complete,
        }
        if self.outcome is not None:
            data["outcome"] = self.outcome
        if self.reward_latency:
            data["reward_latency"] = on_trace_clock(self.reward_latency)
        return data


class TraceRecorder:
    """Writes a trace: the header at once, then one line per :meth:`record` call.

    Use it as a context manager, or call :meth:`close`. The runtime calls :meth:`record` when a
    trajectory's generation ends; the simulator does the same with virtual times.
    """

    def __init__(self, target: str | Path | IO[str], header: TraceHeader | None = None) -> None:
        if isinstance(target, str | Path):
            # held open across record() calls and closed by close() / __exit__
            self._file: IO[str] = Path(target).open("w", encoding="utf-8")  # noqa: SIM115
            self._owned = True
        else:
            self._file = target
            self._owned = False
        h = header or TraceHeader()
        created = h.created or datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        head: dict[str, Any] = {
            "type": "header",
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "source": h.source,
            "group_size": h.group_size,
            "created": created,
            "meta": dict(h.meta),
        }
        self._file.write(json.dumps(head, sort_keys=True) + "\n")
        self.records = 0

    def record(self, rec: TrajectoryRecord) -> None:
        self._file.write(json.dumps(rec.to_json(), sort_keys=True) + "\n")
        self.records += 1

    def close(self) -> None:
        if self._owned:
            self._file.close()
        else:
            self._file.flush()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _need(ok: bool, path: str, line: int, what: str) -> None:
    if not ok:
        raise ConfigError(f"trace {path} line {line}: {what}")


def _objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(number, object)`` for each non-blank line of the trace at ``path``, streamed; a line
    that is not a JSON object is a :class:`ConfigError` naming it."""
    p = Path(path)
    lines = read_lines(
        p, label("replay", path), fix="give a trace file (stalebound-trace JSON Lines)"
    )
    for number, line in enumerate(_nonblank(text for _, text, _ in lines), 1):
        obj = json_line(
            line,
            f"trace {p} line {number}",
            fix="give a trace written by stalebound train or stalebound simulate --record",
        )
        _need(isinstance(obj, dict), str(p), number, "each line must be a JSON object")
        yield number, obj


def read_trace(path: str | Path) -> tuple[TraceHeader, list[TrajectoryRecord]]:
    """Parse a trace file; a malformed one raises :class:`ConfigError` naming the line."""
    p = Path(path)
    records: list[TrajectoryRecord] = []
    header: TraceHeader | None = None
    for number, obj in _objects(path):
        if number == 1:
            header = _header(obj, str(p))
            continue
        if obj.get("type") != "trajectory":
            continue  # other record types are reserved for later versions
        try:
            tokens = obj["tokens"]
            _need(
                isinstance(tokens, int) and tokens >= 0,
                str(p),
                number,
                f"tokens={tokens!r}: must be an integer ≥ 0",
            )
            tools = tuple(float(t) for t in obj.get("tool_latencies", ()))
            _need(
                all(math.isfinite(t) and t >= 0 for t in tools),
                str(p),
                number,
                "tool latencies must be finite and ≥ 0",
            )
            reward = float(obj.get("reward_latency", 0.0))
            _need(
                math.isfinite(reward) and reward >= 0,
                str(p),
                number,
                f"reward_latency={reward!r}: must be finite and ≥ 0",
            )
            start, end = float(obj.get("start", 0.0)), float(obj.get("end", 0.0))
            _need(
                math.isfinite(start) and math.isfinite(end) and 0 <= start <= end,
                str(p),
                number,
                f"start={start!r}, end={end!r}: must be finite seconds with 0 ≤ start ≤ end",
            )
            records.append(
                TrajectoryRecord(
                    prompt_id=obj["prompt_id"],
                    group_id=obj.get("group_id"),
                    member=int(obj.get("member", 0)),
                    start=start,
                    end=end,
                    tokens=tokens,
                    tool_latencies=tools,
                    failed=bool(obj.get("failed", False)),
                    version=int(obj.get("version", 0)),
                    complete=bool(obj.get("complete", True)),
                    outcome=obj.get("outcome"),
                    reward_latency=reward,
                )
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(
                f"trace {p} line {number}: bad trajectory record ({type(exc).__name__}: {exc}); "
                "see stalebound.obs.trace for the fields"
            ) from None
    if header is None:
        raise ConfigError(f"trace {p}: empty; a trace starts with a header line")
    return header, records


def read_trace_header(path: str | Path) -> TraceHeader:
    """A trace's header alone: its first line, checked as :func:`read_trace` checks it."""
    p = Path(path)
    for _, obj in _objects(path):
        return _header(obj, str(p))
    raise ConfigError(f"trace {p}: empty; a trace starts with a header line")


def _header(obj: Mapping[str, Any], path: str) -> TraceHeader:
    """The header line, each field checked (a trace is input: its header may be anything)."""
    _need(
        obj.get("type") == "header" and obj.get("format") == TRACE_FORMAT,
        path,
        1,
        f"the first line must be a header with format {TRACE_FORMAT!r}; "
        "is this a stalebound trace?",
    )
    _need(
        obj.get("version") == TRACE_VERSION,
        path,
        1,
        f"version={obj.get('version')!r}: this stalebound reads version {TRACE_VERSION}",
    )
    source, group_size = obj.get("source", "runtime"), obj.get("group_size")
    meta, created = obj.get("meta") or {}, obj.get("created", "")
    _need(isinstance(source, str), path, 1, f"source={source!r}: must be a string")
    _need(
        group_size is None or (type(group_size) is int and group_size >= 1),
        path,
        1,
        f"group_size={group_size!r}: must be a whole number ≥ 1 (trajectories per group), or null",
    )
    _need(isinstance(created, str), path, 1, f"created={created!r}: must be a date string")
    _need(isinstance(meta, dict), path, 1, f"meta={meta!r}: must be an object")
    bad = _not_finite(meta)
    _need(bad is None, path, 1, f"meta{bad}: must be a finite number (JSON has no NaN or Infinity)")
    return TraceHeader(source=source, group_size=group_size, meta=meta, created=created)


def _not_finite(value: Any, where: str = "") -> str | None:
    """Where in ``value`` a non-finite number sits (``.a[2]``), or ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where}={value!r}"
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        found = _not_finite(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if found is not None:
            return found
    return None


def _nonblank(lines: Iterable[str]) -> Iterator[str]:
    return (line for line in lines if line.strip())


def read_run_trace(run_dir: str | Path) -> list[TrajectoryRecord]:
    """Every episode a run directory's traces hold, as one history: each resume's trace takes
    over from its first episode on (the run's clock goes on from the checkpoint, so what an
    earlier trace recorded from then on belonged to steps the resume did again)."""
    traces = [read_trace(path)[1] for _, path in run_traces(run_dir)]
    records: list[TrajectoryRecord] = []
    for number, trace in enumerate(traces):
        later = [min(r.start for r in t) for t in traces[number + 1 :] if t]
        cut = min(later, default=float("inf"))
        records.extend(r for r in trace if r.start < cut)
    return records

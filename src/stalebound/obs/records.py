"""The typed input surface of the observability layer and the run directory's file formats.

A training loop hands the observability layer plain numbers: step metrics as a flat
``Mapping[str, float]``, the staleness of what it trained as integers, and the staleness buffers as
:class:`BufferRow` values (:func:`buffer_rows` builds them from a :class:`StalenessBuffer`).

A run directory holds, one JSON object per line:

* ``metrics.jsonl`` — one record per training step: ``step``, ``version``, ``wall_time`` (seconds
  since the run started, continued across resumes), ``timestamp`` (Unix time) and the step's flat
  numeric metrics. A non-finite value (NaN, ±inf) is written as ``null`` so that every line is
  standard JSON.
* ``staleness.jsonl`` — per step, ``{"step", "version", "counts": {"<staleness>": n, ...}}``: how
  many trained items (trajectories or tokens, as the caller counts them) had each staleness.
* ``buffers.jsonl`` — buffer samples: ``{"wall_time", "timestamp", "version", "buffers": [row, ...]}``
  with one row per buffer in the window (see :class:`BufferRow`).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from stalebound.core import EntryState, ProtocolError
from stalebound.core.checks import is_integral
from stalebound.userfiles import read_lines

if TYPE_CHECKING:
    from stalebound.core import StalenessBuffer

__all__ = [
    "BUFFERS_FILE",
    "LEDGER_FILE",
    "METRICS_FILE",
    "RESERVED_KEYS",
    "STALENESS_FILE",
    "TARGET_WINDOW",
    "BufferRow",
    "BufferSample",
    "MetricSummary",
    "RunData",
    "RunSummary",
    "StalenessHistogram",
    "StepMetrics",
    "buffer_rows",
    "first_at_target",
    "load_run",
    "numbered_jsonl",
    "reached_target",
    "read_jsonl",
    "step_problems",
    "steps_to_target",
    "summarize",
    "target_reward",
    "time_problems",
]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
STALENESS_FILE = "staleness.jsonl"
BUFFERS_FILE = "buffers.jsonl"
LEDGER_FILE = "ledger.jsonl"
"""The item ledger ``stalebound train`` writes (:mod:`stalebound.train.ledger`)."""

StepMetrics = Mapping[str, float]
"""One training step's metrics: flat names to numbers (``reward_mean``, ``clip_frac``, ...)."""

RESERVED_KEYS = frozenset({"step", "version", "wall_time", "timestamp"})
"""Record fields the logger fills in itself; step metrics may not use these names."""

STATE_NAMES = ("PENDING", "STUCK", "READY_WITH_CAPACITY", "READY")

TARGET_WINDOW = 5
"""A run reaches its ``run.target_reward`` at the first step where the mean reward of its last
``TARGET_WINDOW`` steps (all of them, before that many) is at least the target."""


@dataclass(frozen=True, slots=True)
class BufferRow:
    """One staleness buffer at one moment: its version, entry counts by state and its state name.

    ``state`` is a :class:`~stalebound.core.BufferState` member name (``PENDING``, ``STUCK``,
    ``READY_WITH_CAPACITY`` or ``READY``).
    """

    version: int
    occupied: int
    reserved: int
    empty: int
    state: str

    @property
    def size(self) -> int:
        """Entries in the buffer (B′)."""
        return self.occupied + self.reserved + self.empty

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "occupied": self.occupied,
            "reserved": self.reserved,
            "empty": self.empty,
            "state": self.state,
        }

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> BufferRow:
        return cls(
            version=int(item["version"]),
            occupied=int(item["occupied"]),
            reserved=int(item["reserved"]),
            empty=int(item["empty"]),
            state=str(item["state"]),
        )


def buffer_rows(buf: StalenessBuffer) -> list[BufferRow]:
    """The rows of the head buffer and of every buffer of ``buf``'s window that holds an entry,
    head first (the others are empty; the window ``v … v + η`` may be huge)."""
    rows = []
    for bv in sorted({buf.version, *buf.versions_in_use()}):
        counts = buf.entries(bv)
        rows.append(
            BufferRow(
                version=bv,
                occupied=counts[EntryState.OCCUPIED],
                reserved=counts[EntryState.RESERVED],
                empty=counts[EntryState.EMPTY],
                state=buf.state(bv).name,
            )
        )
    return rows


@dataclass(frozen=True, slots=True)
class BufferSample:
    """A sample of the buffers: when it was taken, the training version and the rows."""

    wall_time: float
    version: int
    rows: tuple[BufferRow, ...]

    @property
    def head(self) -> BufferRow | None:
        """The row of buffer ``version`` (the one trained next), if it was sampled."""
        for row in self.rows:
            if row.version == self.version:
                return row
        return None


class StalenessHistogram:
    """Counts of trained items by staleness (trained version − generating version).

    >>> h = StalenessHistogram()
    >>> h.add([0, 1, 1])
    >>> h.add({2: 1})
    >>> h.counts, h.total, h.max
    ({0: 1, 1: 2, 2: 1}, 4, 2)
    """

    def __init__(self, counts: Mapping[int, int] | None = None) -> None:
        self._counts: Counter[int] = Counter()
        if counts:
            self.add(counts)

    def add(self, values: Iterable[int] | Mapping[int, int]) -> None:
        """Add items: an iterable of staleness values, or a mapping staleness → count."""
        # Count first, then check each distinct value once: a step may train thousands of items.
        pairs = values.items() if isinstance(values, Mapping) else Counter(values).items()
        update: Counter[int] = Counter()
        for staleness, count in pairs:
            if not is_integral(staleness) or staleness < 0:
                raise ProtocolError(
                    f"staleness {staleness!r}: staleness values are ints ≥ 0 (trained version "
                    "minus generating version); pass the per-item staleness"
                )
            if not is_integral(count) or count < 0:
                raise ProtocolError(
                    f"staleness {staleness}: count {count!r} must be an int ≥ 0; pass how many "
                    "items had this staleness"
                )
            if count:
                update[int(staleness)] += int(count)
        self._counts.update(update)

    @property
    def counts(self) -> dict[int, int]:
        """Staleness → count, in increasing staleness."""
        return dict(sorted(self._counts.items()))

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    @property
    def mean(self) -> float | None:
        total = self.total
        return sum(k * n for k, n in self._counts.items()) / total if total else None

    @property
    def max(self) -> int | None:
        return max(self._counts) if self._counts else None

    def __bool__(self) -> bool:
        return bool(self._counts)

    def __repr__(self) -> str:
        return f"StalenessHistogram({self.counts!r})"


@dataclass(frozen=True)
class MetricSummary:
    """First, last, minimum, maximum and mean of one metric over a run (finite values only)."""

    first: float
    last: float
    min: float
    max: float
    mean: float
    count: int


@dataclass(frozen=True)
class RunSummary:
    """What a run did, from its run directory: the basis of the end-of-run summary table."""

    steps: int
    """Step records logged."""
    last_step: int | None
    last_version: int | None
    wall_time: float
    """Seconds from the start of the run to its last record."""
    metrics: Mapping[str, MetricSummary]
    staleness: Mapping[int, int] = field(default_factory=dict)
    """Trained items by staleness, summed over the run."""


@dataclass(frozen=True)
class RunData:
    """The parsed contents of a run directory."""

    steps: tuple[Mapping[str, Any], ...]
    staleness: tuple[Mapping[str, Any], ...]
    buffers: tuple[BufferSample, ...]

    def series(self, key: str) -> tuple[list[int], list[float], list[float]]:
        """``(steps, wall_times, values)`` of one metric, leaving out steps where it is absent or null."""
        steps, times, values = [], [], []
        for rec in self.steps:
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                steps.append(int(rec["step"]))
                times.append(float(rec["wall_time"]))
                values.append(float(value))
        return steps, times, values

    def staleness_histogram(self) -> StalenessHistogram:
        hist = StalenessHistogram()
        for rec in self.staleness:
            hist.add({int(k): int(n) for k, n in rec["counts"].items()})
        return hist


def reached_target(rewards: Sequence[float], target: float) -> bool:
    """Whether the mean of the last :data:`TARGET_WINDOW` of ``rewards`` is at least ``target``."""
    recent = rewards[-TARGET_WINDOW:]
    return bool(recent) and sum(recent) / len(recent) >= target


def first_at_target(rewards: Iterable[float], target: float) -> int | None:
    """The step (1-based) at which ``rewards``, one per step, first :func:`reached_target`;
    ``None`` when they never did."""
    seen: list[float] = []
    for reward in rewards:
        seen.append(reward)
        if reached_target(seen, target):
            return len(seen)
    return None


def target_reward(run_dir: str | Path) -> float | None:
    """The run's ``run.target_reward`` (its ``config.yaml``); ``None`` when it has none."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text(encoding="utf-8"))
        value = cfg["run"]["target_reward"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def steps_to_target(run_dir: str | Path) -> int | None:
    """The step at which the run's training reward (``reward_mean`` in ``metrics.jsonl``) reached
    its ``run.target_reward`` (:func:`reached_target`); ``None`` when it never did (or has no
    target, or a step without a reward)."""
    target = target_reward(run_dir)
    if target is None:
        return None
    rewards: list[float] = []
    for row in read_jsonl(Path(run_dir) / METRICS_FILE):
        reward = row.get("reward_mean")
        if not isinstance(reward, (int, float)):
            break
        rewards.append(float(reward))
    return first_at_target(rewards, target)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file; a missing file has none. An unfinished last line (a
    crash mid-write) is skipped with a warning; a malformed line elsewhere is a ``ProtocolError``."""
    for _, record in numbered_jsonl(path):
        yield record


def numbered_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """:func:`read_jsonl`'s records with their line numbers."""
    if not path.exists():
        return
    fix = "the file is damaged, remove or repair that line"
    for number, line, ended in read_lines(path, str(path), fix=fix):  # streamed, UTF-8 checked
        if not ended:  # a file written completely ends with "\n": this line was cut short
            if line.strip():
                log.warning("%s: skipping an unfinished last line (%d characters)", path, len(line))
            return
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:  # not JSON, or an integer past Python's digit limit
            raise ProtocolError(f"{path}:{number}: not a JSON object ({exc}); {fix}") from None
        if not isinstance(record, dict):
            raise ProtocolError(f"{path}:{number}: expected a JSON object, got {line[:40]!r}")
        yield number, record


def step_problems(
    name: str,
    records: Iterable[tuple[int, Mapping[str, Any]]],
    steps: Iterable[int] | None = None,
    of: str = "the run's steps",
) -> list[str]:
    """What is wrong with the ``step`` fields of numbered ``records`` of file ``name``: a step
    that is not a whole number, one there twice, one out of order, and — when ``steps`` (the
    steps the file must hold, ``of`` saying whose they are) is given — those missing and those
    that are not among them."""
    problems: list[str] = []
    lines: dict[int, int] = {}
    last = 0
    for number, record in records:
        step = record.get("step")
        if type(step) is not int or step < 1:  # JSON's whole numbers are ints
            problems.append(f"{name} line {number}: step={step!r} is not a step number")
            continue
        if step in lines:
            problems.append(
                f"{name}: step {step} is there twice (lines {lines[step]} and {number})"
            )
        elif step < last:
            problems.append(f"{name} line {number}: step {step} comes after step {last}")
        lines.setdefault(step, number)
        last = max(last, step)
    if steps is not None:
        wanted = set(steps)
        missing = sorted(wanted - set(lines))
        if missing:
            problems.append(f"{name}: {_steps_text(missing)} missing")
        extra = sorted(set(lines) - wanted)
        if extra:
            problems.append(f"{name}: {_steps_text(extra)} not among {of}")
    return problems


def time_problems(name: str, records: Iterable[tuple[int, Mapping[str, Any]]]) -> list[str]:
    """Samples of file ``name`` whose ``wall_time`` does not come after the one before: a record
    there twice, or out of order."""
    problems = []
    previous: tuple[int, float] | None = None
    for number, record in records:
        t = record.get("wall_time")
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
            problems.append(f"{name} line {number}: wall_time={t!r} is not a time")
            continue
        if previous is not None and t <= previous[1]:
            problems.append(
                f"{name} line {number}: wall_time {t} is not after line {previous[0]}'s "
                f"{previous[1]} (a record there twice, or out of order)"
            )
        previous = (number, float(t))
    return problems


def _steps_text(steps: list[int]) -> str:
    """``step 4 is`` / ``steps 4, 5, 9 are`` / ``steps 28–30 are``."""
    if len(steps) == 1:
        return f"step {steps[0]} is"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}–{steps[-1]} are"
    shown = ", ".join(str(s) for s in steps[:10])
    return f"steps {shown}{' …' if len(steps) > 10 else ''} are"


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory's metrics, staleness counts and buffer samples."""
    root = Path(run_dir)
    try:
        is_dir = root.is_dir()
    except OSError as exc:  # a name too long, say
        raise ProtocolError(
            f"run directory {str(root)!r}: cannot read it ({exc.strerror}); pass the directory "
            "a run wrote"
        ) from None
    if not is_dir:
        raise ProtocolError(
            f"run directory {str(root)!r} does not exist; pass the directory a run wrote"
        )
    samples = tuple(
        BufferSample(
            wall_time=float(rec["wall_time"]),
            version=int(rec["version"]),
            rows=tuple(BufferRow.from_json(r) for r in rec["buffers"]),
        )
        for rec in read_jsonl(root / BUFFERS_FILE)
    )
    return RunData(
        steps=tuple(read_jsonl(root / METRICS_FILE)),
        staleness=tuple(read_jsonl(root / STALENESS_FILE)),
        buffers=samples,
    )


def summarize(data: RunData | str | Path) -> RunSummary:
    """The summary of a run (its :class:`RunData` or its directory)."""
    if not isinstance(data, RunData):
        data = load_run(data)
    values: dict[str, list[float]] = {}
    for rec in data.steps:
        for key, value in rec.items():
            if key in RESERVED_KEYS or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    metrics = {
        key: MetricSummary(
            first=vals[0],
            last=vals[-1],
            min=min(vals),
            max=max(vals),
            mean=sum(vals) / len(vals),
            count=len(vals),
        )
        for key, vals in values.items()
    }
    last = data.steps[-1] if data.steps else None
    times = [float(r["wall_time"]) for r in data.steps] + [s.wall_time for s in data.buffers]
    return RunSummary(
        steps=len(data.steps),
        last_step=int(last["step"]) if last else None,
        last_version=int(last["version"]) if last and last.get("version") is not None else None,
        wall_time=max(times, default=0.0),
        metrics=metrics,
        staleness=data.staleness_histogram().counts,
    )

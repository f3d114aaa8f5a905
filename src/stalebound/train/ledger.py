"""What became of every item the executor took in: ``RUN_DIR/ledger.jsonl`` and its audit.

The executor numbers items in the order it takes them in (``Trajectory.sample_index``). After each
training step the job appends one line::

    {"step": 12, "trained": [310, 311, ...], "ended": {"filtered": [305], "failed": []}}

— the items of the groups trained in that step, and those that ended untrained since the last
line (:meth:`~stalebound.runtime.WorkflowExecutor.drain_outcomes`). A resumed run first cuts the
file back to the step of its checkpoint, as it does the metrics. :func:`audit_run` then checks the
whole lineage: each item taken in (``0 … next_sample − 1`` of the newest checkpoint) appears
exactly once — trained, ended, or pending in that checkpoint (queued, running, or completed and
waiting in a buffer).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stalebound.core import ConfigError, StaleboundError
from stalebound.core.checks import is_integral
from stalebound.obs.records import (
    BUFFERS_FILE,
    LEDGER_FILE,
    METRICS_FILE,
    STALENESS_FILE,
    numbered_jsonl,
    step_problems,
    time_problems,
)
from stalebound.train.checkpoint import open_checkpoint
from stalebound.userfiles import json_line, read_lines

__all__ = ["LEDGER_FILE", "Audit", "ItemLedger", "audit_run", "record_problems"]


def _read(path: Path) -> list[dict[str, Any]]:
    return [record for _, record in _numbered(path)]


def _numbered(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The ledger's lines. A last line cut short by a crash (no newline, not JSON) is left out;
    any other line that is not a well-formed record — damaged in the middle, a binary file — is a
    :class:`~stalebound.core.errors.ConfigError` naming its number and why, rather than items
    silently counted as lost."""
    if not path.exists():
        return []
    head = f"{path}"
    fix = (
        "the ledger is damaged: restore it from a copy (without the line, the items of its step "
        "cannot be accounted for)"
    )
    lines = []
    for number, raw, ended in read_lines(path, head, fix=fix):
        try:
            record = json_line(raw, f"{head} line {number}", fix=fix)
        except ConfigError:
            if not ended:
                break  # the last line, cut short by a crash
            raise
        why = _malformed(record)
        if why is not None:
            raise ConfigError(f"{head} line {number}: {why}; {fix}")
        lines.append((number, record))
    return lines


def _items(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    )


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _malformed(record: Any) -> str | None:
    """Why a parsed line is not a ledger record (``ItemLedger.record``'s shape), or ``None``."""
    if not isinstance(record, dict):
        return f"holds {_shown(record)}, not a record"
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"step={step!r}: must be an integer"
    if not _items(record.get("trained")):
        return f"trained={_shown(record.get('trained'))}: must be a list of item numbers"
    ended = record.get("ended")
    if not isinstance(ended, dict) or not all(
        isinstance(k, str) and _items(v) for k, v in ended.items()
    ):
        return (
            f"ended={_shown(ended)}: must map each outcome to a list of item numbers, like "
            '{"filtered": [3]}'
        )
    return None


class ItemLedger:
    """Appends one line per step to ``RUN_DIR/ledger.jsonl``.

    ``resume_step``: continue a run restarted from the checkpoint of that step; lines after it
    (work the restart redoes) are removed first. Without it the file must not exist yet.
    """

    def __init__(self, run_dir: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        if resume_step is None:
            if self.path.exists() and self.path.stat().st_size:
                raise ConfigError(
                    f"run_dir={str(self.path.parent)!r}: already holds {LEDGER_FILE}; resume the "
                    "run (resume=RUN_DIR) or choose a new directory"
                )
        else:
            kept = [r for r in _read(self.path) if r["step"] <= resume_step]
            tmp = self.path.with_name(f".{LEDGER_FILE}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.path)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def record(self, step: int, trained: Iterable[int], ended: Iterable[tuple[int, str]]) -> None:
        by_outcome: dict[str, list[int]] = {}
        for index, outcome in ended:
            by_outcome.setdefault(outcome, []).append(index)
        line = {"step": step, "trained": sorted(set(trained)), "ended": by_outcome}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def record_problems(run_dir: str | Path, upto: int | None = None) -> list[str]:
    """What is wrong with the steps of a run's records — ``metrics.jsonl`` and ``ledger.jsonl``
    hold each step from 1 on exactly once and in order, ``staleness.jsonl`` the steps of
    ``metrics.jsonl``, and the samples of ``buffers.jsonl`` follow each other in time — up to step
    ``upto`` (the step of the checkpoint a resume cuts the records back to; ``None``: all)."""
    root = Path(run_dir)
    problems: list[str] = []
    read: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for name, reader in (
        (METRICS_FILE, numbered_jsonl),
        (LEDGER_FILE, _numbered),
        (STALENESS_FILE, numbered_jsonl),
        (BUFFERS_FILE, numbered_jsonl),
    ):
        try:
            records: list[tuple[int, Mapping[str, Any]]] = list(reader(root / name))
        except StaleboundError as exc:  # a line that does not parse: it says which
            problems.append(str(exc))
            continue
        read[name] = [
            (n, r)
            for n, r in records
            if upto is None or not is_integral(r.get("step")) or r["step"] <= upto
        ]
    metrics = read.get(METRICS_FILE, [])
    steps = [int(r["step"]) for _, r in metrics if is_integral(r.get("step"))]
    last = upto if upto is not None else max(steps, default=0)
    if METRICS_FILE in read:
        problems += step_problems(METRICS_FILE, metrics, range(1, last + 1))
    if LEDGER_FILE in read:
        problems += step_problems(LEDGER_FILE, read[LEDGER_FILE], range(1, last + 1))
    if STALENESS_FILE in read and METRICS_FILE in read:
        of = f"those of {METRICS_FILE}"
        problems += step_problems(STALENESS_FILE, read[STALENESS_FILE], steps, of)
    if BUFFERS_FILE in read:
        ends = [
            r.get("wall_time") for _, r in metrics if upto is not None and r.get("step") == upto
        ]
        samples = read[BUFFERS_FILE]
        if ends and isinstance(ends[0], int | float):  # those after it, a resume cuts
            samples = [(n, r) for n, r in samples if not _after(r.get("wall_time"), ends[0])]
        problems += time_problems(BUFFERS_FILE, samples)
    return problems


def _after(t: Any, cutoff: float) -> bool:
    return isinstance(t, int | float) and not isinstance(t, bool) and t > cutoff


@dataclass(frozen=True)
class Audit:
    """Every item of a run's lineage, counted once by what became of it."""

    step: int
    """The step of the checkpoint audited against."""
    taken: int
    """Items taken in (numbered ``0 … taken − 1``)."""
    trained: int
    ended: Mapping[str, int]
    """Items that ended untrained, by outcome (filtered, failed, dropped, surplus, stopped)."""
    pending: int
    """Items still queued, running or waiting in a buffer at the checkpoint."""
    duplicates: tuple[int, ...] = field(default=())
    """Items accounted for more than once (trained twice, say)."""
    missing: tuple[int, ...] = field(default=())
    """Items taken in and accounted for nowhere (lost)."""
    unknown: tuple[int, ...] = field(default=())
    """Items accounted for that were never taken in (a damaged ledger or checkpoint)."""
    damaged: tuple[str, ...] = field(default=())
    """What is wrong with the steps of the run's records (:func:`record_problems`)."""

    @property
    def ok(self) -> bool:
        return not self.duplicates and not self.missing and not self.unknown and not self.damaged

    def describe(self) -> str:
        ended = ", ".join(f"{n} {k}" for k, n in sorted(self.ended.items()) if n) or "none ended"
        verdict = (
            "each accounted for exactly once"
            if not (self.duplicates or self.missing or self.unknown)
            else f"{len(self.duplicates)} counted twice {list(self.duplicates)[:10]}, "
            f"{len(self.missing)} lost {list(self.missing)[:10]}, "
            f"{len(self.unknown)} never taken in {list(self.unknown)[:10]}"
        )
        if self.damaged:
            verdict += f"; the records are damaged: {'; '.join(self.damaged)}"
        return (
            f"step {self.step}: {self.taken} items taken in — {self.trained} trained, {ended}, "
            f"{self.pending} pending; {verdict}"
        )


def audit_run(run_dir: str | Path) -> Audit:
    """Check the ledger of ``run_dir`` against its newest checkpoint (see the module docstring).
    Raises :class:`~stalebound.train.checkpoint.CheckpointError` without a usable checkpoint."""
    ckpt = open_checkpoint(run_dir)
    state = ckpt.rollout_state()
    seen: Counter[int] = Counter()
    trained = 0
    ended: Counter[str] = Counter()
    for record in _read(Path(run_dir) / LEDGER_FILE):
        if record["step"] > ckpt.step:
            break
        seen.update(record["trained"])
        trained += len(record["trained"])
        for outcome, items in record["ended"].items():
            seen.update(items)
            ended[outcome] += len(items)
    for index, outcome in state["outcomes"]:  # ended after the checkpoint's line was written
        seen[index] += 1
        ended[outcome] += 1
    pending = [i for i, _, _ in state["pending"]] + list(state["samples"].values())
    pending += [group[0].sample_index for group in state["waiting"]]
    seen.update(pending)
    taken = int(state["next_sample"])
    return Audit(
        step=ckpt.step,
        taken=taken,
        trained=trained,
        ended=dict(ended),
        pending=len(pending),
        duplicates=tuple(sorted(i for i, n in seen.items() if n > 1)),
        missing=tuple(i for i in range(taken) if i not in seen),
        unknown=tuple(sorted(i for i in seen if not 0 <= i < taken)),
        damaged=tuple(record_problems(run_dir, ckpt.step)),
    )

"""The run logger: one place a training loop sends its numbers, written to a run directory.

Per step it appends a record to ``metrics.jsonl`` (and the step's staleness counts to
``staleness.jsonl``), writes the scalars and a staleness histogram to TensorBoard event files under
``tensorboard/``, hands the metrics to the loggers of ``obs.loggers`` (wandb, MLflow:
:mod:`stalebound.obs.loggers`), and, when asked, updates Prometheus gauges served on 127.0.0.1. Buffer samples go
to ``buffers.jsonl``. The file formats are described in :mod:`stalebound.obs.records`.

Every line is flushed when written, so a crash loses at most the line being written; resuming
skips such an unfinished line and continues the same series.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from stalebound._scoped import Scoped
from stalebound.core import ConfigError, ProtocolError
from stalebound.core.checks import check_version, is_integral
from stalebound.obs.loggers import MetricLogger
from stalebound.obs.prometheus import PrometheusExporter
from stalebound.obs.records import (
    BUFFERS_FILE,
    METRICS_FILE,
    RESERVED_KEYS,
    STALENESS_FILE,
    BufferRow,
    RunSummary,
    StalenessHistogram,
    load_run,
    read_jsonl,
    summarize,
)
from stalebound.obs.tensorboard_events import TensorBoardWriter, tensorboard_available

__all__ = ["TENSORBOARD_DIR", "RunLogger"]

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
_FILES = (METRICS_FILE, STALENESS_FILE, BUFFERS_FILE)


class RunLogger(Scoped):
    """Writes a run directory: step metrics, staleness counts, buffer samples, TensorBoard events.

    ``resume=False`` refuses a directory that already holds a run (so nothing is overwritten);
    ``resume=True`` continues it: steps keep counting from the last one logged and wall time
    continues from the last record. ``resume_step`` (with ``resume=True``) first removes records
    after that step — for a run restarted from a checkpoint taken at that step — and TensorBoard
    hides its events after it too.

    ``tensorboard``: write event files (needs the ``obs`` extra; without it a warning is logged
    once and the JSON files are still written). ``prometheus_port``: serve Prometheus metrics on
    ``127.0.0.1`` at that port (``0`` picks a free one); ``None`` (the default) serves nothing.
    ``loggers``: more places each step's metrics go (:class:`~stalebound.obs.loggers.
    MetricLogger`: wandb, MLflow), closed with this logger. ``clock``: the monotonic clock wall
    times are measured with.

    Thread-safe: the trainer may log steps while a dispatcher thread logs buffer samples.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume: bool = False,
        resume_step: int | None = None,
        tensorboard: bool = True,
        prometheus_port: int | None = None,
        loggers: Sequence[MetricLogger] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_dir = Path(run_dir)
        if resume_step is not None and not resume:
            raise ConfigError(
                f"resume_step={resume_step!r}: only meaningful with resume=True; pass resume=True "
                "to continue the run from that step"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._clock = clock
        self._last_step = 0
        self._last_version: int | None = None
        self._time_offset = 0.0
        self._staleness = StalenessHistogram()
        self._last_buffers: tuple[int | None, tuple[BufferRow, ...]] | None = None
        self._unchanged_buffer_samples = 0
        if resume:
            self._load_previous(resume_step)
        else:
            existing = [n for n in _FILES if (self.run_dir / n).exists()]
            if existing:
                raise ConfigError(
                    f"run_dir={str(self.run_dir)!r}: already holds a run ({', '.join(existing)}); "
                    "pass resume=True to continue it, or choose a new directory"
                )
        self._start = clock()
        self._files: dict[str, IO[str]] = {
            name: (self.run_dir / name).open("a", encoding="utf-8") for name in _FILES
        }
        self._tb: TensorBoardWriter | None = None
        if tensorboard:
            if tensorboard_available():
                self._tb = TensorBoardWriter(
                    self.run_dir / TENSORBOARD_DIR,
                    purge_step=self._last_step + 1 if resume else None,
                )
            else:
                log.warning(
                    "tensorboard is not installed: no event files are written to %s (install "
                    "stalebound[obs] for them); metrics.jsonl is still written",
                    self.run_dir,
                )
        self._prom: PrometheusExporter | None = None
        if prometheus_port is not None:
            self._prom = PrometheusExporter(prometheus_port)
            log.info("Prometheus metrics at %s", self._prom.url)
        self._loggers = list(loggers)
        self._closed = False

    # ------------------------------------------------------------------ queries

    @property
    def last_step(self) -> int:
        """The last step logged (0 before the first)."""
        return self._last_step

    @property
    def elapsed(self) -> float:
        """Seconds since the run started, continued across resumes."""
        return self._time_offset + (self._clock() - self._start)

    @property
    def staleness(self) -> StalenessHistogram:
        """Trained items by staleness over the whole run (a copy)."""
        return StalenessHistogram(self._staleness.counts)

    @property
    def unchanged_buffer_samples(self) -> int:
        """Buffer samples not written because they equalled the previous one."""
        return self._unchanged_buffer_samples

    @property
    def prometheus_url(self) -> str | None:
        return self._prom.url if self._prom else None

    def summary(self) -> RunSummary:
        """The run's summary, read back from its files."""
        with self._lock:
            for fh in self._files.values():
                if not fh.closed:
                    fh.flush()
        return summarize(load_run(self.run_dir))

    # --------------------------------------------------------------- logging

    def log_step(
        self,
        metrics: Mapping[str, float],
        *,
        step: int | None = None,
        version: int | None = None,
        staleness: Iterable[int] | Mapping[int, int] | None = None,
        wall_time: float | None = None,
    ) -> dict[str, Any]:
        """Record one training step and return the record written to ``metrics.jsonl``.

        ``metrics``: flat names to numbers. ``step``: defaults to the last step + 1 (the first is
        1); an explicit step must be larger than the last. ``version``: the policy version after
        the step. ``staleness``: the staleness of each item trained in this step (or a mapping
        staleness → count); it feeds the run's histogram and, unless ``metrics`` has them,
        ``staleness_mean`` and ``staleness_max``. ``wall_time``: seconds since the run started,
        for callers with their own clock (a simulator); default: measured.
        """
        clean = _check_metrics(metrics)
        version = _check_version("log_step", version)
        hist = StalenessHistogram()
        if staleness is not None:
            hist.add(staleness)
        if hist:
            clean.setdefault("staleness_mean", float(hist.mean or 0.0))
            clean.setdefault("staleness_max", float(hist.max or 0))
        with self._lock:
            self._check_open("log_step")
            if step is None:
                step = self._last_step + 1
            elif not is_integral(step):
                raise ProtocolError(f"log_step(step={step!r}): the step must be an int")
            elif step <= self._last_step:
                raise ProtocolError(
                    f"log_step(step={step}): steps must increase, and step {self._last_step} was "
                    "already logged; pass a larger step, or resume with resume_step to rewrite "
                    "from an earlier one"
                )
            step = int(step)
            t = self.elapsed if wall_time is None else float(wall_time)
            stamp = time.time()
            record: dict[str, Any] = {
                "step": step,
                "version": version,
                "wall_time": round(t, 6),
                "timestamp": round(stamp, 3),
            }
            record.update({k: (v if math.isfinite(v) else None) for k, v in clean.items()})
            self._write(METRICS_FILE, record)
            counts = hist.counts
            if counts:
                self._write(
                    STALENESS_FILE,
                    {
                        "step": step,
                        "version": version,
                        "counts": {str(k): n for k, n in counts.items()},
                    },
                )
                self._staleness.add(counts)
            self._last_step = step
            self._last_version = version
            if self._tb is not None:
                self._tb.add_scalars(step, clean, wall_time=stamp)
                if counts:
                    self._tb.add_int_histogram("staleness", step, counts, wall_time=stamp)
            if self._prom is not None:
                finite = {k: v for k, v in clean.items() if math.isfinite(v)}
                self._prom.record_step(step, version, finite, counts)
            for logger in self._loggers:
                logger.log_metrics(
                    step, clean if version is None else {**clean, "version": version}
                )
        return record

    def log_buffers(
        self, time: float | None, version: int, rows: Sequence[BufferRow]
    ) -> dict[str, Any] | None:
        """Record a sample of the buffers: one :class:`BufferRow` per buffer in the window.

        ``time``: seconds since the run started (``None``: measured now). ``version``: the training
        version v (row ``v`` is the head buffer, consumed next). Returns the record written, or
        ``None`` when nothing changed since the previous sample (so callers may sample on every
        buffer event without filling the disk); :attr:`unchanged_buffer_samples` counts those.
        """
        for row in rows:
            if not isinstance(row, BufferRow):
                raise ProtocolError(
                    f"log_buffers: {row!r} is not a BufferRow; build the rows with "
                    "stalebound.obs.buffer_rows(buffer)"
                )
        checked = _check_version("log_buffers", version)
        key = (checked, tuple(rows))
        with self._lock:
            self._check_open("log_buffers")
            if key == self._last_buffers:
                self._unchanged_buffer_samples += 1
                return None
            self._last_buffers = key
            t = self.elapsed if time is None else float(time)
            record = {
                "wall_time": round(t, 6),
                "timestamp": round(_now(), 3),
                "version": checked,
                "buffers": [row.to_json() for row in rows],
            }
            self._write(BUFFERS_FILE, record)
            if self._prom is not None:
                self._prom.record_buffers(checked or 0, rows)
        return record

    def flush(self) -> None:
        with self._lock:
            for fh in self._files.values():
                fh.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        """Flush and sync the files to disk, close the event file, stop the Prometheus server."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fh in self._files.values():
                fh.flush()
                os.fsync(fh.fileno())
                fh.close()
            if self._tb is not None:
                self._tb.close()
            if self._prom is not None:
                self._prom.close()
            for logger in self._loggers:
                logger.close()

    def _exit_scope(self) -> None:
        self.close()

    # --------------------------------------------------------------- helpers

    def _write(self, name: str, record: Mapping[str, Any]) -> None:
        fh = self._files[name]
        fh.write(json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n")
        fh.flush()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise ProtocolError(
                f"{op}: the RunLogger for {str(self.run_dir)!r} is closed; create a new one "
                "with resume=True to log more"
            )

    def _load_previous(self, resume_step: int | None) -> None:
        """Read the previous run's records; drop those after ``resume_step`` and any unfinished
        last line, rewriting a file only when something was dropped."""
        steps = list(read_jsonl(self.run_dir / METRICS_FILE))
        if resume_step is not None:
            if isinstance(resume_step, bool) or not isinstance(resume_step, int) or resume_step < 0:
                raise ConfigError(f"resume_step={resume_step!r}: must be an int ≥ 0")
            known = [int(r["step"]) for r in steps]
            if resume_step > max(known, default=0):
                raise ConfigError(
                    f"resume_step={resume_step}: the run directory's last step is "
                    f"{max(known, default=0)}; pass a step the run reached"
                )
            steps = [r for r in steps if int(r["step"]) <= resume_step]
        cutoff = float(steps[-1]["wall_time"]) if steps and resume_step is not None else math.inf
        kept = {
            METRICS_FILE: steps,
            STALENESS_FILE: [
                r
                for r in read_jsonl(self.run_dir / STALENESS_FILE)
                if resume_step is None or int(r["step"]) <= resume_step
            ],
            BUFFERS_FILE: [
                r
                for r in read_jsonl(self.run_dir / BUFFERS_FILE)
                if float(r["wall_time"]) <= cutoff
            ],
        }
        for name, records in kept.items():
            _rewrite_if_changed(self.run_dir / name, records)
        if steps:
            self._last_step = int(steps[-1]["step"])
            version = steps[-1].get("version")
            self._last_version = int(version) if version is not None else None
        times = [float(r["wall_time"]) for recs in kept.values() for r in recs if "wall_time" in r]
        self._time_offset = max(times, default=0.0)
        for rec in kept[STALENESS_FILE]:
            self._staleness.add({int(k): int(n) for k, n in rec["counts"].items()})


def _check_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise ProtocolError(
            f"log_step: metrics must be a mapping of names to numbers, got {type(metrics).__name__}"
        )
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ProtocolError(f"log_step: metric name {key!r} must be a non-empty str")
        if key in RESERVED_KEYS:
            raise ProtocolError(
                f"log_step: metric name {key!r} is a field the logger fills in itself "
                f"({', '.join(sorted(RESERVED_KEYS))}); rename the metric"
            )
        if not _is_real(value):
            raise ProtocolError(
                f"log_step: metric {key}={value!r} is not a number; metrics are flat names to "
                "numbers (convert tensors with .item())"
            )
        clean[key] = float(value)
    return clean


def _check_version(op: str, version: int | None) -> int | None:
    """A step's policy version (numpy integers admitted), or ``None`` when it has none."""
    return None if version is None else check_version(op, version, integral=True)


def _rewrite_if_changed(path: Path, records: list[dict[str, Any]]) -> None:
    """Atomically rewrite a JSON-lines file with ``records`` if its bytes would change."""
    text = "".join(json.dumps(r, allow_nan=False, separators=(",", ":")) + "\n" for r in records)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if old == text:
        return
    old_lines = sum(1 for line in old.split("\n") if line.strip())
    log.info("%s: rewritten for resume, %d line(s) dropped", path, old_lines - len(records))
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _is_real(value: object) -> bool:
    return type(value) in (float, int) or (
        isinstance(value, numbers.Real) and not isinstance(value, bool)
    )


def _now() -> float:
    return time.time()

"""TensorBoard event files, written with the ``tensorboard`` package's own event writer.

``torch.utils.tensorboard`` is a wrapper over this same package, so writing through it directly
needs the same install (the ``obs`` extra) without importing torch. Imported lazily: the module
loads ``tensorboard`` only when a :class:`TensorBoardWriter` is created.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardWriter", "tensorboard_available"]


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (the ``obs`` extra) can be imported."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardWriter:
    """Scalars and integer histograms into one event file under ``logdir``.

    ``purge_step``: when resuming, events at this step and later left by an earlier writer are
    hidden by TensorBoard (the same mechanism as ``SummaryWriter(purge_step=...)``).
    """

    def __init__(self, logdir: str | Path, *, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2: Any = event_pb2
        self._summary_pb2: Any = summary_pb2
        self._writer = EventFileWriter(str(logdir), flush_secs=10)
        self.logdir = Path(logdir)
        if purge_step is not None:
            self._writer.add_event(
                event_pb2.Event(
                    wall_time=time.time(),
                    step=purge_step,
                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
                )
            )

    def add_scalars(
        self, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """One event holding a scalar per tag. Non-finite values are written as they are."""
        summary = self._summary_pb2.Summary(
            value=[
                self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
                for tag, value in values.items()
            ]
        )
        self._emit(step, summary, wall_time)

    def add_int_histogram(
        self, tag: str, step: int, counts: Mapping[int, int], wall_time: float | None = None
    ) -> None:
        """A histogram of integer values (value → count), one bucket per integer."""
        if not counts:
            return
        lo, hi = min(counts), max(counts)
        num = sum(counts.values())
        total = sum(k * n for k, n in counts.items())
        squares = sum(k * k * n for k, n in counts.items())
        # A TensorBoard bucket i holds (limit[i-1], limit[i]]: put integer k in (k - 0.5, k + 0.5].
        limits = [lo - 0.5] + [k + 0.5 for k in range(lo, hi + 1)]
        buckets = [0.0] + [float(counts.get(k, 0)) for k in range(lo, hi + 1)]
        histo = self._summary_pb2.HistogramProto(
            min=float(lo),
            max=float(hi),
            num=float(num),
            sum=float(total),
            sum_squares=float(squares),
            bucket_limit=limits,
            bucket=buckets,
        )
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, histo=histo)]
        )
        self._emit(step, summary, wall_time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def _emit(self, step: int, summary: Any, wall_time: float | None) -> None:
        stamp = time.time() if wall_time is None or not math.isfinite(wall_time) else wall_time
        self._writer.add_event(self._event_pb2.Event(wall_time=stamp, step=step, summary=summary))

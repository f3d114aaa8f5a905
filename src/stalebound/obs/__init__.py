"""Observability: the run directory (metrics, staleness counts, buffer samples, TensorBoard,
Prometheus), the live terminal view, the summary table and the plots.

A training loop passes plain numbers: step metrics as ``Mapping[str, float]``, per-item staleness
as ints, and the buffers as :class:`BufferRow` values (``buffer_rows(buffer)`` builds them).
TensorBoard, Prometheus and matplotlib (the ``obs`` extra) are imported only when used.
"""

from stalebound._lazy import lazy_attributes
from stalebound.obs.live import LiveView, render_buffers, summary_table
from stalebound.obs.metrics import RunLogger
from stalebound.obs.records import (
    BufferRow,
    BufferSample,
    MetricSummary,
    RunData,
    RunSummary,
    StalenessHistogram,
    StepMetrics,
    buffer_rows,
    load_run,
    summarize,
)

__all__ = [
    "BufferRow",
    "BufferSample",
    "LiveView",
    "MetricSummary",
    "RunData",
    "RunLogger",
    "RunSummary",
    "StalenessHistogram",
    "StepMetrics",
    "buffer_rows",
    "load_run",
    "plot_run",
    "render_buffers",
    "summarize",
    "summary_table",
]


# plot_run lives with the matplotlib code; importable from here without loading it early.
__getattr__ = lazy_attributes(__name__, {"plot_run": "plots"})

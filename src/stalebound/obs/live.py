"""A live terminal view of a training run, and the end-of-run summary table (rich).

The view shows a header (step, version, η, elapsed time), the run's progress (step N / total,
elapsed and estimated time left, from rich's progress tracking), the latest figures (reward with a
sparkline of recent steps, throughput, staleness, idle fractions, ...) and the staleness buffers:
one row per buffer version in the window, each entry drawn as ``■`` (occupied), ``▣`` (reserved) or
``□`` (empty), with the buffer's state. A row longer than the space available is drawn as a scaled
bar, with the exact counts beside it.

On a terminal the view redraws in place (``rich.live.Live``). Elsewhere (CI logs, a file) it prints
one plain line per training step and nothing for buffer-only updates, so logs stay readable.

:func:`phase` says what a run is doing before its view starts (loading the model, warm start): a
spinner on a terminal, one line elsewhere.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from stalebound._scoped import Scoped
from stalebound.obs.records import BufferRow, RunSummary

__all__ = [
    "EMPTY_GLYPH",
    "OCCUPIED_GLYPH",
    "RESERVED_GLYPH",
    "LiveView",
    "phase",
    "render_buffers",
    "summary_table",
]

OCCUPIED_GLYPH = "■"
RESERVED_GLYPH = "▣"
EMPTY_GLYPH = "□"

_STATE_STYLE = {
    "PENDING": "yellow",
    "STUCK": "bold red",
    "READY_WITH_CAPACITY": "cyan",
    "READY": "bold green",
}
_SPARK = "▁▂▃▄▅▆▇█"

FIGURES: tuple[tuple[str, str], ...] = (
    ("reward_mean", "reward"),
    ("response_length", "response len"),
    ("trajectories_per_s", "trajectories/s"),
    ("staleness_mean", "staleness mean"),
    ("staleness_max", "staleness max"),
    ("trainer_idle_fraction", "trainer idle"),
    ("engine_idle_fraction", "engine idle"),
    ("entropy", "entropy"),
    ("kl_behaviour", "kl"),
    ("clip_fraction", "clip frac"),
    ("masked_fraction", "masked frac"),
    ("filtered_groups", "filtered"),
    ("aborted_tokens", "aborted tokens"),
)
"""The step metrics the view shows, in order, with their labels; absent ones are left out."""


@dataclass(frozen=True)
class _Frame:
    """What the view shows; replaced whole on each update so a redraw never sees half of one."""

    step: int | None = None
    version: int | None = None
    elapsed: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    rows: tuple[BufferRow, ...] = ()
    rewards: tuple[float, ...] = ()


class LiveView(Scoped):
    """The live view of one run. Use as a context manager, or call :meth:`start` and :meth:`stop`.

    ``console``: where to draw (default: a new stdout console). ``staleness``: η, for the header.
    ``live``: redraw in place; default: when the console is an interactive terminal.
    ``reward_key``: the metric the sparkline follows. ``history``: steps in the sparkline.
    ``total_steps``: the step the run ends at, for the progress (step N / total, time left);
    ``first_step``: the step it starts after (a resumed run's). ``clock``: the monotonic clock
    elapsed time and the estimate of the time left are measured with.
    """

    def __init__(
        self,
        console: Console | None = None,
        *,
        staleness: int | None = None,
        title: str = "stalebound",
        live: bool | None = None,
        reward_key: str = "reward_mean",
        history: int = 40,
        refresh_per_second: float = 4.0,
        total_steps: int | None = None,
        first_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console if console is not None else Console()
        self.staleness = staleness
        self.title = title
        self.reward_key = reward_key
        self.is_live = (
            live
            if live is not None
            else self.console.is_terminal and not self.console.is_dumb_terminal
        )
        self._rewards: deque[float] = deque(maxlen=max(1, history))
        self._frame = _Frame()
        self._clock = clock
        self._started_at = clock()
        self._refresh = refresh_per_second
        self._live: Live | None = None
        # rich's progress tracking, never started itself: the view draws its row, and its
        # estimate of the time left (over the last ten minutes of steps) goes in the log line
        self._progress = Progress(
            TextColumn("[dim]steps"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("[dim]left"),
            TimeRemainingColumn(),
            get_time=clock,
            auto_refresh=False,
            speed_estimate_period=600.0,
        )
        self._task: TaskID | None = None
        if total_steps is not None:
            self._task = self._progress.add_task("steps", total=total_steps, completed=first_step)

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._started_at = self._clock()
        if self._task is not None:
            self._progress.reset(
                self._task, completed=int(self._progress.tasks[0].completed), start=True
            )
        if self.is_live and self._live is None:
            self._live = Live(
                get_renderable=self.render,
                console=self.console,
                refresh_per_second=self._refresh,
                transient=False,
            )
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _enter_scope(self) -> None:
        self.start()

    def _exit_scope(self) -> None:
        self.stop()

    # ---------------------------------------------------------------- updates

    def update_step(
        self,
        step: int,
        version: int | None,
        metrics: Mapping[str, float],
        *,
        rows: Sequence[BufferRow] | None = None,
        elapsed: float | None = None,
    ) -> None:
        """A training step finished: show its metrics (and the buffers, if given).

        Off a terminal this prints one line.
        """
        reward = metrics.get(self.reward_key)
        if reward is not None and math.isfinite(reward):
            self._rewards.append(float(reward))
        frame = _Frame(
            step=step,
            version=version,
            elapsed=self._elapsed(elapsed),
            metrics=dict(metrics),
            rows=tuple(rows) if rows is not None else self._frame.rows,
            rewards=tuple(self._rewards),
        )
        self._frame = frame
        if self._task is not None:
            self._progress.update(self._task, completed=step)
        if self._live is not None:
            self._live.refresh()
        elif not self.is_live:
            self.console.print(self.step_line(), markup=False, highlight=False, soft_wrap=True)

    def update_buffers(
        self, rows: Sequence[BufferRow], *, version: int | None = None, elapsed: float | None = None
    ) -> None:
        """The buffers changed. Redrawn at the next refresh; never printed off a terminal."""
        old = self._frame
        self._frame = _Frame(
            step=old.step,
            version=old.version if version is None else version,
            elapsed=self._elapsed(elapsed),
            metrics=old.metrics,
            rows=tuple(rows),
            rewards=old.rewards,
        )

    # ------------------------------------------------------------- rendering

    def render(self) -> RenderableType:
        """The whole view for the current state."""
        f = self._frame
        parts: list[RenderableType] = [self._header(f)]
        if self._task is not None:
            parts.append(self._progress.make_tasks_table(self._progress.tasks))
        parts += [_figures(f), render_buffers(f.rows, width=self.console.width)]
        return Group(*parts)

    def step_line(self) -> str:
        """The one-line form of the current state, printed per step off a terminal."""
        f = self._frame
        parts = [f"step {f.step}{self._of_total()}", f"version {f.version}"]
        if self.staleness is not None:
            parts.append(f"η {self.staleness}")
        parts.append(_clock(f.elapsed))
        if self._task is not None:
            parts.append(f"ETA {_clock(self._progress.tasks[0].time_remaining)}")
        parts += [f"{key} {_num(f.metrics[key])}" for key, _ in FIGURES if key in f.metrics]
        head = next((r for r in f.rows if r.version == f.version), f.rows[0] if f.rows else None)
        if head is not None:
            parts.append(
                f"head {head.state} occ {head.occupied} res {head.reserved} emp {head.empty}"
            )
        return " | ".join(parts)

    def _header(self, f: _Frame) -> Text:
        text = Text()
        text.append(self.title, style="bold")
        text.append(f"   step {f.step if f.step is not None else '-'}{self._of_total()}")
        text.append(f"   version {f.version if f.version is not None else '-'}")
        if self.staleness is not None:
            text.append(f"   η = {self.staleness}")
        text.append(f"   elapsed {_clock(f.elapsed)}")
        return text

    def _elapsed(self, elapsed: float | None) -> float:
        return self._clock() - self._started_at if elapsed is None else elapsed

    def _of_total(self) -> str:
        return "" if self._task is None else f"/{self._progress.tasks[0].total:.0f}"


@contextmanager
def phase(console: Console, what: str) -> Iterator[None]:
    """Say that the run is doing ``what`` (``loading the model …``) while the block runs: a
    spinner on a terminal, one line in a log."""
    if console.is_terminal and not console.is_dumb_terminal:
        with console.status(what):
            yield
    else:
        console.print(what, markup=False, highlight=False, soft_wrap=True)
        yield


def _figures(f: _Frame) -> Table:
    table = Table.grid(padding=(0, 3))
    cells: list[Text] = []
    for key, label in FIGURES:
        if key not in f.metrics:
            continue
        cell = Text(f"{label} ", style="dim")
        cell.append(_num(f.metrics[key]), style="bold")
        if key == "reward_mean" and len(f.rewards) > 1:
            cell.append(" " + _sparkline(f.rewards), style="green")
        cells.append(cell)
    columns = 3
    for _ in range(columns):
        table.add_column()
    for i in range(0, len(cells), columns):
        row = cells[i : i + columns]
        table.add_row(*row, *[Text("")] * (columns - len(row)))
    return table


def render_buffers(rows: Sequence[BufferRow], *, width: int = 100) -> Table:
    """The buffers as rows of entries (■ occupied, ▣ reserved, □ empty), head buffer first.

    A row with more entries than fit in ``width`` is drawn as a bar of proportional cells, each
    standing for about ``k`` entries (shown as ``×k``); the counts are always printed beside it.
    """
    table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
    table.add_column("buffer", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("entries", no_wrap=True)
    table.add_column("occ/res/emp", no_wrap=True, justify="right")
    head = rows[0].version if rows else 0
    # Leave room for the other columns: label ~10, state ~20, counts ~16, padding.
    cells = max(8, width - 52)
    for row in rows:
        table.add_row(
            Text(f"v{row.version} (+{row.version - head})"),
            Text(row.state, style=_STATE_STYLE.get(row.state, "")),
            _entries_bar(row, cells),
            Text(f"{row.occupied}/{row.reserved}/{row.empty}"),
        )
    return table


def _entries_bar(row: BufferRow, cells: int) -> Text:
    counts = [row.occupied, row.reserved, row.empty]
    size = sum(counts)
    scaled = size > cells
    widths = _scale(counts, cells) if scaled else counts
    text = Text()
    for glyph, n, style in zip(
        (OCCUPIED_GLYPH, RESERVED_GLYPH, EMPTY_GLYPH),
        widths,
        ("green", "yellow", "dim"),
        strict=True,
    ):
        text.append(glyph * n, style=style)
    if scaled:
        text.append(f" ×{math.ceil(size / cells)}", style="dim")
    return text


def _scale(counts: Sequence[int], cells: int) -> list[int]:
    """Split ``cells`` in proportion to ``counts`` (largest remainder); a non-zero count keeps at
    least one cell so that no state vanishes from a long row."""
    total = sum(counts)
    if total == 0:
        return [0] * len(counts)
    raw = [c * cells / total for c in counts]
    out = [max(1, math.floor(r)) if c else 0 for c, r in zip(counts, raw, strict=True)]
    order = sorted(range(len(counts)), key=lambda i: raw[i] - math.floor(raw[i]), reverse=True)
    for i in order:
        if sum(out) >= cells:
            break
        if counts[i]:
            out[i] += 1
    while sum(out) > cells:  # the at-least-one rule overshot: take from the widest
        widest = max(range(len(out)), key=lambda i: out[i])
        out[widest] -= 1
    return out


def _sparkline(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    span = hi - lo
    if span <= 0:
        return _SPARK[0] * len(values)
    top = len(_SPARK) - 1
    return "".join(_SPARK[round((v - lo) / span * top)] for v in values)


def _num(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.3f}"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def summary_table(summary: RunSummary, *, keys: Sequence[str] | None = None) -> RenderableType:
    """The end-of-run summary: a table of each metric's first, last, minimum, maximum and mean
    value, then a line with the staleness distribution of the trained data.

    ``keys``: the metrics to show, in order (default: every metric, the view's figures first).
    """
    if keys is None:
        known = [k for k, _ in FIGURES if k in summary.metrics]
        keys = known + sorted(k for k in summary.metrics if k not in known)
    title = (
        f"run summary: {summary.steps} steps, last version {summary.last_version}, "
        f"{_clock(summary.wall_time)} elapsed"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for name in ("first", "last", "min", "max", "mean"):
        table.add_column(name, justify="right")
    for key in keys:
        m = summary.metrics.get(key)
        if m is None:
            continue
        table.add_row(key, *(_num(x) for x in (m.first, m.last, m.min, m.max, m.mean)))
    total = sum(summary.staleness.values())
    if not total:
        return table
    shares = ", ".join(
        f"{k}: {n} ({100 * n / total:.0f}%)" for k, n in sorted(summary.staleness.items())
    )
    return Group(table, Text(f"staleness of trained data ({total} items): {shares}"))

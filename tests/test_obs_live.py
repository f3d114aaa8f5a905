"""The live terminal view, the buffer rows it draws, and the summary table."""

from __future__ import annotations

import io
import re

from rich.console import Console

from stalebound import StalenessBuffer
from stalebound.obs import BufferRow, LiveView, buffer_rows, render_buffers, summary_table
from stalebound.obs.records import MetricSummary, RunSummary

ROWS = [
    BufferRow(version=4, occupied=3, reserved=1, empty=0, state="STUCK"),
    BufferRow(version=5, occupied=1, reserved=2, empty=1, state="PENDING"),
    BufferRow(version=6, occupied=0, reserved=0, empty=4, state="PENDING"),
]


def rendered(view: LiveView) -> str:
    console = view.console
    console.print(view.render())
    return console.export_text()


def buffer_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^v\d+ \(\+\d+\)", line)]


def test_view_draws_header_figures_and_one_row_per_buffer() -> None:
    view = LiveView(Console(record=True, width=100), staleness=2, live=False)
    view.update_buffers(ROWS, version=4, elapsed=3.0)
    view.console.export_text()  # drop anything printed so far
    view.update_step(
        12,
        4,
        {"reward_mean": 0.625, "trajectories_per_s": 41.5, "staleness_max": 2.0},
        rows=ROWS,
        elapsed=75.0,
    )
    view.console.export_text()
    text = rendered(view)
    assert "step 12" in text and "version 4" in text and "η = 2" in text and "01:15" in text
    assert "reward 0.625" in text and "trajectories/s 41.500" in text and "staleness max 2" in text
    lines = buffer_lines(text)
    assert len(lines) == 3
    for line, row in zip(lines, ROWS, strict=True):
        assert row.state in line
        assert line.count("■") == row.occupied
        assert line.count("▣") == row.reserved
        assert line.count("□") == row.empty
        assert f"{row.occupied}/{row.reserved}/{row.empty}" in line
    assert lines[0].startswith("v4 (+0)") and lines[2].startswith("v6 (+2)")


def test_view_of_a_real_buffer() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1, buffer_size=3)
    for gid in "abcde":
        buf.try_reserve(gid)
    buf.occupy("e")
    view = LiveView(Console(record=True, width=100), staleness=1, live=False)
    view.update_buffers(buffer_rows(buf), version=buf.version)
    lines = buffer_lines(rendered(view))
    # a, b, c reserved the latest buffer (1), d and e buffer 0; e then occupied in buffer 0.
    assert [(ln.count("■"), ln.count("▣"), ln.count("□")) for ln in lines] == [(1, 1, 1), (0, 3, 0)]
    assert "PENDING" in lines[0] and "STUCK" in lines[1]


def test_long_rows_collapse_to_a_scaled_bar_with_counts() -> None:
    row = BufferRow(version=0, occupied=1200, reserved=3, empty=845, state="READY_WITH_CAPACITY")
    console = Console(record=True, width=100)
    console.print(render_buffers([row], width=100))
    (line,) = buffer_lines(console.export_text())
    glyphs = line.count("■") + line.count("▣") + line.count("□")
    assert 8 <= glyphs <= 100 - 52
    assert line.count("▣") == 1  # a small count keeps one cell rather than vanishing
    assert line.count("■") > line.count("□") > 0
    assert "1200/3/845" in line and "×" in line
    assert len(line) <= 100


def test_off_a_terminal_one_line_per_step_and_none_for_buffer_updates() -> None:
    out = io.StringIO()
    view = LiveView(Console(file=out, width=100), staleness=1)
    assert not view.is_live
    with view:
        view.update_buffers(ROWS)
        view.update_step(1, 1, {"reward_mean": 0.1}, rows=ROWS, elapsed=1.0)
        view.update_buffers(ROWS)
        view.update_buffers(ROWS)
        view.update_step(2, 2, {"reward_mean": 0.2, "staleness_mean": 0.5}, elapsed=2.0)
    printed = out.getvalue().splitlines()
    assert len(printed) == 2
    assert printed[0].startswith("step 1 | version 1 | η 1 | 00:01 | reward_mean 0.100")
    assert "staleness_mean 0.500" in printed[1]
    assert "head STUCK occ 3 res 1 emp 0" in printed[0]
    assert not any("\x1b" in line for line in printed)  # no escape codes in logs


def test_on_a_terminal_the_view_redraws_in_place() -> None:
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, force_interactive=True)
    view = LiveView(console, staleness=1)
    assert view.is_live
    with view:
        view.update_step(1, 1, {"reward_mean": 0.1}, rows=ROWS, elapsed=1.0)
        view.update_step(2, 2, {"reward_mean": 0.3}, rows=ROWS, elapsed=2.0)
    text = out.getvalue()
    assert "step 2" in text and "■" in text
    assert "step 1 | version" not in text  # the per-step line is for logs only
    assert "\x1b[" in text  # cursor movement: redrawn in place


def test_reward_sparkline_follows_recent_steps() -> None:
    view = LiveView(Console(record=True, width=100), live=False, history=3)
    for step, reward in enumerate([0.0, 0.1, 0.5, 1.0], start=1):
        view.update_step(step, step, {"reward_mean": reward}, elapsed=float(step))
    view.console.export_text()
    text = rendered(view)
    assert "reward 1 ▁▄█" in text


def test_summary_table_lists_metrics_and_staleness() -> None:
    summary = RunSummary(
        steps=20,
        last_step=20,
        last_version=20,
        wall_time=125.0,
        metrics={
            "kl": MetricSummary(first=0.0, last=0.02, min=0.0, max=0.03, mean=0.01, count=20),
            "reward_mean": MetricSummary(
                first=0.1, last=0.8, min=0.1, max=0.85, mean=0.5, count=20
            ),
        },
        staleness={0: 30, 1: 50, 2: 20},
    )
    console = Console(record=True, width=100)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "20 steps" in text and "02:05" in text
    lines = text.splitlines()
    reward = next(line for line in lines if "reward_mean" in line)
    assert re.search(r"0\.100.*0\.800.*0\.100.*0\.850.*0\.500", reward)
    # the view's figures come first, the others after
    assert text.index("reward_mean") < text.index("kl")
    assert "0: 30 (30%), 1: 50 (50%), 2: 20 (20%)" in text


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_view_shows_step_n_of_the_total_and_the_time_left() -> None:
    out = io.StringIO()
    clock = FakeClock()
    view = LiveView(Console(file=out, width=120), staleness=1, total_steps=10, clock=clock)
    with view:
        for step in (1, 2, 3):
            clock.now += 4.0  # a step every 4 s: 7 steps left take 28 s
            view.update_step(step, step, {"reward_mean": 0.1})
    printed = out.getvalue().splitlines()
    assert printed[0].startswith("step 1/10 | version 1 | η 1 | 00:04 | ETA")
    assert printed[2].startswith("step 3/10 | version 3 | η 1 | 00:12 | ETA 00:28 | "), printed
    console = Console(record=True, width=120)
    console.print(view.render())
    drawn = console.export_text()
    assert "step 3/10" in drawn and "3/10" in drawn.split("\n", 2)[1]  # the progress row
    assert "0:00:12" in drawn and "0:00:28" in drawn  # elapsed, and the time left


def test_a_resumed_run_counts_from_its_checkpoint() -> None:
    out = io.StringIO()
    clock = FakeClock()
    view = LiveView(Console(file=out, width=120), total_steps=60, first_step=40, clock=clock)
    with view:
        clock.now += 2.0
        view.update_step(41, 41, {})
        clock.now += 2.0
        view.update_step(42, 42, {})
    assert out.getvalue().splitlines()[1].startswith("step 42/60 | version 42 | 00:04 | ETA 00:36")


def test_a_phase_is_one_line_in_a_log_and_a_spinner_on_a_terminal() -> None:
    from stalebound.obs.live import phase

    out = io.StringIO()
    with phase(Console(file=out, width=100), "loading the model from runs/a/policy-v0 …"):
        pass
    assert out.getvalue() == "loading the model from runs/a/policy-v0 …\n"
    term = io.StringIO()
    console = Console(file=term, width=100, force_terminal=True, force_interactive=True)
    with phase(console, "warm start …"):
        pass
    assert "warm start …" in term.getvalue() and "\x1b[" in term.getvalue()

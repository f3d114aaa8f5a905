"""``stalebound simulate`` and trace record / replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalebound.cli import main
from stalebound.core import ConfigError
from stalebound.obs.trace import (
    TraceHeader,
    TraceRecorder,
    TrajectoryRecord,
    read_trace,
    read_trace_header,
)
from stalebound.sim.cli import run_simulations
from stalebound.sim.replay import ReplaySource

KEYS = {
    "policy",
    "staleness",
    "target",
    "throughput",
    "bound",
    "efficiency",
    "trainer_util",
    "engine_util",
    "staleness_mean",
    "staleness_max",
    "violations",
    "wasted_fraction",
    "stuck_fraction",
}


def test_json_prints_one_object_per_policy_and_staleness(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--preset", "small", "--steps", "6", "--json", "--seed", "1"]
    argv += ["--policy", "sync", "--policy", "buffer", "--policy", "capacity-drop"]
    argv += ["--staleness", "1", "2"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["policy"], r["staleness"]) for r in rows] == [
        ("sync", 0),
        ("buffer", 1),
        ("buffer", 2),
        ("capacity-drop", 1),
        ("capacity-drop", 2),
    ]
    for r in rows:
        assert set(r) >= KEYS
        assert r["efficiency"] == pytest.approx(r["throughput"] / r["bound"])
    assert rows[3]["stuck_fraction"] is None  # no buffer, no head state
    assert rows[1]["violations"] == 0


SIMULATE = ["simulate", "--preset", "small", "--steps", "3", "--json"]
HARD_BOUND_NOTE = (
    "stalebound simulate: --staleness is the hard bound η_h for every policy; under deadline "
    "admission aims at the soft target η_s = η_h // 2 (--target). Before, --staleness N was their soft target with "
    "η_h = 2N: write --staleness 2N --target N for that (or --soft-staleness N, for one more "
    "release)\n"
)


def bounds(
    capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[list[tuple[str, int, int]], str]:
    assert main([*SIMULATE, *argv]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    return [(r["policy"], r["staleness"], r["target"]) for r in rows], err


def test_staleness_is_the_hard_bound_of_every_policy_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--policy", "capacity", "--policy", "deadline", "--policy", "deadline-tight"]
    rows, err = bounds(capsys, *argv, "--staleness", "4", "5")
    assert rows == [
        ("capacity", 4, 4),
        ("capacity", 5, 5),
        ("deadline", 4, 2),
        ("deadline", 5, 2),
        ("deadline-tight", 4, 4),
        ("deadline-tight", 5, 5),
    ]
    assert err == HARD_BOUND_NOTE
    rows, err = bounds(capsys, "--policy", "deadline")  # the default bound, 4, changed meaning too
    assert (rows, err) == ([("deadline", 4, 2)], HARD_BOUND_NOTE)
    # a target given: nothing changed meaning, nothing to say
    rows, err = bounds(capsys, "--policy", "deadline", "--staleness", "4", "--target", "1")
    assert (rows, err) == ([("deadline", 4, 1)], "")
    rows, err = bounds(capsys, "--policy", "buffer", "--staleness", "2")
    assert (rows, err) == ([("buffer", 2, 2)], "")


def test_the_former_meaning_runs_as_before_under_its_own_flag_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--policy", "capacity", "--policy", "deadline", "--policy", "deadline-tight"]
    rows, err = bounds(capsys, *argv, "--soft-staleness", "2")
    assert rows == [("capacity", 2, 2), ("deadline", 4, 2), ("deadline-tight", 2, 2)]
    assert err == (
        "stalebound simulate: --soft-staleness is the former meaning of --staleness and goes in "
        "the next release; for the deadline policies write --staleness 2N --target N "
        "(--staleness is the hard bound η_h, --target the soft target η_s)\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--staleness", "4", "2", "--target", "3"],
            "stalebound simulate: target=3: the soft admission target must be ≥ 0 and at most "
            "every --staleness (the hard bound η_h, here 2); lower --target or raise --staleness\n",
        ),
        (
            ["--soft-staleness", "2", "--target", "1"],
            "stalebound simulate: target=1: --soft-staleness already sets the deadline policies' "
            "target; give --staleness N --target M instead\n",
        ),
        (
            ["--soft-staleness", "-1"],
            "stalebound simulate: soft-staleness=-1: must be ≥ 0; 0 is synchronous training\n",
        ),
    ],
)
def test_bad_bounds_are_refused_naming_the_fix(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([*SIMULATE, "--policy", "deadline", *argv]) == 2
    err = capsys.readouterr().err
    assert err.endswith(message) and "Traceback" not in err


def test_the_table_prints_both_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--preset", "small", "--steps", "3", "--policy", "deadline"]
    assert main([*argv, "--staleness", "4"]) == 0
    out = capsys.readouterr().out
    assert "η_h" in out and "η_s" in out
    row = next(line for line in out.splitlines() if "deadline" in line)
    assert [c.strip() for c in row.split("│")[1:4]] == ["deadline", "4", "2"]


def test_table_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["simulate", "--preset", "small", "--steps", "3", "--policy", "buffer"]) == 0
    assert "buffer" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch:\n  groups: 0\n")
    assert main(["simulate", "--workload", str(bad), "--policy", "buffer"]) == 2
    assert "batch.groups=0: must be an integer ≥ 1" in capsys.readouterr().err


def test_record_then_replay_under_other_policies(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    run_simulations(preset="small", policies=["buffer"], etas=[2], steps=8, record=str(trace))
    header, records = read_trace(trace)
    assert header.source == "simulator" and header.group_size == 4
    assert len(records) >= 8 * 4 * 4
    assert {r.outcome for r in records} >= {"trained"}
    results = run_simulations(
        preset="small", policies=["capacity", "buffer"], etas=[1], steps=8, replay=str(trace)
    )
    assert [r.policy for r in results] == ["capacity", "buffer"]
    assert all(r.counts["trained"] == 8 * 4 * 4 for r in results)
    again = run_simulations(
        preset="small", policies=["buffer"], etas=[1], steps=8, replay=str(trace)
    )
    assert again[0].to_json() == results[1].to_json()


def test_replay_uses_the_recorded_lengths(tmp_path: Path) -> None:
    trace = tmp_path / "fixed.jsonl"
    with TraceRecorder(trace, TraceHeader(source="runtime", group_size=4)) as rec:
        for i in range(40):
            rec.record(TrajectoryRecord(i // 4, i // 4, i % 4, 0.0, 1.0, 50, (0.5,), False, 0))
    (result,) = run_simulations(
        preset="small", policies=["buffer"], etas=[1], steps=5, replay=str(trace)
    )
    assert result.tokens["trained"] == pytest.approx(50 * result.counts["trained"])
    source = ReplaySource(read_trace(trace)[1], 4)
    spec = source.spec(0, 0, 0)
    assert spec.segments == (25, 25) and spec.tools == (0.5,)


def test_bad_traces_name_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"type": "trajectory"}\n')
    for read in (read_trace, read_trace_header):
        with pytest.raises(ConfigError, match="line 1: the first line must be a header"):
            read(trace)
    trace.write_text(
        '{"type": "header", "format": "stalebound-trace", "version": 1, "meta": {"k": 1}}\n'
        '{"type": "trajectory"}\n'
    )
    with pytest.raises(ConfigError, match="line 2: bad trajectory record"):
        read_trace(trace)
    assert read_trace_header(trace).meta == {"k": 1}  # the header alone: line 2 is not read
    trace.write_text("\n")
    with pytest.raises(ConfigError, match="empty; a trace starts with a header line"):
        read_trace_header(trace)


def test_the_shipped_example_trace_replays() -> None:
    from importlib import resources

    trace = resources.files("stalebound.sim").joinpath("traces", "small-buffer.jsonl")
    header, records = read_trace(str(trace))
    assert header.source == "simulator"
    assert any(not r.complete for r in records)  # in flight at the end: kept, marked
    (result,) = run_simulations(
        preset="small", policies=["buffer+truncate"], etas=[3], steps=4, replay=str(trace)
    )
    assert result.counts["trained"] == 4 * 4 * 4


def test_a_resumed_runs_traces_read_as_one_history(tmp_path: Path) -> None:
    from stalebound.obs.trace import read_run_trace, run_traces

    def write(name: str, starts: range) -> None:
        with TraceRecorder(tmp_path / name, TraceHeader(source="runtime", group_size=1)) as rec:
            for s in starts:
                rec.record(TrajectoryRecord(s, s, 0, float(s), s + 0.5, 10, (), False, 0))

    write("trace.jsonl", range(0, 10))  # killed at 10 s; its checkpoint was at 6 s
    write("trace-from-step-0.jsonl", range(100, 100))  # a resume that recorded nothing
    write("trace-from-step-3.jsonl", range(6, 12))  # the run's clock goes on from 6 s
    (tmp_path / "trace-from-step-x.jsonl").write_text("not a run's trace")
    assert [(step, p.name) for step, p in run_traces(tmp_path)] == [
        (0, "trace.jsonl"),
        (0, "trace-from-step-0.jsonl"),
        (3, "trace-from-step-3.jsonl"),
    ]
    # the steps after the checkpoint, done again, are the resume's alone
    assert [r.start for r in read_run_trace(tmp_path)] == [float(s) for s in range(12)]

"""``stalebound simulate`` and trace record / replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalebound.cli import main
from stalebound.core import ConfigError
from stalebound.obs.trace import TraceHeader, TraceRecorder, TrajectoryRecord, read_trace
from stalebound.sim.cli import run_simulations
from stalebound.sim.replay import ReplaySource

KEYS = {
    "policy",
    "staleness",
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
    with pytest.raises(ConfigError, match="line 1: the first line must be a header"):
        read_trace(trace)
    trace.write_text(
        '{"type": "header", "format": "stalebound-trace", "version": 1}\n{"type": "trajectory"}\n'
    )
    with pytest.raises(ConfigError, match="line 2: bad trajectory record"):
        read_trace(trace)


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

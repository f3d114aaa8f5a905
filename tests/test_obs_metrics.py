"""The run logger: the run directory's files, TensorBoard events, Prometheus, resuming."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import pytest

from stalebound import ConfigError, ProtocolError, StalenessBuffer
from stalebound.obs import (
    BufferRow,
    RunLogger,
    StalenessHistogram,
    buffer_rows,
    load_run,
    summarize,
)


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_step_records_have_the_schema_and_numbering(tmp_path: Path) -> None:
    clock = FakeClock()
    with RunLogger(tmp_path, tensorboard=False, clock=clock) as logger:
        clock.now += 1.5
        logger.log_step({"reward_mean": 0.25, "clip_frac": 0.1}, version=1, staleness=[0, 1, 1, 2])
        clock.now += 1.0
        logger.log_step({"reward_mean": 0.5, "staleness_mean": 9.0}, version=2, staleness={0: 2})
    recs = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["version"] for r in recs] == [1, 2]
    assert [r["wall_time"] for r in recs] == [1.5, 2.5]
    assert all(isinstance(r["timestamp"], float) for r in recs)
    assert recs[0]["reward_mean"] == 0.25 and recs[0]["clip_frac"] == 0.1
    # staleness_mean/max come from the per-item staleness unless the caller gave them.
    assert recs[0]["staleness_mean"] == 1.0 and recs[0]["staleness_max"] == 2.0
    assert recs[1]["staleness_mean"] == 9.0 and recs[1]["staleness_max"] == 0.0
    assert lines(tmp_path / "staleness.jsonl") == [
        {"step": 1, "version": 1, "counts": {"0": 1, "1": 2, "2": 1}},
        {"step": 2, "version": 2, "counts": {"0": 2}},
    ]


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    with RunLogger(tmp_path, tensorboard=False) as logger:
        logger.log_step({"loss": math.nan, "kl": math.inf, "reward_mean": 1.0})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    rec = json.loads(text)
    assert rec["loss"] is None and rec["kl"] is None and rec["reward_mean"] == 1.0
    assert summarize(tmp_path).metrics.keys() == {"reward_mean"}


@pytest.mark.parametrize(
    ("metrics", "fragment"),
    [
        ({"reward_mean": "high"}, "reward_mean='high' is not a number"),
        ({"step": 3.0}, "'step' is a field the logger fills in itself"),
        ({"ok": True}, "ok=True is not a number"),
        ({"": 1.0}, "must be a non-empty str"),
    ],
)
def test_bad_metrics_are_refused_and_nothing_is_written(
    tmp_path: Path, metrics: dict[str, object], fragment: str
) -> None:
    with RunLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ProtocolError, match=fragment):
            logger.log_step(metrics)  # type: ignore[arg-type]
        assert logger.last_step == 0
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_steps_must_increase(tmp_path: Path) -> None:
    with RunLogger(tmp_path, tensorboard=False) as logger:
        logger.log_step({"x": 1.0}, step=5)
        with pytest.raises(ProtocolError, match=r"step=5\): steps must increase"):
            logger.log_step({"x": 2.0}, step=5)
        assert logger.log_step({"x": 3.0})["step"] == 6


def test_numpy_scalars_are_accepted(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    with RunLogger(tmp_path, tensorboard=False) as logger:
        rec = logger.log_step(
            {"reward_mean": np.float32(0.5), "filtered": np.int64(3)},
            version=np.int64(4),
            staleness=np.array([0, 1]),
        )
    assert rec["reward_mean"] == 0.5 and rec["filtered"] == 3.0 and rec["version"] == 4
    json.loads((tmp_path / "metrics.jsonl").read_text())


def test_a_directory_holding_a_run_is_not_overwritten(tmp_path: Path) -> None:
    with RunLogger(tmp_path, tensorboard=False) as logger:
        logger.log_step({"x": 1.0})
    with pytest.raises(ConfigError, match=r"already holds a run.*pass resume=True"):
        RunLogger(tmp_path, tensorboard=False)
    assert len(lines(tmp_path / "metrics.jsonl")) == 1


def test_buffer_rows_follow_the_staleness_buffer(tmp_path: Path) -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1, buffer_size=3)
    for gid in "abcd":
        buf.try_reserve(gid)
    buf.occupy("a")
    rows = buffer_rows(buf)
    # Reserve fills the latest buffer first (v + η), then v; "a" moved to buffer 0 on occupy.
    assert rows == [
        BufferRow(version=0, occupied=1, reserved=1, empty=1, state="PENDING"),
        BufferRow(version=1, occupied=0, reserved=2, empty=1, state="PENDING"),
    ]
    buf.occupy("b")
    assert buffer_rows(buf)[0] == BufferRow(
        version=0, occupied=2, reserved=1, empty=0, state="READY"
    )
    buf.abort("d")
    with RunLogger(tmp_path, tensorboard=False) as logger:
        logger.log_buffers(0.5, buf.version, buffer_rows(buf))
        with pytest.raises(ProtocolError, match="is not a BufferRow"):
            logger.log_buffers(0.6, buf.version, [{"version": 0}])  # type: ignore[list-item]
    (rec,) = lines(tmp_path / "buffers.jsonl")
    assert rec["wall_time"] == 0.5 and rec["version"] == 0
    assert rec["buffers"] == [
        {"version": 0, "occupied": 2, "reserved": 0, "empty": 1, "state": "READY_WITH_CAPACITY"},
        {"version": 1, "occupied": 0, "reserved": 1, "empty": 2, "state": "PENDING"},
    ]
    (sample,) = load_run(tmp_path).buffers
    assert sample.head == BufferRow(0, 2, 0, 1, "READY_WITH_CAPACITY")


def test_staleness_histogram_accumulates_and_validates() -> None:
    empty = StalenessHistogram()
    assert empty.mean is None and empty.max is None and not empty
    hist = StalenessHistogram()
    hist.add([2, 0, 2])
    hist.add({1: 3, 5: 0})
    assert hist.counts == {0: 1, 1: 3, 2: 2}
    assert (hist.total, hist.max) == (6, 2)
    assert hist.mean == pytest.approx(7 / 6)
    with pytest.raises(ProtocolError, match="staleness -1"):
        hist.add([-1])
    with pytest.raises(ProtocolError, match=r"count 1\.5"):
        hist.add({0: 1.5})
    assert hist.counts == {0: 1, 1: 3, 2: 2}


def test_resume_appends_and_keeps_numbering_and_time(tmp_path: Path) -> None:
    clock = FakeClock()
    with RunLogger(tmp_path, tensorboard=False, clock=clock) as logger:
        for _ in range(3):
            clock.now += 2.0
            logger.log_step({"reward_mean": 0.1}, version=logger.last_step + 1, staleness=[1])
    clock.now += 1000.0  # the process was down for a while: wall time continues from the records
    with RunLogger(tmp_path, resume=True, tensorboard=False, clock=clock) as logger:
        assert logger.last_step == 3
        assert logger.staleness.counts == {1: 3}
        clock.now += 1.0
        rec = logger.log_step({"reward_mean": 0.2}, staleness=[0])
    assert rec["step"] == 4 and rec["wall_time"] == 7.0
    recs = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert summarize(tmp_path).staleness == {0: 1, 1: 3}


def test_resume_step_drops_records_after_the_checkpoint(tmp_path: Path) -> None:
    clock = FakeClock()
    with RunLogger(tmp_path, tensorboard=False, clock=clock) as logger:
        for step in range(1, 6):
            clock.now += 1.0
            logger.log_buffers(None, step - 1, [BufferRow(step - 1, 0, 1, 0, "STUCK")])
            logger.log_step({"x": float(step)}, staleness=[step])
    with RunLogger(tmp_path, resume=True, resume_step=2, tensorboard=False, clock=clock) as logger:
        assert logger.last_step == 2
        assert logger.log_step({"x": 30.0})["step"] == 3
    data = load_run(tmp_path)
    assert [r["x"] for r in data.steps] == [1.0, 2.0, 30.0]
    assert data.staleness_histogram().counts == {1: 1, 2: 1}
    assert [s.version for s in data.buffers] == [0, 1]
    with pytest.raises(ConfigError, match="resume_step=9: the run directory's last step is 3"):
        RunLogger(tmp_path, resume=True, resume_step=9, tensorboard=False)
    with pytest.raises(ConfigError, match="only meaningful with resume=True"):
        RunLogger(tmp_path / "new", resume_step=1, tensorboard=False)


def test_resume_skips_an_unfinished_last_line(tmp_path: Path) -> None:
    with RunLogger(tmp_path, tensorboard=False) as logger:
        logger.log_step({"x": 1.0})
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step":2,"ver')  # a crash mid-write
    with RunLogger(tmp_path, resume=True, tensorboard=False) as logger:
        assert logger.last_step == 1
        logger.log_step({"x": 2.0})
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2]


def test_closed_logger_refuses_more(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path, tensorboard=False)
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(ProtocolError, match="is closed"):
        logger.log_step({"x": 1.0})


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    with RunLogger(tmp_path) as logger:
        for step in range(1, 4):
            logger.log_step({"reward_mean": step / 10, "kl": 0.01}, staleness=[0, step, step])
    with RunLogger(tmp_path, resume=True, resume_step=2) as logger:
        logger.log_step({"reward_mean": 0.9}, staleness=[1])
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    acc = ea_mod.EventAccumulator(
        str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}
    )
    acc.Reload()
    # The resumed writer hides the first writer's step 3: the series is 1, 2, then the new 3.
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.9),
    ]
    assert {"reward_mean", "kl", "staleness_mean", "staleness_max"} <= set(acc.Tags()["scalars"])
    hists = acc.Histograms("staleness")
    assert [h.step for h in hists] == [1, 2, 3]
    first = hists[0].histogram_value
    assert (first.num, first.min, first.max, first.sum) == (3, 0, 1, 2)
    assert list(first.bucket) == [0, 1, 2]  # (-0.5], (-0.5, 0.5], (0.5, 1.5]


def test_prometheus_endpoint_serves_the_run(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    with RunLogger(tmp_path, tensorboard=False, prometheus_port=0) as logger:
        url = logger.prometheus_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        logger.log_step({"reward_mean": 0.75, "ratio/max": 1.5}, version=7, staleness=[0, 2, 2])
        logger.log_buffers(
            1.0, 7, [BufferRow(7, 3, 1, 0, "STUCK"), BufferRow(8, 0, 0, 4, "PENDING")]
        )
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    assert "stalebound_step 1.0" in text
    assert "stalebound_version 7.0" in text
    assert "stalebound_reward_mean 0.75" in text
    assert "stalebound_ratio_max 1.5" in text
    assert 'stalebound_trained_items_total{staleness="2"} 2.0' in text
    assert 'stalebound_buffer_entries{offset="0",state="occupied"} 3.0' in text
    assert 'stalebound_buffer_state{offset="0",state="STUCK"} 1.0' in text
    assert 'stalebound_buffer_state{offset="1",state="STUCK"} 0.0' in text
    with pytest.raises(OSError):  # the server is stopped on close
        urllib.request.urlopen(url, timeout=2)


def test_prometheus_port_is_validated(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    with pytest.raises(ConfigError, match="prometheus_port=70000"):
        RunLogger(tmp_path, tensorboard=False, prometheus_port=70000)


def test_unchanged_buffer_samples_are_not_written(tmp_path: Path) -> None:
    rows = [BufferRow(0, 1, 1, 0, "STUCK")]
    with RunLogger(tmp_path, tensorboard=False) as logger:
        assert logger.log_buffers(0.1, 0, rows) is not None
        assert logger.log_buffers(0.2, 0, list(rows)) is None
        assert logger.log_buffers(0.3, 1, rows) is not None  # the version moved
        assert logger.log_buffers(0.4, 1, [BufferRow(0, 2, 0, 0, "READY")]) is not None
        assert logger.unchanged_buffer_samples == 1
    assert [r["wall_time"] for r in lines(tmp_path / "buffers.jsonl")] == [0.1, 0.3, 0.4]

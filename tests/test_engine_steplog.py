"""The embedded engine's step log: what its worker writes, and how calibration reads it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from stalebound.core.errors import ConfigError
from stalebound.engines.steplog import FIELDS, StepLog, read_step_logs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_window_is_written_once_it_is_full_and_the_last_at_close(tmp_path: Path) -> None:
    clock = Clock()
    log = StepLog(tmp_path / "steps" / "local0.jsonl", window=1.0, clock=clock)
    log.admitted(3, 0.002)
    log.piped(0.001)
    clock.now = 0.5
    log.decoded([(2, 10, 4), (1, 30, 25)], 0.004)  # two passes, 3 rows
    assert not (tmp_path / "steps" / "local0.jsonl").read_text()  # the window is not full
    clock.now = 1.0
    log.decoded([(3, 31, 26)], 0.003)
    clock.now = 1.2
    log.decoded([(3, 32, 27)], 0.003)
    log.close()
    log.close()  # a second close does nothing
    (first, last) = read_step_logs(tmp_path / "steps")["local0"]
    assert first == {
        "steps": 2,
        "decode_s": 0.007,
        "passes": 3,
        "rows": 6,
        "slots": 2 * 10 + 30 + 3 * 31,
        "context_slots": 2 * 4 + 25 + 3 * 26,
        "lone_steps": 0,
        "lone_s": 0,
        "lone_slots": 0,
        "admitted": 3,
        "admit_s": 0.002,
        "pipe_s": 0.001,
    }
    assert last["steps"] == 1 and last["slots"] == 96 and last["admitted"] == 0


def test_a_step_of_one_request_is_summed_apart_too(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "a.jsonl", window=1.0, clock=Clock())
    log.decoded([(1, 120, 100)], 0.002)  # a straggler alone
    log.decoded([(1, 121, 101), (1, 5, 2)], 0.003)  # two passes: not alone
    log.decoded([(2, 40, 30)], 0.003)  # two rows: not alone
    log.close()
    (window,) = read_step_logs(tmp_path)["a"]
    assert (window["lone_steps"], window["lone_s"], window["lone_slots"]) == (1, 0.002, 120)


def test_a_log_written_before_steps_alone_were_summed_reads_them_as_none(tmp_path: Path) -> None:
    old = {k: 1 for k in FIELDS if not k.startswith("lone_")}
    (tmp_path / "a.jsonl").write_text(json.dumps(old) + "\n")
    (window,) = read_step_logs(tmp_path)["a"]
    assert window["lone_steps"] == window["lone_s"] == window["lone_slots"] == 0


def test_an_empty_window_writes_nothing(tmp_path: Path) -> None:
    clock = Clock()
    log = StepLog(tmp_path / "a.jsonl", clock=clock)
    clock.now = 10.0
    log.write()
    log.close()
    assert (tmp_path / "a.jsonl").read_text() == ""
    assert read_step_logs(tmp_path) == {"a": []}
    assert read_step_logs(tmp_path / "absent") == {}


def test_a_torn_last_line_is_left_out_and_a_damaged_one_before_it_named(tmp_path: Path) -> None:
    good = json.dumps({"t": 1.0, **dict.fromkeys(FIELDS, 1)})
    path = tmp_path / "local0.jsonl"
    path.write_text(f"{good}\n{good[:20]}")  # a worker killed while writing
    assert len(read_step_logs(tmp_path)["local0"]) == 1
    bad = json.dumps({"t": 1.0, **dict.fromkeys(FIELDS, 1), "rows": -2})
    path.write_text(f"{good}\n{bad}\n{good}\n")
    with pytest.raises(ConfigError) as info:
        read_step_logs(tmp_path)
    assert str(info.value) == (
        f"{path}:2: rows=-2: must be a number ≥ 0; the step log is damaged: remove the file "
        "(calibration then fits the engine from the trace alone)"
    )
    path.write_text(f"{good}\n{good[:20]}\n{good}\n")  # a line cut short, then more
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}:2: not a JSON object")):
        read_step_logs(tmp_path)


def test_a_run_started_again_from_the_beginning_logs_its_steps_afresh(tmp_path: Path) -> None:
    # a run that stopped before its first checkpoint starts again from nothing: windows of the
    # first attempt would count against the trace written again
    from stalebound.engines.steplog import STEP_LOG_DIR
    from stalebound.train.recipe import clear_unfinished_start

    log = StepLog(tmp_path / STEP_LOG_DIR / "local0.jsonl", window=0.0)
    log.decoded([(1, 10, 5)], 0.001)
    log.close()
    assert read_step_logs(tmp_path / STEP_LOG_DIR)["local0"]
    clear_unfinished_start(tmp_path)
    assert read_step_logs(tmp_path / STEP_LOG_DIR) == {}


def test_a_log_that_cannot_be_written_stops_and_the_engine_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = StepLog(tmp_path / "a.jsonl", window=0.0)
    log.decoded([(1, 10, 5)], 0.001)

    def full(_: str) -> int:
        raise OSError(28, "No space left on device")

    log._file.write = full  # type: ignore[method-assign]
    log.decoded([(1, 11, 6)], 0.001)
    log.decoded([(1, 12, 7)], 0.001)  # nothing more is tried
    log.close()
    assert len(read_step_logs(tmp_path)["a"]) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"the engine's step log {tmp_path / 'a.jsonl'} stops: [Errno 28] No space left on device"
    ]

"""Checkpoint files are data, found and verified before use; the run directory has one owner.

Everything here runs on real files and real processes, without a training run: the states are
built from the project's own record types, and the checkpoints written by ``write_checkpoint``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stalebound.core.groups import MemberId, MemberResult  # noqa: E402
from stalebound.runtime.executor import Trajectory as Rollout  # noqa: E402
from stalebound.tasks.base import Sample, Trajectory  # noqa: E402
from stalebound.train import checkpoint as ck  # noqa: E402
from stalebound.train import statejson  # noqa: E402
from stalebound.train.runlock import RunLock  # noqa: E402


def _trajectory(reward: float = 1.0) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 5, 6],
        output_ids=[7, 2],
        behaviour_logprobs=[-0.25, -1e-9],
        versions=[3, 4],
        reward=reward,
        sample_id="s1",
        response="7",
        metrics={"score": 1.0, "acc": 1.0},
    )


def _state() -> dict[str, Any]:
    """An executor state with what a real one holds: tuples, int keys, records, floats."""
    member = MemberResult(MemberId(12, 0), 3, _trajectory())
    rollout = Rollout(_trajectory(0.5), 12, 1, 3, 5, 2, (3, 4), False, 41)
    return {
        "format": 1,
        "policy_state": {"buffer": {"groups": [{"group_id": 12, "payload": (member,)}]}},
        "pending": [(40, Sample("40", "1+2", "3", {"level": 1}), 0)],
        "samples": {12: 41, 13: 42},
        "waiting": [(rollout,)],
        "outcomes": [(7, "filtered")],
        "counters": {"events": Counter({"$odd": 1, "admitted": 3})},
        "nan": math.inf,
    }


def test_the_executor_state_round_trips_through_json() -> None:
    state = _state()
    data = json.loads(json.dumps(statejson.encode(state)))
    back = statejson.decode(data)
    assert back == {**state, "counters": {"events": {"$odd": 1, "admitted": 3}}}
    assert isinstance(back["waiting"][0][0], Rollout)
    assert isinstance(back["policy_state"]["buffer"]["groups"][0]["payload"][0].member, MemberId)


def test_values_that_are_not_data_are_refused_with_where_they_are() -> None:
    with pytest.raises(statejson.StateDataError, match=r"state\['pending'\]\[0\]\[1\]: a torch"):
        statejson.encode({"pending": [(1, torch.zeros(2))]})

    class Custom:
        pass

    with pytest.raises(statejson.StateDataError, match=r"state\[0\]: a .*Custom cannot be stored"):
        statejson.encode([Custom()])


@pytest.mark.parametrize(
    "data",
    [
        {"$type": "os.system", "fields": {"command": "touch /tmp/owned"}},
        {"$type": "builtins.eval", "fields": {}},
        {"$type": "stalebound.tasks.base.Trajectory", "fields": {"output_ids": [1]}},
        {"$map": [[[1, 2], 3]]},
        {"$what": 1},
    ],
)
def test_decoding_builds_only_the_known_record_types(data: Any) -> None:
    with pytest.raises(statejson.StateDataError):
        statejson.decode({"x": [data]})


def _write(run_dir: Path, step: int, **overrides: Any) -> Path:
    def save_model(directory: Path) -> None:
        (directory / "config.json").write_text("{}")

    parts: dict[str, Any] = {
        "save_model": save_model,
        "trainer_state": {
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
            "version": step,
            "rng": {"torch": torch.get_rng_state(), "python": (3, tuple(range(625)), None)},
        },
        "rollout_state": _state(),
        "job_state": {"progress": {"step": step}},
        "keep": 5,
    }
    parts.update(overrides)
    return ck.write_checkpoint(run_dir, step, step, **parts)


@pytest.mark.parametrize("free", [10, 10**12])
def test_a_library_error_on_a_full_disk_is_named_for_what_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int
) -> None:
    """torch reports running out of room mid-write as its own error ("unexpected pos …"); when
    the disk has less room than the last checkpoint took, the message says the disk is full."""
    first = _write(tmp_path, 1)
    need = ck._checkpoint_bytes(first)
    assert need > 0

    def cut_short(directory: Path) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ck.shutil, "disk_usage", lambda _: SimpleNamespace(free=free))
    with pytest.raises(ck.CheckpointWriteError) as caught:
        _write(tmp_path, 2, save_model=cut_short)
    message = str(caught.value)
    full = "No space left on device: RuntimeError: [enforce fail"
    assert message.startswith(f"writing the checkpoint of step 2 failed: {full}") == (free < need)
    assert f"{free} bytes free on that disk" in message and "['step-000001'] are intact" in message
    if free < need:
        assert f"a checkpoint takes {need}" in message


def _resign(checkpoint: Path) -> None:
    """What someone crafting a checkpoint does: fix up the manifest's sizes and digests."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for rel, meta in manifest["files"].items():
        meta["bytes"] = (checkpoint / rel).stat().st_size
        meta["sha256"] = ck._digest(checkpoint / rel)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_is_read_back_as_data(tmp_path: Path) -> None:
    path = _write(tmp_path, 4)
    assert (path / "rollout_state.json").is_file() and not list(path.glob("*.pkl"))
    found = ck.open_checkpoint(tmp_path)
    assert (found.step, found.version) == (4, 4)
    assert found.rollout_state()["samples"] == {12: 41, 13: 42}
    state = found.trainer_state()
    assert state["version"] == 4 and state["rng"]["python"][1][-1] == 624


def test_a_crafted_trainer_state_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    _write(tmp_path, 2)
    newest = _write(tmp_path, 4)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Payload(), "version": 4}, newest / "trainer_state.pt")
    _resign(newest)
    with pytest.raises(ck.CheckpointError) as caught:
        ck.open_checkpoint(tmp_path).trainer_state()
    assert not marker.exists()
    assert str(caught.value) == (
        f"{newest / 'trainer_state.pt'}: holds objects other than tensors and plain values, "
        "which could run code when read, so it is refused; resume from an earlier checkpoint "
        f"instead, e.g. resume={tmp_path / 'checkpoints' / 'step-000002'}"
    )


@pytest.mark.parametrize(
    ("name", "junk", "why"),
    [
        ("trainer_state.pt", b"\x00junk", "not a trainer state this stalebound reads"),
        ("rollout_state.json", b"\xff\xfe", "not valid JSON"),
        ("rollout_state.json", b'{"a": {"$type": "os.system", "fields": {}}}', "not an executor"),
        ("job_state.json", b"[1, 2]", "not a job state"),
    ],
)
def test_junk_under_a_re_signed_manifest_names_the_file_and_the_way_out(
    tmp_path: Path, name: str, junk: bytes, why: str
) -> None:
    _write(tmp_path, 2)
    newest = _write(tmp_path, 4)
    (newest / name).write_bytes(junk)
    _resign(newest)
    found = ck.open_checkpoint(tmp_path)
    read = {
        "trainer_state.pt": found.trainer_state,
        "rollout_state.json": found.rollout_state,
        "job_state.json": found.job_state,
    }[name]
    with pytest.raises(ck.CheckpointError) as caught:
        read()
    text = str(caught.value)
    assert text.startswith(f"{newest / name}: {why}"), text
    assert text.endswith(f"e.g. resume={tmp_path / 'checkpoints' / 'step-000002'}"), text


def test_a_damaged_latest_names_a_checkpoint_that_exists(tmp_path: Path) -> None:
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    root = tmp_path / "checkpoints"
    (root / "step-000004" / "manifest.json").write_text("{")  # and the newest is damaged too
    for content, why in [
        ("step-000009\n", "names step-000009, which does not exist"),
        ("\x00", ""),
    ]:
        (root / "latest").write_text(content)
        with pytest.raises(ck.CheckpointError) as caught:
            ck.find_checkpoint(tmp_path)
        text = str(caught.value)
        assert why in text and text.endswith(
            f"the file is damaged — resume from the newest intact checkpoint: "
            f"resume={root / 'step-000002'}"
        ), text


def test_a_run_without_a_checkpoint_is_told_it_starts_again(tmp_path: Path) -> None:
    assert ck.find_checkpoint(tmp_path) is None
    with pytest.raises(ck.CheckpointError, match=r"no checkpoint yet .* starts it again from the"):
        ck.open_checkpoint(tmp_path)
    _write(tmp_path, 3)
    (tmp_path / "checkpoints" / "latest").unlink()  # killed between the rename and `latest`
    assert ck.find_checkpoint(tmp_path).step == 3  # type: ignore[union-attr]


def test_resuming_an_older_checkpoint_abandons_the_later_ones(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _write(tmp_path, step)
    (tmp_path / "trace-from-step-4.jsonl").write_text("")
    (tmp_path / "trace-from-step-2.jsonl").write_text("")
    (tmp_path / "summary.json").write_text("{}")
    older = ck.open_checkpoint(tmp_path / "checkpoints" / "step-000002")
    moved = ck.abandon_after(tmp_path, older)
    assert sorted(p.name for p in moved) == [
        "step-000004",
        "step-000006",
        "summary.json",
        "trace-from-step-4.jsonl",
    ]
    assert ck.open_checkpoint(tmp_path).step == 2
    assert [p.name for p in ck.checkpoint_dirs(tmp_path / "checkpoints")] == ["step-000002"]
    assert (tmp_path / "trace-from-step-2.jsonl").exists()
    assert ck.abandon_after(tmp_path, older) == []  # nothing left to move


def test_a_checkpoint_is_put_in_place_before_a_signal_is_handled(tmp_path: Path) -> None:
    # Python's default handler (KeyboardInterrupt), set here: a process started in the background
    # by a non-interactive shell inherits SIGINT ignored, and Python then leaves it ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), ck._signals_deferred():
            signal.raise_signal(signal.SIGINT)
            _write(tmp_path, 5)  # still runs: the interrupt waits for the block to end
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ck.open_checkpoint(tmp_path).step == 5


def _hold_lock(run_dir: Path) -> subprocess.Popen[str]:
    code = textwrap.dedent(
        f"""
        import sys, time
        from stalebound.train.runlock import RunLock
        RunLock({str(run_dir)!r}).acquire()
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_one_process_at_a_time_holds_a_run_directory(tmp_path: Path) -> None:
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(ck.StaleboundError) as caught:
            RunLock(tmp_path).acquire()
        assert f"pid {holder.pid} is running in this run directory" in str(caught.value)
    finally:
        holder.kill()  # dies holding it: the kernel releases the lock, the pid stays in the file
        holder.wait()
    assert (tmp_path / ".lock").read_text().strip() == str(holder.pid)
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    assert (tmp_path / ".lock").read_text() == ""

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
from train_helpers import CodeOnUnpickle, resign  # noqa: E402


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
    torch.save({"optimizer": CodeOnUnpickle(marker), "version": 4}, newest / "trainer_state.pt")
    resign(newest)
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
    resign(newest)
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


# ------------------------------------------------------------------ a checkpoint verified whole


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """The default policy and its tokenizer, with an AdamW state of one step over it."""
    from stalebound.engines.models import build_default_model, load_model, load_tokenizer

    path = build_default_model(tmp_path_factory.mktemp("policy"))
    model, tokenizer = load_model(path), load_tokenizer(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 6]]), labels=torch.tensor([[1, 5, 6]])).loss.backward()
    optimizer.step()
    return model, tokenizer, optimizer.state_dict()


def _rollout_config() -> Any:
    from stalebound.config import RolloutConfig

    return RolloutConfig(consumer_batch_size=2, group_size=2, staleness=1)


def _executor_state(version: int) -> dict[str, Any]:
    """A real executor's state (one that has taken nothing in yet), at ``version``."""
    from scripted import ScriptedEngine
    from stalebound.runtime import WorkflowExecutor

    engine = ScriptedEngine(auto=True, version=version)
    with WorkflowExecutor(_rollout_config(), engine).initialize() as ex:
        return ex.state_dict()


def _real(run_dir: Path, step: int, policy: tuple[Any, Any, Any]) -> Path:
    model, tokenizer, optimizer = policy

    def save_model(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return _write(
        run_dir,
        step,
        save_model=save_model,
        trainer_state={
            "optimizer": optimizer,
            "version": step,
            "rng": {"torch": torch.get_rng_state(), "python": __import__("random").getstate()},
        },
        rollout_state=_executor_state(step),
    )


def _verify(run_dir: Path | str) -> Any:
    from stalebound.train.verify import verify_checkpoint

    return verify_checkpoint(ck.open_checkpoint(run_dir), _rollout_config())


def _state_with(checkpoint: Path, change: Any) -> None:
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    change(state)
    torch.save(state, checkpoint / "trainer_state.pt")


def _unlist(checkpoint: Path, name: str) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"][name]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _listed_too(checkpoint: Path, name: str) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    resign(checkpoint)


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


# (damage, what it does to the newest checkpoint, the file named, the start of why; re-signed)
DAMAGES: list[tuple[str, Any, str, str, bool]] = [
    (
        "junk trainer state",
        lambda c, m: (c / "trainer_state.pt").write_bytes(b"junk" * 9),
        "trainer_state.pt",
        "not a trainer state this stalebound reads (",
        True,
    ),
    (
        "code in the trainer state",
        lambda c, m: torch.save({"a": CodeOnUnpickle(m)}, c / "trainer_state.pt"),
        "trainer_state.pt",
        "holds objects other than tensors and plain values",
        True,
    ),
    (
        "optimizer of another model",
        lambda c, m: _state_with(
            c, lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3))
        ),
        "trainer_state.pt",
        "does not fit the checkpoint's model: the optimizer's exp_avg of "
        "parameter 0 has shape (3,)",
        True,
    ),
    (
        "an optimizer of fewer parameters",
        lambda c, m: _state_with(
            c, lambda s: s["optimizer"]["param_groups"][0].update(params=[0, 1])
        ),
        "trainer_state.pt",
        "does not fit the checkpoint's model: the optimizer holds 2 parameters",
        True,
    ),
    (
        "a Python RNG state that is not one",
        lambda c, m: _state_with(c, lambda s: s["rng"].update(python=(3, (1, 2), None))),
        "trainer_state.pt",
        "does not fit the checkpoint's model: its Python RNG state",
        True,
    ),
    (
        "a pickle as the rollout state",
        lambda c, m: (c / "rollout_state.json").write_bytes(
            __import__("pickle").dumps({"a": CodeOnUnpickle(m)})
        ),
        "rollout_state.json",
        "not valid JSON",
        True,
    ),
    (
        "100,000-deep JSON",
        lambda c, m: (c / "rollout_state.json").write_text("[" * 100_000 + "]" * 100_000),
        "rollout_state.json",
        "not valid JSON (it nests 100000 deep, more than the 100",
        True,
    ),
    (
        "a $type tag of a function",
        lambda c, m: (c / "rollout_state.json").write_text(
            json.dumps({"a": {"$type": "os.system", "fields": {}}})
        ),
        "rollout_state.json",
        "not an executor state: rollout state['a']: 'os.system' is not",
        True,
    ),
    (
        "an executor state of another run",
        lambda c, m: (c / "rollout_state.json").write_text(
            (c / "rollout_state.json").read_text().replace('"batch_size": 2', '"batch_size": "x"')
        ),
        "rollout_state.json",
        "not an executor state (",
        True,
    ),
    (
        "truncated weights, re-signed",
        lambda c, m: _truncate(c / "model.safetensors", 5000),
        "model.safetensors",
        "not a safetensors file this stalebound reads (SafetensorError",
        True,
    ),
    (
        "truncated weights, unlisted",
        lambda c, m: (_truncate(c / "model.safetensors", 5000), _unlist(c, "model.safetensors")),
        "model.safetensors",
        "not listed in manifest.json",
        False,
    ),
    (
        "weights of another model",
        lambda c, m: (c / "config.json").write_text(
            (c / "config.json").read_text().replace('"hidden_size": 128', '"hidden_size": 64')
        ),
        "model.safetensors",
        "does not hold the weights of the model in config.json (tensors of another shape",
        True,
    ),
    (
        "a pickled weight file",
        lambda c, m: torch.save({"w": CodeOnUnpickle(m)}, c / "pytorch_model.bin"),
        "pytorch_model.bin",
        "a .bin file in a checkpoint, which this stalebound never writes",
        False,
    ),
    (
        "a pickled weight file, listed",
        lambda c, m: (
            torch.save({"w": CodeOnUnpickle(m)}, c / "pytorch_model.bin"),
            _listed_too(c, "pytorch_model.bin"),
        ),
        "pytorch_model.bin",
        "a .bin file in a checkpoint",
        False,
    ),
    (
        "an unlisted file",
        lambda c, m: (c / "notes.txt").write_text("hi"),
        "notes.txt",
        "not listed in manifest.json, so it is not verified",
        False,
    ),
    (
        "a tokenizer that does not load",
        lambda c, m: (c / "tokenizer.json").write_text("{}"),
        "",
        "its tokenizer does not load (",
        True,
    ),
]


@pytest.mark.parametrize(
    ("spoil", "name", "why", "re_signed"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES]
)
def test_a_checkpoint_is_read_whole_and_a_damaged_one_refused_naming_the_file(
    tmp_path: Path, policy: Any, spoil: Any, name: str, why: str, re_signed: bool
) -> None:
    earlier = _real(tmp_path, 2, policy)
    newest = _real(tmp_path, 4, policy)
    verified = _verify(tmp_path)  # intact: every file reads as what it should hold
    assert verified.checkpoint.step == 4 and verified.trainer_state["version"] == 4
    marker = tmp_path / "ran"
    spoil(newest, marker)
    if re_signed:
        resign(newest)
    with pytest.raises(ck.CheckpointError) as caught:
        _verify(tmp_path)
    text = str(caught.value)
    assert text.startswith(f"{newest / name}: {why}" if name else f"{newest}: {why}"), text
    assert text.endswith(f"; resume from an earlier checkpoint instead, e.g. resume={earlier}")
    assert text.count("instead") == 1 and "\n" not in text, text
    assert not marker.exists(), "something in the checkpoint ran"


def test_an_older_checkpoint_that_is_damaged_names_the_newer_one(
    tmp_path: Path, policy: Any
) -> None:
    older = _real(tmp_path, 2, policy)
    newest = _real(tmp_path, 4, policy)
    (older / "trainer_state.pt").write_bytes(b"junk")
    resign(older)
    with pytest.raises(ck.CheckpointError) as caught:
        _verify(older)
    assert str(caught.value).endswith(f"; resume from another checkpoint instead: resume={newest}")

"""Fault injection on real training runs (``stalebound train`` in its own process, real engine
workers, real files): after every fault the run either resumes or fails with a message that says
what happened and how to continue, and then the whole lineage is checked —

* every item the executor took in is accounted for exactly once (``stalebound audit``): trained,
  ended (filtered, failed, ...), or pending in the newest checkpoint — nothing lost, nothing twice;
* the metrics hold each step exactly once, in order, across the restarts;
* no trained trajectory is staler than η;
* no slot leaked: the buffers' reservations are exactly the groups running at the checkpoint.

Kill points are random; the seed is printed (set ``STALEBOUND_FAULT_SEED`` to replay one).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stalebound.core import StalenessBuffer
from stalebound.train.checkpoint import CheckpointError, open_checkpoint
from stalebound.train.ledger import audit_run
from train_helpers import CodeOnUnpickle, resign

pytestmark = pytest.mark.faults

ETA = 2
STEPS = 12
SEED = int(os.environ.get("STALEBOUND_FAULT_SEED", time.time_ns() % 2**32))


@pytest.fixture(scope="module")
def rng() -> random.Random:
    print(f"fault seed: STALEBOUND_FAULT_SEED={SEED}")
    return random.Random(SEED)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def train_args(run_dir: Path, models: Path, *extra: str) -> list[str]:
    """A short run of the main job: small batches, frequent checkpoints, nothing drawn."""
    return [
        "train",
        f"run.run_dir={run_dir}",
        "run.live=false",
        "run.eval_prompts=16",
        "run.plots=false",
        "run.tensorboard=false",
        "run.trace=false",
        "train.warm_start_steps=30",
        f"engine.cache_dir={models}",
        "rollout.consumer_batch_size=16",
        "rollout.group_size=4",
        f"rollout.staleness={ETA}",
        "run.checkpoint_every_steps=2",
        "run.checkpoint_every_s=0",
        f"run.steps={STEPS}",
        *extra,
    ]


class Run:
    """One ``stalebound`` process, its output kept in a log file."""

    def __init__(
        self, args: list[str], log: Path, tally: dict[str, Any], *, session: bool = False
    ) -> None:
        self.log = log
        self._out = log.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stalebound", *args],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=session,  # its own process group, as a shell job in a terminal
        )
        tally["runs"] += 1

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()

    @property
    def output(self) -> str:
        return self.log.read_text()

    @property
    def said(self) -> str:
        """The output with runs of whitespace as one space (the console wraps long lines)."""
        return " ".join(self.output.split())


def wait_until(cond: Callable[[], bool], run: Run, timeout: float, what: str) -> bool:
    """Whether ``cond`` came true before the process ended (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if run.proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s:\n{run.output}"
        time.sleep(0.02)
    return True


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            break  # a line cut short by the kill
    return steps


def run_patched(tmp: Path, name: str, patch: str, args: list[str], tally: dict[str, Any]) -> str:
    """Run ``stalebound ARGS`` with ``patch`` applied first (in the training process, not in the
    engine workers, which import the script too); return its output. The exit code is checked by
    the caller through :func:`returncode`."""
    script = tmp / f"{name}.py"
    head = "import sys\nfrom stalebound.cli import main\n"
    tail = '\nif __name__ == "__main__":\n    apply()\n    sys.exit(main(sys.argv[1:]))\n'
    script.write_text(head + textwrap.dedent(patch) + tail)
    out = tmp / f"{name}.log"
    with out.open("w") as f:
        code = subprocess.run(
            [sys.executable, str(script), *args], stdout=f, stderr=subprocess.STDOUT, timeout=400
        ).returncode
    tally["runs"] += 1
    (tmp / f"{name}.rc").write_text(str(code))
    return out.read_text()


def returncode(tmp: Path, name: str) -> int:
    return int((tmp / f"{name}.rc").read_text())


def check_lineage(run_dir: Path, tally: dict[str, Any]) -> None:
    audit = audit_run(run_dir)
    assert audit.ok, audit.describe()
    assert audit.step == STEPS and audit.trained > 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert max(r["traj_staleness_max"] for r in records) <= ETA
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["violations"] == 0 and summary["steps"] == STEPS
    state = open_checkpoint(run_dir).rollout_state()
    buffer = state["policy_state"]["buffer"]
    reserved = {g["group_id"] for g in buffer["groups"] if "seq" not in g}
    assert reserved == set(state["running_groups"]), "a reservation without a running group"
    StalenessBuffer.restore(buffer).check_invariants()
    tally["items"] += audit.taken
    tally["violations"] += summary["violations"]


def resume(run_dir: Path, tmp: Path, tally: dict[str, Any], n: int, *extra: str) -> Run:
    tally["resumed"] += 1
    return Run(["train", f"resume={run_dir}", *extra], tmp / f"resume{n}.log", tally)


def resume_to_the_end(run_dir: Path, tmp: Path, tally: dict[str, Any], n: int, *extra: str) -> Run:
    """Resume the run, which must then finish, and check its whole lineage."""
    again = resume(run_dir, tmp, tally, n, *extra)
    assert again.wait() == 0, again.output
    check_lineage(run_dir, tally)
    return again


def kill_engines(run: Run, run_dir: Path, tally: dict[str, Any], kind: str) -> None:
    """SIGKILL the run's engine workers: it must exit 1 with the cause and the resume command
    (the command's way out, not the engine library's)."""
    workers = _engine_workers(run.proc.pid)
    assert workers, "no engine worker found"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    tally["faults"][kind] += 1
    assert run.wait() == 1, run.output
    final = run.output[run.output.rindex("stalebound train: ") :]
    assert "the worker exited (code -9)" in final, final
    assert f"stalebound train resume={run_dir}" in final, final
    assert "LocalEngine" not in final, final
    tally["failures_reported"] += 1


def test_trainer_killed_at_random_points_resumes_with_nothing_lost(
    tmp_path: Path, models: Path, rng: random.Random, tally: dict[str, Any]
) -> None:
    run_dir = tmp_path / "run"
    run = Run(train_args(run_dir, models), tmp_path / "first.log", tally)
    latest = run_dir / "checkpoints" / "latest"
    kills = 0
    for n in range(1, 4):
        if not wait_until(latest.exists, run, 240, "a first checkpoint"):
            break
        start = len(logged_steps(run_dir))

        def stepped(start: int = start) -> bool:
            return len(logged_steps(run_dir)) > start

        # a random moment once this process has trained a step: during generation, a train
        # step, a weight update, or a checkpoint write
        if not wait_until(stepped, run, 240, "a step"):
            break
        time.sleep(rng.uniform(0.0, 1.5))
        if run.proc.poll() is not None:
            break
        run.proc.send_signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL
        kills += 1
        tally["faults"]["trainer SIGKILL"] += 1
        run = resume(run_dir, tmp_path, tally, n)
    assert run.wait() == 0, run.output
    assert kills >= 1, "every run ended before it could be killed; lengthen the runs"
    check_lineage(run_dir, tally)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_it_and_the_run_resumes(
    tmp_path: Path, models: Path, sig: signal.Signals, tally: dict[str, Any]
) -> None:
    # Periodic checkpoints by time only here, so the one after the signal is the signal's.
    run_dir = tmp_path / "run"
    args = train_args(run_dir, models, "run.checkpoint_every_steps=0", "run.checkpoint_every_s=1")
    run = Run(args, tmp_path / "first.log", tally)
    assert wait_until(lambda: len(logged_steps(run_dir)) >= 4, run, 240, "four steps")
    run.proc.send_signal(sig)
    tally["faults"][sig.name] += 1
    assert run.wait() == 128 + sig, run.output
    stopped = logged_steps(run_dir)[-1]
    assert stopped < STEPS, "the run ended before the signal; lengthen it"
    name = f"step-{stopped:06d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == name
    assert (
        f"{sig.name} received: stopped after step {stopped}; continue from "
        f"{run_dir / 'checkpoints' / name} with: stalebound train resume={run_dir}"
    ) in run.output, run.output
    tally["failures_reported"] += 1
    resume_to_the_end(run_dir, tmp_path, tally, 1)


@pytest.mark.parametrize("when", ["during warm start", "after step 1", "engine killed"])
def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(
    tmp_path: Path, models: Path, when: str, tally: dict[str, Any]
) -> None:
    # No periodic checkpoint before the last step: what is there to resume from is the
    # checkpoint of step 0 (after warm start), or, killed before it, nothing at all.
    run_dir = tmp_path / "run"
    args = train_args(run_dir, models, "run.checkpoint_every_steps=0")
    run = Run(args, tmp_path / "first.log", tally)
    if when == "during warm start":
        assert wait_until((run_dir / "config.yaml").exists, run, 240, "the run to start")
    else:
        assert wait_until(lambda: len(logged_steps(run_dir)) >= 1, run, 240, "a first step")
    assert logged_steps(run_dir)[-1:] != [STEPS], "the run ended before the kill"
    if when == "engine killed":
        kill_engines(run, run_dir, tally, "engine SIGKILL before a periodic checkpoint")
    else:
        run.proc.send_signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL
        kind = "during warm start" if when == "during warm start" else "before a periodic ckpt"
        tally["faults"][f"trainer SIGKILL {kind}"] += 1
    had_one = (run_dir / "checkpoints" / "latest").exists()
    assert main_quiet(["audit", str(run_dir)]) == (0 if had_one else 2)  # no traceback
    again = resume_to_the_end(run_dir, tmp_path, tally, 1)
    if had_one:
        assert "from step-000000: step 0, version 0" in again.said, again.output
    else:
        assert "no checkpoint yet (the run stopped before its first one)" in again.said


def main_quiet(argv: list[str]) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "stalebound", *argv], capture_output=True, text=True, timeout=120
    )
    return done.returncode


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_to_the_process_group_checkpoints_and_the_run_resumes(
    tmp_path: Path, models: Path, presses: int, tally: dict[str, Any]
) -> None:
    # A terminal sends SIGINT to the whole foreground process group: the trainer and its
    # engine worker. Once: the step finishes, is checkpointed, the command exits 130. Twice: it
    # stops at once, and the checkpoint before is intact.
    run_dir = tmp_path / "run"
    args = train_args(run_dir, models, "run.checkpoint_every_steps=3", "run.steps=400")
    run = Run(args, tmp_path / "first.log", tally, session=True)
    assert wait_until(lambda: len(logged_steps(run_dir)) >= 4, run, 240, "four steps")
    group = os.getpgid(run.proc.pid)
    os.killpg(group, signal.SIGINT)
    tally["faults"]["Ctrl-C: SIGINT to the process group"] += 1
    if presses == 2:
        assert wait_until(lambda: "stopping after this step" in run.said, run, 60, "the notice")
        os.killpg(group, signal.SIGINT)
        tally["faults"]["second Ctrl-C: stopped at once"] += 1
    assert run.wait(120) == 130, run.output
    out = run.output
    assert "EngineClosedError" not in out and "Traceback" not in out, out
    latest = open_checkpoint(run_dir)  # verified: intact
    if presses == 1:
        assert latest.step == logged_steps(run_dir)[-1], out
        assert f"SIGINT received: stopped after step {latest.step}; continue from" in out, out
    else:
        assert "SIGINT received: stopped at once after step" in out, out
    assert f"stalebound train resume={run_dir}" in out, out
    tally["failures_reported"] += 1
    resume_to_the_end(run_dir, tmp_path, tally, 1, f"run.steps={STEPS}")


def _engine_workers(pid: int) -> list[int]:
    """The trainer's engine worker processes (its multiprocessing spawn children)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            out.append(int(proc.name))
    return out


def test_engine_worker_killed_mid_generation_fails_clearly_then_resumes(
    tmp_path: Path, models: Path, tally: dict[str, Any]
) -> None:
    run_dir = tmp_path / "run"
    run = Run(train_args(run_dir, models), tmp_path / "first.log", tally)
    assert wait_until(lambda: len(logged_steps(run_dir)) >= 3, run, 240, "three steps")
    kill_engines(run, run_dir, tally, "engine worker SIGKILL")
    resume_to_the_end(run_dir, tmp_path, tally, 1)


def test_failing_and_hanging_workflows_are_counted_and_nothing_is_lost(
    tmp_path: Path, models: Path, tally: dict[str, Any]
) -> None:
    # The workflow raises for 10% of episodes and hangs past rollout.request_timeout for 5%,
    # chosen per episode from a seeded generator inside the training process.
    run_dir = tmp_path / "run"
    patch = f"""
        import asyncio, random
        from stalebound.train import episode

        rng = random.Random({SEED})
        real = episode.EngineEpisode.arun_episode

        async def faulty(self, engine, sample):
            roll = rng.random()
            if roll < 0.10:
                raise RuntimeError("injected workflow failure")
            if roll < 0.15:
                await asyncio.sleep(3600)  # cut off by rollout.request_timeout
            return await real(self, engine, sample)

        def apply():
            episode.EngineEpisode.arun_episode = faulty
        """
    # the buffer policy waits for a hung episode until rollout.request_timeout cuts it off (the
    # recipe's deadline policy would abort its group at the deadline first, as overdue_groups)
    args = train_args(
        run_dir, models, "rollout.request_timeout=3", "rollout.staleness_policy=buffer"
    )
    output = run_patched(tmp_path, "faulty", patch, args, tally)
    assert returncode(tmp_path, "faulty") == 0, output
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    timed_out = int(last["timed_out_members"])
    raised = int(last["failed_members"]) - timed_out
    assert raised > 0 and timed_out > 0, last
    tally["faults"]["workflow raised"] += raised
    tally["faults"]["workflow timed out"] += timed_out
    check_lineage(run_dir, tally)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Path:
    """A finished run with checkpoints at its last two even steps (kept as a pristine copy)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    from stalebound.cli import main

    assert main(train_args(run_dir, models)) == 0
    return run_dir


def _copy(run_dir: Path, tmp: Path) -> Path:
    dst = tmp / "run"
    shutil.copytree(run_dir, dst)
    return dst


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped byte in the rollout state": (
        lambda c: _flip_byte(c / "rollout_state.json"),
        "rollout_state.json: corrupt checkpoint file: its SHA-256 differs from the manifest's",
    ),
    "truncated model weights": (
        lambda c: (c / "model.safetensors").write_bytes(
            (c / "model.safetensors").read_bytes()[:100]
        ),
        "model.safetensors: corrupt checkpoint file: 100 bytes, the manifest says",
    ),
    "deleted optimizer state": (
        lambda c: (c / "trainer_state.pt").unlink(),
        "trainer_state.pt: corrupt checkpoint file: missing",
    ),
    "garbled manifest": (
        lambda c: (c / "manifest.json").write_text("{not json"),
        "manifest.json: unreadable or corrupt",
    ),
    "another format": (
        lambda c: (c / "manifest.json").write_text(
            json.dumps({**json.loads((c / "manifest.json").read_text()), "format": 99})
        ),
        "checkpoint format 99 (written by stalebound '0.1.0'); this stalebound reads format 2",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_with_the_way_out(
    finished_run: Path, tmp_path: Path, damage: str, tally: dict[str, Any]
) -> None:
    run_dir = _copy(finished_run, tmp_path)
    newest = open_checkpoint(run_dir).path
    spoil, message = DAMAGE[damage]
    spoil(newest)
    tally["faults"][f"checkpoint: {damage}"] += 1
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(run_dir)
    text = str(caught.value)
    assert message in text, text
    if "format" not in damage:
        earlier = run_dir / "checkpoints" / f"step-{STEPS - 2:06d}"
        assert f"resume from an earlier checkpoint instead, e.g. resume={earlier}" in text
    tally["failures_reported"] += 1


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its content's digest: the whole run directory's state."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


def _torch_save(value: Any, path: Path) -> None:
    import torch

    torch.save(value, path)


def _unlisted(checkpoint: Path, name: str) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"][name]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _cut(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


# (what is damaged, how — in the checkpoint c, with marker m —, the argv after `train`, which
# checkpoint (the newest or the earlier), re-signed, the exit code, the start of the message)
REFUSED: dict[str, tuple[Callable[[Path, Path], Any], str, bool, int, str]] = {
    "junk trainer state": (
        lambda c, m: (c / "trainer_state.pt").write_bytes(b"\x00junk" * 10),
        "newest",
        True,
        1,
        "trainer_state.pt: not a trainer state this stalebound reads",
    ),
    "a trainer state that runs code": (
        lambda c, m: _torch_save({"optimizer": CodeOnUnpickle(m)}, c / "trainer_state.pt"),
        "newest",
        True,
        1,
        "trainer_state.pt: holds objects other than tensors",
    ),
    "a pickle as the rollout state": (
        lambda c, m: _torch_save({"a": CodeOnUnpickle(m)}, c / "rollout_state.json"),
        "newest",
        True,
        1,
        "rollout_state.json: not valid JSON",
    ),
    "a 100,000-deep rollout state": (
        lambda c, m: (c / "rollout_state.json").write_text("[" * 100_000 + "]" * 100_000),
        "newest",
        True,
        1,
        "rollout_state.json: not valid JSON (it nests 100000 deep",
    ),
    "a $type tag of a function": (
        lambda c, m: (c / "rollout_state.json").write_text(
            (c / "rollout_state.json")
            .read_text()
            .replace("stalebound.core.groups.MemberId", "posix.system")
        ),
        "newest",
        True,
        1,
        "rollout_state.json: not an executor state: ",
    ),
    "truncated weights, re-signed": (
        lambda c, m: _cut(c / "model.safetensors", 100),
        "newest",
        True,
        1,
        "model.safetensors: not a safetensors file this stalebound reads",
    ),
    "truncated weights, unlisted": (
        lambda c, m: (_cut(c / "model.safetensors", 100), _unlisted(c, "model.safetensors")),
        "newest",
        False,
        1,
        "model.safetensors: not listed in manifest.json",
    ),
    "a pickled pytorch_model.bin": (
        lambda c, m: _torch_save({"w": CodeOnUnpickle(m)}, c / "pytorch_model.bin"),
        "newest",
        False,
        1,
        "pytorch_model.bin: a .bin file in a checkpoint",
    ),
    "an unlisted file": (
        lambda c, m: (c / "extra.json").write_text("{}"),
        "newest",
        False,
        1,
        "extra.json: not listed in manifest.json",
    ),
    "the earlier checkpoint's trainer state, resumed by name": (
        lambda c, m: (c / "trainer_state.pt").write_bytes(b"\x00junk" * 10),
        "earlier",
        True,
        1,
        "trainer_state.pt: not a trainer state this stalebound reads",
    ),
    "a step twice in metrics.jsonl": (
        lambda c, m: (c.parent.parent / "metrics.jsonl").write_text(
            "".join(_twice((c.parent.parent / "metrics.jsonl").read_text().splitlines(True)))
        ),
        "newest",
        False,
        2,
        "the run's records up to step 12 are damaged (metrics.jsonl: step 3",
    ),
}


def _twice(lines: list[str]) -> list[str]:
    return [*lines[:3], lines[2], *lines[3:]]


@pytest.mark.parametrize("damage", list(REFUSED))
def test_a_resume_refused_for_damage_leaves_the_run_directory_byte_for_byte(
    finished_run: Path,
    tmp_path: Path,
    damage: str,
    tally: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Each file of the checkpoint is read as what it holds before anything is written: nothing
    # moves to abandoned/, no record is cut back, no config.yaml, ledger, TensorBoard or trace
    # file is written, the lock is not taken, the model and the engines never start.
    from stalebound.cli import main

    run_dir = _copy(finished_run, tmp_path)
    spoil, which, re_signed, code, message = REFUSED[damage]
    step = STEPS if which == "newest" else STEPS - 2
    checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
    marker = tmp_path / "ran"
    spoil(checkpoint, marker)
    if re_signed:
        resign(checkpoint)
    before = _tree(run_dir)
    target = str(run_dir) if which == "newest" else str(checkpoint)
    tally["faults"][f"checkpoint refused before writing: {damage}"] += 1
    assert main(["train", "--resume", target, "run.live=false"]) == code
    err = capsys.readouterr().err
    assert _tree(run_dir) == before, "the refused resume changed the run directory"
    assert not marker.exists(), "code in the checkpoint ran"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert err.count("instead") <= 1, err
    tally["failures_reported"] += 1
    if which == "earlier":  # the run itself is whole: its newest checkpoint still resumes
        newest = run_dir / "checkpoints" / f"step-{STEPS:06d}"
        assert f"resume from another checkpoint instead: resume={newest}" in err, err
        assert audit_run(run_dir).ok


def test_two_ctrl_c_while_a_checkpoint_is_put_in_place_name_the_one_resume_uses(
    tmp_path: Path, models: Path, tally: dict[str, Any]
) -> None:
    # The order is driven, not timed: a wrapper sends the two SIGINTs itself while the checkpoint
    # of step 4 is being put in place (they wait for it to be whole, then stop the run at once).
    run_dir = tmp_path / "run"
    patch = """
        import signal
        from stalebound.train import checkpoint

        real = checkpoint.atomic_write_text

        def write(path, text):
            real(path, text)
            if path.name == "latest" and text.strip() == "step-000004":
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)

        def apply():
            checkpoint.atomic_write_text = write
        """
    output = run_patched(tmp_path, "ctrl_c", patch, train_args(run_dir, models), tally)
    tally["faults"]["two SIGINTs while a checkpoint is put in place"] += 1
    said = " ".join(output.split())
    assert returncode(tmp_path, "ctrl_c") == 130, said
    newest = run_dir / "checkpoints" / "step-000004"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == newest.name
    assert f"SIGINT received: stopped at once after step 4; continue from {newest} with:" in said
    tally["failures_reported"] += 1
    command = said[said.rindex("with: stalebound train ") + len("with: stalebound ") :].split()
    assert command == ["train", f"resume={run_dir}"], said
    again = Run(command, tmp_path / "resume.log", tally)
    tally["resumed"] += 1
    assert again.wait() == 0, again.output
    assert f"from {newest.name}: step 4, version 4" in again.said, again.output
    check_lineage(run_dir, tally)


def test_resume_refuses_a_corrupt_checkpoint_then_continues_from_the_earlier_one(
    finished_run: Path, tmp_path: Path, models: Path, tally: dict[str, Any]
) -> None:
    run_dir = _copy(finished_run, tmp_path)
    _flip_byte(open_checkpoint(run_dir).path / "rollout_state.json")
    tally["faults"]["checkpoint: corrupt, then resumed"] += 1
    run = resume(run_dir, tmp_path, tally, 1)
    assert run.wait() == 1
    assert "corrupt checkpoint file" in run.output and "resume from an earlier" in run.output
    tally["failures_reported"] += 1
    earlier = run_dir / "checkpoints" / f"step-{STEPS - 2:06d}"
    run = Run(["train", f"resume={earlier}"], tmp_path / "earlier.log", tally)
    assert run.wait() == 0, run.output
    check_lineage(run_dir, tally)


def test_resuming_an_older_checkpoint_then_resuming_again_keeps_one_history(
    finished_run: Path, tmp_path: Path, tally: dict[str, Any]
) -> None:
    # From the finished run's step 10 (its newest is 12), killed after step 11: the run's
    # newest checkpoint is step 10 again, so resuming the run continues from there.
    run_dir = _copy(finished_run, tmp_path)
    older = run_dir / "checkpoints" / f"step-{STEPS - 2:06d}"
    run = Run(["train", "--resume", str(older)], tmp_path / "fork.log", tally)
    tally["resumed"] += 1

    def stepped_past() -> bool:
        return "resuming" in run.output and logged_steps(run_dir) == list(range(1, STEPS))

    assert wait_until(stepped_past, run, 240, f"step {STEPS - 1} of the resumed run")
    run.proc.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    tally["faults"]["resume an older step, SIGKILL, resume again"] += 1
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == older.name
    assert (run_dir / "abandoned" / f"step-{STEPS:06d}").is_dir()
    resume_to_the_end(run_dir, tmp_path, tally, 1)


def test_an_engine_killed_while_a_resume_starts_names_the_resume_command(
    finished_run: Path, tmp_path: Path, tally: dict[str, Any]
) -> None:
    run_dir = _copy(finished_run, tmp_path)
    run = resume(run_dir, tmp_path, tally, 1)  # at its last step: it starts, trains nothing
    assert wait_until(lambda: bool(_engine_workers(run.proc.pid)), run, 120, "an engine worker")
    kill_engines(run, run_dir, tally, "engine SIGKILL while a resume starts")  # still loading
    newest = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    assert f"continue from {newest} with: stalebound train resume={run_dir}" in run.output
    resume_to_the_end(run_dir, tmp_path, tally, 2)


def _unshare() -> list[str]:
    """A private mount namespace for the disk faults (root cannot be kept out by permissions)."""
    if os.geteuid() != 0:
        return []
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root without user namespaces: {probe.stderr.decode().strip()}")
    return ["unshare", "-rm"]


def test_a_read_only_run_directory_is_refused_before_anything_starts(
    tmp_path: Path, models: Path, tally: dict[str, Any]
) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    run_dir = parent / "run"
    args = " ".join(train_args(run_dir, models))
    wrapper = _unshare()
    if wrapper:
        lock = f"mount --bind {parent} {parent} && mount -o remount,bind,ro {parent}"
    else:
        parent.chmod(0o555)
        lock = "true"
    cmd = f"{lock} && exec {sys.executable} -m stalebound {args}"
    done = subprocess.run([*wrapper, "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    tally["runs"] += 1
    tally["faults"]["read-only run directory"] += 1
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"run.run_dir='{run_dir}': cannot write there (Read-only file system" in done.stderr
        or f"run.run_dir='{run_dir}': cannot write there (Permission denied" in done.stderr
    ), done.stderr
    tally["failures_reported"] += 1


def test_a_disk_that_fills_up_mid_run_fails_clearly_and_resumes_once_freed(
    tmp_path: Path, models: Path, tally: dict[str, Any]
) -> None:
    # A small tmpfs is the run's disk: once the first checkpoint is there, a file fills it up;
    # the run must stop with the reason and the checkpoint to continue from, leave that checkpoint
    # intact, and continue from it once the file is gone.
    wrapper = _unshare()
    if not wrapper:
        pytest.skip("a size-limited disk needs a mount namespace (run as root with unshare)")
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "run"
    keep = tmp_path / "kept"
    py = f"{sys.executable} -m stalebound"
    script = tmp_path / "full_disk.sh"
    script.write_text(
        textwrap.dedent(
            f"""
            set -u
            mount -t tmpfs -o size=64m tmpfs {disk}
            {py} {" ".join(train_args(run_dir, models, "run.steps=400"))} > {tmp_path}/first.log 2>&1 &
            pid=$!
            while [ ! -e {run_dir}/checkpoints/latest ]; do sleep 0.05; done
            dd if=/dev/zero of={disk}/filler bs=1M 2>/dev/null
            wait $pid; echo $? > {tmp_path}/first.rc
            {py} audit {run_dir} > {tmp_path}/audit-full.log 2>&1
            rm {disk}/filler
            {py} train resume={run_dir} run.steps={STEPS} > {tmp_path}/resume.log 2>&1
            echo $? > {tmp_path}/resume.rc
            cp -r {run_dir} {keep}
            """
        )
    )
    done = subprocess.run([*wrapper, "bash", str(script)], capture_output=True, timeout=600)
    tally["runs"] += 2
    tally["resumed"] += 1
    tally["faults"]["disk full mid-run"] += 1
    first = (tmp_path / "first.log").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "1", first + done.stderr.decode()
    assert "No space left on device" in first, first
    assert f"stalebound train resume={run_dir}" in first, first
    tally["failures_reported"] += 1
    assert "each accounted for exactly once" in (tmp_path / "audit-full.log").read_text()
    resumed = (tmp_path / "resume.log").read_text()
    assert (tmp_path / "resume.rc").read_text().strip() == "0", resumed
    audit = audit_run(keep)
    assert audit.ok, audit.describe()
    records = [json.loads(line) for line in (keep / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert max(r["traj_staleness_max"] for r in records) <= ETA
    tally["items"] += audit.taken


def test_a_sharded_run_killed_mid_step_resumes_with_every_prompt_once(
    tmp_path: Path, models: Path, rng: random.Random, tally: dict[str, Any]
) -> None:
    # Two FSDP rank processes train each step; the job is SIGKILLed at a random moment once it
    # has trained a step after a checkpoint: its ranks end with it, and the resumed run (also
    # sharded, from its config.yaml) accounts for every prompt exactly once.
    run_dir = tmp_path / "run"
    sharded = ("train.parallel=fsdp", "train.world_size=2")
    run = Run(train_args(run_dir, models, *sharded), tmp_path / "first.log", tally)
    latest = run_dir / "checkpoints" / "latest"
    assert wait_until(latest.exists, run, 300, "a first checkpoint")
    start = len(logged_steps(run_dir))
    assert wait_until(lambda: len(logged_steps(run_dir)) > start, run, 300, "a step")
    children = _engine_workers(run.proc.pid)  # the engine worker and the two ranks
    assert len(children) >= 3, children
    time.sleep(rng.uniform(0.0, 1.0))
    assert logged_steps(run_dir)[-1:] != [STEPS], "the run ended before the kill"
    run.proc.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    tally["faults"]["sharded trainer SIGKILL mid-step"] += 1
    deadline = time.monotonic() + 60
    while any(_running(p) for p in children):  # they end with the job
        assert time.monotonic() < deadline, "a rank or engine process outlived its job"
        time.sleep(0.1)
    resume_to_the_end(run_dir, tmp_path, tally, 1)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"  # a zombie has ended, unreaped

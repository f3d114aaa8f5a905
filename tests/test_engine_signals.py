"""The local engine's worker ignores a terminal's Ctrl-C, and still ends with its owner.

A terminal sends SIGINT to its whole foreground process group; the owner of the engine (the
training job) decides what it means, so the worker must survive it. Each scenario runs in a
process of its own session, so the signals sent to "the terminal's group" reach only it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from stalebound.engines.models import build_default_model

OWNER = """
import asyncio, multiprocessing, os, signal, sys
from stalebound.engines.local import LocalEngine
from stalebound.engines.protocol import GenerateRequest, SamplingParams

if __name__ == "__main__":
    caught = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # the owner handles them its own way
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    engine = LocalEngine(sys.argv[1], name="e")
    group = os.getpgid(0)
    os.killpg(group, signal.SIGINT)  # Ctrl-C while the worker starts ...
    os.killpg(group, signal.SIGTERM)
    engine.wait_ready(120)
    (worker,) = multiprocessing.active_children()
    os.killpg(group, signal.SIGINT)  # ... and while it runs
    os.killpg(group, signal.SIGTERM)
    request = GenerateRequest("r", (1, 5, 6), SamplingParams(max_new_tokens=4))
    response = asyncio.run(engine.agenerate(request))
    print(worker.pid, os.getsid(worker.pid) != os.getsid(0), len(caught), flush=True)
    print(response.num_output_tokens, flush=True)
    if sys.argv[2] == "close":
        engine.close()
        print(worker.exitcode, flush=True)
    else:  # the owner dies without a word
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_default_model(tmp_path_factory.getbasetemp() / "default-model", seed=0)


def _owner(tmp_path: Path, model_dir: Path, end: str) -> subprocess.Popen[str]:
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(OWNER))
    return subprocess.Popen(
        [sys.executable, str(script), str(model_dir), end],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_the_worker_survives_the_terminals_signals_and_stops_when_closed(
    tmp_path: Path, model_dir: Path
) -> None:
    owner = _owner(tmp_path, model_dir, "close")
    out, err = owner.communicate(timeout=180)
    assert owner.returncode == 0, err
    _, own_session, caught, tokens, exitcode = out.split()
    assert own_session == "True" and caught == "4", out
    assert int(tokens) >= 1 and exitcode == "0", out


def test_the_worker_ends_when_its_owner_is_killed(tmp_path: Path, model_dir: Path) -> None:
    owner = _owner(tmp_path, model_dir, "kill")
    out, err = owner.communicate(timeout=180)
    assert owner.returncode == -signal.SIGKILL, err
    worker = int(out.split()[0])
    # it reads end-of-file on its pipe and exits (it is no child of ours: poll /proc)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{worker}").exists() and b"Z" not in _state(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived its owner"
        time.sleep(0.05)


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return b"Z"


def test_a_worker_still_dies_of_a_signal_sent_to_it(tmp_path: Path, model_dir: Path) -> None:
    from stalebound.engines.local import LocalEngine

    engine = LocalEngine(model_dir, name="t")
    try:
        engine.wait_ready(120)
        import multiprocessing

        (worker,) = [p for p in multiprocessing.active_children() if p.name.endswith("-t")]
        os.kill(worker.pid or 0, signal.SIGTERM)
        # The engine's reader reaps the worker; a second join here would race it for the exit
        # status (the loser's waitpid finds no child and its exitcode reads None).
        deadline = time.monotonic() + 30
        while engine.death is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert worker.exitcode == -signal.SIGTERM
        assert engine.death == "engine 't': the worker exited (code -15)"
        assert engine.closed
    finally:
        engine.close()
    assert engine.death == "engine 't': the worker exited (code -15)"

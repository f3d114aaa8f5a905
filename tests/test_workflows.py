"""Workflows a user names: ``rollout.workflow=module:Class`` checked before anything is written,
its failures counted per cause at run time, and the Python API's example run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalebound.cli import main

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parents[1] / "examples" / "custom_workflow"

WORKFLOWS = '''
from stalebound import Trajectory


def agent(engine, row):
    pass


class Earlier:
    async def run(self, generate, sample):
        pass


class NotAsync:
    def arun_episode(self, engine, row):
        pass


class NoEngine:
    async def arun_episode(self, row):
        pass


class Settings:
    def __init__(self, max_turns=2):
        self.max_turns = max_turns

    async def arun_episode(self, engine, row):
        pass


class Broken:
    def __init__(self):
        raise RuntimeError("no tools configured")

    async def arun_episode(self, engine, row):
        pass


class Crashes:
    """Raises on every other row (or all of them): one model turn, then the crash."""

    def __init__(self, every=2):
        self.every = every

    async def arun_episode(self, engine, row):
        gen = await engine.agenerate(engine.encode_row(row))
        if int(row.id) % self.every == 0:
            raise ValueError("the environment crashed")
        return Trajectory(
            prompt_ids=list(gen.input_ids),
            output_ids=list(gen.output_ids),
            behaviour_logprobs=list(gen.output_logprobs),
            versions=list(gen.output_versions),
            reward=0.0,
            sample_id=row.id,
        )
'''

SHORT = [
    "train.warm_start_steps=0",
    "rollout.consumer_batch_size=2",
    "rollout.group_size=2",
    "run.eval_prompts=2",
    "run.live=false",
    "run.plots=false",
    "run.tensorboard=false",
]


def train(tmp_path: Path, *args: str) -> tuple[int, Path]:
    (tmp_path / "workflows.py").write_text(WORKFLOWS)
    run = tmp_path / "run"
    return main(["train", *SHORT, f"run.run_dir={run}", *args]), run


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["rollout.workflow=W:agent"],
            "rollout.workflow='W:agent': a function, not a class; name a class that defines "
            "async arun_episode(self, engine, row)",
        ),
        (
            ["rollout.workflow=W:Earlier"],
            "rollout.workflow='W:Earlier': Earlier has no arun_episode (run(generate, sample) is "
            "the earlier interface); name a class that defines async arun_episode(self, engine, "
            "row)",
        ),
        (
            ["rollout.workflow=W:NotAsync"],
            "rollout.workflow='W:NotAsync': NotAsync.arun_episode is not async; define it with "
            "async def arun_episode(self, engine, row)",
        ),
        (
            ["rollout.workflow=W:NoEngine"],
            "rollout.workflow='W:NoEngine': NoEngine.arun_episode(self, row) cannot be called as "
            "arun_episode(self, engine, row); give it exactly those parameters",
        ),
        (
            ["rollout.workflow=W:Settings", "rollout.workflow_args={turns: 3}"],
            "rollout.workflow_args={'turns': 3}: Settings(max_turns=2) cannot be constructed "
            "with them (got an unexpected keyword argument 'turns'); give the keyword arguments "
            "its __init__ takes",
        ),
        (
            ["rollout.workflow=W:Broken"],
            "rollout.workflow='W:Broken': constructing Broken failed (RuntimeError: no tools "
            "configured); fix the class or rollout.workflow_args",
        ),
        (
            ["rollout.workflow_args={max_turns: 3}"],
            "rollout.workflow_args={'max_turns': 3}: arguments for a workflow class, and "
            "rollout.workflow names none; name the class (rollout.workflow=module:Class) or drop "
            "the arguments",
        ),
    ],
)
def test_a_workflow_that_cannot_run_is_one_line_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], line: str
) -> None:
    spec = f"{tmp_path / 'workflows.py'}"
    args = [a.replace("=W:", f"={spec}:") for a in args]
    code, run = train(tmp_path, *args)
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"stalebound train: {line.replace('W:', spec + ':')}\n"
    assert not run.exists()


def test_a_workflow_that_raises_is_counted_per_cause_and_the_run_goes_on(tmp_path: Path) -> None:
    code, run = train(
        tmp_path,
        f"rollout.workflow={tmp_path / 'workflows.py'}:Crashes",
        "rollout.max_consecutive_failures=1000",
        "run.steps=2",
    )
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["failed_members/error:ValueError"] >= 2


def test_a_workflow_that_always_raises_trips_the_failure_breaker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = train(
        tmp_path,
        f"rollout.workflow={tmp_path / 'workflows.py'}:Crashes",
        "rollout.workflow_args={every: 1}",
        "rollout.max_consecutive_failures=3",
        "run.steps=2",
    )
    err = capsys.readouterr().err
    assert code == 1  # the executor stopped: an error of the run, not of its settings
    assert "3 groups failed in a row" in err and "error:ValueError" in err


def test_the_custom_workflow_example_trains_from_python(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "run.py"),
            *SHORT,
            "train.warm_start_steps=5",
            "run.steps=2",
            "run.trace=true",
            f"run.run_dir={run}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1].startswith(f"2 steps in {run}: reward ")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["max_staleness"] <= 4
    # episodes whose first answer was wrong had a second turn after the checker's reply
    trace = [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines()[1:]]
    turns = {len(r["tool_latencies"]) + 1 for r in trace}
    assert 2 in turns and turns <= {1, 2}

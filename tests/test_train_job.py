"""The main job end to end on the embedded default: it learns, and the bound holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from stalebound.cli import main
from stalebound.config import load_config
from stalebound.engines.devices import resolve_device

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "r"
    code = main(
        [
            "train",
            "run.steps=40",
            f"run.run_dir={run_dir}",
            "run.live=false",
            "run.eval_prompts=60",
            "--rollout.staleness",
            "2",
            "--max-head-offpolicyness",  # AReaL's admission bound: the deadline policy's η_s
            "1",
            f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        ]
    )
    assert code == 0
    return run_dir


def test_reward_rises_and_no_trained_trajectory_is_staler_than_eta(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    # the recipe's policy; AReaL's flag sets its one bound, here the hard bound η_h
    assert summary["staleness"] == 2 and summary["policy"] == "deadline"
    assert summary["violations"] == 0
    assert summary["max_staleness"] <= 2
    assert summary["reward_last"] > summary["reward_first"] + 0.05, summary
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r["staleness_max"] <= 2 for r in records)
    assert all(r["traj_staleness_max"] <= 2 for r in records)
    # the executor's counters reach the metrics under their own names, and the live view shows
    # the trainer's figures under the names the trainer logs them
    from stalebound.obs.live import FIGURES

    for key in ("filtered_groups", "failed_groups", "surplus_groups", "aborted_tokens"):
        assert key in records[-1], key
    assert {k for k, _ in FIGURES} - {"reward_mean"} <= set(records[-1]), "unlogged live figure"


def test_run_directory_holds_config_metrics_tensorboard_plots_and_checkpoint(run: Path) -> None:
    rollout = load_config([run / "config.yaml"]).rollout
    assert (rollout.staleness, rollout.deadline.target) == (2, 1)
    for name in ("metrics.jsonl", "staleness.jsonl", "buffers.jsonl", "summary.json"):
        assert (run / name).stat().st_size > 0, name
    assert list(run.glob("**/events.out.tfevents.*"))
    for png in (
        "reward_vs_time.png",
        "reward_vs_step.png",
        "staleness_hist.png",
        "buffer_timeline.png",
    ):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000040"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000020", "step-000040"]
    ckpt = ckpts / "step-000040"
    for name in ("config.json", "model.safetensors", "trainer_state.pt", "rollout_state.json"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / "manifest.json").read_text())["version"] == 40


def test_a_run_directory_is_never_overwritten(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = (run / "metrics.jsonl").read_bytes()
    assert main(["train", f"run.run_dir={run}", "run.live=false"]) == 2
    err = capsys.readouterr().err
    assert f"run.run_dir='{run}': already holds a run (metrics.jsonl, ledger.jsonl, " in err
    assert f"continue it with resume={run}, or choose a new directory" in err
    assert (run / "metrics.jsonl").read_bytes() == before


def test_bad_settings_fail_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "rollout.max_head_offpolicyness=-1", "train.lr=0"]) == 2
    err = capsys.readouterr().err
    assert "rollout.max_head_offpolicyness=-1: must be an integer ≥ 0" in err
    assert "train.lr=0.0: must be a finite number > 0 (1e-3 suits the tiny model)" in err


def test_resuming_a_directory_that_holds_no_run_is_one_error_from_the_cli_and_the_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.core import ConfigError
    from stalebound.train.recipe import run_training

    empty = tmp_path / "empty"
    empty.mkdir()
    why = (
        f"resume='{empty}': neither a checkpoint nor the directory of a run "
        f"({empty / 'config.yaml'} does not exist); give the directory of a run written by "
        "stalebound train, or one of its checkpoints"
    )
    assert main(["train", f"resume={empty}", "run.live=false"]) == 2
    assert capsys.readouterr().err.strip() == f"stalebound train: {why}"
    with pytest.raises(ConfigError) as info:
        run_training(load_config(overrides=[f"resume={empty}"]))
    assert str(info.value) == why
    assert list(empty.iterdir()) == []


def test_bad_task_settings_fail_before_the_run_directory_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "never"
    args = ["train", "task.reward_latency.median_s=-1", f"run.run_dir={run_dir}", "run.live=false"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        "stalebound train: task.reward_latency.median_s=-1.0, cap_s=2.0: must be finite numbers "
        ">= 0 (seconds)"
    )
    assert not run_dir.exists()


def test_the_run_trace_replays_under_other_policies(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = run / "trace.jsonl"
    lines = trace.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["source"] == "runtime"
    # where the embedded engine decoded: the recipe's `engine.device`, resolved on this machine
    recipe = yaml.safe_load((run / "config.yaml").read_text())
    assert header["meta"]["engine_device"] == resolve_device(recipe["engine"]["device"])
    assert len(lines) > 40 * 32 * 8  # every episode of the run, and the header
    # each episode names the executor's group and its launch index: a group's members share one
    # prompt, and a whole group holds rollout.group_size of them
    groups: dict[int, list[dict[str, Any]]] = {}
    for line in lines[1:]:
        record = json.loads(line)
        groups.setdefault(record["group_id"], []).append(record)
    assert all(len({r["prompt_id"] for r in g}) == 1 for g in groups.values())
    assert all(len({r["member"] for r in g}) == len(g) for g in groups.values())
    assert max(len(g) for g in groups.values()) == recipe["rollout"]["group_size"] > 1
    capsys.readouterr()
    code = main(
        [
            "simulate",
            "--preset",
            "small",
            "--replay",
            str(trace),
            "--policy",
            "buffer",
            "--policy",
            "capacity",
            "--staleness",
            "4",
            "--steps",
            "5",
            "--json",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert {r["policy"] for r in rows} >= {"buffer", "capacity"}
    assert all(r["throughput"] > 0 for r in rows)
    assert next(r for r in rows if r["policy"] == "buffer")["violations"] == 0


def test_the_audit_accounts_for_every_prompt_and_catches_a_tampered_ledger(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from stalebound.train.ledger import audit_run

    audit = audit_run(run)
    assert audit.ok and audit.step == 40 and audit.trained == 40 * 32, audit.describe()
    assert audit.trained + sum(audit.ended.values()) + audit.pending == audit.taken
    assert main(["audit", str(run)]) == 0
    assert "each accounted for exactly once" in capsys.readouterr().out

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    lines = [json.loads(line) for line in (bad / "ledger.jsonl").read_text().splitlines()]
    lost = lines[3]["trained"].pop()  # an item lost
    twice = lines[5]["trained"][0]
    lines[7]["trained"].append(twice)  # an item trained twice
    lines[9]["ended"]["filtered"] = [10**6]  # an item never taken in
    (bad / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    audit = audit_run(bad)
    assert (audit.missing, audit.duplicates, audit.unknown) == ((lost,), (twice,), (10**6,))
    assert main(["audit", str(bad)]) == 1
    assert "1 counted twice" in capsys.readouterr().out


def test_the_data_audit_adds_up_to_the_ledger(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.obs.audit import DATA_AUDIT_PNG, data_audit
    from stalebound.train.ledger import audit_run

    ledger, audit = audit_run(run), data_audit(run)
    buckets = audit.buckets
    # the executor may draw after the checkpoint's snapshot, before it stops: those items are
    # offered, and pending, to the data audit only
    drawn_later = audit.offered - ledger.taken
    assert drawn_later >= 0 and audit.offered == sum(b.offered for b in buckets)
    assert audit.trained == ledger.trained == sum(b.trained for b in buckets)
    for b in [*buckets, audit]:  # offered = trained + ended + pending, bucket by bucket
        assert b.offered == b.trained + sum(b.ended.values()) + b.pending
    # what ended after the last ledger line is pending to the data audit
    assert sum(audit.ended.values()) + audit.pending == (
        sum(ledger.ended.values()) + ledger.pending + drawn_later
    )
    # every trained item in exactly one bucket, each bucket named by its difficulty
    trained = [
        i
        for line in (run / "ledger.jsonl").read_text().splitlines()
        for i in json.loads(line)["trained"]
    ]
    assert len(trained) == len(set(trained)) == sum(b.trained for b in buckets)
    assert [b.bucket for b in buckets] == ["1", "2–3"]  # one-digit sums: 1 or 2 characters
    assert sum(b.trajectories for b in buckets) == 40 * 32 * 8 and audit.ks is not None
    assert [s for s, _ in audit.length_by_step] == list(range(1, 41))
    assert sum(b.offered_share for b in buckets) == pytest.approx(1.0)
    assert json.loads((run / "summary.json").read_text())["data_audit"] == json.loads(
        json.dumps(audit.to_json())
    )
    assert main(["audit", "--data", str(run)]) == 0
    out = capsys.readouterr().out
    assert "data audit: KS(generated, trained lengths)" in out and f"{audit.offered}" in out
    assert (run / DATA_AUDIT_PNG).stat().st_size > 0


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda t: b"\xff\xfe" + t, "line 1: not UTF-8 text (byte 0 is 0xff"),
        (lambda t: bytes(reversed(range(256))) * 16, "line 1: not UTF-8 text"),
        (lambda t: t.replace(b'"ended": {}', b'"ended": []', 1), "line 1: ended=[]: must map"),
        (
            lambda t: t.replace(b'"trained": [', b'"trained": "96", "x": [', 1),
            'line 1: trained="96"',
        ),
        (
            lambda t: b"\n".join(ln[:40] if i == 1 else ln for i, ln in enumerate(t.split(b"\n"))),
            "line 2: not JSON (",
        ),
    ],
    ids=["not UTF-8", "binary", "ended a list", "trained a string", "a broken middle line"],
)
def test_a_damaged_ledger_is_reported_by_line_not_as_lost_items(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Any,
    expected: str,
) -> None:
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    ledger = bad / "ledger.jsonl"
    ledger.write_bytes(damage(ledger.read_bytes()))
    assert main(["audit", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stalebound audit: {ledger} {expected}"), err
    assert "restore it from a copy" in err and "Traceback" not in err and "lost" not in err


def test_a_ledger_cut_short_by_a_crash_is_still_audited(run: Path, tmp_path: Path) -> None:
    import shutil

    from stalebound.train.ledger import audit_run

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    with (bad / "ledger.jsonl").open("a") as f:
        f.write('{"step": 41, "trained": [1, 2')  # the line a crash interrupted
    assert audit_run(bad).ok


def test_resuming_to_fewer_steps_than_done_is_refused_before_anything_is_written(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["train", f"resume={run}", "run.steps=10"]) == 2
    err = capsys.readouterr().err
    assert (
        f"run.steps=10: the run is already at step 40 ({run / 'checkpoints' / 'step-000040'}); "
        "give run.steps=40 or more to continue it" in err
    ), err
    assert {p: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("name", "damage", "problem"),
    [
        (
            "metrics.jsonl",
            lambda ls: ls[:7] + ls[6:],
            "metrics.jsonl: step 7 is there twice (lines 7 and 8)",
        ),
        ("staleness.jsonl", lambda ls: ls[:11] + ls[12:], "staleness.jsonl: step 12 is missing"),
        (
            "ledger.jsonl",
            lambda ls: [*ls[:3], ls[4], ls[3], *ls[5:]],
            "ledger.jsonl line 5: step 4 comes after step 5",
        ),
        ("buffers.jsonl", lambda ls: [*ls[:2], ls[1], *ls[2:]], "buffers.jsonl line 3: wall_time"),
    ],
    ids=["a step twice", "a step missing", "steps out of order", "a sample twice"],
)
def test_a_damaged_record_is_reported_by_the_audit_and_refused_by_a_resume(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    damage: Any,
    problem: str,
) -> None:
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    lines = (bad / name).read_text().splitlines(keepends=True)
    (bad / name).write_text("".join(damage(lines)))
    assert main(["audit", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "each accounted for exactly once; the records are damaged: " in out, out
    assert problem in out, out
    before = _tree(bad)
    assert main(["train", f"resume={bad}", "run.steps=42", "run.live=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"stalebound train: resume='{bad}': the run's records up to step 40 are damaged ("
    ), err
    assert problem in err and err.count("\n") == 1, err
    assert _tree(bad) == before


@pytest.mark.parametrize(
    "setting",
    ["train.warm_start_steps=3", "train.warm_start_lr=0.1", "engine.model_path={run}/policy-v0"],
)
def test_a_setting_a_resumed_run_would_ignore_is_refused(
    run: Path, capsys: pytest.CaptureFixture[str], setting: str
) -> None:
    before = _tree(run)
    setting = setting.format(run=run)
    assert main(["train", f"resume={run}", setting, "run.live=false"]) == 2
    err = capsys.readouterr().err
    key = setting.split("=")[0]
    assert err.startswith(f"stalebound train: {key}=") and err.count("\n") == 1, err
    assert ": a resumed run ignores it (" in err, err
    assert "drop it (the run's own is " in err
    assert _tree(run) == before


def test_a_run_directory_in_use_is_refused_naming_the_process(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from stalebound.train.runlock import RunLock; "
        f"RunLock({str(run)!r}).acquire(); print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        config = (run / "config.yaml").read_bytes()
        assert main(["train", f"resume={run}", "run.live=false"]) == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid} is running in this run directory" in err, err
        assert (run / "config.yaml").read_bytes() == config
    finally:
        holder.kill()
        holder.wait()


def test_the_episode_trace_waits_for_the_runs_clock_and_writes_what_ended_before_it() -> None:
    # A resumed run starts its groups again while it sets up, before its clock is known: an
    # episode that ends then is written once the clock is set, on that clock.
    import asyncio
    import io
    import time

    from stalebound.engines.protocol import GenerateResponse, SamplingParams
    from stalebound.obs.trace import TraceRecorder
    from stalebound.train.episode import EngineEpisode

    class OneTurn:
        async def arun_episode(self, engine: Any, row: Any) -> str:
            await engine.agenerate((1,), max_new_tokens=2, stop_token_ids=())
            return "done"

    class Task:
        def episode_workflow(self, tokenizer: Any) -> OneTurn:
            return OneTurn()

    class Engine:
        def get_version(self) -> int:
            return 3

        async def agenerate(self, request: Any) -> GenerateResponse:
            return GenerateResponse(request.request_id, (1,), (5, 6), (0.0, 0.0), (3, 3), "stop")

    class Sample:
        id = "p0"

    def starts(out: io.StringIO) -> list[float]:  # the header line, then one per episode
        return [json.loads(line)["start"] for line in out.getvalue().splitlines()[1:]]

    out = io.StringIO()
    episode = EngineEpisode(Task(), None, SamplingParams(), TraceRecorder(out))
    before = time.monotonic()
    asyncio.run(episode.arun_episode(Engine(), Sample()))  # ends before the clock is set
    assert starts(out) == []  # waiting, not counted from some other moment
    origin = before - 100.0  # a run resumed at 100 s of its clock
    episode.set_origin(origin)
    asyncio.run(episode.arun_episode(Engine(), Sample()))  # after: written at once
    first, second = starts(out)
    assert 100.0 <= first <= second <= time.monotonic() - origin

    out = io.StringIO()
    unset = EngineEpisode(Task(), None, SamplingParams(), TraceRecorder(out))
    asyncio.run(unset.arun_episode(Engine(), Sample()))
    unset.close_trace()  # a run that never trained: counted from its setup
    assert [round(s) for s in starts(out)] == [0]

    out = io.StringIO()
    late = EngineEpisode(Task(), None, SamplingParams(), TraceRecorder(out))
    asyncio.run(late.arun_episode(Engine(), Sample()))
    late.set_origin(time.monotonic() + 5.0)  # the clock starts after the episode: it counts as 0
    assert starts(out) == [0.0]

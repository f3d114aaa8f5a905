"""Checks a run passes before it writes anything: the steps of its records, the memory its sizes
take, and the settings a resumed run would ignore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stalebound.cli import main
from stalebound.config import BENCH_RECIPE, TRAIN_RECIPE, load_config
from stalebound.train.ledger import record_problems
from stalebound.train.limits import estimate, memory_problems

# ------------------------------------------------------------------ the steps of a run's records


def _lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(tmp_path: Path, steps: list[int], **changes: list[dict[str, Any]]) -> Path:
    """A run directory whose records hold ``steps`` (each file as a run writes it)."""
    files = {
        "metrics.jsonl": [{"step": s, "wall_time": float(s), "version": s} for s in steps],
        "staleness.jsonl": [{"step": s, "version": s, "counts": {"0": 1}} for s in steps],
        "ledger.jsonl": [{"step": s, "trained": [s], "ended": {}} for s in steps],
        "buffers.jsonl": [{"wall_time": s - 0.5, "version": s, "buffers": []} for s in steps],
    }
    for name, records in files.items():
        _lines(tmp_path / name, changes.get(name.split(".")[0], records))
    return tmp_path


def test_intact_records_pass() -> None:
    assert record_problems(Path("/nonexistent")) == []  # a run that has logged nothing yet


def test_records_with_each_step_once_pass(tmp_path: Path) -> None:
    assert record_problems(_run(tmp_path, [1, 2, 3])) == []
    assert record_problems(tmp_path, upto=2) == []


def test_a_step_there_twice_is_named_with_its_lines(tmp_path: Path) -> None:
    run = _run(tmp_path, [1, 2, 2, 3])
    assert record_problems(run) == [
        "metrics.jsonl: step 2 is there twice (lines 2 and 3)",
        "ledger.jsonl: step 2 is there twice (lines 2 and 3)",
        "staleness.jsonl: step 2 is there twice (lines 2 and 3)",
        "buffers.jsonl line 3: wall_time 1.5 is not after line 2's 1.5 (a record there twice, "
        "or out of order)",
    ]


def test_missing_and_unordered_steps_are_named(tmp_path: Path) -> None:
    run = _run(
        tmp_path,
        [1, 2, 3, 4, 5],
        metrics=[{"step": s, "wall_time": float(s)} for s in (1, 4, 3, 5)],
        ledger=[{"step": s, "trained": [], "ended": {}} for s in (1, 2, 3, 4, 5)],
    )
    assert record_problems(run) == [
        "metrics.jsonl line 3: step 3 comes after step 4",
        "metrics.jsonl: step 2 is missing",
        "staleness.jsonl: step 2 is not among those of metrics.jsonl",
    ]
    # a resume cuts the records back to its checkpoint's step: what it keeps must be whole
    assert record_problems(run, upto=1) == []
    assert "metrics.jsonl: steps 2–3 are missing" in record_problems(_run(tmp_path, [1]), upto=3)


def test_records_after_the_checkpoint_a_resume_cuts_are_not_held_against_it(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, [1, 2, 3, 3])  # a damaged step 3, after the checkpoint of step 2
    assert record_problems(run, upto=2) == []
    assert record_problems(run, upto=3)


def test_a_line_that_does_not_parse_is_one_problem(tmp_path: Path) -> None:
    run = _run(tmp_path, [1, 2])
    (run / "staleness.jsonl").write_text('{"step": 1, "counts": {}}\nnot json\n{"step": 2}\n')
    problems = record_problems(run)
    assert len(problems) == 1 and "staleness.jsonl:2: not a JSON object" in problems[0]


# ------------------------------------------------------------------ sizes against memory

GIB = 1 << 30


def _cfg(*overrides: str) -> Any:
    return load_config([TRAIN_RECIPE], list(overrides))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.consumer_batch_size=1000000000", "rollout.consumer_batch_size"),
        ("rollout.group_size=100000000", "rollout.group_size"),
        ("rollout.staleness=100000000", "rollout.staleness"),
        ("rollout.max_concurrent_rollouts=100000000", "rollout.max_concurrent_rollouts"),
        ("task.max_new_tokens=100000000", "task.max_new_tokens"),
    ],
)
def test_a_size_past_the_memory_names_the_setting_and_the_largest_value_that_fits(
    override: str, key: str
) -> None:
    cfg = _cfg(override)
    sizes = {"vocab_size": 100, "trains_on_cpu": True}
    [problem] = memory_problems(cfg, 16 * GIB, **sizes)
    value = override.split("=")[1]
    assert problem.startswith(f"{key}={value}: the run would hold about "), problem
    assert "more than the 16.0 GiB of memory available; the largest value that fits is " in problem
    fits = int(problem.split("the largest value that fits is ")[1].split()[0])

    def need(v: int) -> int:
        return estimate(_cfg(override, f"{key}={v}"), **sizes).total  # type: ignore[arg-type]

    assert need(fits) <= 16 * GIB < need(fits + 1)


def test_the_recipe_and_the_bench_fit_in_a_gibibyte() -> None:
    sizes: dict[str, Any] = {"vocab_size": 100, "trains_on_cpu": True}
    bench = load_config([TRAIN_RECIPE, BENCH_RECIPE])
    for cfg in (_cfg(), bench, _cfg("rollout.staleness=1000", "rollout.group_size=16")):
        assert memory_problems(cfg, GIB, **sizes) == [], cfg.rollout
    assert memory_problems(_cfg(), 1 << 20, vocab_size=100, trains_on_cpu=False)


def test_sizes_no_single_setting_can_fix_are_named_together() -> None:
    [problem] = memory_problems(_cfg(), 1 << 10, vocab_size=100, trains_on_cpu=False)
    assert problem.startswith("rollout.consumer_batch_size=32, rollout.group_size=8, ")
    assert problem.endswith("; make them smaller together")


# ------------------------------------------------------------------ settings a resume ignores


def test_a_run_directory_given_with_a_resume_is_refused_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "a"
    run.mkdir()
    (run / "config.yaml").write_text("run: {steps: 3}\n")
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    other = tmp_path / "b"
    code = main(
        ["train", "--resume", str(run / "checkpoints" / "step-000002"), f"run.run_dir={other}"]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == (
        f"stalebound train: run.run_dir='{other}': a resumed run continues in its own directory "
        f"({run}), so it would be ignored; drop run.run_dir, or copy the run there and resume "
        "the copy\n"
    )
    assert not other.exists()
    assert main(["train", f"resume={run}", f"run.run_dir={run}", "run.steps=-1"]) == 2
    assert "run.run_dir" not in capsys.readouterr().err  # its own directory may be named

"""``stalebound bench``'s command line: what ``--staleness``, ``--target`` and
``--soft-staleness`` ask for, the warnings where a meaning changed, and the refusals (the runs
themselves are tested in test_bench.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stalebound.cli import main
from stalebound.config import load_config
from stalebound.train import bench


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """What ``stalebound bench`` would run: ``run_bench``'s arguments, the runs themselves
    skipped (the runs are tested above)."""
    calls: list[dict[str, Any]] = []

    def plan(
        base: Any, staleness: Any, out: Path, policies: Any, *, soft: bool, same_admission: bool
    ) -> list[Any]:
        out.mkdir(parents=True)  # where the runs would have gone
        calls.append(
            {
                "staleness": list(staleness),
                "policies": policies,
                "soft": soft,
                "same_admission": same_admission,
                "base": base,
            }
        )
        return []

    monkeypatch.setattr(bench, "run_bench", plan)
    monkeypatch.chdir(tmp_path)
    return calls


@pytest.mark.parametrize(
    ("flags", "staleness", "target", "soft", "note"),
    [
        (["--staleness", "4", "5"], [4, 5], None, False, bench.HARD_NOTE),
        ([], [0, 1, 2, 4], None, False, bench.HARD_NOTE),
        (["--staleness", "4", "--target", "1"], [4], 1, False, ""),
        (["--staleness", "4", "rollout.deadline.target=3"], [4], 3, False, ""),
        (["--soft-staleness", "1", "2"], [1, 2], None, True, bench.SOFT_NOTE),
        (["--policy", "buffer", "--staleness", "2"], [2], None, False, ""),
    ],
)
def test_bench_reads_staleness_as_the_hard_bound_and_says_so_where_that_changed(
    planned: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    staleness: list[int],
    target: int | None,
    soft: bool,
    note: str,
) -> None:
    assert main(["bench", *flags, "--json"]) == 0
    [call] = planned
    assert (call["staleness"], call["soft"]) == (staleness, soft)
    assert call["base"].rollout.deadline.target == target
    assert capsys.readouterr().err == (note + "\n" if note else "")


def test_bench_policy_config_pairs_the_bounds(tmp_path: Path) -> None:
    base = load_config([])
    hard = bench.policy_config(base, "deadline", 4, tmp_path)
    assert (hard.rollout.staleness, hard.rollout.deadline.target) == (4, None)
    former = bench.policy_config(base, "deadline", 2, tmp_path, soft=True)
    assert (former.rollout.staleness, former.rollout.deadline.target) == (4, 2)
    capacity = bench.policy_config(base, "capacity", 2, tmp_path, soft=True)
    assert capacity.rollout.staleness == 2


@pytest.mark.parametrize(
    ("policy", "bound"), [("capacity", 2), ("buffer", 2), ("deadline", 4), ("sync", 0)]
)
def test_same_admission_runs_capacity_and_buffer_at_the_deadline_policys_target(
    planned: list[dict[str, Any]], tmp_path: Path, policy: str, bound: int
) -> None:
    """``--staleness 4 --target 2 --same-admission``: the deadline recipe at η_s = 2, η_h = 4
    beside AReaL's capacity rule (and the buffer) at the same admission bound 2."""
    args = ["bench", "--staleness", "4", "--target", "2", "--same-admission", "--json"]
    assert main(args) == 0
    [call] = planned
    assert call["same_admission"] and call["staleness"] == [4]
    cfg = bench.policy_config(call["base"], policy, 4, tmp_path, same_admission=True)
    assert cfg.rollout.staleness == bound and cfg.rollout.deadline.target == 2


def test_same_admission_is_refused_with_the_former_spelling(
    planned: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--soft-staleness", "2", "--same-admission"]) == 2
    assert capsys.readouterr().err == (
        "stalebound bench: --same-admission with --soft-staleness: the former spelling already "
        "runs capacity and buffer at η_s; give --staleness 2N --target N --same-admission\n"
    )
    assert planned == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--staleness", "2", "4", "--target", "3"],
            "stalebound bench: rollout.deadline.target=3: the soft admission target must be ≤ "
            "the hard bound rollout.staleness=2; raise rollout.staleness to at least 3 (twice the "
            "target is the measured default) or lower the target\n",
        ),
        (
            ["--staleness", "2", "--soft-staleness", "1"],
            "stalebound bench: --soft-staleness: the former spelling of --staleness, not to be "
            "given with it; give --staleness N --target M\n",
        ),
        (
            ["--soft-staleness", "2", "--target", "1"],
            "stalebound bench: --target 1: one soft target η_s, with --staleness "
            "(--soft-staleness sets its own); e.g. --staleness 4 --target 2\n",
        ),
        (
            ["--target", "1", "2"],
            "stalebound bench: --target 1 2: one soft target η_s, with --staleness "
            "(--soft-staleness sets its own); e.g. --staleness 4 --target 2\n",
        ),
    ],
)
def test_bench_refuses_bounds_that_do_not_pair_before_writing_anything(
    planned: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    flags: list[str],
    message: str,
) -> None:
    assert main(["bench", *flags, "--json"]) == 2
    assert capsys.readouterr().err == message
    assert planned == [] and list(tmp_path.iterdir()) == []


def test_bench_longtail_workload_takes_its_file_in_place_of_the_bench_recipe(
    planned: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--workload", "longtail", "--policy", "sync", "capacity", "--json"]) == 0
    [call] = planned
    assert call["policies"] == ["sync", "capacity"]
    task = call["base"].task
    assert (task.name, task.strings.lengths, task.reward_latency.distribution) == (
        "strings",
        "lognormal",
        "none",
    )
    assert main(["bench", "--json"]) == 0
    assert planned[1]["base"].task.reward_latency.distribution == "lognormal"


def test_bench_refuses_an_unknown_workload(
    planned: list[dict[str, Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["bench", "--workload", "huge", "--json"]) == 2
    assert capsys.readouterr().err == (
        "stalebound bench: --workload huge: not a bench workload; use one of default, longtail, "
        "e.g. --workload longtail\n"
    )
    assert planned == [] and list(tmp_path.iterdir()) == []


def test_bench_sync_is_capacity_at_eta_zero_whatever_the_bound(tmp_path: Path) -> None:
    sync = bench.policy_config(load_config([]), "sync", 4, tmp_path)
    assert (sync.rollout.staleness_policy, sync.rollout.staleness) == ("capacity", 0)

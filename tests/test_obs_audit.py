"""The data audit on records written by hand: a run that dropped its long answers shows it (the
audit of a real run is tested end to end in test_train_job.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from stalebound.cli import main
from stalebound.obs import audit as obs_audit
from stalebound.obs.audit import (
    ITEMS_FILE,
    ItemLog,
    OfferedLoader,
    bucket_of,
    data_audit,
    ks_distance,
    target_line,
)
from stalebound.obs.records import first_at_target, reached_target, steps_to_target
from stalebound.obs.trace import TraceHeader, TraceRecorder, TrajectoryRecord
from stalebound.tasks.episode import Sample


def test_buckets_are_powers_of_two_of_the_difficulty() -> None:
    assert [bucket_of(d) for d in (0.5, 1, 2, 3, 4, 7.9, 8, 200)] == [
        "0",
        "1",
        "2–3",
        "2–3",
        "4–7",
        "4–7",
        "8–15",
        "128–255",
    ]
    assert bucket_of(None) == "?"


def test_ks_distance_is_the_largest_gap_between_the_two_cdfs() -> None:
    assert ks_distance([1, 2, 3], [1, 2, 3]) == 0.0
    assert ks_distance([1, 1], [5, 5]) == 1.0
    assert ks_distance([1, 2, 3, 4], [1, 2]) == pytest.approx(0.5)
    assert ks_distance([], [1]) is None


def write_run(root: Path) -> None:
    """Eight one-letter and two 100-letter prompts offered, the long ones dropped untrained, one
    item pending; the trace saw every episode generated to its end."""
    log = ItemLog(root, lambda s: len(s.answer))
    samples = [
        Sample(str(i), f"copy {'a' * n}", "a" * n) for i, n in enumerate([1] * 8 + [100] * 2)
    ]
    drawn = list(OfferedLoader([samples[:5], *samples[5:], samples[0]], log))
    assert drawn == [*samples, samples[0]]  # lists are drawn item by item

    def traj(n: int, truncated: bool = False) -> SimpleNamespace:
        return SimpleNamespace(
            loss_mask=None, output_ids=[0] * n, reward=1.0 if n == 2 else 0.5, truncated=truncated
        )

    log.trained(1, [(0, traj(2)), (0, traj(2)), (1, traj(2)), (1, traj(3, truncated=True))])
    log.trained(2, [(i, traj(2)) for i in range(2, 8)])
    log.close()
    ledger = [
        {"step": 1, "trained": [0, 1], "ended": {"dropped": [8]}},
        {"step": 2, "trained": list(range(2, 8)), "ended": {"filtered": [9]}},
    ]
    (root / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    with TraceRecorder(root / "trace.jsonl", TraceHeader(source="runtime", group_size=2)) as rec:
        for n in [2] * 11 + [101] * 4:
            rec.record(TrajectoryRecord("p", 0, 0, 0.0, 1.0, n))


def test_the_audit_shows_the_long_prompts_that_were_not_trained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_run(tmp_path)
    audit = data_audit(tmp_path)
    assert (audit.offered, audit.trained, audit.ended, audit.pending) == (
        11,
        8,
        {"dropped": 1, "filtered": 1},
        1,  # item 10, drawn after the last step: not yet decided
    )
    short, long = audit.buckets
    assert (short.bucket, short.offered, short.trained, short.pending) == ("1", 9, 8, 1)
    assert (long.bucket, long.offered, long.trained, long.ended) == (
        "64–127",
        2,
        0,
        {"dropped": 1, "filtered": 1},
    )
    assert (short.trajectories, short.truncated, long.trajectories) == (10, 1, 0)
    assert short.reward_mean == pytest.approx((9 * 1.0 + 0.5) / 10)
    assert (short.prompts, short.never_trained, long.prompts, long.never_trained) == (8, 0, 2, 2)
    assert audit.never_trained_fraction == pytest.approx(0.2)
    # decided items: 8 short, 2 long; trained: 8 short
    assert (short.offered_share, short.trained_share) == (0.8, 1.0)
    assert (long.offered_share, long.trained_share, long.share_ratio) == (0.2, 0.0, 0.0)
    assert audit.worst_share_ratio is None  # neither bucket has 10 decided items to rank by
    monkeypatch.setattr(obs_audit, "MIN_BUCKET_ITEMS", 2)
    assert data_audit(tmp_path).worst_share_ratio == 0.0
    # 11 short and 4 long generated, 9 of 2 tokens and 1 of 3 trained
    assert audit.ks == pytest.approx(4 / 15)
    assert audit.length_by_step == [(1, 2.25), (2, 2.0)]

    assert main(["audit", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "never trained 20.0% of prompts" in out and "64–127" in out
    assert (tmp_path / "data_audit.png").stat().st_size > 0


def test_a_resumed_run_keeps_the_first_draw_of_an_item_and_the_last_line_of_a_step(
    tmp_path: Path,
) -> None:
    write_run(tmp_path)
    with (tmp_path / ITEMS_FILE).open("a") as f:  # a resume from step 1 draws 0… again
        f.write(json.dumps({"offered": 0, "id": "x", "difficulty": 100.0}) + "\n")
        f.write(json.dumps({"step": 2, "trained": [[2, 7, 0.0, False]]}) + "\n")
        f.write(json.dumps({"step": 3, "trained": [[3, 7, 0.0, False]]}) + "\n")  # no ledger
    audit = data_audit(tmp_path)
    assert audit.buckets[0].offered == 9
    assert audit.length_by_step == [(1, 2.25), (2, 7.0)]


def test_audit_data_refuses_a_directory_without_a_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "--data", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"stalebound audit: run_dir={str(tmp_path)!r}: holds no ledger.jsonl; give the directory "
        "of a run written by stalebound train\n"
    )


def test_a_step_that_trains_the_easy_prompts_first_is_weighed_at_the_offered_mix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four easy and four hard prompts offered; step 1 trains three easy and one hard, step 2
    the rest. As trained, step 1's reward (0.6) already reaches the target 0.5; at the offered
    mix (half easy, half hard) it is 0.4, and the target waits for step 2."""
    log = ItemLog(tmp_path, lambda s: len(s.answer))
    samples = [Sample(str(i), "copy", "a" * n) for i, n in enumerate([1] * 4 + [8] * 4)]
    list(OfferedLoader(samples, log))

    def traj(reward: float) -> SimpleNamespace:
        return SimpleNamespace(loss_mask=None, output_ids=[0, 0], reward=reward, truncated=False)

    log.trained(1, [(0, traj(0.8)), (1, traj(0.8)), (2, traj(0.8)), (4, traj(0.0))])
    log.trained(2, [(3, traj(1.0)), (5, traj(0.4)), (6, traj(0.4)), (7, traj(0.4))])
    log.close()
    ledger = [
        {"step": 1, "trained": [0, 1, 2, 4], "ended": {}},
        {"step": 2, "trained": [3, 5, 6, 7], "ended": {}},
    ]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    with TraceRecorder(tmp_path / "trace.jsonl", TraceHeader(source="runtime")) as rec:
        rec.record(TrajectoryRecord("p", 0, 0, 0.0, 1.0, 2))
    audit = data_audit(tmp_path)
    assert audit.target_reward is None and audit.steps_to_target is None
    assert target_line(audit) is None

    (tmp_path / "config.yaml").write_text("run:\n  target_reward: 0.5\n")
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward_mean": r}) + "\n" for s, r in ((1, 0.6), (2, 0.55)))
    )
    audit = data_audit(tmp_path)
    assert [
        (s, pytest.approx(raw), pytest.approx(mix)) for s, raw, mix in audit.reward_by_step
    ] == [
        (1, 0.6, 0.4),
        (2, 0.55, 0.7),
    ]
    assert (audit.target_reward, audit.steps_to_target, audit.steps_to_target_offered_mix) == (
        0.5,
        1,
        2,
    )
    assert audit.steps_to_target == steps_to_target(tmp_path)  # the metrics' reward agrees
    assert audit.to_json()["reward_by_step"][1][0] == 2
    assert main(["audit", "--data", str(tmp_path)]) == 0
    assert (
        "target reward 0.5 (the mean of 5 steps): step 1 as trained, step 2 at the offered mix"
        in capsys.readouterr().out
    )


def test_the_target_is_reached_by_the_mean_of_the_last_five_steps() -> None:
    assert first_at_target([0.1, 0.9, 0.9], 0.6) == 3  # 0.1, 0.5, then 0.63
    assert first_at_target([0, 0, 0, 0, 0, 1, 1, 1, 1, 1], 0.8) == 9  # the window, not all
    assert first_at_target([0.1, 0.2], 0.5) is None
    assert reached_target([0.7], 0.7) and not reached_target([], 0.0)

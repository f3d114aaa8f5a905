"""The deadline action ``continue`` end to end on the longtail workload: stragglers keep
generating past their deadline, no trained token is staler than η_h, and the audits add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalebound.cli import main

pytestmark = pytest.mark.slow

LONGTAIL = Path(__file__).parents[1] / "src" / "stalebound" / "configs" / "bench-longtail.yaml"
ETA = 1


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """η_s = η_h = 1 (a group is due one version after the one it was admitted at), batches of 4
    groups (a training step is short), 4 spare entries per buffer (room to continue into) and
    sampling hot enough that the tiny model often rambles on towards the token limit, and a
    verifier that now and then takes seconds (one reward in ten over 0.6 s, at most 6 s): groups
    still generating, or still waiting for a reward, when their deadline buffer is due."""
    run_dir = tmp_path_factory.mktemp("run") / "r"
    code = main(
        [
            "train",
            str(LONGTAIL),
            "run.steps=12",
            "rollout.consumer_batch_size=4",
            f"run.run_dir={run_dir}",
            "run.live=false",
            "run.eval_prompts=20",
            f"rollout.staleness={ETA}",
            "rollout.deadline.action=continue",
            f"rollout.deadline.target={ETA}",
            "rollout.deadline.slack=4",
            "engine.temperature=2.0",
            "task.reward_latency.distribution=lognormal",
            "task.reward_latency.median_s=0.05",
            "task.reward_latency.sigma=2.0",
            "task.reward_latency.cap_s=6.0",
            f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        ]
    )
    assert code == 0
    return run_dir


def test_stragglers_continue_and_no_trained_token_is_staler_than_the_bound(run: Path) -> None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["continued_groups"] > 0  # some group ran past its deadline buffer
    # the staleness of the oldest token each step trained: never past η_h
    assert all(r["staleness_max"] <= ETA for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["violations"] == 0


def test_the_ledger_and_the_data_audit_add_up_with_continued_groups_in_them(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.obs.audit import data_audit
    from stalebound.train.ledger import audit_run

    ledger, audit = audit_run(run), data_audit(run)
    assert ledger.ok, ledger.describe()
    assert ledger.trained == 12 * 4  # every step trained a whole batch, continued groups in it
    assert audit.trained == ledger.trained == sum(b.trained for b in audit.buckets)
    for b in [*audit.buckets, audit]:
        assert b.offered == b.trained + sum(b.ended.values()) + b.pending
    assert main(["audit", str(run)]) == 0
    assert "each accounted for exactly once" in capsys.readouterr().out
    assert main(["audit", "--data", str(run)]) == 0

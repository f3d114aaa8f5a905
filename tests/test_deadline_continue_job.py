"""The deadline action ``continue`` end to end, as a user runs it: their JSONL, their reward
function in a file, the embedded model. One group is made to straggle past its deadline by its
reward, which holds its answer until the trainer has logged its second step (the order of events
is the run's own, not a clock's); it continues into a later buffer, no trained token is staler
than η_h, and the audits add up with the continued group in them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalebound.cli import main

pytestmark = pytest.mark.slow

ETA = 1

REWARD = """
import asyncio
from pathlib import Path

METRICS = Path({metrics!r})
calls = []


async def score(prompt, completion, answer, **columns):
    calls.append(prompt)
    # call 1 is the greedy evaluation before training (run.eval_prompts=1); call 2 is the first
    # answer of training: its group waits here until step 2 was logged, past its deadline
    if len(calls) >= 2 and prompt == calls[1] and not (METRICS.parent / "released").exists():
        while not METRICS.exists() or len(METRICS.read_text().splitlines()) < 2:
            await asyncio.sleep(0.01)
        (METRICS.parent / "released").write_text(prompt)
    return float(completion.strip() == answer)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """η_s = η_h = 1 (a group is due one version after the one it was admitted at), batches of 4
    groups and 4 spare entries per buffer (room to continue into)."""
    tmp = tmp_path_factory.mktemp("job")
    run_dir = tmp / "r"
    words = ["ab", "cab", "dog", "eel", "fig", "gnu", "hat", "ink", "jam", "kit", "log", "map"]
    data = tmp / "copy.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"copy {w}", "answer": w}) + "\n" for w in words)
    )
    reward = tmp / "held.py"
    reward.write_text(REWARD.format(metrics=str(run_dir / "metrics.jsonl")))
    code = main(
        [
            "train",
            f"data.path={data}",
            f"task.reward={reward}:score",
            "task.reward_timeout_s=600",
            "task.max_new_tokens=6",
            "run.steps=6",
            "rollout.consumer_batch_size=4",
            "rollout.group_size=2",
            f"run.run_dir={run_dir}",
            "run.live=false",
            "run.plots=false",
            "run.tensorboard=false",
            "run.eval_prompts=1",
            "rollout.staleness_policy=deadline",
            f"rollout.staleness={ETA}",
            "rollout.deadline.action=continue",
            f"rollout.deadline.target={ETA}",
            "rollout.deadline.slack=4",
            f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        ]
    )
    assert code == 0
    assert (run_dir / "released").exists()  # the held group did wait for step 2
    return run_dir


def test_a_straggler_continues_and_no_trained_token_is_staler_than_the_bound(run: Path) -> None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["continued_groups"] >= 1  # the held group ran past its deadline buffer
    # its tokens, all from version 0, were masked when it was trained at version ≥ 2
    assert sum(r["tokens_masked_stale"] for r in records) > 0
    assert max(r["traj_staleness_max"] for r in records) > ETA  # trained later than V + η_h…
    assert all(r["staleness_max"] <= ETA for r in records)  # …but no trained token was
    summary = json.loads((run / "summary.json").read_text())
    assert summary["violations"] == 0


def test_the_ledger_and_the_data_audit_add_up_with_continued_groups_in_them(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.obs.audit import data_audit
    from stalebound.train.ledger import audit_run

    ledger, audit = audit_run(run), data_audit(run)
    assert ledger.ok, ledger.describe()
    assert ledger.trained == 6 * 4  # every step trained a whole batch, the continued group in it
    assert audit.trained == ledger.trained == sum(b.trained for b in audit.buckets)
    for b in [*audit.buckets, audit]:
        assert b.offered == b.trained + sum(b.ended.values()) + b.pending
    assert main(["audit", str(run)]) == 0
    assert "each accounted for exactly once" in capsys.readouterr().out
    assert main(["audit", "--data", str(run)]) == 0

"""A user's job from the command line: their BPE checkpoint, their JSONL (capitals, newlines,
other column names) and their reward function in a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalebound.cli import main

pytestmark = pytest.mark.slow

PROBLEMS = [
    {"question": "Natalia sold clips to 48 of her friends in April.\nHow many?", "answer": "48"},
    {"question": "Tom has 3 apples and eats 1.\nHow many are left?", "answer": "2"},
    {"question": "A box holds 6 eggs. How many in 2 boxes?", "answer": "12"},
    {"question": "Écrivez 7 — «sept».", "answer": "7"},
]

REWARD = """
def score(prompt, completion, answer, **columns):
    if "boom" in prompt:
        raise RuntimeError("the verifier crashed")
    return {"reward": float(answer in completion), "length": len(completion)}
"""


def test_a_users_checkpoint_data_and_reward_train_and_failures_are_counted(
    llama_dir: Path, tmp_path: Path
) -> None:
    # five rows and 16 prompts taken: every row, the crashing one included, is drawn
    rows = [dict(r, id=f"p{i}", level=i % 2) for i, r in enumerate(PROBLEMS)]
    rows.append({"question": "boom\nthis row's reward raises", "answer": "1", "id": "boom"})
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARD)
    run = tmp_path / "run"
    code = main(
        [
            "train",
            f"engine.model_path={llama_dir}",
            f"data.path={data}",
            f"task.reward={tmp_path / 'rewards.py'}:score",
            "task.max_new_tokens=8",
            "train.warm_start_steps=0",
            "rollout.consumer_batch_size=4",
            "rollout.group_size=4",
            "rollout.staleness=2",
            "rollout.max_consecutive_failures=1000",
            "run.steps=4",
            "run.eval_prompts=4",
            "run.live=false",
            "run.plots=false",
            "run.tensorboard=false",
            f"run.run_dir={run}",
        ]
    )
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["max_staleness"] <= 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # every member of the crashing row's groups failed with the reward's cause, counted per cause
    failures = max(r.get("failed_members/reward:raised", 0.0) for r in records)
    assert failures >= 4 and records[-1]["failed_groups"] >= 1


def test_the_issue_line_is_not_refused_for_a_bpe_model(llama_dir: Path, tmp_path: Path) -> None:
    """The character set of the demo tokenizer applies to the demo tokenizer only."""
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(PROBLEMS[0]) + "\n")
    run = tmp_path / "run"
    code = main(
        [
            "train",
            f"engine.model_path={llama_dir}",
            f"data.path={data}",
            "task.reward=numeric",
            "train.warm_start_steps=0",
            "rollout.consumer_batch_size=1",
            "rollout.group_size=2",
            "run.steps=1",
            "run.eval_prompts=1",
            "run.live=false",
            "run.plots=false",
            "run.tensorboard=false",
            f"run.run_dir={run}",
        ]
    )
    assert code == 0


@pytest.mark.parametrize("data", ["problems.jsonl", "chat.jsonl"])
def test_the_word_problems_example_trains_as_its_readme_says(
    llama_dir: Path, tmp_path: Path, data: str
) -> None:
    example = Path(__file__).parents[1] / "examples" / "word_problems"
    chat = ["data.messages_key=messages"] if data == "chat.jsonl" else []
    run = tmp_path / "run"
    code = main(
        [
            "train",
            str(example / "config.yaml"),
            f"engine.model_path={llama_dir}",
            f"data.path={example / data}",
            f"task.reward={example / 'rewards.py'}:score",
            *chat,
            "run.steps=3",
            "run.live=false",
            "run.plots=false",
            "run.tensorboard=false",
            f"run.run_dir={run}",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["traj_staleness_max"] <= 4 for r in records)
    # the reward's extra metric is logged beside the reward, as a batch mean
    assert all(0.0 <= r["reward/stated_number"] <= 1.0 for r in records)

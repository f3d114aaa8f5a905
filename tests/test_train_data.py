"""A user's job from the command line: their BPE checkpoint, their JSONL (capitals, newlines,
other column names) and their reward function in a file."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from stalebound.cli import main
from stalebound.obs.loggers import LOGGER_IDS_FILE

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


ROOT = Path(__file__).parents[1]
QUICK = {"word-problems-chat": ["run.steps=2"]}  # the chat run shows it reads; fewer steps do


def readme_commands(section: str) -> list[list[str]]:
    """The commands of the last ``bash`` block of the README's ``section``, continuation lines
    joined and comments left out, each split as the shell would."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = body.split("```bash\n")[-1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line and not line.startswith("#")]


def test_your_model_your_data_runs_as_the_readme_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)  # the example's YAML names its files from the repository's root
    runs = tmp_path / "runs"
    commands = readme_commands("Your model, your data")
    assert [c[0] for c in commands] == [".venv/bin/python", *[".venv/bin/stalebound"] * 4]
    for command in commands:
        argv = [a.replace("runs/", f"{runs}/") for a in command[1:]]
        if command[0] == ".venv/bin/python":
            assert argv[0] == "-c"
            exec(argv[1], {})  # builds the stand-in checkpoint
            continue
        if argv[0] == "train":
            named = [a.split("=", 1)[1] for a in argv if a.startswith(("run.run_dir=", "resume="))]
            argv += [*QUICK.get(Path(named[0]).name, []), "run.live=false", "run.plots=false"]
        assert main(argv) == 0, argv
    assert "each accounted for exactly once" in capsys.readouterr().out

    run = runs / "word-problems"
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))  # 10 steps, resumed to 12
    assert summary["max_staleness"] <= 4 and summary["violations"] == 0
    assert all(r["traj_staleness_max"] <= 4 for r in records)
    # the reward's extra metric is logged beside the reward, as a batch mean
    assert all(0.0 <= r["reward/stated_number"] <= 1.0 for r in records)
    # greedy accuracy on the problems, with the example's reward: the training took
    assert summary["eval_after"] > summary["eval_before"], summary
    # wandb (offline files) and MLflow (a file store) hold the twelve steps in one run each
    from test_obs_loggers import _mlflow

    ids = json.loads((run / LOGGER_IDS_FILE).read_text())
    assert {p.name.rsplit("-", 1)[-1] for p in (run / "wandb").glob("offline-run-*")} == {
        ids["wandb"]
    }
    client = _mlflow(run)
    history = client.get_metric_history(ids["mlflow"], "reward_mean")
    assert sorted(m.step for m in history) == list(range(1, 13))
    chat = [json.loads(line) for line in (runs / "word-problems-chat" / "metrics.jsonl").open()]
    assert [r["step"] for r in chat] == [1, 2]


def test_one_epoch_stopped_and_resumed_trains_every_row_once_then_ends(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # eight good rows and, past the rows checked up front, one that cannot be trained on
    rows = [{"question": f"What is {i} plus {i}?\nSay it.", "answer": str(2 * i)} for i in range(8)]
    rows.insert(5, {"question": "", "answer": "0"})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    common = [
        "run.live=false",
        "run.plots=false",
        "run.tensorboard=false",
        "run.eval_prompts=2",
    ]
    first = [
        "train",
        f"engine.model_path={llama_dir}",
        f"data.path={data}",
        "data.epochs=1",
        "data.check_rows=2",
        "task.reward=numeric",
        "task.max_new_tokens=4",
        "train.warm_start_steps=0",
        "rollout.consumer_batch_size=2",
        "rollout.group_size=2",
        "rollout.staleness=2",
        "run.steps=2",
        f"run.run_dir={run}",
        *common,
    ]
    assert main(first) == 0
    assert main(["train", f"resume={run}", "run.steps=50", *common]) == 0
    said = capsys.readouterr().out
    assert (
        "data.epochs=1: every row of" in said and "the run ends at step 4 of run.steps=50" in said
    )
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == [1, 2, 3, 4]
    trained = [i for r in ledger for i in r["trained"]]
    assert sorted(trained) == list(range(8))  # each of the eight rows drawn once, trained once
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["data/skipped_rows"] for r in records) == 1
    assert main(["audit", str(run)]) == 0


GOOD = {"question": "Tom has 3 apples.\nHow many?", "answer": "3"}
BAD_INPUTS = {
    "missing column": ([GOOD], ["data.prompt_key=prompt"], "", "data.prompt_key"),
    "misspelled column": ([GOOD], ["data.answer_key=answr"], "", "data.answer_key"),
    "prompt not a string": ([{"question": ["Tom", "Ann"], "answer": "5"}], [], "", "question"),
    "empty dataset": ([], [], "", "holds no rows"),
    "reward does not import": ([GOOD], [], "import no_such_module_here\n", "no_such_module_here"),
    "reward not callable": ([GOOD], [], "score = 3\n", "not a function"),
    "reward signature": ([GOOD], [], "def score():\n    return 1.0\n", "def reward(prompt"),
    "no user turn": (
        [{"messages": [{"role": "system", "content": "Be brief."}], "answer": "1"}],
        ["data.messages_key=messages"],
        "",
        "user",
    ),
    "glob matches nothing": ([GOOD], ["data.path={tmp}/nothing-*.jsonl"], "", "matches no file"),
    "not parquet": ([GOOD], ["data.path={tmp}/rows.parquet"], "", "parquet"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2_before_anything_is_written(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    rows, settings, reward_source, named = BAD_INPUTS[case]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rows.parquet").write_text("not a parquet file")
    reward = tmp_path / "rewards.py"
    reward.write_text(
        reward_source or "def score(prompt, completion, **columns):\n    return 1.0\n"
    )
    run = tmp_path / "run"
    code = main(
        [
            "train",
            f"engine.model_path={llama_dir}",
            f"data.path={data}",
            f"task.reward={reward}:score",
            *(s.format(tmp=tmp_path) for s in settings),
            f"run.run_dir={run}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert not run.exists()
    assert named in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err

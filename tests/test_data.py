"""A user's dataset: formats, column mapping, exact errors, shuffling, epochs, resume, eval split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("datasets")

from stalebound.core.errors import ConfigError
from stalebound.data import DataConfig, DataPosition, Message, RowStream, held_out

ROWS = [
    {"question": f"Natalia sold {i} clips.\nHow many?", "answer": str(2 * i), "level": i % 3}
    for i in range(12)
]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_jsonl_of_word_problems_reads_with_any_unicode_and_its_other_columns(
    tmp_path: Path,
) -> None:
    rows = [*ROWS, {"question": "Ünïcode — «quotes»?", "answer": "ok", "level": 9}]
    s = RowStream(
        DataConfig(path=str(write_jsonl(tmp_path / "p.jsonl", rows)), shuffle=False, epochs=1),
        seed=0,
    )
    s.check()
    got = list(s)
    assert [r.prompt for r in got] == [r["question"] for r in rows]
    assert got[0].answer == "0" and got[0].columns == {"level": 0} and got[0].id == "0"
    assert got[-1].prompt == "Ünïcode — «quotes»?"


@pytest.mark.parametrize("kind", ["json", "csv", "parquet", "saved"])
def test_json_csv_parquet_and_saved_datasets_give_the_same_rows(tmp_path: Path, kind: str) -> None:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if kind == "json":
        (tmp_path / "d.json").write_text(json.dumps(ROWS))
        path = str(tmp_path / "d.json")
    elif kind == "csv":
        ds.to_csv(str(tmp_path / "d.csv"))
        path = str(tmp_path / "d.csv")
    elif kind == "parquet":
        ds.to_parquet(str(tmp_path / "d.parquet"))
        path = str(tmp_path / "d.parquet")
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        path = str(tmp_path / "saved")
    got = list(RowStream(DataConfig(path=path, shuffle=False, epochs=1), seed=0))
    assert [(r.prompt, r.answer) for r in got] == [(r["question"], r["answer"]) for r in ROWS]


def test_a_glob_and_a_list_read_the_files_in_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ROWS[:5])
    write_jsonl(tmp_path / "b.jsonl", ROWS[5:])
    for spec in (str(tmp_path / "*.jsonl"), [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]):
        got = list(RowStream(DataConfig(path=spec, shuffle=False, epochs=1), seed=0))
        assert [r.answer for r in got] == [r["answer"] for r in ROWS]


def test_chat_messages_with_a_system_prompt(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "Hi?\nTwo lines"}], "answer": "a"},
        {
            "messages": [
                {"role": "system", "content": "Own system."},
                {"role": "user", "content": "Q"},
            ],
            "answer": "b",
        },
    ]
    cfg = DataConfig(
        path=str(write_jsonl(tmp_path / "c.jsonl", rows)),
        messages_key="messages",
        system_prompt="Be brief.",
        shuffle=False,
        epochs=1,
    )
    got = list(RowStream(cfg, seed=0))
    assert got[0].messages(cfg.system_prompt) == (
        Message("system", "Be brief."),
        Message("user", "Hi?\nTwo lines"),
    )
    assert got[1].messages(cfg.system_prompt)[0] == Message("system", "Own system.")


@pytest.mark.parametrize(
    ("rows", "settings", "message"),
    [
        (
            [{"prompt": "x", "answer": "1"}],
            {},
            "data.prompt_key='question': data.path row 0 has no such column (its columns: "
            "['prompt', 'answer']); set data.prompt_key to the column that holds the prompt",
        ),
        (
            [{"question": "x", "solution": "1"}],
            {},
            "data.answer_key='answer': data.path row 0 has no such column (its columns: "
            "['question', 'solution']); set data.answer_key to the column of reference answers, "
            "or null if the data has none",
        ),
        (
            [{"question": ["not", "text"], "answer": "1"}],
            {},
            "data.path row 0: question=['not', 'text'] is not a prompt one can train on; give "
            "every row non-empty text (or use data.messages_key for chat lists)",
        ),
        (
            [{"messages": [{"role": "system", "content": "s"}], "answer": "1"}],
            {"messages_key": "messages"},
            "data.path row 0: messages has no user turn (['system']); every conversation needs "
            "at least one message with role 'user'",
        ),
    ],
)
def test_a_bad_row_is_one_line_naming_the_value_and_the_fix(
    tmp_path: Path, rows: list[dict[str, object]], settings: dict[str, object], message: str
) -> None:
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), **settings)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as e:
        RowStream(cfg, seed=0).check()
    assert str(e.value) == message


def test_paths_that_name_no_data_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.parquet").write_text("not parquet")
    (tmp_path / "dir").mkdir()
    (tmp_path / "x.txt").write_text("hi")
    cases = {
        str(tmp_path / "nope-*.jsonl"): "the glob matches no file",
        str(tmp_path / "missing.jsonl"): "no such file",
        str(tmp_path / "dir"): "is a directory but not one written by Dataset.save_to_disk",
        str(tmp_path / "x.txt"): "'x.txt' is not a data file stalebound reads",
        str(tmp_path / "empty.jsonl"): "holds no rows",
        str(tmp_path / "bad.parquet"): "cannot read it as parquet",
    }
    for spec, why in cases.items():
        with pytest.raises(ConfigError) as e:
            RowStream(DataConfig(path=spec), seed=0).check()
        assert why in str(e.value), (spec, str(e.value))
        assert "\n" not in str(e.value)


def test_each_epoch_is_a_seeded_permutation_and_epochs_end_the_stream(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    s = RowStream(DataConfig(path=path, epochs=2), seed=3)
    seen = [r.index for r in s]
    first, second = seen[:12], seen[12:]
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second and first != list(range(12))
    again = [r.index for r in RowStream(DataConfig(path=path, epochs=2), seed=3)]
    assert again == seen
    other = [r.index for r in RowStream(DataConfig(path=path, epochs=1), seed=4)]
    assert other != first


@pytest.mark.parametrize("stop", [0, 5, 12, 17])
def test_a_stream_resumed_from_its_position_continues_exactly(tmp_path: Path, stop: int) -> None:
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    whole = [r.index for r in RowStream(DataConfig(path=path, epochs=2), seed=1)]
    s = RowStream(DataConfig(path=path, epochs=2), seed=1)
    it = iter(s)
    head = [next(it).index for _ in range(stop)]
    saved = DataPosition.from_json(json.loads(json.dumps(s.position.to_json())))
    resumed = RowStream(DataConfig(path=path, epochs=2), seed=1)
    resumed.seek(saved)
    assert head + [r.index for r in resumed] == whole


def test_the_eval_fraction_holds_out_the_same_rows_every_time(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(400)]
    path = str(write_jsonl(tmp_path / "d.jsonl", rows))
    cfg = DataConfig(path=path, eval_fraction=0.1, epochs=1, eval_rows=1000)
    train = {r.index for r in RowStream(cfg, seed=7)}
    evals = RowStream(cfg, seed=7, split="eval").head(1000)
    held = {r.index for r in evals}
    assert train.isdisjoint(held) and train | held == set(range(400))
    assert held == {i for i in range(400) if held_out(7, i, 0.1)}
    assert 20 <= len(held) <= 60  # about 10 % of 400


def test_rows_found_bad_after_the_check_are_skipped_and_counted(tmp_path: Path) -> None:
    rows = [*ROWS[:3], {"question": "", "answer": "x"}, *ROWS[3:6]]
    path = str(write_jsonl(tmp_path / "d.jsonl", rows))
    s = RowStream(DataConfig(path=path, check_rows=2, shuffle=False, epochs=1), seed=0)
    s.check()
    assert [r.answer for r in s] == [r["answer"] for r in ROWS[:6]]
    assert s.skipped == 1


def test_a_row_reads_as_a_mapping_of_its_columns(tmp_path: Path) -> None:
    from stalebound.tasks.dataset import _sample

    rows = [{"question": "Hi,\nTom?", "answer": "7", "topic": "sum", "level": 2}]
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), shuffle=False)
    stream = RowStream(cfg, seed=0)
    stream.check()
    row = _sample(next(iter(stream)))
    assert (row["answer"], row["topic"], row["level"], row["prompt"]) == (
        "7",
        "sum",
        2,
        "Hi,\nTom?",
    )
    assert row.get("missing", 0) == 0 and row["id"] == row.id
    with pytest.raises(KeyError):
        row["missing"]

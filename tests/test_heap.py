"""The set-up's heap is frozen for a run and released after it (``run.gc_freeze``)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalebound._heap import frozen_heap
from stalebound.cli import main


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    assert gc.get_freeze_count() == 0, "a test before this one left the heap frozen"
    yield
    gc.unfreeze()


def collected() -> set[int]:
    """The ids of the objects the collector visits (a frozen object is not among them)."""
    return {id(o) for o in gc.get_objects()}


def test_a_block_freezes_what_lives_at_its_start_and_releases_it_at_its_end() -> None:
    kept = [[i] for i in range(100)]
    with frozen_heap():
        made_inside = [[i] for i in range(10)]
        visited = collected()
        assert not any(id(k) in visited for k in kept)
        assert all(id(m) in visited for m in made_inside)  # made in the block: collected as ever
    visited = collected()
    assert gc.get_freeze_count() == 0
    assert all(id(k) in visited for k in [*kept, *made_inside])


def test_a_nested_block_leaves_the_outer_one_frozen_and_the_outer_one_releases_all() -> None:
    kept = [[i] for i in range(10)]
    with frozen_heap():
        between = [[i] for i in range(10)]
        with frozen_heap():
            assert not any(id(o) in collected() for o in [*kept, *between])
        assert not any(id(o) in collected() for o in [*kept, *between])  # the outer block's
    assert all(id(o) in collected() for o in [*kept, *between])


def test_a_block_that_raises_releases_the_heap() -> None:
    with pytest.raises(RuntimeError, match="the step failed"), frozen_heap():
        raise RuntimeError("the step failed")
    assert gc.get_freeze_count() == 0


# The reward runs in the trainer's process: it reports whether that process's heap was frozen.
REWARD = """
import gc

def score(prompt, completion, answer, **columns):
    return {"reward": float(answer in completion), "frozen": float(gc.get_freeze_count() > 0)}
"""


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [True, False])
def test_the_run_freezes_the_heap_only_while_it_trains_as_configured(
    freeze: bool, llama_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"question": "How many is 2 and 3?", "answer": "5"}) + "\n")
    (tmp_path / "rewards.py").write_text(REWARD)
    run = tmp_path / "run"
    code = main(
        [
            "train",
            f"engine.model_path={llama_dir}",
            f"data.path={data}",
            f"task.reward={tmp_path / 'rewards.py'}:score",
            "task.max_new_tokens=4",
            "train.warm_start_steps=0",
            "rollout.consumer_batch_size=2",
            "rollout.group_size=2",
            "run.steps=3",
            "run.eval_prompts=1",
            f"run.gc_freeze={str(freeze).lower()}",
            "run.live=false",
            "run.plots=false",
            "run.tensorboard=false",
            f"run.run_dir={run}",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/frozen"] for r in records] == [float(freeze)] * 3
    assert gc.get_freeze_count() == 0  # released when the run ended

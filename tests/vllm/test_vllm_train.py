"""``stalebound train engine.kind=vllm``: the main job against the real server learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_reference import Server

from stalebound.cli import main

pytestmark = pytest.mark.vllm


def test_train_against_vllm_learns_keeps_the_bound_and_reloads_weights(
    vllm_server: Server, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "engine.kind=vllm",
            f"engine.urls=[{vllm_server.url}]",
            f"engine.model_path={vllm_server.model_dir}",
            "run.steps=25",
            f"run.run_dir={run_dir}",
            "run.live=false",
            "run.eval_prompts=50",
            "run.plots=false",
            "psrl.staleness=1",
        ]
    )
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["violations"] == 0 and summary["max_staleness"] <= 1
    assert summary["reward_last"] > summary["reward_first"] + 0.02, summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["version"] == 25
    # the server reloaded each step's weights from the directory the job wrote atomically
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v24", "v25"]

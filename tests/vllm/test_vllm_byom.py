"""A user-style checkpoint on the real vLLM server: a tiny Qwen2 with a byte-level BPE tokenizer, a
ChatML template and a list of end-of-sequence ids, served from its directory and trained against."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm_reference import teacher_forced_logprobs

from stalebound.cli import main
from stalebound.engines import GenerateRequest, SamplingParams
from stalebound.engines.models import load_model, load_tokenizer
from stalebound.engines.vllm import VLLMEngine
from stalebound.engines.vllm_server import VLLMServer, start_vllm_server
from stalebound.tasks.workflow import encode_prompt, stop_ids

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def qwen2_server(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    root = tmp_path_factory.mktemp("vllm-qwen2")
    server = start_vllm_server(qwen2_dir, 0, log_path=root / "server.log")
    try:
        yield server
    finally:
        server.stop()


def test_vllm_serves_the_checkpoint_with_its_template_and_stop_ids(
    qwen2_server: VLLMServer, qwen2_dir: Path, tmp_path: Path
) -> None:
    tok = load_tokenizer(qwen2_dir)
    prompt = tuple(encode_prompt(tok, "3+4="))
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    # the same weights with all-zero output logits: greedy takes id 0, <|endoftext|>, a stop id
    # of the generation config only
    silent = load_model(qwen2_dir)
    with torch.no_grad():
        silent.lm_head.weight.zero_()
    silent.save_pretrained(tmp_path / "silent")

    async def scenario() -> None:
        async with VLLMEngine(qwen2_server.url) as engine:
            sampled = await engine.agenerate(
                GenerateRequest("s", prompt, SamplingParams(max_new_tokens=6, seed=3))
            )
            expected = teacher_forced_logprobs(load_model(qwen2_dir), prompt, sampled.output_ids)
            assert sampled.output_logprobs == pytest.approx(expected, abs=5e-4)
            await engine.update_weights(str(tmp_path / "silent"), 1)
            try:
                greedy = SamplingParams(
                    max_new_tokens=6, temperature=0.0, stop_token_ids=stop_ids(tok)
                )
                stopped = await engine.agenerate(GenerateRequest("g", prompt, greedy))
                assert stopped.output_ids == (eot,) and stopped.finish_reason == "stop"
            finally:
                await engine.update_weights(str(qwen2_dir), 2)

    asyncio.run(scenario())


def test_train_against_vllm_with_the_users_checkpoint(
    qwen2_server: VLLMServer, qwen2_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "engine.kind=vllm",
            f"engine.urls=[{qwen2_server.url}]",
            f"engine.model_path={qwen2_dir}",
            "train.warm_start_steps=100",
            "train.lr=1e-3",
            # the trainer waits for every due group, so any truncation below is the answer
            # reaching max_new_tokens (a missed stop id), never a deadline a slow step set off
            "rollout.deadline.grace_steps=null",
            "run.steps=10",
            f"run.run_dir={run_dir}",
            "run.live=false",
            "run.eval_prompts=40",
            "run.plots=false",
        ]
    )
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    # the recipe's hard bound (the deadline policy's η_h = 4)
    assert summary["staleness"] == 4 and summary["violations"] == 0
    assert summary["max_staleness"] <= summary["staleness"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # well-formed chat answers that stop on <|im_end|>: the prompts reached the server rendered
    # with the template and the stop ids went with them
    assert all(r["truncated_fraction"] < 0.1 for r in records)
    assert sum(r["reward_mean"] for r in records) / len(records) > 0.3

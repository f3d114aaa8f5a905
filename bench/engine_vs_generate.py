"""The local engine's continuous batching against the same model's batched Hugging Face ``generate``.

    PYTHONPATH=src python bench/engine_vs_generate.py [--device auto] [--dtype float32]
        [--requests 64] [--tokens 64] [--repeats 3] [--model-dir DIR]

Both serve the same ``--requests`` prompts (arithmetic prompts rendered with the checkpoint's chat
template) on the same device and precision. Request i asks for a length drawn between
``--tokens``/8 and ``--tokens`` new tokens (sampled at temperature 1, end of sequence ignored), as
RL rollouts vary in length. The engine takes them all at once and lets each leave the batch when it
is done; ``generate`` runs them as one left-padded batch until the longest is done. Reported:
useful tokens per second (the requested tokens, not the padding) of each, and their ratio, as the
median of ``--repeats`` runs with the range. Without ``--model-dir`` the model is a tiny Qwen2
with a BPE tokenizer built locally (``build_bpe_model``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stalebound.engines import GenerateRequest, SamplingParams
from stalebound.engines.devices import resolve_device
from stalebound.engines.local import LocalEngine
from stalebound.engines.models import build_bpe_model, load_model, load_tokenizer
from stalebound.tasks import TaskConfig, make_task
from stalebound.tasks.workflow import encode_prompt


def workload(model_dir: Path, requests: int, tokens: int) -> list[tuple[tuple[int, ...], int]]:
    """``(prompt ids, new tokens)`` per request; the same for every run (seeded)."""
    tokenizer = load_tokenizer(model_dir)
    task = make_task(TaskConfig())
    rng = random.Random(0)
    samples = task.samples()
    return [
        (
            tuple(encode_prompt(tokenizer, task.prompt(samples[i % len(samples)]))),
            rng.randint(max(1, tokens // 8), tokens),
        )
        for i in range(requests)
    ]


async def engine_rate(
    engine: LocalEngine, work: list[tuple[tuple[int, ...], int]], tag: str
) -> float:
    requests = [
        GenerateRequest(
            f"{tag}-{i}", ids, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        )
        for i, (ids, n) in enumerate(work)
    ]
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.agenerate(r) for r in requests))
    elapsed = time.perf_counter() - started
    return sum(r.num_output_tokens for r in results) / elapsed


@torch.inference_mode()
def generate_rate(model: Any, work: list[tuple[tuple[int, ...], int]], pad: int) -> float:
    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in work)
    ids = torch.full((len(work), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, _) in enumerate(work):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    longest = max(n for _, n in work)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=longest,
        min_new_tokens=longest,
        pad_token_id=pad,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return sum(n for _, n in work) / (time.perf_counter() - started)


async def compare(
    model_dir: Path,
    *,
    device: str = "auto",
    dtype: str = "float32",
    requests: int = 64,
    tokens: int = 64,
    repeats: int = 3,
) -> dict[str, Any]:
    """Measure both ``repeats`` times, alternating; returns medians, ranges and the ratio."""
    device = resolve_device(device)
    work = workload(model_dir, requests, tokens)
    model = load_model(model_dir, device=device, dtype=dtype)
    pad = int(load_tokenizer(model_dir).pad_token_id or 0)
    engine_rates, generate_rates = [], []
    async with LocalEngine(model_dir, device=device, dtype=dtype, name="bench") as engine:
        await engine_rate(engine, work[:8], "warmup")
        generate_rate(model, work[:8], pad)
        for r in range(repeats):
            engine_rates.append(await engine_rate(engine, work, f"run{r}"))
            generate_rates.append(generate_rate(model, work, pad))
    ratios = [e / g for e, g in zip(engine_rates, generate_rates, strict=True)]
    return {
        "device": device,
        "dtype": dtype,
        "requests": requests,
        "tokens": tokens,
        "engine_tokens_per_s": statistics.median(engine_rates),
        "engine_range": [min(engine_rates), max(engine_rates)],
        "generate_tokens_per_s": statistics.median(generate_rates),
        "generate_range": [min(generate_rates), max(generate_rates)],
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model-dir",
        default=None,
        help="a checkpoint directory (default: a tiny Qwen2 with a BPE tokenizer, built locally)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = (
        Path(args.model_dir)
        if args.model_dir
        else build_bpe_model(Path(tempfile.gettempdir()) / "stalebound-bpe-qwen2", "qwen2")
    )
    result = asyncio.run(
        compare(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            requests=args.requests,
            tokens=args.tokens,
            repeats=args.repeats,
        )
    )
    result["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

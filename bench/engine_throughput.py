"""Local engine throughput against a naive baseline, and the weight-update pause.

    PYTHONPATH=src python bench/engine_throughput.py [--tokens 64] [--model-dir DIR]

For 1, 8, 32 and 128 concurrent requests (each ``--tokens`` new tokens, sampled at temperature 1,
end-of-sequence ignored so every request has the same length) it measures generated tokens per
second of the :class:`LocalEngine` (one worker process, one thread) and of a naive baseline:
Hugging Face ``generate`` on the same model, one request at a time, in this process with one
thread. The baseline is sequential, so its rate does not depend on the concurrency; it is measured
on at most ``--naive-cap`` requests per row to keep the run short. Each row is measured
``--repeats`` times (engine and baseline alternating) and printed as the median with its range; the
speed-up is the ratio of the medians.

Then it measures the weight-update pause: while 32 requests are decoding, it publishes
``--updates`` new state dicts and reports the stall the worker saw between two tokens (reading,
checking and copying the weights) and the caller's round trip, as medians (and p90).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from stalebound.engines import GenerateRequest, SamplingParams
from stalebound.engines.local import LocalEngine
from stalebound.engines.models import build_default_model, load_model, load_tokenizer

CONCURRENCY = (1, 8, 32, 128)


def prompts(tokenizer: Any, count: int) -> list[tuple[int, ...]]:
    return [tuple(tokenizer(f"{17 * i + 3}+{29 * i + 11}=").input_ids) for i in range(count)]


async def engine_rate(
    engine: LocalEngine, ids: list[tuple[int, ...]], tokens: int, tag: str
) -> float:
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    requests = [GenerateRequest(f"{tag}-{i}", p, sampling) for i, p in enumerate(ids)]
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.agenerate(r) for r in requests))
    elapsed = time.perf_counter() - started
    return sum(r.num_output_tokens for r in results) / elapsed


@torch.inference_mode()
def naive_rate(model: Any, ids: list[tuple[int, ...]], tokens: int) -> float:
    started = time.perf_counter()
    generated = 0
    for p in ids:
        out = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones((1, len(p)), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=model.config.pad_token_id,
        )
        generated += out.shape[1] - len(p)
    return generated / (time.perf_counter() - started)


async def update_pauses(
    engine: LocalEngine, model: Any, ids: list[tuple[int, ...]], updates: int
) -> tuple[list[float], list[float]]:
    sampling = SamplingParams(max_new_tokens=10_000, temperature=1.0, ignore_eos=True)
    busy = [
        asyncio.create_task(engine.agenerate(GenerateRequest(f"pause-{i}", p, sampling)))
        for i, p in enumerate(ids)
    ]
    await asyncio.sleep(0.2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    round_trips = []
    first = len(engine.statistics().pause_ms)
    for _ in range(updates):
        version = engine.get_version() + 1
        started = time.perf_counter()
        await engine.update_weights(state, version)
        round_trips.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.02)
    for i in range(len(ids)):
        await engine.abort(f"pause-{i}")
    results = await asyncio.gather(*busy)
    if any(len(set(r.output_versions)) < 2 for r in results):
        raise RuntimeError("some request saw no update: the pause was not measured mid-decoding")
    return list(engine.statistics().pause_ms[first:]), round_trips


def spread(values: list[float]) -> str:
    """``median (min–max)``, rounded to whole units."""
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model_dir = build_default_model(args.model_dir, seed=0)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    async with LocalEngine(model_dir, name="bench") as engine:
        await engine_rate(engine, prompts(tokenizer, 8), 16, "warmup")
        naive_rate(model, prompts(tokenizer, 2), 16)
        rows = []
        for c in CONCURRENCY:
            ids = prompts(tokenizer, c)
            ours, naive = [], []
            for r in range(args.repeats):
                ours.append(await engine_rate(engine, ids, args.tokens, f"c{c}-{r}"))
                naive.append(naive_rate(model, ids[: args.naive_cap], args.tokens))
            rows.append((c, ours, naive))
        pauses, trips = await update_pauses(engine, model, prompts(tokenizer, 32), args.updates)

    print(
        f"\nLocalEngine vs naive HF generate (one at a time); {args.tokens} new tokens/request; "
        f"median (range) of {args.repeats} runs"
    )
    print(f"load average before/after: {args.load_before} / {os.getloadavg()[0]:.2f}")
    print(f"{'concurrent':>10} | {'engine tok/s':>18} | {'naive tok/s':>15} | {'speedup':>7}")
    print(f"{'-' * 10}-+-{'-' * 18}-+-{'-' * 15}-+-{'-' * 7}")
    for c, ours, naive in rows:
        a, b = statistics.median(ours), statistics.median(naive)
        print(f"{c:>10} | {spread(ours):>18} | {spread(naive):>15} | {a / b:>6.1f}x")
    print(
        f"\nweight update during 32-way decoding ({len(pauses)} updates, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params):"
    )
    print(
        f"  generation stall in the worker: median {statistics.median(pauses):.1f} ms, "
        f"p90 {pct(pauses, 0.9):.1f} ms"
    )
    print(
        f"  update_weights round trip:      median {statistics.median(trips):.1f} ms, "
        f"p90 {pct(trips, 0.9):.1f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--naive-cap", type=int, default=16, help="baseline requests per row")
    parser.add_argument("--updates", type=int, default=20, help="weight updates to time")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (median, range)")
    parser.add_argument(
        "--model-dir",
        default=os.path.join(tempfile.gettempdir(), "stalebound-default-model"),
        help="where the default model is built (reused when present)",
    )
    arguments = parser.parse_args()
    arguments.load_before = f"{os.getloadavg()[0]:.2f}"
    asyncio.run(main(arguments))

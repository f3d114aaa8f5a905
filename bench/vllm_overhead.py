"""Client overhead against one vLLM server: raw concurrent HTTP requests vs stalebound's engine.

Every variant generates the same trajectories (same prompts, greedy, ``max_new_tokens`` tokens,
``--concurrency`` in flight) against the same server, in one run; the variants take turns in each
round so that drift of the shared machine hits all of them alike. Printed: the median
trajectories/s and tokens/s over the rounds, each variant's ratio to the fastest raw client (the
same wire format as the engine's default, parsed minimally), and the client process's CPU
time per trajectory — the client's own cost, which on a busy machine is a steadier measure of
overhead than throughput (the server's share of the cores varies from round to round).

Variants (add one by writing an ``async def run_x(ctx, requests) -> int`` that returns the number of
generated tokens, and listing it in ``VARIANTS``):

* ``raw-stream``: httpx, ``/v1/completions`` streamed with ``return_token_ids`` and ``logprobs=0``,
  read to the end (the connection goes back to the pool).
* ``raw-stream-close``: the same, but it stops reading at ``data: [DONE]`` (the connection is
  closed, as the engine does).
* ``raw-nostream``: httpx, the same request without streaming (one JSON answer per request).
* ``engine``: :class:`~stalebound.engines.vllm.VLLMEngine` (``api="completions"``).
* ``engine-generate``: ``VLLMEngine(api="generate")`` (vLLM's token endpoint).
* ``router``: :class:`~stalebound.engines.router.Router` over two ``VLLMEngine`` clients.
* ``executor``: the same requests as episodes of a
  :class:`~stalebound.runtime.WorkflowExecutor` (buffer policy, one trajectory per group,
  ``--concurrency`` groups in flight) over its own ``VLLMEngine``: the whole rollout path.

Usage::

    python bench/vllm_overhead.py                      # starts a server from .venv-vllm
    python bench/vllm_overhead.py --url http://127.0.0.1:8000   # reuses a running one
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from stalebound.engines import GenerateRequest, Router, SamplingParams
from stalebound.engines.vllm import VLLMEngine


@dataclass
class Context:
    url: str
    model: str
    concurrency: int
    max_new_tokens: int
    engines: dict[str, Any] = field(default_factory=dict)
    raw_retries: int = 0
    engine_retries: int = 0


Variant = Callable[[Context, list[GenerateRequest]], Awaitable[int]]


async def _retrying(ctx: Context, go: Callable[[], Awaitable[int]]) -> int:
    # The raw clients retry a request whose connection failed, as the engine does, so that a
    # rare connection reset under load does not end the run; retries are reported.
    for attempt in range(4):
        try:
            return await go()
        except httpx.TransportError:
            if attempt == 3:
                raise
            ctx.raw_retries += 1
            await asyncio.sleep(0.25 * 2**attempt)
    raise AssertionError("unreachable")


async def _bounded(concurrency: int, jobs: list[Callable[[], Awaitable[int]]]) -> int:
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[int]]) -> int:
        async with gate:
            return await job()

    return sum(await asyncio.gather(*(one(job) for job in jobs)))


def _body(ctx: Context, request: GenerateRequest, stream: bool) -> dict[str, Any]:
    # The same fields the engine sends, so that only the client differs.
    return {
        "model": ctx.model,
        "prompt": list(request.input_ids),
        "max_tokens": request.sampling.max_new_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "stop_token_ids": [],
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stream": stream,
    }


def _raw_stream(close_at_done: bool) -> Variant:
    async def run(ctx: Context, requests: list[GenerateRequest]) -> int:
        async with _client() as client:

            def job(request: GenerateRequest) -> Callable[[], Awaitable[int]]:
                return lambda: _retrying(ctx, lambda: go(request))

            async def go(request: GenerateRequest) -> int:
                n = 0
                body = _body(ctx, request, True)
                async with client.stream("POST", f"{ctx.url}/v1/completions", json=body) as reply:
                    reply.raise_for_status()
                    async for line in reply.aiter_lines():
                        if line.startswith("data: [DONE]"):
                            if close_at_done:
                                break  # leave the rest unread: the connection is closed
                        elif line.startswith("data:"):
                            n += len(json.loads(line[5:])["choices"][0]["token_ids"] or ())
                return n

            return await _bounded(ctx.concurrency, [job(r) for r in requests])

    return run


async def run_raw_nostream(ctx: Context, requests: list[GenerateRequest]) -> int:
    async with _client() as client:

        async def go(request: GenerateRequest) -> int:
            reply = await client.post(f"{ctx.url}/v1/completions", json=_body(ctx, request, False))
            reply.raise_for_status()
            return len(reply.json()["choices"][0]["token_ids"])

        jobs = [lambda r=r: _retrying(ctx, lambda: go(r)) for r in requests]
        return await _bounded(ctx.concurrency, jobs)


def _through(name: str) -> Variant:
    async def run(ctx: Context, requests: list[GenerateRequest]) -> int:
        engine = ctx.engines[name]

        def job(request: GenerateRequest) -> Callable[[], Awaitable[int]]:
            async def go() -> int:
                return (await engine.agenerate(request)).num_output_tokens

            return go

        return await _bounded(ctx.concurrency, [job(r) for r in requests])

    return run


class _Episode:
    """The executor's workflow: one request per episode, returning its generated tokens."""

    async def arun_episode(self, engine: Any, request: GenerateRequest) -> int:
        return (await engine.agenerate(request)).num_output_tokens


async def run_executor(ctx: Context, requests: list[GenerateRequest]) -> int:
    executor = ctx.engines["executor"]
    trajectories = await asyncio.to_thread(executor.rollout_batch, requests, _Episode())
    return sum(int(t.data) for t in trajectories)


VARIANTS: dict[str, Variant] = {
    "raw-stream": _raw_stream(close_at_done=False),
    "raw-stream-close": _raw_stream(close_at_done=True),
    "raw-nostream": run_raw_nostream,
    "engine": _through("engine"),
    "engine-generate": _through("engine-generate"),
    "router": _through("router"),
    "executor": run_executor,
}


def _client() -> httpx.AsyncClient:
    # A fresh client (and pool) per batch, as a short script would write it: a pool kept across
    # batches holds connections the server closed meanwhile, which httpcore re-checks on every
    # request event (a CPU cost of the client, not of the server).
    return httpx.AsyncClient(
        timeout=httpx.Timeout(300.0, connect=5.0),
        limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
    )


async def _setup(ctx: Context) -> None:
    completions = VLLMEngine(ctx.url, api="completions")
    generate = VLLMEngine(ctx.url, api="generate")
    replicas = [VLLMEngine(ctx.url), VLLMEngine(ctx.url)]
    for engine in (completions, generate, *replicas):
        await engine.start(timeout=60)
    ctx.model = completions.model or ctx.model
    # The executor runs its own event loop: its engine client is started (and closed) there.
    from stalebound.config import RolloutConfig
    from stalebound.runtime import WorkflowExecutor

    executor_engine = VLLMEngine(ctx.url, api="completions")
    settings = RolloutConfig(
        consumer_batch_size=1,
        group_size=1,
        max_head_offpolicyness=1000,  # no weight updates here: staleness never binds
        max_concurrent_rollouts=ctx.concurrency,
    )
    executor = WorkflowExecutor(settings, executor_engine).initialize()
    executor.run_coroutine(executor_engine.start(timeout=60))
    ctx.engines = {
        "executor": executor,
        "_executor_engine": executor_engine,
        "engine": completions,
        "engine-generate": generate,
        "router": Router(replicas),
        "_all": [completions, generate, *replicas],
    }


async def _teardown(ctx: Context) -> None:
    executor, executor_engine = ctx.engines.get("executor"), ctx.engines.get("_executor_engine")
    if executor is not None:
        stats = executor_engine.statistics()
        ctx.engine_retries += stats.retries + stats.stream_retries
        executor.run_coroutine(executor_engine.aclose())
        executor.destroy()
    for engine in ctx.engines.get("_all", []):
        stats = engine.statistics()
        ctx.engine_retries += stats.retries + stats.stream_retries
        await engine.aclose()


def _requests(tag: str, n: int, max_new_tokens: int) -> list[GenerateRequest]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    # Distinct prompts (so no two requests share a whole prompt in the prefix cache).
    return [
        GenerateRequest(f"{tag}-{i}", (1, 4 + i % 60, 4 + (i // 60) % 60, 20, 21), sampling)
        for i in range(n)
    ]


async def _measure(
    ctx: Context, names: list[str], rounds: int, n: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Trajectories/s and client CPU milliseconds per trajectory, per variant and round."""
    results: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: connections, server caches
        await VARIANTS[name](ctx, _requests(f"warm-{name}", min(n, ctx.concurrency), 4))
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            requests = _requests(f"{name}-{r}", n, ctx.max_new_tokens)
            started = time.perf_counter()
            cpu_started = time.process_time()
            tokens = await VARIANTS[name](ctx, requests)
            seconds = time.perf_counter() - started
            cpu[name].append(1000 * (time.process_time() - cpu_started) / n)
            if tokens != n * ctx.max_new_tokens:
                raise RuntimeError(f"{name}: {tokens} tokens, expected {n * ctx.max_new_tokens}")
            results[name].append(n / seconds)
    return results, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running vLLM server (default: start one)")
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")

    server = None
    url = args.url
    if url is None:
        from stalebound.engines.models import build_default_model
        from stalebound.engines.vllm_server import start_vllm_server

        root = Path(tempfile.mkdtemp(prefix="stalebound-bench-vllm-"))
        model = build_default_model(root / "model")
        print(f"starting a vLLM server (log {root / 'server.log'}) ...", flush=True)
        server = start_vllm_server(model, 0, log_path=root / "server.log")
        print(f"healthy after {server.startup_seconds:.0f} s at {server.url}", flush=True)
        url = server.url
    ctx = Context(url, "", args.concurrency, args.max_new_tokens)

    async def run() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        await _setup(ctx)
        try:
            return await _measure(ctx, names, args.rounds, args.trajectories)
        finally:
            await _teardown(ctx)

    try:
        results, cpu = asyncio.run(run())
    finally:
        if server is not None:
            server.stop()

    print(
        f"\n{args.trajectories} trajectories x {args.max_new_tokens} tokens, concurrency "
        f"{args.concurrency}, {args.rounds} rounds (median):"
    )
    # The ratio is to the fastest raw client, so that the engine is compared with the best a
    # hand-written client did in this run.
    raw = [statistics.median(results[n]) for n in names if n.startswith("raw")]
    base = max(raw) if raw else None
    print(
        f"{'variant':<16} {'traj/s':>8} {'tokens/s':>9} {'vs best raw':>14} "
        f"{'client CPU ms/traj':>19}   rounds (traj/s)"
    )
    for name in names:
        rate = statistics.median(results[name])
        ratio = f"{rate / base:.3f}" if base else "-"
        rounds = " ".join(f"{x:.1f}" for x in results[name])
        ms = statistics.median(cpu[name])
        print(
            f"{name:<16} {rate:>8.1f} {rate * args.max_new_tokens:>9.0f} {ratio:>14} "
            f"{ms:>19.2f}   {rounds}"
        )
    print(f"retried after a transport error: raw {ctx.raw_retries}, engines {ctx.engine_retries}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

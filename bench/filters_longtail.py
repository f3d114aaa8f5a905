"""The proactive filter on a long-tail workload: ``null`` vs ``retry`` vs ``truncate``, side by side.

A scripted engine generates tokens at a fixed rate; each request's length is drawn from a seeded
long-tail distribution (most short, a few running towards the length cap, like a reasoning model
that loops or an agent stuck in a tool loop). The k-th request for a prompt gets the same length in
every run, so the three methods see the same workload; a retried prompt draws fresh lengths. The
engine implements ``abort(request_id)``: it stops the request and returns the tokens generated so
far. A trainer loop takes batches with ``prepare_batch`` through the real ``WorkflowExecutor``,
"trains" for a fixed time and publishes the next version.

Reported per method: time the head buffer spent STUCK, wall time per step (median and total),
trajectories wasted (generated, or partly generated, and then thrown away: retried or surplus,
cancelled or already finished; the tokens column counts only what the aborts returned), the share of
trained trajectories that were truncated, and the largest staleness trained (never above η).

    PYTHONPATH=src python bench/filters_longtail.py [--steps 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from collections import Counter
from typing import Any

from stalebound.config import ProactiveFilterConfig, RolloutConfig
from stalebound.runtime import WorkflowExecutor


class LongTailEngine:
    """Generates ``length`` tokens at ``rate`` tokens/s per request; abortable."""

    def __init__(self, seed: int, rate: float, cap: int) -> None:
        self.seed = seed
        self.rate = rate
        self.cap = cap
        self.version = 0
        self.attempts: Counter[str] = Counter()
        self.running: dict[str, tuple[asyncio.Future[Any], asyncio.TimerHandle, float, int]] = {}

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    def length(self, prompt: str) -> int:
        k = self.attempts[prompt]
        self.attempts[prompt] += 1
        rng = random.Random(f"{self.seed}:{prompt}:{k}")
        if rng.random() < 0.04:  # the tail: runs to the length cap or close to it
            return min(self.cap, int(self.cap * rng.uniform(0.6, 1.2)))
        return min(self.cap, int(rng.lognormvariate(3.0, 0.5)))

    def _response(self, rid: str, tokens: int, version: int, reason: str) -> dict[str, Any]:
        return {
            "request_id": rid,
            "output_ids": [0] * tokens,
            "output_logprobs": [0.0] * tokens,
            "output_versions": [version] * tokens,
            "finish_reason": reason,
        }

    async def agenerate(self, request: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        rid, n = request["request_id"], self.length(request["prompt"])
        version = self.version
        future: asyncio.Future[Any] = loop.create_future()
        reason = "length" if n >= self.cap else "stop"
        done = self._response(rid, n, version, reason)
        handle = loop.call_later(n / self.rate, lambda: future.done() or future.set_result(done))
        self.running[rid] = (future, handle, loop.time(), version)
        try:
            return await future  # type: ignore[no-any-return]
        finally:
            handle.cancel()
            self.running.pop(rid, None)

    async def abort(self, request_id: str) -> dict[str, Any] | None:
        entry = self.running.pop(request_id, None)
        if entry is None:
            return None
        future, handle, start, version = entry
        handle.cancel()
        tokens = int((asyncio.get_running_loop().time() - start) * self.rate)
        partial = self._response(request_id, tokens, version, "abort")
        if not future.done():
            future.set_result(partial)
        return partial


_rids = itertools.count()


class Episode:
    async def arun_episode(self, engine: Any, prompt: str) -> dict[str, Any]:
        out = await engine.agenerate({"request_id": f"r{next(_rids)}", "prompt": prompt})
        return {
            "prompt": prompt,
            "tokens": len(out["output_ids"]),
            "versions": out["output_versions"],
            "finish_reason": out["finish_reason"],
        }


def run(method: str, args: argparse.Namespace) -> dict[str, float]:
    engine = LongTailEngine(args.seed, args.rate, args.cap)
    config = RolloutConfig(
        max_head_offpolicyness=args.eta,
        consumer_batch_size=args.batch,
        group_size=args.group,
        proactive_filter=ProactiveFilterConfig(
            method=method,  # type: ignore[arg-type]
            threshold=args.threshold,
            stuck_timeout_s=args.stuck_timeout,
        ),
        progress_log_s=None,
    )
    loader = [f"prompt-{i}" for i in range(10_000)]
    steps: list[float] = []
    trained: list[Any] = []
    with WorkflowExecutor(config, engine).initialize() as ex:
        start = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            batch = ex.prepare_batch(loader, Episode())
            time.sleep(args.train_s)  # the training step
            ex.set_version(ex.version)
            trained.extend(batch)
            steps.append(time.perf_counter() - t0)
        total = time.perf_counter() - start
        s = ex.statistics()
    wasted = sum(n for c, n in s.cancelled_members.items() if c in ("retried", "surplus"))
    wasted += sum(s.discarded_members.values())
    return {
        "stuck_s": s.stuck_seconds,
        "step_median_s": statistics.median(steps),
        "step_max_s": max(steps),
        "total_s": total,
        "wasted_traj": wasted,
        "wasted_tokens": sum(s.aborted_tokens.values()),
        "truncated_frac": sum(t.truncated for t in trained) / len(trained),
        "max_staleness": max(t.staleness for t in trained),
        "retried": s.retried_groups,
        "truncated": s.truncated_groups,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eta", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4, help="B, groups per step")
    parser.add_argument("--group", type=int, default=4, help="N, trajectories per group")
    parser.add_argument("--rate", type=float, default=400.0, help="tokens per second")
    parser.add_argument("--cap", type=int, default=800, help="length cap in tokens")
    parser.add_argument("--train-s", type=float, default=0.05)
    parser.add_argument("--threshold", type=int, default=2)
    parser.add_argument("--stuck-timeout", type=float, default=0.1)
    args = parser.parse_args()
    print(
        f"η={args.eta} B={args.batch} N={args.group} steps={args.steps} seed={args.seed}; "
        f"{args.rate:g} tok/s, lengths lognormal(3, 0.5) with a 4 % tail at the {args.cap}-token "
        f"cap; proactive threshold={args.threshold}, stuck_timeout_s={args.stuck_timeout:g}"
    )
    rows = {m: run(m, args) for m in ("null", "retry", "truncate")}
    header = (
        f"{'method':<9}{'STUCK s':>9}{'step med s':>11}{'step max s':>11}{'total s':>9}"
        f"{'wasted traj':>12}{'wasted tok':>11}{'truncated':>10}{'max stale':>10}"
    )
    print(header)
    for m, r in rows.items():
        print(
            f"{m:<9}{r['stuck_s']:>9.2f}{r['step_median_s']:>11.3f}{r['step_max_s']:>11.2f}"
            f"{r['total_s']:>9.2f}{int(r['wasted_traj']):>12}{int(r['wasted_tokens']):>11}"
            f"{r['truncated_frac']:>10.1%}{int(r['max_staleness']):>10}"
        )


if __name__ == "__main__":
    main()

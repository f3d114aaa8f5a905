"""Trajectories per second through the WorkflowExecutor with an engine that answers instantly.

This is the ceiling the executor itself imposes (admission, group tracking, batching, thread hops),
for both staleness policies. A trainer loop takes batches with ``prepare_batch`` and publishes a new
version after each one, as a real trainer would. Beside them, ``asyncio tasks`` is the bare cost of
one ``create_task`` + done callback per trajectory on the same machine: the floor any asyncio
executor pays. Wall-clock rates depend on what else the cores are doing; the CPU-time rate
(trajectories per CPU-second of this process, all threads) does much less.

    PYTHONPATH=src python bench/executor_overhead.py [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from stalebound.config import RolloutConfig
from stalebound.runtime import WorkflowExecutor


class InstantEngine:
    """Answers at once; its version is whatever the trainer last published."""

    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    async def agenerate(self, request: Any) -> dict[str, Any]:
        return {"prompt": request, "versions": (self.version,)}


class Workflow:
    async def arun_episode(self, engine: InstantEngine, data: Any) -> dict[str, Any]:
        return await engine.agenerate(data)


def run_raw(n: int) -> tuple[float, float]:
    """One asyncio task and done callback per trajectory, nothing else."""

    async def episode(x: int) -> dict[str, int]:
        return {"x": x}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        left = n

        def done(_: object) -> None:
            nonlocal left
            left -= 1
            if not left:
                finished.set_result(None)

        for i in range(n):
            loop.create_task(episode(i)).add_done_callback(done)
        await finished

    wall, cpu = time.perf_counter(), time.process_time()
    asyncio.run(main())
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def run_once(policy: str, steps: int, batch: int, group: int, eta: int) -> tuple[float, float]:
    config = RolloutConfig(
        staleness_policy=policy,  # type: ignore[arg-type]
        max_head_offpolicyness=eta,
        consumer_batch_size=batch,
        group_size=group,
        max_concurrent_rollouts=(eta + 1) * batch,  # the same window for both policies
    )
    engine = InstantEngine()
    executor = WorkflowExecutor(config, engine).initialize()
    dataloader = [list(range(batch))]
    workflow = Workflow()
    try:
        executor.prepare_batch(dataloader, workflow)  # warm-up: the loop and the first window
        executor.set_version(executor.version)
        n = 0
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            n += len(executor.prepare_batch(dataloader, workflow))
            executor.set_version(executor.version)  # "publish the new weights"
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        executor.destroy()
    return n / wall, n / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="consumer_batch_size (groups)")
    parser.add_argument("--group", type=int, default=4, help="group_size N")
    parser.add_argument("--eta", type=int, default=2)
    args = parser.parse_args()
    print(
        f"B={args.batch} groups x N={args.group} trajectories per step, eta={args.eta}, "
        f"{args.steps} steps, median of {args.repeats}"
    )
    print(f"{'policy':<15} {'traj/s wall':>12} {'(min':>9} {'max)':>9} {'traj/CPU-s':>12}")
    rows: list[tuple[str, list[tuple[float, float]]]] = []
    for policy in ("buffer", "capacity"):
        rows.append(
            (
                policy,
                [
                    run_once(policy, args.steps, args.batch, args.group, args.eta)
                    for _ in range(args.repeats)
                ],
            )
        )
    n = args.steps * args.batch * args.group
    rows.append(("asyncio tasks", [run_raw(n) for _ in range(args.repeats)]))
    for name, runs in rows:
        walls = [w for w, _ in runs]
        cpus = [c for _, c in runs]
        print(
            f"{name:<15} {statistics.median(walls):>12,.0f} {min(walls):>9,.0f} "
            f"{max(walls):>9,.0f} {statistics.median(cpus):>12,.0f}"
        )


if __name__ == "__main__":
    main()

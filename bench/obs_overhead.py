"""What observability costs a training loop, per call.

    python bench/obs_overhead.py [--calls N] [--repeats R]

Times RunLogger.log_step (20 metrics, 64 staleness values, with and without TensorBoard),
RunLogger.log_buffers (η + 1 = 5 rows, every sample different) and one LiveView render of
a window of 5 buffers at B′ = 64 and B′ = 4096. Prints the median over repeats in microseconds.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from collections.abc import Callable

from rich.console import Console

from stalebound.obs import BufferRow, LiveView, RunLogger

METRICS = {f"metric_{i}": 0.5 + i for i in range(20)}
STALENESS = [i % 3 for i in range(64)]


def per_call_us(fn: Callable[[int], object], calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def bench_logger(tensorboard: bool, calls: int, repeats: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp, RunLogger(tmp, tensorboard=tensorboard) as logger:
        step_us = per_call_us(
            lambda i: logger.log_step(METRICS, version=i, staleness=STALENESS), calls, repeats
        )
        rows = [BufferRow(v, 10, 5, 49, "PENDING") for v in range(5)]

        def sample(i: int) -> None:
            logger.log_buffers(
                None, 0, [*rows[:4], BufferRow(4, i % 64, 0, 64 - i % 64, "PENDING")]
            )

        buffers_us = per_call_us(sample, calls, repeats)
    return step_us, buffers_us


def bench_render(size: int, calls: int, repeats: int) -> float:
    console = Console(file=io.StringIO(), width=120, force_terminal=True)
    view = LiveView(console, staleness=4, live=False)
    third = size // 3
    rows = [BufferRow(v, third, third, size - 2 * third, "PENDING") for v in range(5)]
    view.update_buffers(rows, version=0)
    return per_call_us(lambda _: console.print(view.render()), calls, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    step_tb, buffers_us = bench_logger(True, args.calls, args.repeats)
    step_plain, _ = bench_logger(False, args.calls, args.repeats)
    render_small = bench_render(64, max(1, args.calls // 10), args.repeats)
    render_large = bench_render(4096, max(1, args.calls // 10), args.repeats)
    print(f"{'operation':<42} {'median µs/call':>15}")
    print(f"{'log_step, JSONL only':<42} {step_plain:>15.1f}")
    print(f"{'log_step, JSONL + TensorBoard':<42} {step_tb:>15.1f}")
    print(f"{'log_buffers (5 rows)':<42} {buffers_us:>15.1f}")
    print(f"{'LiveView render, 5 buffers x B′=64':<42} {render_small:>15.1f}")
    print(f"{'LiveView render, 5 buffers x B′=4096':<42} {render_large:>15.1f}")


if __name__ == "__main__":
    main()

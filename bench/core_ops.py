"""Reserve → occupy → consume cycles per second through the staleness buffer.

    python bench/core_ops.py [--trajectories N] [--repeats R]

Steady state at η = 4 and B′ = 1.25·B: every round reserves until the window is full, occupies the
oldest reservations until buffer v is ready, and consumes it (surplus reservations are aborted by
consume, as in a real run). One cycle is one trained trajectory, including its share of the
reservations that consume aborted. Prints the median over repeats with the range (fastest–slowest
repeat) and the ratio of medians to B = 64.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from stalebound import StalenessBuffer


def run_once(batch: int, eta: int, trajectories: int) -> tuple[float, int]:
    buf = StalenessBuffer(batch, eta, buffer_size=batch + batch // 4)
    pending: deque[int] = deque()
    next_id = 0
    trained = 0
    reserve, occupy, consume, ready = buf.try_reserve, buf.occupy, buf.consume, buf.ready
    start = time.perf_counter()
    while trained < trajectories:
        while reserve(next_id) is not None:
            pending.append(next_id)
            next_id += 1
        while not ready():
            gid = pending.popleft()
            if gid in buf:  # not aborted as surplus by an earlier consume
                occupy(gid)
        trained += len(consume().groups)
    return time.perf_counter() - start, trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--staleness", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for batch in (64, 512, 4096):
        per_cycle = []
        for _ in range(args.repeats):
            seconds, trained = run_once(batch, args.staleness, args.trajectories)
            per_cycle.append(seconds / trained * 1e6)
        rows.append((batch, statistics.median(per_cycle), min(per_cycle), max(per_cycle)))
    base = rows[0][1]
    print(
        f"staleness buffer, η = {args.staleness}, B′ = 1.25·B, {args.trajectories} trajectories "
        f"× {args.repeats} repeats (median, range)"
    )
    print(f"{'B':>6} {'cycles/s':>24} {'µs/cycle':>20} {'vs B=64':>8}")
    for batch, us, fast, slow in rows:
        rate = f"{1e6 / us:,.0f} ({1e6 / slow:,.0f}–{1e6 / fast:,.0f})"
        cost = f"{us:.2f} ({fast:.2f}–{slow:.2f})"
        print(f"{batch:>6} {rate:>24} {cost:>20} {us / base:>7.2f}×")


if __name__ == "__main__":
    main()

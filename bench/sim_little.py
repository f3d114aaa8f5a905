"""Why the reference preset caps staleness-bounded throughput: Little's law and the length tail.

Prints, for a workload (default ``reference``) and each η:

* ``E[L]``, ``E[max of N]`` (a group's length: its slowest member) and ``E[max of B·N]`` (a whole
  batch's slowest member), from the capped length distribution by numerical integration;
* the Little's-law ceiling for any policy that keeps at most (η + 1)·B groups in flight (both the
  capacity policy and the buffer with B′ = B): X ≤ (η + 1)·B·N ÷ W, with W the group latency
  at the fastest decode step (one active sequence) — an optimistic W, so a true upper bound;
* the straggler estimate for the plain buffer, whose head must wait for the slowest of the B·N
  trajectories reserved in it: X ≈ (η + 1)·B·N ÷ (E[max of B·N]·step), capped by the bound;
* ``too slow``: the share of groups that cannot finish within η train steps even at the fastest
  decode step — what a per-trajectory bound must wait for, truncate or throw away when the
  trainer runs at its full rate.

    PYTHONPATH=src python bench/sim_little.py [--preset reference] [--staleness 0 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import math

from stalebound.sim.config import DistributionConfig, load_preset
from stalebound.sim.simulator import compute_bound
from stalebound.sim.workload import Z99


def cdf(d: DistributionConfig, x: float) -> float:
    """The capped lognormal's CDF."""
    if d.cap is not None and x >= d.cap:
        return 1.0
    if x <= 0:
        return 0.0
    mu = math.log(d.median)
    sigma = (math.log(d.p99) - mu) / Z99
    return 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))


def expected_max(d: DistributionConfig, k: int, steps: int = 20000) -> float:
    """E[max of k draws] = ∫ (1 − F(x)^k) dx over [0, cap], by the midpoint rule."""
    top = d.cap if d.cap is not None else d.p99 * 50
    h = top / steps
    return sum((1 - cdf(d, (i + 0.5) * h) ** k) * h for i in range(steps))


def too_slow(d: DistributionConfig, n: int, tokens: float) -> float:
    """P(a group's slowest member needs more than ``tokens`` tokens)."""
    return 1 - cdf(d, tokens) ** n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="reference")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    args = ap.parse_args()
    cfg = load_preset(args.preset)
    if cfg.lengths.distribution != "lognormal":
        raise SystemExit("this analysis handles lognormal lengths only")
    b = compute_bound(cfg)
    B, N = cfg.batch.groups, cfg.batch.group_size
    e = cfg.engine
    fast = e.step_base + e.step_per_seq  # one active sequence
    full = e.step_base + e.step_per_seq * e.max_concurrency
    mean = b.mean_length
    group = expected_max(cfg.lengths, N)
    batch = expected_max(cfg.lengths, B * N)
    print(
        f"workload {cfg.name}: bound {b.value:.2f} traj/s "
        f"(generation {b.generation:.2f}, training {b.training:.2f})"
    )
    print(
        f"E[L] = {mean:,.0f} tokens, E[max of {N}] = {group:,.0f}, "
        f"E[max of {B * N}] = {batch:,.0f} (cap {cfg.lengths.cap:,.0f})"
    )
    print(f"decode step {1000 * fast:.1f} ms (1 active) … {1000 * full:.1f} ms (full)")
    w = group * fast
    print(f"group latency W ≥ {w:.0f} s; a train step is {cfg.trainer.step_time:.0f} s\n")
    print(
        f"{'η':>3} {'in flight':>10} {'Little X ≤':>11} {'÷ bound':>8} "
        f"{'buffer X ≈':>11} {'÷ bound':>8} {'too slow':>9}"
    )
    for eta in args.staleness:
        in_flight = (eta + 1) * B
        little = min(b.value, in_flight * N / w)
        straggler = min(b.value, in_flight * N / (batch * fast))
        print(
            f"{eta:>3} {in_flight:>10} {little:>11.2f} {little / b.value:>8.2f} "
            f"{straggler:>11.2f} {straggler / b.value:>8.2f} "
            f"{too_slow(cfg.lengths, N, eta * cfg.trainer.step_time / fast):>9.1%}"
        )
    need = math.ceil(0.9 * b.value * w / (B * N)) - 1
    print(f"\nη needed for Little's ceiling ≥ 0.9 of the bound: η ≥ {need}")


if __name__ == "__main__":
    main()

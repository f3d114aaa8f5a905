"""Simulator scale: 10,000 concurrent generation slots and 1,000,000 trajectories.

Runs the ``buffer`` policy on a reference-like workload scaled to 100 replicas × 100 sequences,
B = 128 groups of N = 8, for enough train steps to train at least ``--trajectories`` trajectories,
and prints the wall time, events per second and trajectories per second of wall time.

    PYTHONPATH=src python bench/sim_scale.py [--trajectories 1000000] [--policy buffer] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time

from stalebound.sim.config import workload_from_dict
from stalebound.sim.simulator import POLICIES, Simulation

WORKLOAD = {
    "name": "scale",
    "lengths": {"distribution": "lognormal", "median": 2000, "p99": 20000, "cap": 32768},
    "engine": {"replicas": 100, "max_concurrency": 100, "step_base": 0.02, "step_per_seq": 0.0001},
    "batch": {"groups": 128, "group_size": 8},
    "trainer": {"step_time": 8.0},
    "proactive": {"threshold": 32},
    "run": {"warmup_fraction": 0.1},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=1_000_000)
    ap.add_argument("--policy", default="buffer", choices=POLICIES)
    ap.add_argument("--staleness", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="print the top functions by time")
    args = ap.parse_args()
    cfg = workload_from_dict(WORKLOAD)
    per_step = cfg.batch.groups * cfg.batch.group_size
    steps = math.ceil(args.trajectories / per_step)
    sim = Simulation(cfg, args.policy, args.staleness, seed=args.seed, steps=steps)
    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    cpu_started = time.process_time()
    if profiler:
        profiler.enable()
    result = sim.run()
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    slots = cfg.engine.replicas * cfg.engine.max_concurrency
    launched = result.counts.get("launched", 0)
    print(f"policy {args.policy}, η = {args.staleness}, {slots} slots, {steps} steps")
    print(f"peak slots in use     {slots - sim.min_free_slots:>12,}")
    print(f"trajectories trained  {result.counts.get('trained', 0):>12,}")
    print(f"trajectories launched {launched:>12,}")
    print(f"events                {result.events:>12,}")
    print(f"virtual time          {result.sim_time:>12,.0f} s")
    print(f"wall time             {wall:>12.1f} s")
    print(f"CPU time              {cpu:>12.1f} s  (less than wall when the cores are shared)")
    print(f"events/s              {result.events / wall:>12,.0f}")
    print(f"trajectories/s (wall) {launched / wall:>12,.0f}")
    print(
        f"throughput            {result.throughput:>12.2f} traj/s virtual "
        f"(efficiency {result.efficiency:.3f})"
    )
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()

"""The deadline policy against AReaL's capacity policy on the simulator's presets.

Runs ``capacity``, ``deadline`` (η_h = 2η_s), ``deadline-tight`` (η_h = η_s) and ``deadline-abort``
(η_h = 2η_s, abort at the deadline) at η_s ∈ {2, 4, 8}, seeds 0–2, on ``reference`` and
``agentic``, appending one JSON line per run to ``--out``; ``--table`` prints the Markdown tables
of docs/deadline.md from such a file (medians over seeds, [min–max]; throughput ratios are per
seed against capacity on the same seed and η_s).

    python bench/sim_deadline.py --out deadline.jsonl
    python bench/sim_deadline.py --table deadline.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

POLICIES = ("capacity", "deadline", "deadline-tight", "deadline-abort")
HARD = {"capacity": "η_s", "deadline": "2η_s", "deadline-tight": "η_s", "deadline-abort": "2η_s"}


def run(out: str, presets: list[str], etas: list[int], seeds: list[int]) -> None:
    from stalebound.sim.config import load_preset
    from stalebound.sim.simulator import policy_spec, simulate

    with open(out, "a") as f:
        for preset in presets:
            cfg = load_preset(preset)
            for eta in etas:
                for seed in seeds:
                    for policy in POLICIES:
                        t = time.time()
                        # the hard bound that pairs with the soft target η_s = eta
                        hard = policy_spec(policy).hard_bound(eta)
                        r = simulate(cfg, policy, hard, seed=seed)
                        row = {
                            "preset": preset,
                            "eta_s": eta,
                            "seed": seed,
                            "policy": policy,
                            "throughput": r.throughput,
                            "mean": r.staleness_mean,
                            "max": r.staleness_max,
                            "violations": r.violations,
                            "truncated_fraction": r.truncated_fraction,
                            "wasted_fraction": r.wasted_fraction,
                            "tokens": r.tokens,
                            "wall": time.time() - t,
                        }
                        f.write(json.dumps(row) + "\n")
                        f.flush()


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def table(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    cap = {
        (r["preset"], r["eta_s"], r["seed"]): r["throughput"]
        for r in rows
        if r["policy"] == "capacity"
    }
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["preset"], r["eta_s"], r["policy"])].append(r)
    for preset in dict.fromkeys(r["preset"] for r in rows):
        print(f"\n**{preset}** (medians of seeds 0–2 [min–max])\n")
        print(
            "| η_s | policy | η_h | traj/s | × capacity | mean staleness | max staleness | "
            "violations | % traj. truncated | % tokens truncated | % tokens wasted |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for eta in sorted({r["eta_s"] for r in rows if r["preset"] == preset}):
            for policy in POLICIES:
                rs = groups.get((preset, eta, policy))
                if not rs:
                    continue
                ratio = [r["throughput"] / cap[(preset, eta, r["seed"])] for r in rs]
                ttok = [100 * r["tokens"]["truncated"] / r["tokens"]["trained"] for r in rs]
                hard = {"–": "–", "2η_s": str(2 * eta), "η_s": str(eta)}[HARD[policy]]
                print(
                    f"| {eta} | {policy} | {hard} | {_spread([r['throughput'] for r in rs], '.2f')} "
                    f"| {_spread(ratio, '.3f')} | {_spread([r['mean'] for r in rs], '.2f')} "
                    f"| {max(r['max'] for r in rs)} | {sum(r['violations'] for r in rs)} "
                    f"| {_spread([100 * r['truncated_fraction'] for r in rs], '.1f')} "
                    f"| {_spread(ttok, '.1f')} "
                    f"| {_spread([100 * r['wasted_fraction'] for r in rs], '.2f')} |"
                )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="append one JSON line per run to this file")
    p.add_argument("--table", help="print the Markdown tables from this file")
    p.add_argument("--preset", action="append", default=None)
    p.add_argument("--eta", type=int, action="append", default=None)
    p.add_argument("--seed", type=int, action="append", default=None)
    a = p.parse_args()
    if a.out:
        run(a.out, a.preset or ["reference", "agentic"], a.eta or [2, 4, 8], a.seed or [0, 1, 2])
    if a.table:
        table(a.table)
    if not (a.out or a.table):
        p.print_usage(sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

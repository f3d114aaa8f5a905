"""A large JSONL trains without being held in memory: start-up time and peak memory of
`stalebound train data.path=BIG.jsonl` against the same run on a file of 100 rows.

    python bench/data_stream.py            # a 2 GB file (written once into --dir, reused)
    python bench/data_stream.py --gb 0.2   # quicker

Each run is `stalebound train` for 2 steps in a child process; printed are its wall time to the
end of step 1 (from the step log) and its peak resident memory (the child's ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_rows(path: Path, target_bytes: int) -> int:
    """Word problems with capitals and newlines until the file holds ``target_bytes``."""
    rows = 0
    with path.open("w", encoding="utf-8") as f:
        while f.tell() < target_bytes:
            a, b = rows % 9 + 1, rows % 7 + 1
            rec = {
                "question": f"Row {rows}: Tom has {a} apples.\nHe buys {b} more. How many?",
                "answer": str(a + b),
                "notes": "x" * 200,  # a wide column, as real data has
            }
            f.write(json.dumps(rec) + "\n")
            rows += 1
    return rows


def train(data: Path, run_dir: Path) -> tuple[float, float, float]:
    """(seconds to the first step's log line, seconds in all, peak RSS in MiB) of one run."""
    cmd = [
        sys.executable, "-m", "stalebound", "train", f"data.path={data}", "task.reward=numeric",
        "task.max_new_tokens=4", "train.warm_start_steps=0", "rollout.consumer_batch_size=8",
        "rollout.group_size=2", "run.steps=2", "run.eval_prompts=4", "run.live=false",
        "run.plots=false", "run.tensorboard=false", "run.checkpoint=false",
        f"run.run_dir={run_dir}",
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    first = float("nan")
    assert proc.stdout is not None
    for line in proc.stdout:
        if first != first and re.match(r"step 1\b", line):
            first = time.perf_counter() - start
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    total = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return first, total, max(peak, before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the large file (GB)")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "stalebound-bench"))
    args = parser.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    big = work / f"big-{args.gb:g}GB.jsonl"
    if not big.is_file() or big.stat().st_size < args.gb * 1e9:
        t = time.perf_counter()
        n = write_rows(big, int(args.gb * 1e9))
        print(f"wrote {big} ({n:,} rows) in {time.perf_counter() - t:.0f} s")
    small = work / "small.jsonl"
    write_rows(small, 100 * 300)
    # the small run first: children's ru_maxrss is a running maximum
    rows = []
    for name, path in (("100 rows", small), (f"{big.stat().st_size / 1e9:.1f} GB", big)):
        with tempfile.TemporaryDirectory() as d:
            rows.append((name, *train(path, Path(d) / "run")))
    print(f"{'data':>10} {'to step 1 (s)':>14} {'in all (s)':>11} {'peak RSS (MiB)':>15}")
    for name, first, total, peak in rows:
        print(f"{name:>10} {first:>14.1f} {total:>11.1f} {peak:>15.0f}")


if __name__ == "__main__":
    main()

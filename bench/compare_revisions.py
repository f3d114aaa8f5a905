"""Run a bench script under two revisions of ``src``, alternately, and print the ratio of medians.

    python bench/compare_revisions.py REV [--rounds 5] [--match TEXT] -- bench/core_ops.py [ARGS]

``REV`` (any git revision, e.g. ``main``) is exported with ``git archive`` into a temporary
directory; each round runs the bench once with ``PYTHONPATH`` at REV's ``src`` and once at this
working tree's, in alternating order, so both see the same load. Every number on each output
line whose text contains ``--match`` (all lines with numbers by default) is collected by its
position; the medians of each revision and their ratio (this tree / REV) are printed. Absolute
figures depend on the machine's load; the ratios measured side by side do much less.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def export(rev: str, into: Path) -> Path:
    """REV's ``src`` under ``into``."""
    archive = into / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def figures(output: str, match: str) -> dict[tuple[str, int], float]:
    """Every number of each line containing ``match``, keyed by (the line's first word — its
    row, e.g. ``buffer`` or ``64`` — and the number's position after it)."""
    found = {}
    for line in output.splitlines():
        words = line.split(maxsplit=1)
        if match not in line or len(words) < 2:
            continue
        label, numbers = words[0], _NUMBER.findall(words[1])
        for i, n in enumerate(numbers):
            found[(label, i)] = float(n.replace(",", ""))
    return found


def run(src: Path, command: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, *command], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the revision to compare against, e.g. main")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--match", default="", help="only lines containing this text")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("name the bench after --, e.g. -- bench/core_ops.py")
    with tempfile.TemporaryDirectory() as tmp:
        sources = {args.rev: export(args.rev, Path(tmp)), "this tree": ROOT / "src"}
        seen: dict[str, defaultdict[tuple[str, int], list[float]]] = {
            name: defaultdict(list) for name in sources
        }
        for r in range(args.rounds):
            order = list(sources) if r % 2 == 0 else list(reversed(sources))
            for name in order:
                for key, value in figures(run(sources[name], command), args.match).items():
                    seen[name][key].append(value)
    base, new = seen[args.rev], seen["this tree"]
    print(f"{' '.join(command)}: medians of {args.rounds} rounds, {args.rev} vs this tree")
    print(f"{'row':<14} {'#':>2} {args.rev:>14} {'this tree':>14} {'ratio':>7}")
    for (label, i), values in base.items():
        if (label, i) not in new or not statistics.median(values):
            continue
        a, b = statistics.median(values), statistics.median(new[(label, i)])
        print(f"{label:<14} {i:>2} {a:>14,.2f} {b:>14,.2f} {b / a:>7.3f}")


if __name__ == "__main__":
    main()

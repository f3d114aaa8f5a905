"""The fault-injection suite's tally, printed at the end of the session.

Each scenario reports the faults it injected, the runs it resumed, the items its audit accounted
for and the staleness violations it found; ``make test-faults`` prints the totals (and writes them
as JSON to ``$STALEBOUND_FAULTS_REPORT`` when that is set).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import pytest

TALLY: dict[str, Any] = {
    "faults": Counter(),
    "runs": 0,
    "resumed": 0,
    "items": 0,
    "violations": 0,
    "failures_reported": 0,
}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TALLY["runs"]:
        return
    faults = TALLY["faults"]
    tr = terminalreporter
    tr.section("fault injection")
    rows = [
        *sorted(faults.items()),
        ("faults injected", sum(faults.values())),
        ("training processes run", TALLY["runs"]),
        ("runs resumed from a checkpoint", TALLY["resumed"]),
        ("failures reported clearly", TALLY["failures_reported"]),
        ("items accounted for exactly once", TALLY["items"]),
        ("staleness violations", TALLY["violations"]),
    ]
    width = max(len(kind) for kind, _ in rows)
    for kind, n in rows:
        tr.write_line(f"  {kind:<{width}} {n}")
    path = os.environ.get("STALEBOUND_FAULTS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({**TALLY, "faults": dict(faults)}, f, indent=1)


@pytest.fixture(scope="session")
def tally() -> dict[str, Any]:
    return TALLY

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
    for kind, n in sorted(faults.items()):
        tr.write_line(f"  {kind:<46} {n}")
    tr.write_line(f"  {'faults injected':<46} {sum(faults.values())}")
    tr.write_line(f"  {'training processes run':<46} {TALLY['runs']}")
    tr.write_line(f"  {'runs resumed from a checkpoint':<46} {TALLY['resumed']}")
    tr.write_line(f"  {'failures reported clearly':<46} {TALLY['failures_reported']}")
    tr.write_line(f"  {'items accounted for exactly once':<46} {TALLY['items']}")
    tr.write_line(f"  {'staleness violations':<46} {TALLY['violations']}")
    path = os.environ.get("STALEBOUND_FAULTS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({**TALLY, "faults": dict(faults)}, f, indent=1)


@pytest.fixture(scope="session")
def tally() -> dict[str, Any]:
    return TALLY

"""Regenerate the sample files shipped in src/stalebound/tasks/data/ (seeded, deterministic).

    PYTHONPATH=src python scripts/make_task_data.py

Each built-in task writes ``<name>.jsonl`` with seed 0 and its default settings, except that
``arithmetic`` uses operands of 1 to 2 digits: 2000 records for ``arithmetic`` and ``strings``,
1000 for ``calculator``. One JSON object per line with ``id``,
``question``, ``answer`` and the task's extra fields.
"""

from __future__ import annotations

import json
from pathlib import Path

from stalebound.tasks import TaskConfig, make_task

SIZES = {"arithmetic": 2000, "strings": 2000, "calculator": 1000}
OUT = Path(__file__).resolve().parent.parent / "src" / "stalebound" / "tasks" / "data"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, n in SIZES.items():
        config = TaskConfig(name=name)
        config.arithmetic.max_digits = 2
        task = make_task(config)
        lines = []
        for s in task.generate_samples(n, seed=0):
            rec = {"id": s.id, "question": s.question, "answer": s.answer, **s.data}
            lines.append(json.dumps(rec, sort_keys=True))
        (OUT / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

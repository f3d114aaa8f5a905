"""Inject one cause of idle time at a time into a short real run and print what the doctor names.

Each row trains the embedded default for a few steps with one cause injected, runs
``stalebound.obs.doctor`` on it and prints the cause it names the largest, that cause's share of
the trainer's idle time less its start-up, the injected delay's share of that idle time, and the
simulator's predicted gain of the setting that moves it, calibrated on the run (the
docs/doctor.md table). The injections:

* a constant 1 s reward (η = 1): the delay is 1 s for each step after the first;
* η = 0: the delay is the steps' waits (after the first) beyond the uninjected row's;
* a 0.5 s sleep before each weight publication: 0.5 s for each step;
* a long tail of generation lengths (the ``strings`` task's ``copy`` of log-normal words, as in
  ``configs/bench-longtail.yaml``, at the recipe's η = 4): the delay is the steps' waits beyond
  those of the same run with every word of the median length;
* processes spinning on the core the training thread is pinned to (``os.sched_setaffinity``,
  Linux): the delay is the steps' training time (``step_time_s``) beyond the uninjected row's.

Absolute seconds depend on the machine and its load.

    .venv/bin/python bench/doctor_injected.py [--steps 6] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalebound.cli import main as stalebound
from stalebound.obs.doctor import diagnose
from stalebound.obs.records import load_run
from stalebound.sim.whatif import predict_gain
from stalebound.train.recipe import TrainRecipe
from stalebound.train.trainer import Trainer

SHORT = Path(__file__).resolve().parent / "doctor_short.yaml"
PUBLISH_DELAY_S = 0.5
REWARD_DELAY_S = 1.0
HOGS = 2
"""Processes spinning on the training thread's core: it runs about a third of the time."""


@contextlib.contextmanager
def slow_publication() -> Iterator[None]:
    send = TrainRecipe._send_weights

    def slow(self: TrainRecipe, state_dict: Any, version: int) -> None:
        time.sleep(PUBLISH_DELAY_S)
        send(self, state_dict, version)

    TrainRecipe._send_weights = slow  # type: ignore[method-assign]
    try:
        yield
    finally:
        TrainRecipe._send_weights = send  # type: ignore[method-assign]


@contextlib.contextmanager
def hog_on_trainer_core(hogs: int = HOGS) -> Iterator[int]:
    """Spin ``hogs`` processes on one core and pin the training thread to it during each step
    (the thread only: the engines keep every core). Yields the core."""
    mine = os.sched_getaffinity(0)
    core = max(mine)
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(hogs)]
    step = Trainer.step

    def pinned(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        os.sched_setaffinity(0, {core})  # on Linux, pid 0 is the calling thread
        try:
            return step(self, *args, **kwargs)
        finally:  # what the thread starts between steps is not pinned
            os.sched_setaffinity(0, mine)

    Trainer.step = pinned  # type: ignore[method-assign]
    try:
        yield core
    finally:
        Trainer.step = step  # type: ignore[method-assign]
        for proc in procs:
            proc.kill()
            proc.wait()


def _sum(run: Path, key: str, first: int) -> float:
    return sum(float(r[key]) for r in load_run(run).steps if int(r["step"]) >= first)


def beyond(key: str, first: int) -> Callable[[Path, Path], float]:
    """The injected delay as the run's ``key`` seconds (steps from ``first``) beyond the same
    seconds of its baseline run."""
    return lambda run, baseline: _sum(run, key, first) - _sum(baseline, key, first)


def per_step(seconds: float, first: int) -> Callable[[Path, Path], float]:
    """The injected delay as ``seconds`` for each step from ``first``."""
    return lambda run, baseline: (
        seconds * sum(1 for r in load_run(run).steps if int(r["step"]) >= first)
    )


DEFAULT = "none (the default, η = 4)"
SHORT_WORDS = "strings, every word 2 letters (η = 4)"
LONG_TAIL = [
    "task.name=strings",
    "task.partial_credit=true",
    "task.max_new_tokens=208",
    "task.strings.operations=[copy]",
    "task.reward_latency.distribution=none",
    "train.micro_batch_tokens=4096",  # micro-batches of like length: training costs its tokens
    "rollout.staleness=4",
]


@dataclass
class Row:
    name: str
    cause: str | None = None
    """The cause injected."""
    overrides: list[str] = field(default_factory=list)
    hook: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    delay: Callable[[Path, Path], float] | None = None
    """The injected seconds, from the run and its baseline's."""
    baseline: str = DEFAULT
    """The row the injection is measured against (the same run without it)."""
    shown: bool = True
    """``False`` for a row that is only another row's baseline."""


ROWS = [
    Row(DEFAULT),
    Row(
        f"reward {REWARD_DELAY_S:g} s (η = 1)",
        "reward wait",
        [
            "rollout.staleness=1",
            "task.reward_latency.distribution=constant",
            f"task.reward_latency.median_s={REWARD_DELAY_S}",
        ],
        delay=per_step(REWARD_DELAY_S, 2),  # the first step's reward wait is its start-up
    ),
    Row("η = 0", "admission bound", ["rollout.staleness=0"], delay=beyond("wait_s", 2)),
    Row(
        f"publication +{PUBLISH_DELAY_S:g} s",
        "publication",
        hook=slow_publication,
        delay=per_step(PUBLISH_DELAY_S, 1),  # every step publishes
    ),
    Row(
        SHORT_WORDS,
        overrides=[*LONG_TAIL, "task.strings.max_length=2", "task.strings.min_length=2"],
        shown=False,
    ),
    Row(
        "long tail: strings, log-normal words (η = 4)",
        "generation",
        [
            *LONG_TAIL,
            "task.strings.lengths=lognormal",
            "task.strings.median_length=2.0",
            "task.strings.sigma=1.4",
            "task.strings.max_length=200",
        ],
        delay=beyond("wait_s", 2),
        baseline=SHORT_WORDS,
    ),
    Row(
        f"{HOGS} processes spinning on the trainer's core",
        "CPU contention",
        hook=hog_on_trainer_core,
        delay=beyond("step_time_s", 1),
    ),
]


def _movable_idle(trainer: dict[str, float]) -> float:
    return sum(v for k, v in trainer.items() if k not in ("start-up", "unexplained"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="run only the rows whose name holds one of these (and the baselines)",
    )
    parser.add_argument("--no-predict", action="store_true", help="skip the simulator's column")
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        ROWS.remove(ROWS[-1])
        print(
            "(no os.sched_setaffinity here: the row of the hog on the trainer's core is left out)"
        )
    print(
        "| injected | named largest | its share of the trainer's idle | injected share | "
        "with the cause's own time | predicted gain |"
    )
    print("|---|---|---|---|---|---|")
    runs: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for number, row in enumerate(ROWS):
            baseline = number == 0 or not row.shown  # run for the rows measured against them
            if args.only is not None and not baseline and not any(w in row.name for w in args.only):
                continue
            run = Path(tmp) / f"run{number}"
            with row.hook():
                code = stalebound(
                    [
                        "train",
                        str(SHORT),
                        f"run.steps={args.steps}",
                        f"run.run_dir={run}",
                        f"engine.cache_dir={tmp}/models",
                        *row.overrides,
                    ]
                )
            if code:
                raise SystemExit(code)
            runs[row.name] = run
            if row.shown:
                print(_row(row, run, runs[row.baseline], predict=not args.no_predict), flush=True)


def _row(row: Row, run: Path, baseline: Path, *, predict: bool) -> str:
    """The table's row: the named cause and its share; the injected seconds' share, alone and
    with the cause's own seconds in the baseline run (what the named share also counts)."""
    d = diagnose(run)
    idle = _movable_idle(d.trainer)
    largest = d.largest or "none (trainer-bound)"
    share = f"{d.trainer[d.largest] / idle:.2f}" if d.largest and idle else "–"
    alone = together = "–"
    if row.delay is not None and row.cause is not None and idle:
        injected = max(0.0, row.delay(run, baseline))
        own = diagnose(baseline).trainer.get(row.cause, 0.0)
        alone = f"{min(1.0, injected / idle):.2f}"
        together = f"{min(1.0, (injected + own) / idle):.2f}"
    prediction = predict_gain(run, d.largest) if d.largest and predict else None
    gain = f"{prediction.change}: {prediction.gain:+.0%}" if prediction else "–"
    return f"| {row.name} | {largest} | {share} | {alone} | {together} | {gain} |"


if __name__ == "__main__":
    main()

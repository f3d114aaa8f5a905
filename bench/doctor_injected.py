"""Inject one cause of idle time at a time into a short real run and print what the doctor names.

Each row trains the embedded default for a few steps with one cause injected (none; a constant
1 s reward; η = 0; a 0.5 s sleep before each weight publication), runs ``stalebound.obs.doctor``
on it and prints the cause it names the largest, that cause's share of the trainer's idle time
less its start-up, the injected delay's share of that idle time where the injection is a delay,
and the simulator's predicted gain of the setting that moves it, calibrated on the run (the
docs/doctor.md table). Absolute seconds depend on the machine and its load.

    .venv/bin/python bench/doctor_injected.py [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalebound.cli import main as stalebound
from stalebound.obs.doctor import diagnose
from stalebound.sim.whatif import predict_gain
from stalebound.train.recipe import TrainRecipe

SHORT = Path(__file__).resolve().parent / "doctor_short.yaml"
PUBLISH_DELAY_S = 0.5
REWARD_DELAY_S = 1.0


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


ROWS: list[tuple[str, list[str], float | None]] = [  # name, overrides, delay per step
    ("none (the default, η = 4)", [], None),
    (
        f"reward {REWARD_DELAY_S:g} s (η = 1)",
        [
            "rollout.staleness=1",
            "task.reward_latency.distribution=constant",
            f"task.reward_latency.median_s={REWARD_DELAY_S}",
        ],
        REWARD_DELAY_S,
    ),
    ("η = 0", ["rollout.staleness=0"], None),
    (f"publication +{PUBLISH_DELAY_S:g} s", [], PUBLISH_DELAY_S),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(
        "| injected | named largest | its share of the trainer's idle | injected share | "
        "predicted gain |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for number, (name, overrides, delay) in enumerate(ROWS):
            run = Path(tmp) / f"run{number}"
            hook = (
                slow_publication() if name.startswith("publication") else contextlib.nullcontext()
            )
            with hook:
                code = stalebound(
                    [
                        "train",
                        str(SHORT),
                        f"run.steps={args.steps}",
                        f"run.run_dir={run}",
                        f"engine.cache_dir={tmp}/models",
                        *overrides,
                    ]
                )
            if code:
                raise SystemExit(code)
            d = diagnose(run)
            idle = sum(v for k, v in d.trainer.items() if k not in ("start-up", "unexplained"))
            largest = d.largest or "none (trainer-bound)"
            share = f"{d.trainer[d.largest] / idle:.2f}" if d.largest and idle else "–"
            # every step publishes; the first step's reward wait is its start-up
            paid = args.steps if name.startswith("publication") else args.steps - 1
            injected = f"{min(1.0, delay * paid / idle):.2f}" if delay and idle else "–"
            prediction = predict_gain(run, d.largest) if d.largest else None
            gain = f"{prediction.change}: {prediction.gain:+.0%}" if prediction else "–"
            print(f"| {name} | {largest} | {share} | {injected} | {gain} |", flush=True)


if __name__ == "__main__":
    main()

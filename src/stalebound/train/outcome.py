"""How a run of the main job ends: the result it measured, the errors that stop it (each naming the
checkpoint to continue from), and the signal handling that asks it to stop after a step."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from stalebound.core import StaleboundError

__all__ = [
    "RunDirectoryError",
    "StopNow",
    "StopRequest",
    "TrainResult",
    "TrainingFailed",
    "TrainingInterrupted",
    "Where",
]


@dataclass(frozen=True)
class TrainResult:
    """What a run measured; ``run_training`` also writes it to ``RUN_DIR/summary.json``."""

    run_dir: str
    steps: int
    staleness: int
    policy: str
    eval_before: float
    """Greedy accuracy on the evaluation prompts after warm start, before RL."""
    eval_after: float
    """Greedy accuracy after RL."""
    reward_first: float
    """Mean training reward of the first 5 steps."""
    reward_last: float
    """Mean training reward of the last 5 steps."""
    max_staleness: int
    """The largest staleness of any trained token's trajectory (≤ η under the buffer policy)."""
    violations: int
    """Trained groups staler than η, as the staleness policy counts them (always 0 under the
    buffer policy)."""
    wall_s: float
    """Wall time of the RL phase (engines started to last step)."""
    trajectories_per_s: float
    trainer_idle_fraction: float
    engine_idle_fraction: float
    time_to_target_s: float | None
    warm_start_s: float


def _continue_hint(run_dir: Path, checkpoint: Path | None) -> str:
    """How to continue the run in ``run_dir`` (from ``checkpoint``, its newest, if any)."""
    from stalebound.train.checkpoint import resume_target

    # the checkpoint a resume will use is the one on disk: a signal can cut the job short
    # between putting a checkpoint in place and taking note of it
    checkpoint = resume_target(run_dir) or checkpoint
    if checkpoint is None:
        return (
            "no checkpoint was written yet, so start it again from the beginning with: "
            f"stalebound train resume={run_dir}"
        )
    return f"continue from {checkpoint} with: stalebound train resume={run_dir}"


class RunDirectoryError(StaleboundError, OSError):
    """The run directory could not be written (a full disk, say); the message names the last
    checkpoint to continue from."""


class TrainingFailed(StaleboundError, RuntimeError):
    """The run stopped on an error; the message ends with the checkpoint to continue from."""


class TrainingInterrupted(StaleboundError, RuntimeError):
    """SIGTERM or SIGINT stopped the run: after a step, with a checkpoint of that step, or — a
    second signal — at once (``at_once``), the newest checkpoint being the one to continue from."""

    def __init__(
        self,
        signum: int,
        step: int,
        run_dir: Path,
        checkpoint: Path | None,
        *,
        at_once: bool = False,
    ) -> None:
        from stalebound.train.checkpoint import resume_target

        self.signum = signum
        self.step = step
        self.run_dir = run_dir
        self.checkpoint = resume_target(run_dir) or checkpoint
        self.at_once = at_once
        name = signal.Signals(signum).name
        how = "stopped at once" if at_once else "stopped"
        super().__init__(
            f"{name} received: {how} after step {step}; {_continue_hint(run_dir, checkpoint)}"
        )


@dataclass
class Where:
    """How far the run got: the last step trained and the newest checkpoint written (what a
    message about an interruption or a failure names)."""

    run_dir: Path
    step: int = 0
    checkpoint: Path | None = None

    def hint(self) -> str:
        return _continue_hint(self.run_dir, self.checkpoint)


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: stop at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received twice")
        self.signum = signum


class StopRequest:
    """The first SIGTERM/SIGINT asks the job to stop after the current step (with a
    checkpoint); a second one interrupts at once (:class:`StopNow`), and so does the first one
    within :meth:`at_once`."""

    def __init__(self, console: Console) -> None:
        self.signum: int | None = None
        self._console = console
        self._previous: dict[int, Any] = {}
        self._at_once = False

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Within: the first signal stops at once too — for a wait that has no step to finish
        (for the servers to answer, for the engines to start)."""
        before, self._at_once = self._at_once, True
        try:
            yield
        finally:
            self._at_once = before

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None or self._at_once:
            raise StopNow(signum)
        self.signum = signum
        self._console.print(
            f"[yellow]{signal.Signals(signum).name}: stopping after this step, with a "
            "checkpoint (send it again to stop at once)[/]"
        )

"""``stalebound doctor RUN_DIR``: where a run's idle time went, cause by cause.

The trainer is idle whenever it is not computing a training step: waiting for its batch,
publishing the new weights, writing a checkpoint, or between steps. The engines are idle whenever
no episode is generating. The run's records place both on one clock: each step's
``wait_start_s``, ``wait_s``, ``step_and_publish_s``, ``publish_s`` and ``checkpoint_s``
(metrics.jsonl) and each episode's start, end and reward wait (the trace). The doctor cuts the
run into the intervals between those events and gives every interval of idle time one cause
(:data:`CAUSES`), so the causes sum to the idle time, per step and in total. The engines' idle
time the engines' own meter measured (``engine_idle_fraction``) and the trace does not explain is
reported as ``unexplained``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from stalebound.core.errors import ConfigError
from stalebound.obs.records import load_run
from stalebound.obs.trace import TrajectoryRecord, on_trace_clock, read_run_trace, run_traces

__all__ = [
    "CAUSES",
    "DOCTOR_PNG",
    "Cause",
    "Diagnosis",
    "Prediction",
    "diagnose",
    "plot_diagnosis",
    "register",
    "run_doctor",
]

DOCTOR_PNG = "doctor.png"


@dataclass(frozen=True)
class Cause:
    """One cause of idle time: its name, what it means, and the setting that moves it."""

    name: str
    meaning: str
    setting: str


CAUSES: dict[str, Cause] = {
    c.name: c
    for c in (
        Cause(
            "start-up",
            "the first step of the run (and of each resume) waits for a whole batch generated "
            "from nothing",
            "none: paid once per start",
        ),
        Cause(
            "generation",
            "the batch's episodes were still generating (the group's longest member, or too "
            "little engine throughput for the trainer)",
            "engine.replicas (more engines) or rollout.deadline.target (cut the longest members)",
        ),
        Cause(
            "reward wait",
            "the batch's last episode waited for its reward (the trainer), or no episode was "
            "generating and some waited for their reward (the engines)",
            "task.reward_workers (score in parallel), or a larger rollout.staleness so other "
            "episodes generate meanwhile",
        ),
        Cause(
            "admission bound",
            "the staleness bound admitted no work until the trainer published: the engines had "
            "nothing to do during the step, and the trainer then waited for episodes started "
            "only after it",
            "rollout.staleness (a larger η admits the next batches while the trainer steps)",
        ),
        Cause(
            "publication",
            "the new weights were being published to the engines",
            "engine.weight_transfer (cuda_ipc when trainer and engines share a GPU)",
        ),
        Cause(
            "CPU contention",
            "the trainer's training thread was runnable but not running during its step: "
            "another process, or the engines' threads, held its core (the step's wall time "
            "less its CPU time)",
            "give the trainer a core of its own: fewer engine.replicas on a CPU, nothing else "
            "running on the machine, or the engines on a GPU",
        ),
        Cause(
            "checkpoint",
            "a checkpoint was being written",
            "run.checkpoint_every_steps / run.checkpoint_every_s (checkpoint less often)",
        ),
        Cause(
            "filtering and refills",
            "nothing was generating while the trainer waited, in a step whose groups were "
            "filtered out and replaced",
            "rollout.filter_groups / rollout.proactive_filter (filter less, or earlier)",
        ),
        Cause(
            "aborts and retries",
            "nothing was generating while the trainer waited, in a step that aborted, dropped "
            "or retried groups",
            "rollout.deadline.action / rollout.proactive_filter.max_retries",
        ),
        Cause(
            "executor loop",
            "nothing was generating and nothing waited for a reward while the trainer waited: "
            "the executor's own latency in starting the next episodes",
            "rollout.max_concurrent_rollouts (keep more episodes in flight)",
        ),
        Cause(
            "bookkeeping",
            "between two steps: the trainer logged the step and its ledger",
            "run.live / obs.loggers (what each step writes)",
        ),
        Cause(
            "unexplained",
            "engine idle time the engines' meter measured and the trace does not place (for "
            "example time in tool calls, or episodes aborted before they were recorded)",
            "none",
        ),
    )
}

_UNMOVABLE = ("start-up", "unexplained")
"""Causes no setting moves: never named the largest."""
_TRAINER_BOUND = 0.1
"""Below this share of the run's time in idle time a setting moves, the trainer is the
bottleneck: the engines' idle time is spare capacity, not what slows the run."""
_REFILL_COUNTERS = ("filtered_groups",)
_ABORT_COUNTERS = ("retried_groups", "dropped_groups", "failed_groups", "aborted_tokens")
_ADMISSION_SHARE = 0.25
"""The share of a step's training time the engines must have spent held by the admission bound
for the trainer's next wait to count as the bound's."""


@dataclass
class StepDiagnosis:
    """One step's idle seconds by cause, for the trainer and for the engines."""

    step: int
    span_s: float
    trainer: dict[str, float] = field(default_factory=dict)
    engines: dict[str, float] = field(default_factory=dict)


@dataclass
class Diagnosis:
    """A run's idle time by cause (:func:`diagnose`)."""

    run_dir: str
    window_s: float
    trainer_busy_s: float
    steps: list[StepDiagnosis]
    trainer: dict[str, float]
    engines: dict[str, float]
    engines_measured_s: float | None
    resumed_at: list[int]

    @property
    def trainer_idle_s(self) -> float:
        return sum(self.trainer.values())

    @property
    def engine_idle_s(self) -> float:
        return sum(self.engines.values())

    @property
    def movable_idle_s(self) -> float:
        """The trainer's idle seconds a setting moves (all but start-up)."""
        return sum(v for k, v in self.trainer.items() if k not in _UNMOVABLE)

    @property
    def trainer_bound(self) -> bool:
        """The trainer computed nearly all the time: no idle time of its is worth moving."""
        return self.movable_idle_s < _TRAINER_BOUND * self.window_s

    @property
    def largest(self) -> str | None:
        """The largest cause of the trainer's idle time that a setting moves: what each step's
        time waits on beyond the training itself. ``None`` when the run is trainer-bound."""
        return None if self.trainer_bound else _largest(self.trainer)

    @property
    def engines_largest(self) -> str | None:
        """The largest cause of the engines' idle time that a setting moves."""
        return _largest(self.engines)

    def to_json(self) -> dict[str, Any]:
        largest = self.largest
        return {
            "run_dir": self.run_dir,
            "window_s": _r(self.window_s),
            "resumed_at": self.resumed_at,
            "trainer": {
                "busy_s": _r(self.trainer_busy_s),
                "idle_s": _r(self.trainer_idle_s),
                "causes": _rounded(self.trainer),
            },
            "engines": {
                "idle_s": _r(self.engine_idle_s),
                "measured_idle_s": (
                    None if self.engines_measured_s is None else _r(self.engines_measured_s)
                ),
                "causes": _rounded(self.engines),
            },
            "trainer_bound": self.trainer_bound,
            "largest": largest,
            "setting": CAUSES[largest].setting if largest else None,
            "engines_largest": self.engines_largest,
            "predicted_gain": None,
            "steps": [
                {
                    "step": s.step,
                    "span_s": _r(s.span_s),
                    "trainer": _rounded(s.trainer),
                    "engines": _rounded(s.engines),
                }
                for s in self.steps
            ],
        }


def _largest(causes: Mapping[str, float]) -> str | None:
    movable = {k: v for k, v in causes.items() if k not in _UNMOVABLE and v > 0}
    return max(movable, key=lambda k: movable[k]) if movable else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _r(x: float) -> float:
    return round(x, 6)


def _rounded(d: Mapping[str, float]) -> dict[str, float]:
    return {k: _r(v) for k, v in d.items() if v}


@dataclass(frozen=True)
class _Step:
    step: int
    wait_start: float
    wait_end: float
    publish_start: float
    end: float
    checkpoint_before: float
    contention: float
    """Seconds of the training the training thread was runnable but not running."""
    refills: bool
    aborts: bool
    engine_idle_fraction: float | None

    @property
    def training_s(self) -> float:
        return self.publish_start - self.wait_end

    @property
    def contended_from(self) -> float:
        """The training's last :attr:`contention` seconds are placed as the contention's."""
        return self.publish_start - self.contention


def _steps(rows: Sequence[Mapping[str, Any]], run_dir: str) -> list[_Step]:
    steps: list[_Step] = []
    previous: Mapping[str, Any] = {}
    trained = 0.0
    for row in rows:
        trained += _number(row.get("num_trajectories")) or 0.0
        rate = _number(row.get("trajectories_per_s"))
        start = _number(row.get("wait_start_s"))
        wait, both = _number(row.get("wait_s")), _number(row.get("step_and_publish_s"))
        if start is None and rate and wait is not None and both is not None:
            # a run recorded before wait_start_s: the rate is cumulative from the run's start,
            # so trained ÷ rate is the step's end (the calibration reads it the same way)
            start = trained / rate - both - wait
        if start is None or wait is None or both is None:
            missing = [
                k
                for k in ("wait_start_s", "wait_s", "step_and_publish_s")
                if _number(row.get(k)) is None
            ]
            raise ConfigError(
                f"run_dir={run_dir!r}: step {row.get('step')} of metrics.jsonl has no "
                f"{', '.join(missing)}; the doctor reads the step timing stalebound train "
                "records: give a run directory it wrote"
            )
        # on the trace's clock, so an episode that began as the trainer's wait did begins with it
        start = on_trace_clock(start)
        wait_end = on_trace_clock(start + wait)
        end = on_trace_clock(wait_end + both)
        publish = row.get("publish_s")
        if not isinstance(publish, int | float):
            publish = max(0.0, float(row["step_and_publish_s"]) - float(row.get("step_time_s", 0)))

        def rose(
            names: Sequence[str],
            row: Mapping[str, Any] = row,
            previous: Mapping[str, Any] = previous,
        ) -> bool:
            return any(float(row.get(n) or 0) > float(previous.get(n) or 0) for n in names)

        idle = row.get("engine_idle_fraction")
        publish_start = on_trace_clock(max(wait_end, end - float(publish)))
        steps.append(
            _Step(
                step=int(row["step"]),
                wait_start=start,
                wait_end=wait_end,
                publish_start=publish_start,
                end=end,
                checkpoint_before=float(row.get("checkpoint_s") or 0.0),
                contention=_contention(row, publish_start - wait_end),
                refills=rose(_REFILL_COUNTERS),
                aborts=rose(_ABORT_COUNTERS),
                engine_idle_fraction=float(idle) if isinstance(idle, int | float) else None,
            )
        )
        previous = row
    return steps


def _contention(row: Mapping[str, Any], training_s: float) -> float:
    """The step's training seconds its thread was not running: ``step_time_s`` less
    ``step_cpu_s`` (0 for a run that did not record them, or a GPU's NaN)."""
    wall, cpu = _number(row.get("step_time_s")), _number(row.get("step_cpu_s"))
    if wall is None or cpu is None or not math.isfinite(cpu):
        return 0.0
    return min(max(0.0, wall - cpu), max(0.0, training_s))


class _Episodes:
    """How many episodes generate, and how many wait for their reward, at a time."""

    def __init__(self, records: Sequence[TrajectoryRecord]) -> None:
        gen = [(r.start, max(r.start, r.end - r.reward_latency)) for r in records]
        self.gen_starts = sorted(a for a, _ in gen)
        self.gen_ends = sorted(b for _, b in gen)
        self.reward_starts = self.gen_ends
        self.reward_ends = sorted(r.end for r in records)
        self.points = sorted({*self.gen_starts, *self.gen_ends, *self.reward_ends})
        self.by_end = sorted(
            (r.end, max(r.start, r.end - r.reward_latency), r.start) for r in records
        )
        self.ends = [e for e, _, _ in self.by_end]

    def last_before(self, t: float) -> tuple[float, float, float] | None:
        """``(end, generation end, start)`` of the episode that ended last at or before ``t``:
        the one a batch ready at ``t`` waited for."""
        i = bisect.bisect_right(self.ends, t)
        return self.by_end[i - 1] if i else None

    def generating(self, t: float) -> int:
        return bisect.bisect_right(self.gen_starts, t) - bisect.bisect_right(self.gen_ends, t)

    def rewarding(self, t: float) -> int:
        return bisect.bisect_right(self.reward_starts, t) - bisect.bisect_right(self.reward_ends, t)


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Split a run directory's idle time into causes (:data:`CAUSES`); ``ConfigError`` when the
    directory lacks the records it needs."""
    folder = str(run_dir)
    data = load_run(run_dir)
    if not data.steps:
        raise ConfigError(
            f"run_dir={folder!r}: no training steps in metrics.jsonl; give the directory of a "
            "run of stalebound train that trained at least one step"
        )
    if not run_traces(run_dir):
        raise ConfigError(
            f"run_dir={folder!r}: no episode trace (trace.jsonl); the doctor needs the run "
            "trained with run.trace=true (the default)"
        )
    steps = _steps(data.steps, folder)
    episodes = _Episodes(read_run_trace(run_dir))
    resumed = sorted(k for k, _ in run_traces(run_dir) if k > 0)
    return _attribute(folder, steps, episodes, resumed)


def _attribute(
    folder: str, steps: list[_Step], episodes: _Episodes, resumed: list[int]
) -> Diagnosis:
    begin, finish = steps[0].wait_start, steps[-1].end
    marks = [begin, finish]
    for s in steps:
        marks += [s.wait_start, s.wait_end, s.contended_from, s.publish_start, s.end]
        marks.append(max(begin, s.wait_start - s.checkpoint_before))
    marks += [t for t in episodes.points if begin < t < finish]
    cuts = sorted({t for t in marks if begin <= t <= finish})
    per_step = [StepDiagnosis(s.step, 0.0) for s in steps]
    ends = [s.end for s in steps]
    held = [0.0] * len(steps)  # engine seconds the admission bound held, per step's training
    firsts = {k for k, s in enumerate(steps) if k == 0 or s.step - 1 in resumed}
    busy = 0.0
    for a, b in pairwise(cuts):
        if b <= a:
            continue
        mid = (a + b) / 2
        k = min(bisect.bisect_left(ends, mid), len(steps) - 1)
        s, d = steps[k], per_step[k]
        d.span_s += b - a
        gen, rew = episodes.generating(mid), episodes.rewarding(mid)
        phase = _phase(s, mid)
        if phase == "train":
            busy += b - a
        elif phase == "wait":
            bound = k > 0 and held[k - 1] > _ADMISSION_SHARE * steps[k - 1].training_s
            cause = "start-up" if k in firsts else _waited_for(s, episodes, mid, gen, rew, bound)
            _add(d.trainer, cause, b - a)
        else:
            _add(d.trainer, _OUTSIDE_THE_WAIT[phase], b - a)
        if gen:
            continue
        if phase == "contention":  # the engines idle then for what idles them in training
            phase = "train"
        if phase in _OUTSIDE_THE_WAIT:
            engine_cause = _OUTSIDE_THE_WAIT[phase]
        elif rew:
            engine_cause = "reward wait"
        elif phase == "train":
            engine_cause = "admission bound"
            held[k] += b - a
        else:
            engine_cause = "start-up" if k in firsts else _executor(s)
        _add(d.engines, engine_cause, b - a)
    measured = _measured_engine_idle(steps, resumed)
    engines = _total(d.engines for d in per_step)
    if measured is not None:
        engines["unexplained"] = measured - sum(engines.values())
    return Diagnosis(
        run_dir=folder,
        window_s=finish - begin,
        trainer_busy_s=busy,
        steps=per_step,
        trainer=_total(d.trainer for d in per_step),
        engines=engines,
        engines_measured_s=measured,
        resumed_at=resumed,
    )


_OUTSIDE_THE_WAIT = {
    "contention": "CPU contention",
    "publish": "publication",
    "checkpoint": "checkpoint",
    "between": "bookkeeping",
}
"""The cause of idle time in each of the trainer's phases but its wait and its training."""


def _phase(s: _Step, t: float) -> str:
    """What the trainer of step ``s`` did at ``t`` (a time within the step's span)."""
    if s.wait_start <= t < s.wait_end:
        return "wait"
    if s.wait_end <= t < s.contended_from:
        return "train"
    if s.contended_from <= t < s.publish_start:
        return "contention"
    if s.publish_start <= t < s.end:
        return "publish"
    if s.wait_start - s.checkpoint_before <= t < s.wait_start:
        return "checkpoint"
    return "between"


def _waited_for(s: _Step, episodes: _Episodes, t: float, gen: int, rew: int, bound: bool) -> str:
    """Why the trainer still waited at ``t`` for the batch of ``s``: for the episode that ended
    last before the batch was ready, its generation or its reward; before that episode began,
    what the engines did. Generation of episodes the admission bound held back (``bound``: it
    held the engines idle during the previous step's training) is the bound's."""
    last = episodes.last_before(s.wait_end)
    if last is not None and last[0] > s.wait_start and t >= last[2]:
        end, gen_end, start = last
        if t >= end:
            return _executor(s)  # the batch was complete: the executor handed it over
        if t >= gen_end:
            return "reward wait"
        return "admission bound" if bound and start >= s.wait_start else "generation"
    if gen:
        return "admission bound" if bound else "generation"
    return "reward wait" if rew else _executor(s)


def _executor(s: _Step) -> str:
    if s.aborts:
        return "aborts and retries"
    if s.refills:
        return "filtering and refills"
    return "executor loop"


def _add(d: dict[str, float], cause: str, seconds: float) -> None:
    d[cause] = d.get(cause, 0.0) + seconds


def _total(parts: Any) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for cause, seconds in part.items():
            _add(total, cause, seconds)
    return {name: total[name] for name in CAUSES if name in total}


def _measured_engine_idle(steps: Sequence[_Step], resumed: Sequence[int]) -> float | None:
    """The engines' idle seconds by their own meter over the steps, summed over the run's
    segments (the meter starts again at each resume); ``None`` without the metric."""
    segments: list[list[_Step]] = [[]]
    for s in steps:
        if segments[-1] and s.step - 1 in resumed:
            segments.append([])
        segments[-1].append(s)
    total = 0.0
    for segment in segments:
        fraction = segment[-1].engine_idle_fraction
        if fraction is None or not math.isfinite(fraction):
            return None
        total += fraction * (segment[-1].end - segment[0].wait_start)
    return total


def plot_diagnosis(diagnosis: Diagnosis, out_dir: str | Path) -> Path:
    """``doctor.png``: each step's idle seconds by cause, the trainer's above, the engines'
    below (stacked bars)."""
    from stalebound.obs.plots import _figure, _save

    fig, (top, bottom) = _figure(rows=2, height_ratios=(1, 1), sharex=True)
    xs = [s.step for s in diagnosis.steps]
    colours = {name: f"C{i}" for i, name in enumerate(CAUSES)}
    for ax, side, title in (
        (top, "trainer", "trainer idle (s)"),
        (bottom, "engines", "engines idle (s)"),
    ):
        base = [0.0] * len(xs)
        for name in CAUSES:
            ys = [max(0.0, getattr(s, side).get(name, 0.0)) for s in diagnosis.steps]
            if any(ys):
                ax.bar(xs, ys, bottom=base, color=colours[name], label=name, width=0.85)
                base = [b + y for b, y in zip(base, ys, strict=True)]
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper right", fontsize="x-small", ncol=2)
    largest = diagnosis.largest
    named = largest or "none (trainer-bound)"
    top.set_title(f"idle time by cause; the trainer's largest: {named}")
    bottom.set_xlabel("training step")
    return _save(fig, Path(out_dir) / DOCTOR_PNG)


@dataclass(frozen=True)
class Prediction:
    """The simulator's figure for a change of setting, calibrated on the run itself."""

    change: str
    """The change simulated, as ``key=value`` (or what was taken away)."""
    throughput: float
    """Predicted trajectories/s with the change."""
    baseline: float
    """Predicted trajectories/s of the run as it was (the same calibration and seed)."""

    @property
    def gain(self) -> float:
        """The predicted speed-up with the change: 0.25 is 25 % more trajectories/s."""
        return self.throughput / self.baseline - 1 if self.baseline > 0 else 0.0


Predictor = Callable[[str, Sequence[str]], Mapping[str, Prediction | None]]
"""``predictor(run_dir, causes)``: the simulator's figure for the setting that moves each of
``causes``, ``None`` for a cause it does not model a setting of
(:func:`stalebound.sim.whatif.predict_gains`; the command line passes it in, so this layer does
not load the simulator)."""


def register(subparsers: Any, predictor: Predictor | None = None) -> None:
    """Add the ``doctor`` command to an ``argparse`` sub-parser collection; ``--predict`` needs
    ``predictor``."""
    parser = subparsers.add_parser(
        "doctor",
        help="split a run's idle time into causes and name the setting that moves the largest",
        description=(
            "Split the trainer's and the engines' idle time in RUN_DIR into causes (waiting for "
            "generation or rewards, the admission bound, weight publication, checkpoints, "
            "filtering, aborts, the executor's loop), per step and in total, from its "
            "metrics.jsonl and episode trace; name the largest cause and the setting that "
            "moves it; draw RUN_DIR/doctor.png (docs/doctor.md)."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by a run")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--steps", action="store_true", help="print the table of every step")
    parser.add_argument("--no-plot", action="store_true", help=f"do not draw {DOCTOR_PNG}")
    parser.add_argument(
        "--predict",
        action="store_true",
        help=(
            "calibrate the simulator on the run and predict the gain of the setting that moves "
            "each cause (slower)"
        ),
    )
    parser.set_defaults(func=run_doctor, predictor=predictor)


def run_doctor(args: Any) -> int:
    """``stalebound doctor``: exit 0 with the diagnosis, 2 on a directory it cannot read."""
    import sys

    from stalebound.core.errors import StaleboundError

    try:
        diagnosis = diagnose(args.run_dir)
    except StaleboundError as exc:
        print(f"stalebound doctor: {exc}", file=sys.stderr)
        return 2
    written = None
    if not args.no_plot:
        try:
            written = plot_diagnosis(diagnosis, args.run_dir)
        except ImportError as exc:
            print(
                f"stalebound doctor: no plot ({exc}): pip install 'stalebound[obs]'",
                file=sys.stderr,
            )
        except OSError as exc:
            print(f"stalebound doctor: no plot ({exc.strerror or exc})", file=sys.stderr)
    predictions: Mapping[str, Prediction | None] = {}
    why = "pass --predict to simulate it on the run's calibration"
    causes = [k for k, v in diagnosis.trainer.items() if k not in _UNMOVABLE and v > 0]
    if args.predict and causes and args.predictor is not None:
        why = "the simulator does not model a setting of it"
        try:
            predictions = args.predictor(args.run_dir, causes)
        except StaleboundError as exc:
            why = f"the run cannot be calibrated: {exc}"
    largest = diagnosis.largest
    prediction = predictions.get(largest) if largest is not None else None
    if args.json:
        report = diagnosis.to_json()
        report["predicted_gain"] = _prediction_json(prediction)
        if args.predict:
            report["predictions"] = {c: _prediction_json(predictions.get(c)) for c in causes}
        print(json.dumps(report, indent=2))
        return 0
    _print(diagnosis, every_step=args.steps, plot=written, prediction=prediction, why=why)
    if args.predict and predictions:
        _print_predictions(diagnosis, causes, predictions)
    return 0


def _prediction_json(p: Prediction | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {
        "change": p.change,
        "gain": _r(p.gain),
        "trajectories_per_s": _r(p.throughput),
        "baseline_trajectories_per_s": _r(p.baseline),
    }


def _print_predictions(
    d: Diagnosis, causes: Sequence[str], predictions: Mapping[str, Prediction | None]
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="the setting of each cause, and the simulator's predicted gain")
    for column in ("cause", "trainer s", "setting", "simulated", "gain"):
        table.add_column(column, justify="right" if column in ("trainer s", "gain") else "left")
    for cause in sorted(causes, key=lambda c: -d.trainer[c]):
        p = predictions.get(cause)
        table.add_row(
            cause,
            f"{d.trainer[cause]:.2f}",
            CAUSES[cause].setting,
            "not modelled" if p is None else p.change,
            "" if p is None else f"{p.gain:+.0%}",
        )
    Console().print(table)


def _print(
    diagnosis: Diagnosis,
    *,
    every_step: bool,
    plot: Path | None,
    prediction: Prediction | None,
    why: str,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    d = diagnosis
    table = Table(title=f"idle time by cause: {d.run_dir} ({d.window_s:.1f} s of steps)")
    table.add_column("cause")
    table.add_column("trainer s", justify="right")
    table.add_column("share", justify="right")
    table.add_column("engines s", justify="right")
    table.add_column("share", justify="right")
    for name in CAUSES:
        t, e = d.trainer.get(name), d.engines.get(name)
        if t is None and e is None:
            continue
        table.add_row(
            name,
            _seconds(t),
            _share(t, d.trainer_idle_s),
            _seconds(e),
            _share(e, d.engine_idle_s),
        )
    table.add_row(
        "[bold]idle[/]",
        f"{d.trainer_idle_s:.2f}",
        _share(d.trainer_idle_s, d.window_s),
        f"{d.engine_idle_s:.2f}",
        _share(d.engine_idle_s, d.window_s),
        end_section=True,
    )
    console.print(table)
    if every_step:
        steps = Table(title="per step: the largest cause of each side's idle time")
        for column in ("step", "span s", "trainer idle s", "trainer's largest", "engines idle s"):
            steps.add_column(column, justify="left" if "largest" in column else "right")
        steps.add_column("engines' largest")
        for s in d.steps:
            steps.add_row(
                str(s.step),
                f"{s.span_s:.2f}",
                f"{sum(s.trainer.values()):.2f}",
                _top(s.trainer),
                f"{sum(s.engines.values()):.2f}",
                _top(s.engines),
            )
        console.print(steps)
    largest = d.largest
    if largest is None:
        console.print(
            f"the run is trainer-bound: the trainer computed {d.trainer_busy_s / d.window_s:.0%} "
            f"of the time and waited on settings for {d.movable_idle_s:.2f} s only; its speed "
            "is the trainer's (train.micro_batch_tokens, train.device), and the engines' idle "
            "time is spare capacity (fewer engine.replicas)",
            highlight=False,
        )
    else:
        seconds = d.trainer[largest]
        console.print(
            f"largest cause of the trainer's idle time: [bold]{largest}[/] ({seconds:.2f} s, "
            f"{seconds / d.trainer_idle_s:.0%} of it): {CAUSES[largest].meaning}",
            highlight=False,
        )
        console.print(f"the setting that moves it: {CAUSES[largest].setting}", highlight=False)
        if prediction is None:
            console.print(f"no predicted gain: {why}", highlight=False)
        else:
            console.print(
                f"predicted by the simulator calibrated on this run: {prediction.change} → "
                f"{prediction.gain:+.0%} trajectories/s ({prediction.baseline:.1f} → "
                f"{prediction.throughput:.1f})",
                highlight=False,
            )
    engines = d.engines_largest
    if engines is not None:
        console.print(
            f"the engines' idle time, largest: {engines} ({d.engines[engines]:.2f} s of "
            f"{d.engine_idle_s:.2f} s)",
            highlight=False,
        )
    if d.resumed_at:
        console.print(f"resumed at step {', '.join(map(str, d.resumed_at))}", highlight=False)
    if plot is not None:
        console.print(f"wrote {plot}", highlight=False)


def _seconds(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _share(x: float | None, total: float) -> str:
    return "" if x is None or total <= 0 else f"{x / total:.0%}"


def _top(d: Mapping[str, float]) -> str:
    shown = {k: v for k, v in d.items() if v > 0}
    return max(shown, key=lambda k: shown[k]) if shown else ""

"""Calibration: fit a workload to what a real ``stalebound train`` run recorded, and check it.

:func:`calibrate` reads a run directory — ``config.yaml`` (B, N, η, the policy, the engines),
``trace.jsonl`` and each resume's trace (each episode: start, end, tokens, tool and reward waits),
``metrics.jsonl`` (each step: train time, publish time, wait, trained tokens) and
``staleness.jsonl`` — and fits:

* **lengths**, **tool latency**, **reward latency**: the recorded values, as empirical
  distributions (files of values next to the workload file); the lengths a group to a line, as
  the trace recorded its groups (:func:`_groups`), since a prompt's answers are long or short
  together and a group waits for its longest;
* **the engine**: from what its decode steps cost as the embedded engine timed them
  (``engine-steps/``, :mod:`stalebound.engines.steplog`): the cost of a forward pass, of a row and
  of a cache position, and each request's admission (:func:`_fit_logged_engine`). A run without
  step logs (older runs, servers, Ray's engines): each time bin of the trace lasts ``prefill ×
  joins + step_base × decode steps + step_per_seq × tokens + …`` — the replica model's cost,
  summed — fitted by non-negative least squares of the residuals relative to each bin's length,
  then scaled so the bins add up to the measured busy time (:func:`_fit_engine`);
* **the trainer**: each step's training time against its trained tokens and the seconds of it
  during which the engines generated (``step_time``, ``per_token``, ``contention``), the
  bookkeeping added to ``step_time``; the publication against the episodes that started during it
  (``publish``, ``publish_per_start``);
* **failures**: failed members ÷ members launched;
* **the closure**: the run is simulated once as fitted; the median step's wait it does not
  explain is the hand-over (``trainer.handoff``: collating and handing the batch over), and the
  busy time per step it lacks moves ``step_time``.

:func:`measure` reads the run's own figures over the same window the simulator measures (after
the first ``warmup_fraction`` of the steps), and :func:`predict` simulates a run directory's policy
and η under a calibrated workload, so the two can be set side by side.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from stalebound.core.deadline import deadline_bounds
from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.engines.cohorts import COHORT_PADDING_SLOTS
from stalebound.engines.devices import resolve_device
from stalebound.engines.steplog import STEP_LOG_DIR, read_step_logs
from stalebound.obs.records import METRICS_FILE, STALENESS_FILE, StalenessHistogram, read_jsonl
from stalebound.obs.trace import (
    TRACE_FILE,
    TrajectoryRecord,
    read_run_trace,
    read_trace_header,
    run_traces,
)
from stalebound.runtime.config import AREAL_STALENESS_NAME
from stalebound.sim.cohorts import Cohort, Cohorts
from stalebound.sim.config import (
    AgentConfig,
    BatchConfig,
    DistributionConfig,
    EngineConfig,
    FailureConfig,
    ProactiveConfig,
    RunConfig,
    TrainerConfig,
    WorkloadConfig,
    workload_from_dict,
)
from stalebound.sim.replay import decode_steps, id_key
from stalebound.sim.simulator import POLICIES, SimResult, policy_spec, simulate

__all__ = [
    "Calibration",
    "Fit",
    "Measured",
    "RunInfo",
    "calibrate",
    "deadline_spec",
    "measure",
    "predict",
    "read_run_info",
    "write_workload",
]

MAX_SLOWED = 0.9
"""The most of the engines' generating time a step's training can be lengthened by (a fitted
``trainer.contention`` of at most 9)."""

MAX_IN_FLIGHT = 65536
"""Engine slots per replica when the run set no limit (the engine queues what it cannot batch)."""


@dataclass(frozen=True)
class Fit:
    """One fitted value: its workload key, value, unit and how well the model fits the data."""

    key: str
    value: float
    unit: str
    error: str


@dataclass(frozen=True)
class RunInfo:
    """What a run directory's ``config.yaml`` says about the run."""

    policy: str
    staleness: int
    """The hard bound η_h (``rollout.staleness``)."""
    target: int | None
    """The soft target η_s of a ``deadline`` run; ``None`` for the other policies."""
    groups: int
    group_size: int
    steps: int
    replicas: int
    max_batch: int | None
    max_in_flight: int | None
    max_concurrent_groups: int | None
    cohort_padding: int | None = None
    """The embedded engine's cohort merge budget when it ran on a CPU (``engine.kind: local`` and
    the device its trace's header records; a run written before headers recorded it:
    ``engine.device`` ``cpu``, or ``auto`` resolved on the calibrating machine); ``None``: one
    batch."""


@dataclass(frozen=True)
class Measured:
    """A run's figures over its measuring window (the steps after the warm-up)."""

    trajectories_per_s: float
    trainer_idle: float
    engine_idle: float
    staleness_mean: float
    staleness_histogram: Mapping[int, int]
    step_s: float
    steps: int


@dataclass(frozen=True)
class Calibration:
    """A fitted workload, its fits, and the run it came from."""

    workload: WorkloadConfig
    fits: tuple[Fit, ...]
    run: RunInfo
    lengths: tuple[float, ...]
    tool_latencies: tuple[float, ...]
    reward_latencies: tuple[float, ...]
    source: str = ""
    """The run directory it was fitted from."""
    length_groups: tuple[tuple[float, ...], ...] = ()
    """``lengths`` by the group they were generated in (:func:`_groups`); empty: each on its own."""


# ----------------------------------------------------------------------------- reading


def _need_file(run_dir: Path, name: str) -> Path:
    path = run_dir / name
    if not path.is_file():
        raise ConfigError(
            f"calibrate={str(run_dir)!r}: no {name} there; give the directory of a finished "
            "`stalebound train` run (with run.trace=true)"
        )
    return path


STEP_KEYS = (
    "num_trajectories",
    "trajectories_per_s",
    "trainer_idle_fraction",
    "engine_idle_fraction",
    "wait_s",
    "step_time_s",
    "step_and_publish_s",
    "num_trained_tokens",
)
"""The step metrics calibration reads from ``metrics.jsonl``; ``failed_members`` too when there
(a run that failed no member may not write it)."""

_DAMAGED = "the run directory is damaged; calibrate from one a `stalebound train` run wrote"


def _records(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The records of ``run_dir/name`` (a JSON-lines file the run wrote)."""
    try:
        return list(read_jsonl(_need_file(run_dir, name)))
    except ProtocolError as exc:
        raise ConfigError(f"calibrate: {exc}") from None


def _steps(run_dir: Path) -> list[dict[str, float]]:
    """The step records of ``metrics.jsonl``, each with the :data:`STEP_KEYS` as numbers and
    ``elapsed``: seconds from the start of the run to the end of the step (the metrics are
    cumulative from the start, so elapsed = trajectories trained ÷ trajectories/s)."""
    path = run_dir / METRICS_FILE
    steps = []
    trained = 0.0
    for number, row in enumerate(_records(run_dir, METRICS_FILE), 1):
        step = {}
        for key in (*STEP_KEYS, "failed_members"):
            value = row.get(key, 0 if key == "failed_members" else None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(
                    f"calibrate: {path} step {number}: {key}={value!r}: must be a number ≥ 0; "
                    + _DAMAGED
                )
            step[key] = float(value)
        if step["trajectories_per_s"] <= 0:
            raise ConfigError(
                f"calibrate: {path} step {number}: trajectories_per_s=0: must be > 0 after a "
                "trained step; " + _DAMAGED
            )
        cpu = row.get("step_cpu_s")
        # the training thread's CPU seconds, where the run measured them (one torch thread on a
        # CPU); NaN where it did not
        step["step_cpu_s"] = (
            float(cpu)
            if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and cpu > 0
            else float("nan")
        )
        trained += step["num_trajectories"]
        step["elapsed"] = trained / step["trajectories_per_s"]
        steps.append(step)
    return steps


def deadline_spec(deadline: dict[str, Any], hard: int) -> tuple[str, int, int]:
    """The simulator's deadline policy (one of :data:`POLICIES`), its soft target η_s and its
    hard bound η_h for a run's ``rollout.deadline`` section and hard bound."""
    soft, hard = deadline_bounds(deadline.get("target"), hard)
    action = deadline.get("action", "truncate")
    for name in POLICIES:
        spec = policy_spec(name)
        if (spec.kind, spec.deadline_action, spec.tight) == ("deadline", action, False):
            return name, soft, hard
    raise ConfigError(
        f"calibrate: rollout.deadline.action={action!r}: none of the simulator's deadline "
        "policies ends a group that way; simulate the run's workload with --policy deadline "
        "--staleness N instead"
    )


def _engine_device(run_dir: Path, engine: Mapping[str, Any]) -> str:
    """Where the run's embedded engine decoded: as its first trace's header records it, else
    (a run written before traces recorded it) ``engine.device`` resolved on this machine."""
    traces = run_traces(run_dir)
    if traces:
        path = traces[0][1]
        recorded = read_trace_header(path).meta.get("engine_device")
        if recorded is not None:
            if not isinstance(recorded, str):
                raise ConfigError(
                    f"calibrate: {path} header meta.engine_device={recorded!r}: must be a device "
                    "name such as 'cpu' or 'cuda'; fix the header or remove the key"
                )
            return recorded
    return resolve_device(str(engine.get("device", "auto")))


def read_run_info(run_dir: str | Path) -> RunInfo:
    """The policy, η, batch and engines of the run in ``run_dir`` (its ``config.yaml``)."""
    path = _need_file(Path(run_dir), "config.yaml")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        rollout, engine, run = cfg["rollout"], cfg["engine"], cfg["run"]
        method = (rollout.get("proactive_filter") or {}).get("method", "null")
        policy = str(rollout["staleness_policy"])
        if policy == "buffer" and method in ("retry", "truncate"):
            policy = f"buffer+{method}"
        # runs written before the bound had one key store it under AReaL's name
        staleness = int(rollout.get("staleness", rollout.get(AREAL_STALENESS_NAME)))
        target = None
        if policy == "deadline":
            policy, target, staleness = deadline_spec(rollout.get("deadline") or {}, staleness)
        local = engine.get("kind", "local") == "local"
        return RunInfo(
            policy=policy,
            staleness=staleness,
            target=target,
            groups=int(rollout["consumer_batch_size"]),
            group_size=int(rollout["group_size"]),
            steps=int(run["steps"]),
            replicas=int(engine["replicas"]) if local else max(1, len(engine.get("urls") or [])),
            max_batch=int(engine["max_batch_size"]) if local else None,
            max_in_flight=engine.get("max_in_flight_per_engine"),
            max_concurrent_groups=rollout.get("max_concurrent_rollouts"),
            cohort_padding=COHORT_PADDING_SLOTS
            if local and _engine_device(Path(run_dir), engine) == "cpu"
            else None,
        )
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"calibrate: {path} does not read as a stalebound run config ({type(exc).__name__}: "
            f"{exc}); give the directory of a `stalebound train` run"
        ) from None


def measure(run_dir: str | Path, warmup_fraction: float = 0.1) -> Measured:
    """The run's trajectories/s, idle fractions and time per step over the steps after the first
    ``warmup_fraction`` of them, and its staleness over every step (as the simulator measures)."""
    run_dir = Path(run_dir)
    rows = _steps(run_dir)
    if not rows:
        raise ConfigError(f"calibrate: {run_dir}/metrics.jsonl holds no step; the run trained none")
    steps = len(rows)
    warm = min(steps - 1, int(steps * warmup_fraction))
    elapsed, idle_t, idle_e, cum = [0.0], [0.0], [0.0], [0.0]
    for row in rows:
        t = row["elapsed"]
        cum.append(cum[-1] + row["num_trajectories"])
        elapsed.append(t)
        idle_t.append(row["trainer_idle_fraction"] * t)
        idle_e.append(row["engine_idle_fraction"] * t)
    window = elapsed[-1] - elapsed[warm]
    counts = StalenessHistogram()
    for number, record in enumerate(
        _records(run_dir, STALENESS_FILE), 1
    ):  # every step, as simulated
        try:
            counts.add({int(k): n for k, n in record["counts"].items()})
        except (KeyError, AttributeError, ValueError, ProtocolError) as exc:
            raise ConfigError(
                f"calibrate: {run_dir / STALENESS_FILE} step {number}: no staleness counts "
                f"({type(exc).__name__}: {exc}); " + _DAMAGED
            ) from None
    return Measured(
        trajectories_per_s=(cum[-1] - cum[warm]) / window,
        trainer_idle=(idle_t[-1] - idle_t[warm]) / window,
        engine_idle=(idle_e[-1] - idle_e[warm]) / window,
        staleness_mean=counts.mean or 0.0,
        staleness_histogram=counts.counts,
        step_s=window / (steps - warm),
        steps=steps,
    )


# ----------------------------------------------------------------------------- fitting


def _lstsq_nonneg(
    columns: Sequence[Sequence[float]], y: Sequence[float]
) -> tuple[list[float], float]:
    """Least squares with every coefficient ≥ 0 (the best over the subsets of columns whose
    unconstrained solution is non-negative); returns the coefficients and the RMS residual."""
    import itertools

    import numpy as np

    target = np.asarray(y, dtype=float)
    best: tuple[float, list[float]] | None = None
    k = len(columns)
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            x = np.asarray([columns[i] for i in subset], dtype=float).T
            coef = np.linalg.lstsq(x, target, rcond=None)[0]
            if (coef < 0).any():
                continue
            rms = float(np.sqrt(np.mean((x @ coef - target) ** 2)))
            if best is None or rms < best[0] - 1e-12:
                full = [0.0] * k
                for i, c in zip(subset, coef, strict=True):
                    full[i] = float(c)
                best = (rms, full)
    if best is None:
        return [0.0] * k, float(np.sqrt(np.mean(target**2)))
    return best[1], best[0]


def _generation_end(r: TrajectoryRecord) -> float:
    return r.end - r.reward_latency - sum(r.tool_latencies)


class _Period(NamedTuple):
    """One busy period of the engine: generation spans that overlap, merged."""

    start: float
    end: float


def _busy_periods(records: Sequence[TrajectoryRecord]) -> list[_Period]:
    """The engine's busy periods over ``records`` (episodes that generated), in time order."""
    periods: list[_Period] = []
    for s, e in sorted((r.start, max(r.start, _generation_end(r))) for r in records):
        if periods and s <= periods[-1].end:
            periods[-1] = _Period(periods[-1].start, max(periods[-1].end, e))
        else:
            periods.append(_Period(s, e))
    return periods


def _training_overlap(rows: Sequence[Mapping[str, float]], busy: Sequence[_Period]) -> list[float]:
    """For each step, the seconds of its training during which the engines generated. A step's
    training runs from ``step_and_publish_s`` before the step's record for ``step_time_s``; the
    trace counts on the same clock as the step metrics."""
    import bisect

    ends = [p.end for p in busy]
    out = []
    for r in rows:
        begin = r["elapsed"] - r["step_and_publish_s"]
        stop = begin + r["step_time_s"]
        total = 0.0
        for p in busy[bisect.bisect_right(ends, begin) :]:
            if p.start >= stop:
                break
            total += min(p.end, stop) - max(p.start, begin)
        out.append(total)
    return out


MIN_LONE_STEPS = 20
"""The fewest steps of a request decoding alone that pin a forward pass's fixed cost (fewer: it
is fitted with the row's and the position's)."""

MIN_WINDOWS = 4
"""The fewest windows of decoding in the engines' step logs that calibration fits the engine
from; with fewer, it fits the engine from the trace (:func:`_fit_engine`)."""

ENGINE_BIN_S = 0.25
"""The engine fit's time bins (seconds): short enough that the batch's size and context vary from
bin to bin, long enough to hold several decode steps of a full batch (tenths of a second on the
embedded engine; shorter bins put the spread of the episodes' spans on the step's fixed cost)."""


def _cohort_counts(first: Any, last: Any, progress: Any, replicas: int, budget: float) -> Any:
    """The mean number of decode cohorts per replica in each cell (:mod:`stalebound.sim.cohorts`
    applied to the episodes joining at cell ``first`` and leaving at cell ``last``, on the step
    counter ``progress`` of each cell). Episodes go to the replicas round robin, as placed. Every
    ``first`` and ``last`` is a cell of ``progress`` (:func:`_fit_engine` sizes the cells so)."""
    import numpy as np

    cells = len(progress)
    counts = np.zeros(cells)
    order = np.argsort(first, kind="stable")
    for r in range(replicas):
        mine = order[r::replicas]
        # in each cell the leaving episodes go first, then the joining ones
        events = sorted(
            [(int(last[i]), 0, int(i)) for i in mine] + [(int(first[i]), 1, int(i)) for i in mine]
        )
        cohorts = Cohorts(budget)
        joined: dict[int, tuple[Cohort, float]] = {}
        at: list[int] = []
        value: list[int] = []
        for n, (cell, kind, i) in enumerate(events):
            if kind:
                start = float(progress[cell])
                joined[i] = (cohorts.join(start), start)
            else:
                cohorts.leave(*joined.pop(i))
            if n + 1 == len(events) or events[n + 1][0] != cell:
                at.append(cell)
                value.append(cohorts.count(float(progress[cell])))
        # each cell holds the count after the last change at or before it
        index = np.searchsorted(np.asarray(at), np.arange(cells), side="right") - 1
        counts += np.where(index >= 0, np.asarray(value)[np.maximum(index, 0)], 0)
    return counts / replicas


def _fit_engine(
    records: Sequence[TrajectoryRecord],
    replicas: int,
    max_batch: int,
    cohort_padding: float | None = None,
) -> tuple[float, float, float, float, str]:
    """``engine.prefill``, ``step_base``, ``step_per_seq``, ``step_per_ctx`` and the fit's error.

    The trace gives each episode's generation span and tokens; spreading the tokens decoded in
    steps (all but the first of each turn, which comes with the turn's prefill) evenly over the
    span, each :data:`ENGINE_BIN_S` bin of the run gets the requests that joined, the tokens
    decoded, the mean batch decoding (at most ``max_batch`` per replica) and the longest live
    context (the tokens so far of the oldest request generating). Every active request gains one
    token per decode step, so a bin holds ``tokens ÷ batch`` steps, and its busy time is
    ``prefill × joins + step_base × steps + (step_per_seq + step_per_ctx × context) × tokens per
    replica``; with ``cohort_padding`` (the embedded engine on a CPU) a step makes one forward
    pass per cohort, and ``step_base`` is paid ``steps ×`` the bin's mean cohort count, the
    cohorts rebuilt from the episodes' joins and ends on the bins' step counter
    (:func:`_cohort_counts`). Fitted by non-negative least squares of each bin's residual
    relative to its busy time, so bins of a small batch (which pin the cost of a step) count as much as the full ones,
    then scaled so the bins add up to the engine's busy time."""
    import numpy as np

    start = np.asarray([r.start for r in records], dtype=float)
    end = np.maximum(start + 1e-6, [_generation_end(r) for r in records])
    tokens = np.asarray([decode_steps(r) for r in records], dtype=float)
    t0 = float(start.min())
    cell = ENGINE_BIN_S / 50
    cells = int((float(end.max()) - t0) / cell) + 2
    first = ((start - t0) / cell).astype(int)
    last = ((end - t0) / cell).astype(int) + 1
    rate = np.zeros(cells + 1)
    live = np.zeros(cells + 1)
    joins = np.zeros(cells + 1)
    np.add.at(rate, first, tokens / (end - start))
    np.add.at(rate, last, -tokens / (end - start))
    np.add.at(live, first, 1.0)
    np.add.at(live, last, -1.0)
    np.add.at(joins, first, 1.0)
    rate, live = np.cumsum(rate)[:cells], np.cumsum(live)[:cells] / replicas
    context = np.zeros(cells)
    times = t0 + cell * np.arange(cells)
    for s, e, k, i, j in zip(start, end, tokens, first, last, strict=True):
        so_far = np.minimum(k, (times[i:j] - s) / (e - s) * k)
        np.maximum(context[i:j], so_far, out=context[i:j])
    per = 50
    n = cells // per

    def binned(values: Any) -> Any:
        return values[: n * per].reshape(n, per).sum(axis=1)

    busy = binned((live > 0) * cell)
    generated = binned(rate * cell) / replicas
    batch = binned(np.minimum(live, max_batch) * cell) / np.maximum(busy, 1e-12)
    long = binned(rate * context * cell) / replicas
    if cohort_padding is None:
        passes = np.ones(n)
    else:
        # the decode steps of each cell (each active request gains a token a step), their count
        # so far, and on it the cohorts: a step makes one forward pass per cohort
        per_cell = rate * cell / replicas / np.maximum(np.minimum(live, max_batch), 1.0)
        progress = np.concatenate([[0.0], np.cumsum(per_cell)[:-1]])
        cohorts = np.maximum(_cohort_counts(first, last, progress, replicas, cohort_padding), 1.0)
        passes = binned(cohorts * per_cell) / np.maximum(binned(per_cell), 1e-12)  # a step's
    joined = binned(joins[:cells]) / replicas
    keep = (busy > ENGINE_BIN_S / 2) & (generated > 0)
    if keep.sum() < 4:  # too short a run for bins: the whole run as one
        keep = np.ones(1, dtype=bool)
        passes = np.atleast_1d(float((passes * busy).sum() / max(float(busy.sum()), 1e-12)))
        busy, generated, long, joined = (
            np.atleast_1d(x.sum()) for x in (busy, generated, long, joined)
        )
        batch = np.atleast_1d(float(np.mean(np.minimum(live, max_batch)[live > 0])))
    y = busy[keep]
    steps = generated[keep] / batch[keep] * passes[keep]  # forward passes
    columns = [joined[keep], steps, generated[keep], long[keep]]
    coef, rms = _lstsq_nonneg([(c / y).tolist() for c in columns], [1.0] * len(y))
    fitted = sum(c * float(col.sum()) for c, col in zip(coef, columns, strict=True))
    level = float(y.sum()) / fitted if fitted > 0 else 1.0
    prefill, step_base, per_seq, per_ctx = (c * level for c in coef)
    error = (
        f"over {int(keep.sum())} bins of {ENGINE_BIN_S:g} s, batch {float(batch[keep].min()):.0f}–"
        f"{float(batch[keep].max()):.0f}"
        + (
            ""
            if cohort_padding is None
            else f", cohorts {float(passes[keep].min()):.1f}–{float(passes[keep].max()):.1f}"
        )
        + f": RMS relative residual {rms:.0%}"
    )
    return prefill, max(step_base, 1e-6), per_seq, per_ctx, error


def _fit_logged_engine(
    windows: Sequence[Mapping[str, float]], records: Sequence[TrajectoryRecord], replicas: int
) -> tuple[float, float, float, float, str]:
    """``engine.prefill``, ``step_base``, ``step_per_seq``, ``step_per_ctx`` and the fit's error,
    from the windows the engines' step logs hold (:mod:`stalebound.engines.steplog`; at least
    :data:`MIN_WINDOWS` of decoding).

    A window's decode seconds are ``step_base × passes + row × rows + slot × slots`` (a forward
    pass's fixed cost, each row's, each cache position's). Where the engines decoded a request
    alone in :data:`MIN_LONE_STEPS` steps or more, those steps' mean cost pins a pass of one row:
    ``step_base = lone − row − slot × lone positions``, and the row's and the position's costs
    are fitted to what the windows cost beyond that (a batched run says little about a pass of
    one row, the step a straggler decoding alone repeats). The costs fitted by non-negative least
    squares of each window's residual relative to its seconds, their level so that the windows
    add up to the decode seconds logged. The simulator counts only the positions
    a cohort's answers take (``context_slots``); the rest — prompts and their padding, about the
    same for every row — joins the row's cost: ``step_per_seq = row + slot × (slots −
    context_slots) ÷ rows``, and ``step_per_ctx = slot``. ``prefill`` is each admitted request's
    share of the seconds spent admitting and on the pipe, plus its share of the trace's busy time
    the logs do not account for: the engine waiting for requests still on their way to it (a
    burst's requests reach it one after another)."""
    decoding = [w for w in windows if w["decode_s"] > 0]
    total = {k: sum(w[k] for w in windows) for k in windows[0]}
    lone = total["lone_steps"] >= MIN_LONE_STEPS
    # a pass's fixed cost: what a lone step costs beyond its row and positions, where the run
    # decoded enough stragglers alone; else fitted with the others (the batches pin it loosely)
    mean_s = total["lone_s"] / total["lone_steps"] if lone else 0.0
    mean_slots = total["lone_slots"] / total["lone_steps"] if lone else 0.0

    def column(w: Mapping[str, float], key: str) -> float:
        if not lone:
            return w[key]
        return w["rows"] - w["passes"] if key == "rows" else w["slots"] - w["passes"] * mean_slots

    keys = ("rows", "slots") if lone else ("passes", "rows", "slots")
    y = [w["decode_s"] - w["passes"] * mean_s for w in decoding]
    columns = [[column(w, k) / w["decode_s"] for w in decoding] for k in keys]
    coef, rms = _lstsq_nonneg(
        columns, [v / w["decode_s"] for v, w in zip(y, decoding, strict=True)]
    )
    # relative residuals weigh every window alike; the level makes the windows add up
    fitted = sum(c * sum(column(w, k) for w in decoding) for c, k in zip(coef, keys, strict=True))
    coef = [c * sum(y) / fitted for c in coef] if fitted > 0 and sum(y) > 0 else coef
    if lone:
        per_row, per_slot = coef
        step_base = mean_s - per_row - per_slot * mean_slots
    else:
        step_base, per_row, per_slot = coef
    per_seq = per_row + per_slot * (total["slots"] - total["context_slots"]) / max(
        total["rows"], 1.0
    )
    logged = total["decode_s"] + total["admit_s"] + total["pipe_s"]
    busy = sum(p.end - p.start for p in _busy_periods(records)) * replicas
    unlogged = max(0.0, busy - logged)
    joins = max(total["admitted"], 1.0)
    prefill = (total["admit_s"] + total["pipe_s"] + unlogged) / joins
    error = f"over {len(decoding)} windows of the engines' step logs"
    if lone:
        error += f" and {total['lone_steps']:.0f} steps of one request, {mean_s * 1e3:.3g} ms each"
    error += f": RMS relative residual {rms:.0%}"
    if step_base < 0:
        error += "; the lone steps cost less than their row and positions: a pass's cost set to 0"
    if busy > 0:
        error += (
            f"; the logs account for {logged / busy:.0%} of the trace's busy time, the rest "
            f"({unlogged / joins * 1e3:.3g} ms per admitted request) counted as admission"
        )
    return prefill, max(step_base, 1e-6), per_seq, per_slot, error


def _fit_publish(
    rows: Sequence[Mapping[str, float]],
    publish: Sequence[float],
    records: Sequence[TrajectoryRecord],
) -> tuple[float, float, str]:
    """``trainer.publish`` and ``trainer.publish_per_start``: each step's publication against
    the episodes that started during it (the executor starts what the new weights admit before
    it hands the publication back). The slope is fitted over the steps up to the 90th percentile
    (a few publications wait on something else for a long time); the constant keeps the mean."""
    import bisect

    import numpy as np

    starts = sorted(r.start for r in records)
    counts = [
        float(
            bisect.bisect_right(starts, r["elapsed"]) - bisect.bisect_left(starts, r["elapsed"] - p)
        )
        for r, p in zip(rows, publish, strict=True)
    ]
    cut = float(np.quantile(publish, 0.9))
    kept = [(n, p) for n, p in zip(counts, publish, strict=True) if p <= cut]
    (_, slope), rms = _lstsq_nonneg([[1.0] * len(kept), [n for n, _ in kept]], [p for _, p in kept])
    base = max(0.0, statistics.fmean(publish) - slope * statistics.fmean(counts))
    error = (
        f"over {len(publish)} steps: mean {statistics.fmean(publish):.3g} s, "
        f"{statistics.fmean(counts):.3g} episodes started during it; "
        f"RMS residual {rms:.3g} s below the 90th percentile {cut:.3g} s"
    )
    return base, slope, error


def _lengths(
    done: Sequence[TrajectoryRecord], cut: Sequence[TrajectoryRecord], seed: int
) -> tuple[tuple[float, ...], int]:
    """The episodes' lengths: each complete one's, and for each one cut short (a deadline's
    truncation, an abort) a length drawn beyond what it had generated, from the Kaplan–Meier
    estimate of the lengths (the complete lengths, each episode cut at ``t`` counted among those
    that might still end at any length above ``t``). It would have gone on: leaving it out, or
    keeping the length it was cut at, takes the longest answers out of a run that cut them. What
    the estimate leaves beyond the longest complete length goes to that length. Returns the
    lengths and how many were cut short."""
    import bisect
    import random
    from collections import Counter

    ends = Counter(float(r.tokens) for r in done)
    cuts = sorted(float(r.tokens) for r in cut)
    values = sorted(ends)
    masses = []
    surviving = 1.0
    at_risk = len(done) + len(cuts)
    for length in values:
        # episodes cut below this length are no longer at risk of ending at it
        risk = at_risk - bisect.bisect_left(cuts, length)
        hazard = ends[length] / risk
        masses.append(surviving * hazard)
        surviving *= 1.0 - hazard
        at_risk -= ends[length]
    if values:
        masses[-1] += surviving
    rng = random.Random(seed)
    drawn = []
    for t in (float(r.tokens) for r in cut):  # in the trace's order: each stays with its group
        i = bisect.bisect_right(values, t)
        drawn.append(rng.choices(values[i:], masses[i:])[0] if sum(masses[i:]) > 0 else t)
    return (*(float(r.tokens) for r in done), *drawn), len(drawn)


def _groups(
    episodes: Sequence[TrajectoryRecord], lengths: Sequence[float], group_size: int
) -> tuple[tuple[float, ...], ...]:
    """``lengths`` (one per episode) by the group each episode was generated in, in launch order.
    A trace that does not record groups (no ``group_id``, or written before traces recorded them:
    each episode a group of its own) has its episodes put together by prompt, ``group_size`` at
    a time in the order they started (one to a line at ``group_size`` 1)."""
    by_group: dict[Any, list[tuple[int, float]]] = {}
    for record, length in zip(episodes, lengths, strict=True):
        by_group.setdefault(id_key(record.group_id), []).append((record.member, length))
    unrecorded = None in by_group or all(len(members) == 1 for members in by_group.values())
    if unrecorded:
        by_prompt: dict[Any, list[float]] = {}
        ordered = sorted(zip(episodes, lengths, strict=True), key=lambda e: e[0].start)
        for record, length in ordered:
            by_prompt.setdefault(id_key(record.prompt_id), []).append(length)
        return tuple(
            tuple(answers[i : i + group_size])
            for answers in by_prompt.values()
            for i in range(0, len(answers), max(1, group_size))
        )
    return tuple(tuple(length for _, length in sorted(m)) for m in by_group.values())


def _relative(rms: float, values: Sequence[float]) -> str:
    mean = statistics.fmean(values) if values else 0.0
    return f"RMS residual {rms:.3g} s ({rms / mean:.0%} of the mean {mean:.3g} s)" if mean else "–"


def _spread(values: Sequence[float], unit: str) -> str:
    if len(values) < 2:
        return f"{len(values)} value"
    q = statistics.quantiles(values, n=100)
    return (
        f"{len(values)} values, median {statistics.median(values):.3g}{unit}, p99 {q[98]:.3g}{unit}"
    )


def calibrate(run_dir: str | Path, *, seed: int = 0) -> Calibration:
    """Fit a workload to the run in ``run_dir`` (see the module docstring)."""
    run_dir = Path(run_dir)
    info = read_run_info(run_dir)
    _need_file(run_dir, TRACE_FILE)
    records = read_run_trace(run_dir)  # a resumed run's traces too
    done = [r for r in records if r.complete and r.tokens > 0]
    if len(done) < 2:
        raise ConfigError(
            f"calibrate: {run_dir}/{TRACE_FILE} holds {len(done)} complete episodes; record a "
            "run of a few steps at least"
        )
    rows = _steps(run_dir)
    if len(rows) < 3:
        raise ConfigError(
            f"calibrate: {run_dir}/metrics.jsonl holds {len(rows)} steps; calibrate from a run "
            "of 3 steps or more"
        )
    fits: list[Fit] = []

    unfinished = [r for r in records if not r.complete and r.tokens > 0]
    lengths, cut = _lengths(done, unfinished, seed)
    length_groups = _groups([*done, *unfinished], lengths, info.group_size)
    fits.append(
        Fit(
            "lengths",
            statistics.fmean(lengths),
            "tokens",
            _spread(lengths, "")
            + (
                f"; {cut} cut short, each given a complete episode's length beyond its own"
                if cut
                else ""
            ),
        )
    )
    tools = tuple(max(1e-6, t) for r in done for t in r.tool_latencies)
    turns = 1 + round(statistics.median(len(r.tool_latencies) for r in done))
    rewards = tuple(max(1e-6, r.reward_latency) for r in done)
    if tools:
        fits.append(Fit("agent.tool_latency", statistics.fmean(tools), "s", _spread(tools, " s")))
    fits.append(Fit("agent.reward_latency", statistics.fmean(rewards), "s", _spread(rewards, " s")))

    logs = read_step_logs(run_dir / STEP_LOG_DIR)
    windows = [w for log in logs.values() for w in log]
    # each engine timed its steps, over windows enough to tell a pass from a row and a position
    if len(logs) == info.replicas and sum(w["decode_s"] > 0 for w in windows) >= MIN_WINDOWS:
        prefill, step_base, per_seq, per_ctx, engine_error = _fit_logged_engine(
            windows, [r for r in records if r.tokens > 0], info.replicas
        )
    else:
        prefill, step_base, per_seq, per_ctx, engine_error = _fit_engine(
            done, info.replicas, info.max_batch or MAX_IN_FLIGHT, info.cohort_padding
        )
    fits += [
        Fit("engine.prefill", prefill, "s per joining request", engine_error),
        Fit(
            "engine.step_base",
            step_base,
            "s per decode step" + (" and cohort" if info.cohort_padding is not None else ""),
            engine_error,
        ),
        Fit("engine.step_per_seq", per_seq, "s per active request per step", engine_error),
        Fit(
            "engine.step_per_ctx",
            per_ctx,
            "s per active request and token of context per step"
            + (" (its cohort's)" if info.cohort_padding is not None else " (the longest live)"),
            engine_error,
        ),
    ]

    # the trainer is busy for all of a step but its wait: training, publishing, and the
    # bookkeeping after it (metrics, ledger, checkpoints); elapsed = trained ÷ trajectories/s
    publish = [max(0.0, r["step_and_publish_s"] - r["step_time_s"]) for r in rows]
    elapsed = [0.0] + [r["elapsed"] for r in rows]
    busy = [
        max(0.0, elapsed[i + 1] - elapsed[i] - r["wait_s"] - publish[i]) for i, r in enumerate(rows)
    ][1:]  # the first step's clock starts before the engines warmed up
    tokens = [r["num_trained_tokens"] for r in rows][1:]
    # the training itself (step_time_s) is what the engines slow down: fitted against the
    # seconds of it during which they generated; the bookkeeping is a constant on top
    training = [r["step_time_s"] for r in rows][1:]
    generating = _busy_periods([r for r in records if r.tokens > 0])
    overlap = _training_overlap(rows, generating)[1:]
    cpu = [r["step_cpu_s"] for r in rows][1:]
    if all(math.isfinite(c) for c in cpu):
        # the run measured its training thread's CPU seconds: the uncontended training is those,
        # and the seconds it waited for a core are what the engines (and whatever else runs on
        # the machine, the constant) took from it
        (step_time, per_token), rms = _lstsq_nonneg([[1.0] * len(cpu), tokens], cpu)
        (outside, slowed), _ = _lstsq_nonneg(
            [[1.0] * len(cpu), overlap], [t - c for t, c in zip(training, cpu, strict=True)]
        )
        step_time += outside
    else:
        (step_time, per_token, slowed), rms = _lstsq_nonneg(
            [[1.0] * len(training), tokens, overlap], training
        )
    capped = slowed > MAX_SLOWED
    contention = min(slowed, MAX_SLOWED) / (1.0 - min(slowed, MAX_SLOWED))
    step_time += statistics.fmean(b - t for b, t in zip(busy, training, strict=True))
    step_error = f"over {len(busy)} steps: " + _relative(rms, training)
    publish_s, per_start, publish_error = _fit_publish(rows, publish, records)
    fits += [
        Fit("trainer.step_time", step_time, "s per step", step_error),
        Fit("trainer.per_token", per_token, "s per trained token", step_error),
        Fit(
            "trainer.contention",
            contention,
            "× slower while the engines generate",
            f"{step_error}; the engines generated during {statistics.fmean(overlap):.3g} s of a "
            "step's training on average"
            + (f"; capped: the steps said {slowed:.3g} s per second of overlap" if capped else ""),
        ),
        Fit("trainer.publish", publish_s, "s per step", publish_error),
        Fit("trainer.publish_per_start", per_start, "s per episode started", publish_error),
        Fit(
            "engine.update_stall",
            0.0,
            "s per step",
            "0: the engines' stall is inside the measured generation times and trainer.publish",
        ),
    ]

    failed = rows[-1]["failed_members"]
    rate = min(0.99, failed / (len(records) + failed))
    fits.append(Fit("failures.rate", rate, "per episode", f"{failed:.0f} of {len(records)}"))

    workload = WorkloadConfig(
        name=f"calibrated from {run_dir.name}",
        lengths=DistributionConfig("empirical", file="lengths.txt"),
        engine=EngineConfig(
            replicas=info.replicas,
            max_concurrency=info.max_in_flight or MAX_IN_FLIGHT,
            step_base=step_base,
            step_per_seq=per_seq,
            step_per_ctx=per_ctx,
            max_batch=info.max_batch,
            prefill=prefill,
            cohort_padding=info.cohort_padding,
        ),
        batch=BatchConfig(
            info.groups, info.group_size, info.max_concurrent_groups, runtime_default=True
        ),
        trainer=TrainerConfig(step_time, per_token, publish_s, 0.0, contention, per_start),
        agent=AgentConfig(
            turns=turns,
            tool_latency=DistributionConfig("empirical", file="tool_latency.txt")
            if tools
            else AgentConfig().tool_latency,
            reward_latency=DistributionConfig("empirical", file="reward_latency.txt"),
        ),
        failures=FailureConfig(rate=rate),
        proactive=ProactiveConfig(),
        run=RunConfig(steps=len(rows)),
    )
    cal = Calibration(
        workload, tuple(fits), info, lengths, tools, rewards, str(run_dir), length_groups
    )
    share = statistics.fmean(overlap) / max(1e-9, statistics.fmean(training))
    return _close(cal, run_dir, seed, share)


def _close(cal: Calibration, run_dir: Path, seed: int, share: float) -> Calibration:
    """Simulate the run once as fitted so far (no hand-over) and close the two gaps it leaves:

    * ``trainer.handoff``: the median step's wait that the simulation does not explain. The
      median, not the mean: the longer waits of a few steps (for a straggler, a late reward) are
      the policy's, which the simulation is to predict, not a constant of every step;
    * ``trainer.step_time``: moved by the busy time per step the simulated trainer lacks (or
      has too much of) — what the regression's mean does not carry over once the simulation
      decides the overlap with generation. ``share`` (the run's share of training time the
      engines generated) turns busy time into uncontended training."""
    measured = measure(run_dir, cal.workload.run.warmup_fraction)
    waits = [r["wait_s"] for r in _steps(run_dir)]
    waits = waits[len(waits) - _window_steps(cal) :]
    result = predict(cal, seed=seed)
    steps = max(1, _window_steps(cal))
    real = statistics.median(waits)
    simulated = statistics.median(result.trainer_waits) if result.trainer_waits else 0.0
    handoff = max(0.0, real - simulated)
    real_busy = (1.0 - measured.trainer_idle) * measured.step_s
    sim_busy = result.trainer_util * result.window / steps
    t = cal.workload.trainer
    slow = 1.0 + t.contention * share
    step_time = max(0.0, t.step_time + (real_busy - sim_busy) / slow)
    trainer = dataclasses.replace(t, handoff=handoff, step_time=step_time)
    fits = [
        dataclasses.replace(
            f,
            value=step_time,
            error=f"{f.error}; moved by {step_time - t.step_time:+.3g} s to the measured busy time "
            f"{real_busy:.3g} s per step",
        )
        if f.key == "trainer.step_time"
        else f
        for f in cal.fits
    ]
    fits.append(
        Fit(
            "trainer.handoff",
            handoff,
            "s per step",
            f"the median step's wait: {real:.3g} s measured − {simulated:.3g} s simulated without "
            "it",
        )
    )
    return dataclasses.replace(
        cal, workload=dataclasses.replace(cal.workload, trainer=trainer), fits=tuple(fits)
    )


def _window_steps(cal: Calibration) -> int:
    steps = cal.workload.run.steps
    return steps - min(steps - 1, int(steps * cal.workload.run.warmup_fraction))


# ------------------------------------------------------------------------ prediction


def predict(
    cal: Calibration,
    *,
    policy: str | None = None,
    staleness: int | None = None,
    target: int | None = None,
    steps: int | None = None,
    seed: int = 0,
) -> SimResult:
    """Simulate the calibrated workload under ``policy`` at the hard bound ``staleness`` and
    the soft target ``target`` (default: the run's own, when neither policy nor bound is
    given; else the policy's default target)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="stalebound-calibrated-") as tmp:
        _write_values(cal, Path(tmp))
        cfg = dataclasses.replace(cal.workload, base_dir=tmp)
        return simulate(
            cfg,
            cal.run.policy if policy is None else policy,
            cal.run.staleness if staleness is None else staleness,
            target=cal.run.target if (policy, staleness, target) == (None, None, None) else target,
            seed=seed,
            steps=steps,
        )


def _write_values(cal: Calibration, folder: Path, prefix: str = "") -> dict[str, str]:
    """Write the fitted value files into ``folder`` as ``<prefix><key>.txt``, one value a line
    (the lengths one group a line); returns each written file's name by its key (a run without
    tool calls has no tool latencies)."""
    files = {}
    for key, rows in (
        ("lengths", cal.length_groups or [(v,) for v in cal.lengths]),
        ("tool_latency", [(v,) for v in cal.tool_latencies]),
        ("reward_latency", [(v,) for v in cal.reward_latencies]),
    ):
        if rows:
            name = f"{prefix}{key}.txt"
            text = "".join(" ".join(f"{v:.6g}" for v in row) + "\n" for row in rows)
            (folder / name).write_text(text, encoding="utf-8")
            files[key] = name
    return files


def write_workload(cal: Calibration, path: str | Path) -> Path:
    """Write the workload as YAML at ``path`` and its value files beside it; returns the path.

    The value files are named ``<stem>.lengths.txt`` and so on, so several calibrations can share
    a folder. The result loads with ``--workload``."""
    path = Path(path)
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    files = _write_values(cal, folder, f"{stem}.")
    data = dataclasses.asdict(cal.workload)
    data.pop("base_dir", None)
    data["lengths"] = {"distribution": "empirical", "file": files["lengths"]}
    agent = data["agent"]
    agent["reward_latency"] = {"distribution": "empirical", "file": files["reward_latency"]}
    if "tool_latency" in files:
        agent["tool_latency"] = {"distribution": "empirical", "file": files["tool_latency"]}
    header = "".join(f"# {f.key} = {f.value:.6g} {f.unit} ({f.error})\n" for f in cal.fits)
    text = (
        f"# Fitted by `stalebound simulate --calibrate {cal.source}`.\n"
        "# Edit freely and pass it to `stalebound simulate --workload`.\n" + header
    )
    text += yaml.safe_dump(data, sort_keys=False)
    path.write_text(text, encoding="utf-8")
    workload_from_dict(yaml.safe_load(text), base_dir=str(folder))  # it must load back
    return path

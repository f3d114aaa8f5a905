"""Calibration: a recorded run, the workload fitted to it, and the simulator's prediction of it.

The fit and the prediction are checked on a run recorded once and shipped in
``tests/data/calibration-run`` (``scripts/record_calibration_run.py`` records it again), so they
are deterministic: how loaded the machine running the tests is changes nothing. Training a run
now and predicting it is a benchmark (``bench/calibration_check.py``), not a test. One test still
trains a short run, for what only a live run shows: the trace's clock across a resume.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from stalebound.cli import main
from stalebound.core import ConfigError
from stalebound.obs.trace import TrajectoryRecord
from stalebound.sim.calibrate import (
    Calibration,
    calibrate,
    measure,
    predict,
    read_run_info,
    write_workload,
)
from stalebound.sim.config import load_preset, load_workload
from stalebound.sim.simulator import simulate

pytestmark = pytest.mark.slow

# What the calibrated simulator must predict of the recorded run; the preset's engine and trainer
# in place of the fitted ones miss it (by 0.67 in throughput on the recorded run).
TPS_ERROR = 0.25
IDLE_ERROR = 0.15
STALENESS_ERROR = 0.3

RECORDED = Path(__file__).parent / "data" / "calibration-run"
"""A 20-step run of the train recipe (config.yaml, trace.jsonl, metrics.jsonl, staleness.jsonl),
trimmed to what calibration reads."""


@pytest.fixture(scope="module")
def recorded() -> Path:
    assert (RECORDED / "trace.jsonl").is_file(), "run scripts/record_calibration_run.py"
    return RECORDED


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "r"
    code = main(
        [
            "train",
            "run.steps=20",
            f"run.run_dir={run_dir}",
            "run.live=false",
            "run.eval_prompts=20",
            "run.checkpoint=true",  # the clock test resumes a copy of it
            "run.plots=false",
            "run.tensorboard=false",
            "train.warm_start_steps=10",
            f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        ]
    )
    assert code == 0
    return run_dir


def errors(cal: Calibration, run_dir: Path) -> dict[str, float]:
    measured = measure(run_dir)
    r = predict(cal, steps=measured.steps)
    return {
        "tps": abs(r.throughput / measured.trajectories_per_s - 1),
        "trainer_idle": abs((1 - r.trainer_util) - measured.trainer_idle),
        "engine_idle": abs(r.engine_idle - measured.engine_idle),
        "staleness": abs(r.staleness_mean - measured.staleness_mean),
    }


def within(e: dict[str, float]) -> bool:
    return (
        e["tps"] <= TPS_ERROR
        and e["trainer_idle"] <= IDLE_ERROR
        and e["engine_idle"] <= IDLE_ERROR
        and e["staleness"] <= STALENESS_ERROR
    )


def test_the_calibrated_simulator_predicts_its_own_run(recorded: Path) -> None:
    cal = calibrate(recorded)
    # the recipe's deadline policy: the simulator's `deadline` at η_h = 4, η_s = 2
    assert (cal.run.policy, cal.run.staleness, cal.run.target) == ("deadline", 4, 2)
    assert {f.key for f in cal.fits} >= {
        "engine.step_per_seq",
        "engine.prefill",
        "trainer.step_time",
        "trainer.contention",
        "trainer.publish",
        "agent.reward_latency",
        "failures.rate",
        "trainer.handoff",
    }
    e = errors(cal, recorded)
    assert within(e), e
    assert errors(calibrate(recorded), recorded) == e  # deterministic


def test_the_trace_counts_on_the_clock_of_the_step_metrics(run: Path, tmp_path: Path) -> None:
    # calibration sets each step's training beside what the engines generated meanwhile, so
    # the trace and the metrics count from the same moment, and go on doing so after a resume
    import shutil

    from stalebound.obs.trace import read_trace

    _, records = read_trace(run / "trace.jsonl")
    assert min(r.start for r in records) >= 0
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    steps = [json.loads(line) for line in (copy / "metrics.jsonl").open()]
    assert main(["train", f"resume={copy}", f"run.steps={len(steps) + 2}", "run.live=false"]) == 0
    _, resumed = read_trace(copy / f"trace-from-step-{len(steps)}.jsonl")
    assert resumed
    # the clock goes on from the checkpoint's time (a little before the last step's record),
    # not from 0
    assert min(r.start for r in resumed) >= steps[-1]["wall_time"] / 2
    # and calibrating the resumed run reads its episodes from both traces: the first up to where
    # the resume took over (what was in flight at the end, the resume ran again)
    took_over = min(r.start for r in resumed)
    history = [r for r in records if r.start < took_over] + resumed
    complete = sum(1 for r in history if r.complete and r.tokens > 0)
    assert len(calibrate(copy).lengths) == complete


def test_the_bound_fails_when_the_fits_are_replaced_by_the_preset(recorded: Path) -> None:
    cal = calibrate(recorded)
    preset = load_preset("small")
    ignored = dataclasses.replace(
        cal,
        workload=dataclasses.replace(cal.workload, engine=preset.engine, trainer=preset.trainer),
    )
    assert not within(errors(ignored, recorded))


def test_the_written_workload_loads_and_simulates_the_same(recorded: Path, tmp_path: Path) -> None:
    cal = calibrate(recorded)
    path = write_workload(cal, tmp_path / "fitted.yaml")
    assert (tmp_path / "fitted.lengths.txt").is_file()
    text = path.read_text()
    assert "# engine.step_per_seq = " in text  # the fits and their errors head the file
    loaded = load_workload(path)
    assert loaded.engine == cal.workload.engine
    assert loaded.trainer == cal.workload.trainer
    a = simulate(loaded, cal.run.policy, cal.run.staleness, steps=10)
    b = predict(cal, steps=10)
    assert a.throughput == pytest.approx(b.throughput, rel=1e-3)


def test_the_command_prints_fits_and_the_prediction(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w.yaml"
    capsys.readouterr()
    code = main(
        ["simulate", "--calibrate", str(recorded), "--out", str(out), "--json", "--staleness", "0"]
    )
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert lines[0]["workload"] == str(out) and out.is_file()
    row = lines[1]
    assert (row["policy"], row["staleness"], row["target"]) == ("deadline", 4, 2)
    assert set(row["predicted"]) == set(row["measured"])
    what_if = lines[2]  # the run's policy at the η asked for
    assert what_if["policy"] == "deadline" and what_if["staleness"] == 0
    assert what_if["violations"] == 0


def test_a_directory_that_is_not_a_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"no config\.yaml there"):
        calibrate(tmp_path)
    assert main(["simulate", "--compare", str(tmp_path)]) == 2
    assert "--compare needs --calibrate" in capsys.readouterr().err


def _broken_run(tmp_path: Path, metrics: str, staleness: str) -> Path:
    """A run directory whose config and trace read, with the metric files given."""
    (tmp_path / "config.yaml").write_text(
        "rollout: {staleness_policy: buffer, staleness: 2, consumer_batch_size: 1, group_size: 2}\n"
        "engine: {kind: local, replicas: 1, max_batch_size: 8}\n"
        "run: {steps: 3}\n"
    )
    trace = [{"type": "header", "format": "stalebound-trace", "version": 1}] + [
        {"type": "trajectory", "prompt_id": i, "start": i, "end": i + 1.0, "tokens": 10}
        for i in range(6)
    ]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    (tmp_path / "metrics.jsonl").write_text(metrics)
    (tmp_path / "staleness.jsonl").write_text(staleness)
    return tmp_path


_STEP = {
    "num_trajectories": 2,
    "trajectories_per_s": 1.0,
    "trainer_idle_fraction": 0.1,
    "engine_idle_fraction": 0.1,
    "wait_s": 0.1,
    "step_time_s": 0.5,
    "step_and_publish_s": 0.6,
    "num_trained_tokens": 20,
}


@pytest.mark.parametrize(
    ("metrics", "staleness", "message"),
    [
        ("", "", r"metrics\.jsonl holds 0 steps"),
        ("{}\n" * 3, "", r"metrics\.jsonl step 1: num_trajectories=None: must be a number"),
        (
            json.dumps({**_STEP, "trajectories_per_s": 0}) + "\n",
            "",
            r"step 1: trajectories_per_s=0: must be > 0",
        ),
        (
            json.dumps({**_STEP, "wait_s": "x"}) + "\n",
            "",
            r"step 1: wait_s='x': must be a number",
        ),
        ("[1]\n", "", r"metrics\.jsonl:1: expected a JSON object"),
        ((json.dumps(_STEP) + "\n") * 3, '{"step": 1}\n', r"staleness\.jsonl step 1: no staleness"),
    ],
)
def test_a_damaged_run_is_refused_naming_the_file(
    tmp_path: Path, metrics: str, staleness: str, message: str
) -> None:
    run_dir = _broken_run(tmp_path, metrics, staleness)
    with pytest.raises(ConfigError, match=message):
        calibrate(run_dir)


@pytest.mark.parametrize(
    ("deadline", "hard", "expected"),
    [
        ("{}", 4, ("deadline", 4, 2)),
        ("{}", 5, ("deadline", 5, 2)),
        ("{target: 3}", 3, ("deadline", 3, 3)),
        ("{target: 1}", 3, ("deadline", 3, 1)),
        ("{target: 1, action: abort}", 2, ("deadline-abort", 2, 1)),
    ],
)
def test_a_deadline_run_is_simulated_at_its_hard_bound_and_soft_target(
    tmp_path: Path, deadline: str, hard: int, expected: tuple[str, int, int]
) -> None:
    (tmp_path / "config.yaml").write_text(
        f"rollout: {{staleness_policy: deadline, staleness: {hard}, deadline: {deadline},"
        " consumer_batch_size: 1, group_size: 2}\n"
        "engine: {kind: local, replicas: 1, max_batch_size: 8}\nrun: {steps: 3}\n"
    )
    info = read_run_info(tmp_path)
    assert (info.policy, info.staleness, info.target) == expected


@pytest.mark.parametrize(
    ("engine", "padding"),
    [
        ("kind: local, device: cpu", 1024),
        ("kind: local, device: cuda", None),
        ("kind: vllm, urls: [http://a:8000]", None),
    ],
)
def test_the_cohorts_are_modelled_for_the_embedded_engine_on_a_cpu_only(
    tmp_path: Path, engine: str, padding: int | None
) -> None:
    (tmp_path / "config.yaml").write_text(
        "rollout: {staleness_policy: capacity, staleness: 1, consumer_batch_size: 1,"
        f" group_size: 2}}\nengine: {{{engine}, replicas: 1, max_batch_size: 8}}\n"
        "run: {steps: 3}\n"
    )
    assert read_run_info(tmp_path).cohort_padding == padding


@pytest.mark.parametrize(("recorded", "padding"), [("cpu", 1024), ("cuda", None)])
def test_the_device_the_runs_trace_records_decides_the_cohorts(
    tmp_path: Path, recorded: str, padding: int | None
) -> None:
    # `device: auto` resolves where the run ran, which need not be the calibrating machine:
    # the trace's header says where the engine decoded, and that is what is modelled
    from stalebound.obs.trace import TRACE_FILE, TraceHeader, TraceRecorder

    (tmp_path / "config.yaml").write_text(
        "rollout: {staleness_policy: capacity, staleness: 1, consumer_batch_size: 1,"
        " group_size: 2}\nengine: {kind: local, device: auto, replicas: 1, max_batch_size: 8}\n"
        "run: {steps: 3}\n"
    )
    header = TraceHeader(source="runtime", group_size=2, meta={"engine_device": recorded})
    TraceRecorder(tmp_path / TRACE_FILE, header).close()
    assert read_run_info(tmp_path).cohort_padding == padding


def test_a_recorded_device_that_is_no_name_is_an_error_naming_it(tmp_path: Path) -> None:
    from stalebound.obs.trace import TRACE_FILE, TraceHeader, TraceRecorder

    (tmp_path / "config.yaml").write_text(
        "rollout: {staleness_policy: capacity, staleness: 1, consumer_batch_size: 1,"
        " group_size: 2}\nengine: {kind: local, device: auto, replicas: 1, max_batch_size: 8}\n"
        "run: {steps: 3}\n"
    )
    header = TraceHeader(source="runtime", group_size=2, meta={"engine_device": 0})
    TraceRecorder(tmp_path / TRACE_FILE, header).close()
    with pytest.raises(ConfigError) as err:
        read_run_info(tmp_path)
    assert str(err.value) == (
        f"calibrate: {tmp_path / TRACE_FILE} header meta.engine_device=0: must be a device name "
        "such as 'cpu' or 'cuda'; fix the header or remove the key"
    )


def test_a_contention_beyond_the_cap_is_capped_and_says_so(tmp_path: Path) -> None:
    # the engines generate over [0, 6] s (the trace of _broken_run); step 2 trains 5 s inside
    # it, steps 3 and 4 train 0.5 and 0.4 s outside: 0.91 s more per second of overlap
    steps = [(3.0, 0.3), (6.0, 5.0), (20.0, 0.5), (30.0, 0.4)]  # (end of the step, training)
    metrics = "".join(
        json.dumps(
            {
                **_STEP,
                "trajectories_per_s": 2 * number / end,
                "step_time_s": training,
                "step_and_publish_s": training + 0.1,
            }
        )
        + "\n"
        for number, (end, training) in enumerate(steps, 1)
    )
    staleness = "".join(json.dumps({"step": k, "counts": {"2": 2}}) + "\n" for k in range(1, 5))
    cal = calibrate(_broken_run(tmp_path, metrics, staleness))
    fit = next(f for f in cal.fits if f.key == "trainer.contention")
    assert fit.value == pytest.approx(9.0)  # 0.9 / (1 − 0.9)
    assert "capped: the steps said 0.91 s per second of overlap" in fit.error


def _simulated_trace(
    folder: Path, staleness: int, lengths: dict[str, Any], **engine: Any
) -> list[TrajectoryRecord]:
    """The complete episodes of a simulated capacity run at ``staleness`` on one replica (512
    slots, batch 256) with ``engine``'s step costs: a trace the engine fit reads as it reads a
    real run's."""
    from stalebound.obs.trace import read_trace
    from stalebound.sim.config import workload_from_dict
    from stalebound.sim.rundir import write_run_dir

    cfg = workload_from_dict(
        {
            "lengths": {"distribution": "lognormal", **lengths},
            "engine": {"replicas": 1, "max_concurrency": 512, "max_batch": 256, **engine},
            "batch": {"groups": 16, "group_size": 8},
            "trainer": {"step_time": 0.1, "per_token": 0.0, "publish": 0.01},
            "agent": {"reward_latency": {"distribution": "fixed", "value": 1e-6}},
            "run": {"steps": 20},
        }
    )
    write_run_dir(cfg, "capacity", staleness, folder / "r")
    _, records = read_trace(folder / "r" / "trace.jsonl")
    return [r for r in records if r.complete and r.tokens > 0]


def test_the_engine_fit_recovers_a_simulated_engines_step_costs(tmp_path: Path) -> None:
    # a simulated synchronous run (each step's batch drains to its stragglers, so the batch runs
    # from 1 to 128) whose engine pays per step, per active request, and per active request and
    # token of the longest live context (the embedded engine's padded cache); the fit reads the
    # trace alone, as it reads a real run's. A fit without the context term misses the full
    # batch of long contexts by half.
    from stalebound.sim.calibrate import _fit_engine

    base, per_seq, per_ctx = 0.004, 0.0002, 2e-6
    lengths = {"median": 3, "p99": 60, "cap": 200}
    done = _simulated_trace(
        tmp_path, 0, lengths, step_base=base, step_per_seq=per_seq, step_per_ctx=per_ctx
    )
    _, b, p, c, _ = _fit_engine(done, 1, 256)
    # a step of one request is the least seen (the tails of a few steps): the loosest
    for batch, context, error in ((1, 0, 0.5), (100, 50, 0.2), (256, 100, 0.2)):
        true = base + per_seq * batch + per_ctx * batch * context
        assert b + p * batch + c * batch * context == pytest.approx(true, rel=error), (b, p, c)


def test_the_engine_fit_counts_a_step_once_per_cohort(tmp_path: Path) -> None:
    # a simulated run at η = 2 with heavy-tailed answers on an engine that decodes in cohorts
    # (stragglers decode apart from the newer rows, each cohort a forward pass that pays the
    # step's fixed cost: 1 to 5 passes a step); the fit rebuilds the cohorts from the trace. A
    # fit without them puts the passes into the fixed cost: a step of one cohort comes out
    # several times too slow.
    from stalebound.engines.cohorts import COHORT_PADDING_SLOTS
    from stalebound.sim.calibrate import _fit_engine

    base, per_seq = 0.004, 0.0002
    lengths = {"median": 20, "p99": 400, "cap": 1000}
    done = _simulated_trace(
        tmp_path,
        2,
        lengths,
        step_base=base,
        step_per_seq=per_seq,
        cohort_padding=COHORT_PADDING_SLOTS,
    )
    _, b, p, c, error = _fit_engine(done, 1, 256, COHORT_PADDING_SLOTS)
    assert "cohorts 1.0–5.0" in error
    # the fit is loosest where the run spent least time (one cohort of a few rows)
    for cohorts, batch, tolerance in ((1, 10, 0.5), (4, 256, 0.2)):
        true = base * cohorts + per_seq * batch
        assert b * cohorts + p * batch == pytest.approx(true, rel=tolerance), (b, p, c)
    _, b1, p1, c1, _ = _fit_engine(done, 1, 256)
    assert b1 + p1 * 10 > 3 * (base + per_seq * 10), (b1, p1, c1)


def test_the_contention_is_read_from_the_training_threads_cpu_seconds(tmp_path: Path) -> None:
    # the engines generate over [0, 6] s (the trace of _broken_run); step 2 trains 5 s inside it
    # on 2.4 s of CPU, steps 3 and 4 train outside it, each 0.1 s longer than their CPU seconds
    # (another process): 0.1 s a step from outside, and 0.5 s more per second of overlap
    steps = [(3.0, 0.3, 0.2), (6.0, 5.0, 2.4), (20.0, 0.5, 0.4), (30.0, 0.4, 0.3)]
    metrics = "".join(
        json.dumps(
            {
                **_STEP,
                "trajectories_per_s": 2 * number / end,
                "step_time_s": training,
                "step_cpu_s": cpu,
                "step_and_publish_s": training + 0.1,
            }
        )
        + "\n"
        for number, (end, training, cpu) in enumerate(steps, 1)
    )
    staleness = "".join(json.dumps({"step": k, "counts": {"2": 2}}) + "\n" for k in range(1, 5))
    cal = calibrate(_broken_run(tmp_path, metrics, staleness))
    fits = {f.key: f.value for f in cal.fits}
    assert fits["trainer.contention"] == pytest.approx(1.0)  # 0.5 / (1 − 0.5)


def _logged_windows(lone_steps: int = 0) -> list[dict[str, float]]:
    """Windows of an engine whose decode step costs 1.2 ms a pass, 0.08 ms a row and 1.5 µs a
    cache position, a fifth of the positions being prompts; with ``lone_steps``, the last window
    holds that many steps of one request at 100 positions, and the others none."""
    windows = []
    shapes = ((10, 100, 4000), (30, 900, 90000), (12, 1200, 30000), (5, 5, 900))
    for passes, rows, slots in shapes:
        windows.append(
            {
                "steps": 5.0,
                "decode_s": 1.2e-3 * passes + 8e-5 * rows + 1.5e-6 * slots,
                "passes": float(passes),
                "rows": float(rows),
                "slots": float(slots),
                "context_slots": 0.8 * slots,
                "lone_steps": 0.0,
                "lone_s": 0.0,
                "lone_slots": 0.0,
                "admitted": 10.0,
                "admit_s": 0.004,
                "pipe_s": 0.001,
            }
        )
    if lone_steps:
        n = float(lone_steps)
        lone = 1.2e-3 + 8e-5 + 1.5e-6 * 100
        windows.append(
            {
                **windows[-1],
                "steps": n,
                "decode_s": n * lone,
                "passes": n,
                "rows": n,
                "slots": 100 * n,
                "context_slots": 80 * n,
                "lone_steps": n,
                "lone_s": n * lone,
                "lone_slots": 100 * n,
            }
        )
    return windows


def test_the_engine_fit_takes_the_costs_the_engine_logged() -> None:
    # the fit finds the three costs and moves the prompts' share into the row's; admission
    # takes the seconds admitting and on the pipe, and the trace's busy time the logs leave out
    # (0.5 s), per request
    from stalebound.sim.calibrate import _fit_logged_engine

    windows = _logged_windows()
    logged = sum(w["decode_s"] + w["admit_s"] + w["pipe_s"] for w in windows)
    busy = logged + 0.5
    records = [TrajectoryRecord("p", "g", 0, 1.0, 1.0 + busy, 7)]
    prefill, base, per_seq, per_ctx, error = _fit_logged_engine(windows, records, 1)
    assert base == pytest.approx(1.2e-3)
    assert per_ctx == pytest.approx(1.5e-6)
    prompt = 0.2 * sum(w["slots"] for w in windows) / sum(w["rows"] for w in windows)
    assert per_seq == pytest.approx(8e-5 + 1.5e-6 * prompt)
    assert prefill == pytest.approx((0.02 + 0.5) / 40)
    assert error.startswith("over 4 windows of the engines' step logs: RMS relative residual 0%")
    assert f"account for {logged / busy:.0%} of the trace's busy time" in error


@pytest.mark.parametrize("lone_steps", [19, 20])
def test_steps_of_one_request_pin_a_pass_of_one_row(lone_steps: int) -> None:
    # the engine's lone steps cost 0.6 ms more than its batches say (a pass of one row pays for
    # the sampling and the bookkeeping the batches share out): from 20 of them on, the pass's
    # fixed cost is what a lone step costs beyond its row and positions
    from stalebound.sim.calibrate import MIN_LONE_STEPS, _fit_logged_engine

    assert lone_steps - MIN_LONE_STEPS in (-1, 0)
    windows = _logged_windows(lone_steps)
    windows[-1]["decode_s"] += 6e-4 * lone_steps
    windows[-1]["lone_s"] += 6e-4 * lone_steps
    records = [TrajectoryRecord("p", "g", 0, 1.0, 2.0, 7)]
    _, base, per_seq, per_ctx, error = _fit_logged_engine(windows, records, 1)
    alone = base + per_seq + per_ctx * 80  # what the simulator charges a step of one straggler
    if lone_steps < MIN_LONE_STEPS:
        assert alone < 1.2e-3 + 8e-5 + 1.5e-6 * 100 + 3e-4, (base, per_seq, per_ctx)
        assert "steps of one request" not in error
    else:
        assert alone == pytest.approx(1.8e-3 + 8e-5 + 1.5e-6 * 100, rel=0.05)
        assert f"and {lone_steps} steps of one request, 2.03 ms each" in error
        assert "set to 0" not in error


def test_lone_steps_cheaper_than_their_row_leave_a_pass_at_no_cost_and_say_so() -> None:
    from stalebound.sim.calibrate import MIN_LONE_STEPS, _fit_logged_engine

    windows = _logged_windows(MIN_LONE_STEPS)
    windows[-1]["decode_s"] = windows[-1]["lone_s"] = 1e-5 * MIN_LONE_STEPS
    records = [TrajectoryRecord("p", "g", 0, 1.0, 2.0, 7)]
    _, base, _, _, error = _fit_logged_engine(windows, records, 1)
    assert base == 1e-6
    assert "the lone steps cost less than their row and positions: a pass's cost set to 0" in error


def test_a_run_whose_engine_logged_its_steps_is_fitted_from_the_log(run: Path) -> None:
    from stalebound.engines.steplog import STEP_LOG_DIR

    assert (run / STEP_LOG_DIR / "local0.jsonl").is_file()
    cal = calibrate(run)
    fit = next(f for f in cal.fits if f.key == "engine.step_base")
    assert "windows of the engines' step logs" in fit.error


def test_a_step_log_too_short_to_fit_leaves_the_engine_to_the_trace(
    run: Path, tmp_path: Path
) -> None:
    import shutil

    from stalebound.engines.steplog import STEP_LOG_DIR
    from stalebound.sim.calibrate import MIN_WINDOWS

    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    log = copy / STEP_LOG_DIR / "local0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[: MIN_WINDOWS - 1]))
    fit = next(f for f in calibrate(copy).fits if f.key == "engine.step_base")
    assert fit.error.startswith("over "), fit.error
    assert "bins of 0.25 s" in fit.error


def _episode(tokens: int, complete: bool = True) -> TrajectoryRecord:
    return TrajectoryRecord("p", "g", 0, 0.0, 1.0, tokens, complete=complete)


def test_an_episode_cut_short_is_given_a_length_beyond_its_cut() -> None:
    from stalebound.sim.calibrate import _lengths

    done = [_episode(n) for n in (1, 2, 3, 10)]
    lengths, cut = _lengths(done, [_episode(5, False), _episode(20, False)], seed=0)
    # 10 is the one complete length beyond 5; nothing ended beyond 20: it keeps its own
    assert (lengths, cut) == ((1.0, 2.0, 3.0, 10.0, 10.0, 20.0), 2)


def test_the_lengths_beyond_a_cut_are_weighed_as_kaplan_meier_weighs_them() -> None:
    # one episode ended at 60 tokens and one at 200; 800 were cut at 100 and 200 at 50. Of the
    # episodes still running at 60 tokens, 1 in 802 ended there: a cut at 50 almost always goes
    # on to 200 (drawing evenly from the longer complete lengths would give 60 half the time)
    from stalebound.sim.calibrate import _lengths

    cut = [_episode(50, False)] * 200 + [_episode(100, False)] * 800
    lengths, _ = _lengths([_episode(60), _episode(200)], cut, seed=0)
    beyond_50 = lengths[2:202]
    assert sum(n == 200 for n in beyond_50) >= 195
    assert all(n == 200 for n in lengths[202:])


def test_the_lengths_keep_the_groups_the_trace_recorded() -> None:
    from stalebound.sim.calibrate import _groups

    def episode(prompt: str, group: Any, member: int, start: float) -> TrajectoryRecord:
        return TrajectoryRecord(prompt, group, member, start, start + 1.0, 1)

    # recorded groups: each a line, its members in launch order (whatever order they ended in)
    episodes = [episode("a", 7, 1, 0.0), episode("b", 8, 0, 0.1), episode("a", 7, 0, 0.2)]
    assert _groups(episodes, [30.0, 5.0, 10.0], group_size=2) == ((10.0, 30.0), (5.0,))
    # no groups recorded (no group_id, or a group per episode, as older traces have): a
    # prompt's episodes in the order they started, group_size to a line
    for group in (lambda i: None, lambda i: i):
        episodes = [
            episode(p, group(i), 0, start)
            for i, (p, start) in enumerate([("a", 0.3), ("b", 0.0), ("a", 0.1), ("a", 0.2)])
        ]
        lines = _groups(episodes, [4.0, 9.0, 2.0, 3.0], group_size=2)
        assert lines == ((9.0,), (2.0, 3.0), (4.0,))
        # groups of one: each episode a line of its own, never one line of all of them
        lines = _groups(episodes, [4.0, 9.0, 2.0, 3.0], group_size=1)
        assert lines == ((9.0,), (2.0,), (3.0,), (4.0,))


def test_the_calibrated_lengths_are_written_a_group_to_a_line(
    recorded: Path, tmp_path: Path
) -> None:
    cal = calibrate(recorded)
    # the recorded run's trace keeps no group ids: its prompts' episodes, 8 to a group
    assert sum(len(line) for line in cal.length_groups) == len(cal.lengths)
    assert max(len(line) for line in cal.length_groups) == cal.run.group_size == 8
    path = write_workload(cal, tmp_path / "w.yaml")
    lines = (tmp_path / "w.lengths.txt").read_text().splitlines()
    assert [[float(x) for x in line.split()] for line in lines] == [
        list(line) for line in cal.length_groups
    ]
    assert load_workload(path).lengths.file == "w.lengths.txt"

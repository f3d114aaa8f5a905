"""``stalebound simulate``: policies side by side on one seeded workload.

Prints a table (or, with ``--json``, one JSON object per line for each policy and η), optionally
writes plots, records a trace of the first run (``--record``) or replays a recorded one
(``--replay``). ``--calibrate RUN_DIR`` fits a workload to a real run, writes it, and prints the
simulator's prediction of that run (and of ``--compare`` runs) beside what was measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stalebound.core.errors import ConfigError, StaleboundError
from stalebound.obs.trace import TraceHeader, TraceRecorder, TrajectoryRecord, read_trace
from stalebound.sim.config import WorkloadConfig, list_presets, load_preset, load_workload
from stalebound.sim.recommend import OBJECTIVES
from stalebound.sim.replay import ReplaySource, trace_means
from stalebound.sim.simulator import POLICIES, SimResult, compute_bound, policy_spec, simulate
from stalebound.userfiles import label, writable_dir_problem, writable_file_problem

__all__ = ["register", "run_simulations"]


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "simulate",
        help="compare staleness policies on a virtual clock",
        description="Simulate a cluster generating and training under several staleness "
        "policies on the same seeded workload, and compare them with the physical bound.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset", default=None, help=f"a shipped workload: {', '.join(list_presets())}"
    )
    src.add_argument("--workload", default=None, metavar="FILE", help="a workload YAML file")
    src.add_argument(
        "--calibrate",
        default=None,
        metavar="RUN_DIR",
        help="fit a workload to a `stalebound train` run, write it (--out) and predict the run; "
        "with --policy / --staleness, also what the run would do under those",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="with --calibrate: where to write the workload (default RUN_DIR/calibrated.yaml)",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="with --calibrate: also predict this run (its policy and η) and set it beside its "
        "measurement (repeatable)",
    )
    p.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        metavar="P",
        help=f"a policy to run (repeatable; default all): {', '.join(POLICIES)}",
    )
    bound = p.add_mutually_exclusive_group()
    bound.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="hard staleness bounds η_h to run (default 4); sync always runs at η_h = 0",
    )
    bound.add_argument(
        "--soft-staleness",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="the former meaning of --staleness, for one more release: the deadline policies' "
        "soft target η_s (deadline and deadline-abort at η_h = 2·η_s), the others' bound",
    )
    p.add_argument(
        "--target",
        type=int,
        default=None,
        metavar="N",
        help="the deadline policies' soft admission target η_s (default η_h // 2; η_h for "
        "deadline-tight); at most every --staleness",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--steps", type=int, default=None, help="train steps per run (default: the workload's)"
    )
    p.add_argument(
        "--recommend",
        action="store_true",
        help="with --calibrate: sweep policy, η_h, η_s, grace and concurrency on the calibrated "
        "workload, print the Pareto front and the fastest setting within the limits below "
        "(--policy and --staleness narrow the sweep)",
    )
    p.add_argument(
        "--max-staleness",
        type=float,
        default=None,
        metavar="X",
        help="with --recommend: the most mean staleness of the trained trajectories",
    )
    p.add_argument(
        "--max-truncated",
        type=float,
        default=None,
        metavar="PCT",
        help="with --recommend: the most trained trajectories cut short, in percent",
    )
    p.add_argument(
        "--objective",
        default=None,
        choices=OBJECTIVES,
        help="with --recommend: what to minimise (default: time to the run's target reward when "
        "it reached it, else time per step)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line per policy and η")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--replay", default=None, metavar="TRACE", help="replay a recorded trace")
    p.add_argument(
        "--record", default=None, metavar="TRACE", help="write the first run's trace to TRACE"
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.calibrate is not None:
        return _calibrate_main(args)
    if args.compare or args.out or _recommend_flag(args):
        flag = "--compare" if args.compare else "--out" if args.out else _recommend_flag(args)
        print(f"stalebound simulate: {flag} needs --calibrate RUN_DIR", file=sys.stderr)
        return 2
    try:
        if args.plot is not None:  # before minutes of simulating, not after
            problem = writable_dir_problem(
                args.plot, label("plot", args.plot), fix="give a directory you can write to"
            )
            if problem:
                raise ConfigError(problem)
        policies = args.policy or list(POLICIES)
        etas, soft = _bounds(args, policies, [4])
        results = run_simulations(
            preset=args.preset,
            workload=args.workload,
            policies=policies,
            etas=etas,
            target=args.target,
            soft=soft,
            seed=args.seed,
            steps=args.steps,
            replay=args.replay,
            record=args.record,
            timeline=args.plot is not None,
        )
    except StaleboundError as exc:
        print(f"stalebound simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for r in results:
            print(json.dumps(r.to_json(), sort_keys=True))
    else:
        _table(results)
    if args.plot:
        from stalebound.sim import plots

        try:
            for path in plots.write_all(results, Path(args.plot)):
                print(f"wrote {path}", file=sys.stderr)
        except OSError as exc:  # the disk filled up, say
            print(
                f"stalebound simulate: {label('plot', args.plot)}: cannot write the plots "
                f"({exc.strerror or exc}); free space there or give another directory",
                file=sys.stderr,
            )
            return 1
    return 0


def run_simulations(
    *,
    preset: str | None = None,
    workload: str | None = None,
    policies: list[str],
    etas: list[int],
    target: int | None = None,
    soft: bool = False,
    seed: int = 0,
    steps: int | None = None,
    replay: str | None = None,
    record: str | None = None,
    timeline: bool = False,
) -> list[SimResult]:
    """Run every (policy, η_h) pair, at the soft target ``target`` for the deadline policies
    (default: theirs); ``sync`` runs once, at η_h = 0. With ``soft``, ``etas`` are what
    ``--staleness`` meant before it named the hard bound: the deadline policies' soft target
    (η_h by their default pairing) and the others' bound."""
    flag = "soft-staleness" if soft else "staleness"
    bad = [e for e in etas if e < 0]
    if bad:
        raise ConfigError(f"{flag}={bad[0]!r}: must be ≥ 0; 0 is synchronous training")
    if target is not None and (target < 0 or target > min(etas, default=target)):
        raise ConfigError(
            f"target={target!r}: the soft admission target must be ≥ 0 and at most every "
            f"--staleness (the hard bound η_h, here {min(etas)}); lower --target or raise "
            "--staleness"
        )
    if steps is not None and steps < 1:
        raise ConfigError(f"steps={steps!r}: must be ≥ 1 train steps")
    if record:
        problem = writable_file_problem(
            record, label("record", record), fix="give a path you can write to"
        )
        if problem:
            raise ConfigError(problem)
    cfg: WorkloadConfig = (
        load_workload(workload) if workload else load_preset(preset or "reference")
    )
    records: list[TrajectoryRecord] | None = None
    bound = None
    if replay:
        _, records = read_trace(replay)
        tokens, decoded, tool, failed = trace_means(records)
        bound = compute_bound(
            cfg,
            attempt_tokens=tokens,
            attempt_steps=decoded,
            attempt_tool=tool,
            failure_rate=failed,
        )
    pairs: list[tuple[str, int, int | None]] = []
    for policy in dict.fromkeys(policies):
        spec = policy_spec(policy)
        for eta in [0] if policy == "sync" else list(dict.fromkeys(etas)):
            if soft:
                pairs.append((policy, spec.hard_bound(eta), spec.target(eta, eta)))
            else:
                pairs.append((policy, eta, target))
    results: list[SimResult] = []
    for i, (policy, eta, soft_target) in enumerate(pairs):
        recorder = None
        if record and i == 0:
            header = TraceHeader(
                source="simulator",
                group_size=cfg.batch.group_size,
                meta={"workload": cfg.name, "policy": policy, "staleness": eta, "seed": seed},
            )
            recorder = TraceRecorder(record, header)
        source = None
        if records is not None:
            launch = cfg.batch.group_size
            if policy == "buffer+redundancy":
                launch += cfg.redundancy.group_extra
            source = ReplaySource(records, launch)
        try:
            result = simulate(
                cfg,
                policy,
                eta,
                target=soft_target,
                seed=seed,
                steps=steps,
                source=source,
                recorder=recorder,
                record_timeline=timeline,
                bound=bound,
            )
        finally:
            if recorder is not None:
                recorder.close()
        results.append(result)
    return results


def _bounds(
    args: argparse.Namespace, policies: list[str], default: list[int]
) -> tuple[list[int], bool]:
    """The bounds asked for and whether they are in the former, soft meaning; warns (stderr)
    where a run's meaning differs from what the same command meant before."""
    if args.soft_staleness is not None:
        if args.target is not None:
            raise ConfigError(
                f"target={args.target}: --soft-staleness already sets the deadline policies' "
                "target; give "
                "--staleness N --target M instead"
            )
        print(
            "stalebound simulate: --soft-staleness is the former meaning of --staleness and goes "
            "in the next release; for the deadline policies write --staleness 2N --target N "
            "(--staleness is the hard bound η_h, --target the soft target η_s)",
            file=sys.stderr,
        )
        return args.soft_staleness, True
    halved = [p for p in policies if policy_spec(p).kind == "deadline" and not policy_spec(p).tight]
    if args.target is None and halved:  # the default bound changed meaning too
        print(
            f"stalebound simulate: --staleness is the hard bound η_h for every policy; "
            f"under {', '.join(halved)} admission aims at the soft target η_s = η_h // 2 "
            "(--target). Before, "
            "--staleness N was their soft target with η_h = 2N: write --staleness 2N --target N "
            "for that (or --soft-staleness N, for one more release)",
            file=sys.stderr,
        )
    return args.staleness or default, False


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _table(results: list[SimResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not results:
        return
    b = results[0].bound
    table = Table(
        title=f"bound {b.value:.2f} traj/s = min(generation {b.generation:.2f}, "
        f"training {b.training:.2f})"
    )
    for col in (
        "policy",
        "η_h",
        "η_s",
        "traj/s",
        "eff.",
        "trainer",
        "engines",
        "stale mean/max",
        "violations",
        "wasted",
        "truncated",
        "STUCK",
        "blocked",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(
            r.policy,
            str(r.staleness),
            str(r.admission),
            _fmt(r.throughput),
            _fmt(r.efficiency, 3),
            _fmt(r.trainer_util),
            _fmt(r.engine_util),
            f"{r.staleness_mean:.2f}/{r.staleness_max}",
            str(r.violations),
            _fmt(r.wasted_fraction, 3),
            _fmt(r.truncated_fraction, 3),
            _fmt(r.stuck_fraction),
            _fmt(r.blocked_fraction),
        )
    # a pipe or file gets the whole table rather than 80 truncated columns
    Console(width=None if sys.stdout.isatty() else 160).print(table)


# ----------------------------------------------------------------------------- calibration


def _recommend_flag(args: argparse.Namespace) -> str | None:
    """The first of the ``--recommend`` flags given, or ``None``."""
    for flag in ("recommend", "max_staleness", "max_truncated", "objective"):
        if getattr(args, flag) not in (None, False):
            return "--" + flag.replace("_", "-")
    return None


def _calibrate_main(args: argparse.Namespace) -> int:
    from stalebound.sim import calibrate as cal_mod

    if _recommend_flag(args) and not args.recommend:
        print(f"stalebound simulate: {_recommend_flag(args)} needs --recommend", file=sys.stderr)
        return 2
    if args.recommend:
        return _recommend_main(args)
    try:
        run_dir = Path(args.calibrate)
        cal, written = _calibrated(args)
        rows = [_prediction(cal_mod, cal, d, args.seed) for d in [run_dir, *args.compare]]
        what_if: list[SimResult] = []
        if args.policy or args.staleness or args.soft_staleness or args.target is not None:
            # the same workload under other policies / bounds
            policies = args.policy or [cal.run.policy]
            etas, soft = _bounds(args, policies, [cal.run.staleness])
            own = args.target is None and etas == [cal.run.staleness] and not soft
            what_if = run_simulations(
                workload=str(written),
                policies=policies,
                etas=etas,
                target=cal.run.target if own and not args.policy else args.target,
                soft=soft,
                seed=args.seed,
                steps=args.steps,
            )
    except StaleboundError as exc:
        print(f"stalebound simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"fits": [f.__dict__ for f in cal.fits], "workload": str(written)}))
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        for r in what_if:
            print(json.dumps(r.to_json(), sort_keys=True))
        return 0
    _print_calibration(cal, written, rows)
    if what_if:
        print("what if (predicted with the calibrated workload):")
        _table(what_if)
    return 0


def _calibrated(args: argparse.Namespace) -> tuple[Any, Path]:
    """Fit the workload to ``--calibrate RUN_DIR`` and write it (``--out``, by default
    ``RUN_DIR/calibrated.yaml``); the calibration and the path written."""
    from stalebound.sim import calibrate as cal_mod

    run_dir = Path(args.calibrate)
    out = Path(args.out) if args.out else run_dir / "calibrated.yaml"
    problem = writable_file_problem(str(out), label("out", str(out)), fix="give another path")
    if problem:
        raise ConfigError(problem)
    cal = cal_mod.calibrate(run_dir, seed=args.seed)
    return cal, cal_mod.write_workload(cal, out)


def _recommend_main(args: argparse.Namespace) -> int:
    from stalebound.sim import recommend as rec_mod

    try:
        rec_mod.check_limits(args.max_staleness, args.max_truncated, args.objective)
        for name in ("target", "soft_staleness"):
            if getattr(args, name) is not None:
                raise ConfigError(
                    f"{name.replace('_', '-')}={getattr(args, name)}: --recommend sweeps the "
                    "soft target itself; narrow the sweep with --policy and --staleness only"
                )
        cal, written = _calibrated(args)
        rec = rec_mod.recommend(
            cal,
            max_staleness=args.max_staleness,
            max_truncated=args.max_truncated,
            objective=args.objective,
            policies=args.policy,
            bounds=args.staleness,
            steps=args.steps,
            seed=args.seed,
        )
    except StaleboundError as exc:
        print(f"stalebound simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**rec.to_json(), "workload": str(written)}, sort_keys=True))
    else:
        _print_recommendation(rec, written)
    if rec.recommended is None:
        assert rec.closest is not None
        print(f"stalebound simulate: {_no_setting(rec)}", file=sys.stderr)
        return 2
    return 0


def _limits(rec: Any) -> str:
    parts = []
    if rec.max_staleness is not None:
        parts.append(f"--max-staleness {rec.max_staleness:g}")
    if rec.max_truncated is not None:
        parts.append(f"--max-truncated {rec.max_truncated:g}")
    return " ".join(parts)


def _no_setting(rec: Any) -> str:
    c = rec.closest
    return (
        f"no setting meets {_limits(rec)} among the {len(rec.candidates)} simulated; the "
        f"closest: {' '.join(c.setting.overrides())} (mean staleness {c.staleness_mean:.2f}, "
        f"{c.truncated:.1%} truncated); loosen the limits or widen --policy / --staleness"
    )


def _print_recommendation(rec: Any, written: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(f"wrote {written} (edit it and pass it to --workload)")
    to_target = rec.objective == "time-to-target"
    what = (
        f"time to the target reward ({rec.steps_to_target} steps, as the run took)"
        if to_target
        else "time per step"
    )
    table = Table(
        title=f"Pareto front of {len(rec.candidates)} simulated settings: predicted {what} "
        "against mean staleness, truncated and wasted"
    )
    for col in ("policy", "η_h", "η_s", "grace", "concurrency"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for col in ("s to target" if to_target else "s per step", "traj/s", "staleness mean"):
        table.add_column(col, justify="right")
    for col in ("truncated", "wasted", "within limits"):
        table.add_column(col, justify="right")
    for i, c in enumerate([rec.current, *rec.front]):
        label = c.setting.label()
        if i == 0:
            label["policy"] += " (the run)"
        elif c is rec.recommended:
            label["policy"] += " (recommended)"
        table.add_row(
            *label.values(),
            f"{c.objective(rec.objective):.3f}",
            f"{c.trajectories_per_s:.0f}",
            f"{c.staleness_mean:.2f}",
            f"{c.truncated:.1%}",
            f"{c.wasted:.1%}",
            "yes" if rec.within(c) else "no",
            style="bold" if i and c is rec.recommended else None,
            end_section=i == 0,
        )
    console.print(table)
    r = rec.recommended
    if r is None:
        return
    within = f" within {_limits(rec)}" if _limits(rec) else ""
    ratio = rec.current.objective(rec.objective) / r.objective(rec.objective)
    console.print(
        f"recommended{within}: predicted {r.objective(rec.objective):.3f} s "
        f"{'to the target' if to_target else 'per step'}, ×{ratio:.2f} the run's speed; "
        "paste after `stalebound train`:"
    )
    print(" ".join(r.setting.overrides()))


def _prediction(cal_mod: Any, cal: Any, run_dir: str | Path, seed: int) -> dict[str, Any]:
    info = cal_mod.read_run_info(run_dir)
    measured = cal_mod.measure(run_dir, cal.workload.run.warmup_fraction)
    r = cal_mod.predict(
        cal,
        policy=info.policy,
        staleness=info.staleness,
        target=info.target,
        steps=measured.steps,
        seed=seed,
    )
    steps = r.steps - min(r.steps - 1, int(r.steps * cal.workload.run.warmup_fraction))
    return {
        "run": str(run_dir),
        "policy": info.policy,
        "staleness": info.staleness,
        "target": r.admission,
        "predicted": {
            "trajectories_per_s": r.throughput,
            "trainer_idle": 1.0 - r.trainer_util,
            "engine_idle": r.engine_idle,
            "staleness_mean": r.staleness_mean,
            "staleness_histogram": {str(k): v for k, v in r.staleness_histogram.items()},
            "step_s": r.window / steps,
        },
        "measured": {
            "trajectories_per_s": measured.trajectories_per_s,
            "trainer_idle": measured.trainer_idle,
            "engine_idle": measured.engine_idle,
            "staleness_mean": measured.staleness_mean,
            "staleness_histogram": {str(k): v for k, v in measured.staleness_histogram.items()},
            "step_s": measured.step_s,
        },
    }


def _histogram(h: dict[str, int]) -> str:
    n = sum(h.values()) or 1
    return " ".join(f"{k}:{v / n:.0%}" for k, v in h.items())


def _print_calibration(cal: Any, written: Path, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    fits = Table(title=f"fitted from {rows[0]['run']}")
    for col in ("workload key", "value", "unit", "fit"):
        fits.add_column(col, justify="right" if col == "value" else "left")
    for f in cal.fits:
        fits.add_row(f.key, f"{f.value:.4g}", f.unit, f.error)
    console.print(fits)
    console.print(f"wrote {written} (edit it and pass it to --workload)")
    table = Table(title="predicted / measured (steps after the first 10 %)")
    for col in (
        "run",
        "policy",
        "η_h",
        "η_s",
        "traj/s",
        "error",
        "trainer idle",
        "engine idle",
        "staleness mean",
        "staleness histogram",
        "s per step",
    ):
        table.add_column(col, justify="left" if col in ("run", "policy") else "right")
    base = next((r for r in rows if r["staleness"] == 0), None)
    for row in rows:
        p, m = row["predicted"], row["measured"]
        tps = f"{p['trajectories_per_s']:.1f} / {m['trajectories_per_s']:.1f}"
        if base is not None and row is not base:
            ps = p["trajectories_per_s"] / base["predicted"]["trajectories_per_s"]
            ms = m["trajectories_per_s"] / base["measured"]["trajectories_per_s"]
            tps += f" (×{ps:.2f} / ×{ms:.2f})"
        table.add_row(
            Path(row["run"]).name,
            row["policy"],
            str(row["staleness"]),
            str(row["target"]),
            tps,
            f"{p['trajectories_per_s'] / m['trajectories_per_s'] - 1:+.1%}",
            f"{p['trainer_idle']:.3f} / {m['trainer_idle']:.3f}",
            f"{p['engine_idle']:.3f} / {m['engine_idle']:.3f}",
            f"{p['staleness_mean']:.2f} / {m['staleness_mean']:.2f}",
            f"{_histogram(p['staleness_histogram'])} / {_histogram(m['staleness_histogram'])}",
            f"{p['step_s']:.3f} / {m['step_s']:.3f}",
        )
    console.print(table)
    if base is not None and len(rows) > 1:
        console.print("(×k: speed-up over the η_h = 0 run, predicted / measured)")

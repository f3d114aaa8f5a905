"""``stalebound bench``: the same workload trained synchronously and asynchronously, side by side.

Every run uses the same config, seed, warm start and prompts; only η changes (η = 0 is synchronous
training: no rollout starts before the trainer has consumed the batch it belongs to). The config is
the train recipe, then the workload's file — ``configs/bench.yaml`` (a reward verifier with a
heavy-tailed latency, the long tail asynchronous training exists for) or, with ``--workload
longtail``, ``configs/bench-longtail.yaml`` (heavy-tailed generation lengths) — then the command
line. Each row also carries the run's data audit (:mod:`stalebound.obs.audit`): how far the trained
data drifted from what was offered.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

from rich.console import Console
from rich.table import Table

from stalebound.config import (
    BENCH_RECIPE,
    TRAIN_RECIPE,
    StaleboundConfig,
    load_config,
    parse_cli_overrides,
)
from stalebound.core.deadline import deadline_bounds
from stalebound.core.errors import ConfigError
from stalebound.obs.audit import data_audit
from stalebound.obs.records import load_run
from stalebound.train.preflight import default_run_dir
from stalebound.train.recipe import run_training

__all__ = ["main", "run_bench"]

HELP = """usage: stalebound bench [CONFIG.yaml ...] [key=value ...] [--staleness 0 1 2 4]
                        [--target N] [--policy sync buffer capacity deadline]
                        [--workload default|longtail] [--same-admission] [--json]

Trains the same workload once per staleness bound (and per policy, side by side) and prints time
to the target reward (run.target_reward), trajectories/s, trainer and engine idle fractions, final
reward, mean and max staleness, violations, truncated and wasted fractions, and the data audit's
headline (KS distance between generated and trained response lengths, the worst difficulty
bucket's trained/offered share ratio, the prompts never trained). --staleness is the
hard bound η_h (rollout.staleness) for every policy; --target is the deadline policy's soft
admission target η_s (rollout.deadline.target, default η_h // 2). --soft-staleness N keeps the
former meaning of --staleness for one more release (deadline at η_s = N, η_h = 2N).
--same-admission runs capacity and buffer at the deadline policy's η_s instead of η_h (AReaL's
max_head_offpolicyness, the admission bound): every policy admits alike, and they differ only in
what bounds the trained data; e.g. --staleness 4 --target 2 --same-admission. The policy
sync is synchronous training (capacity at η_h = 0), run once whatever --staleness says. The
workload is the train recipe plus configs/bench.yaml: rewards from a verifier with a heavy-tailed
latency (task.reward_latency.distribution=none turns it off); --workload longtail takes
configs/bench-longtail.yaml instead: heavy-tailed generation lengths (a strings task copying
log-normal words, p99 answer ~17× the median), rewards at once."""

Policy = Literal["buffer", "capacity", "deadline"]
POLICIES: tuple[Policy, ...] = get_args(Policy)
SYNC = "sync"
"""Synchronous training, as a bench policy: ``capacity`` at η_h = 0."""
WORKLOADS = {
    "default": BENCH_RECIPE,
    "longtail": BENCH_RECIPE.with_name("bench-longtail.yaml"),
}
"""What ``--workload`` names: the file put on top of the train recipe."""


def run_bound(base: StaleboundConfig, policy: str, eta: int, same_admission: bool) -> int:
    """The bound ``policy`` runs at in a bench at η_h = ``eta``: ``eta``; with
    ``same_admission``, ``capacity`` and ``buffer`` at the deadline policy's soft target η_s
    (the config's target, by default η_h // 2) instead."""
    if same_admission and policy in ("capacity", "buffer"):
        return deadline_bounds(base.rollout.deadline.target, eta)[0]
    return eta


def policy_config(
    base: StaleboundConfig,
    policy: str,
    eta: int,
    run_dir: Path,
    *,
    soft: bool = False,
    same_admission: bool = False,
) -> StaleboundConfig:
    """``base`` run under ``policy`` at the hard bound η_h = ``eta`` (``deadline`` at the
    config's soft target, by default η_h // 2), written to ``run_dir``. With ``soft``, ``eta``
    has the former meaning of ``--staleness``: for ``deadline`` the soft target η_s, with the
    hard bound η_h = 2·``eta``. With ``same_admission`` (:func:`run_bound`), ``capacity`` and
    ``buffer`` run at the deadline policy's η_s. ``sync`` is ``capacity`` at η_h = 0, whatever
    ``eta``."""
    eta = run_bound(base, policy, eta, same_admission)
    if policy == SYNC:
        policy, eta = "capacity", 0
    name = next((p for p in POLICIES if p == policy), None)
    if name is None:
        raise ConfigError(f"policy={policy!r}: not a staleness policy; use one of {POLICIES}")
    rollout = dataclasses.replace(base.rollout, staleness_policy=name, staleness=eta)
    if policy == "deadline" and soft:
        soft_target, hard = deadline_bounds(eta, None)
        rollout = dataclasses.replace(
            rollout,
            staleness=hard,
            deadline=dataclasses.replace(rollout.deadline, target=soft_target),
        )
    return dataclasses.replace(
        base,
        rollout=rollout,
        run=dataclasses.replace(base.run, run_dir=str(run_dir), live=False, plots=False),
    )


def run_figures(run_dir: Path) -> dict[str, float | None]:
    """What a run's own records say about staleness and waste: the mean staleness of its trained
    trajectories, the fraction of them cut short (deadline or proactive truncation) and the
    fraction of generated tokens thrown away: the tokens of aborted requests, plus finished
    trajectories discarded with their group (filtered, surplus, retried, aborted at a deadline)
    counted at the run's mean trained length, over those plus the trained tokens."""
    data = load_run(run_dir)
    last = data.steps[-1] if data.steps else {}
    trajectories = sum(float(r.get("num_trajectories", 0.0)) for r in data.steps)
    trained_tokens = sum(float(r.get("num_trained_tokens", 0.0)) for r in data.steps)
    discarded = float(last.get("discarded_members", 0.0))
    mean_length = trained_tokens / trajectories if trajectories else 0.0
    aborted = float(last.get("aborted_tokens", 0.0)) + discarded * mean_length
    generated = trained_tokens + aborted
    audit = data_audit(run_dir)
    return {
        "audit_ks": audit.ks,
        "audit_worst_share_ratio": audit.worst_share_ratio,
        "audit_never_trained_fraction": audit.never_trained_fraction,
        "audit_steps_to_target_offered_mix": audit.steps_to_target_offered_mix,
        "mean_staleness": data.staleness_histogram().mean,
        "truncated_fraction": (
            float(last.get("truncated_trajectories", 0.0)) / trajectories if trajectories else 0.0
        ),
        "wasted_token_fraction": aborted / generated if generated else 0.0,
    }


def run_bench(
    base: StaleboundConfig,
    staleness: Sequence[int],
    out_dir: Path,
    policies: Sequence[str] | None = None,
    *,
    soft: bool = False,
    same_admission: bool = False,
) -> list[dict[str, object]]:
    """One run per policy and hard bound (the config's policy alone when ``policies`` is
    ``None``), each in ``out_dir/eta{η}`` (one policy) or ``out_dir/{policy}-eta{η}`` (several,
    η the bound it runs at); with ``soft``, the bounds have the former meaning, with
    ``same_admission`` capacity and buffer run at η_s (:func:`policy_config`)."""
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the process
    names = [base.rollout.staleness_policy] if policies is None else list(policies)
    runs: list[dict[str, object]] = []
    for policy in names:
        for eta in [0] if policy == SYNC else staleness:
            bound = run_bound(base, policy, eta, same_admission)
            where = out_dir / (
                f"eta{bound}"
                if len(names) == 1
                else SYNC
                if policy == SYNC
                else f"{policy}-eta{bound}"
            )
            cfg = policy_config(base, policy, eta, where, soft=soft, same_admission=same_admission)
            r = run_training(cfg, console=quiet)
            hard = cfg.rollout.staleness
            runs.append(
                {
                    "staleness": hard,
                    "target": (
                        deadline_bounds(cfg.rollout.deadline.target, hard)[0]
                        if policy == "deadline"
                        else hard
                    ),
                    "policy": SYNC if policy == SYNC else r.policy,
                    "time_to_target_s": r.time_to_target_s,
                    "trajectories_per_s": r.trajectories_per_s,
                    "final_reward": r.reward_last,
                    "trainer_idle_fraction": r.trainer_idle_fraction,
                    "engine_idle_fraction": r.engine_idle_fraction,
                    "wall_s": r.wall_s,
                    "eval_before": r.eval_before,
                    "eval_after": r.eval_after,
                    "max_staleness": r.max_staleness,
                    "violations": r.violations,
                    **run_figures(where),
                }
            )
    return runs


def _table(runs: list[dict[str, object]], target: float) -> Table:
    t = Table(title=f"stalebound bench: time to training reward ≥ {target}")
    for col in (
        "η_h",
        "η_s",
        "policy",
        "time to target (s)",
        "speed-up",
        "traj/s",
        "trainer idle",
        "engine idle",
        "final reward",
        "greedy acc",
        "staleness mean / max",
        "violations",
        "truncated",
        "wasted tokens",
        "length KS",
        "worst bucket",
        "never trained",
    ):
        t.add_column(col, justify="right")
    for r in runs:
        # against η = 0 of the same policy (or of any, when it has none)
        sync = next(
            (
                s["time_to_target_s"]
                for s in sorted(runs, key=lambda s: s["policy"] != r["policy"])
                if s["staleness"] == 0
            ),
            None,
        )
        ttt = r["time_to_target_s"]
        mean = r["mean_staleness"]
        speed = f"{sync / ttt:.2f}×" if isinstance(sync, float) and isinstance(ttt, float) else "–"
        t.add_row(
            str(r["staleness"]),
            str(r["target"]),
            str(r["policy"]),
            f"{ttt:.1f}" if isinstance(ttt, float) else "not reached",
            speed,
            f"{r['trajectories_per_s']:.0f}",
            f"{r['trainer_idle_fraction']:.2f}",
            f"{r['engine_idle_fraction']:.2f}",
            f"{r['final_reward']:.3f}",
            f"{r['eval_before']:.2f} → {r['eval_after']:.2f}",
            f"{mean:.2f} / {r['max_staleness']}" if isinstance(mean, float) else "–",
            str(r["violations"]),
            f"{r['truncated_fraction']:.1%}",
            f"{r['wasted_token_fraction']:.1%}",
            _figure(r["audit_ks"], ".3f"),
            _figure(r["audit_worst_share_ratio"], ".2f"),
            _figure(r["audit_never_trained_fraction"], ".1%"),
        )
    return t


def _figure(value: object, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, float | int) else "–"


def _ints(args: list[str], flag: str) -> tuple[list[int] | None, list[str]]:
    """The integers after ``flag`` (``None`` when it is absent) and the other arguments."""
    if flag not in args:
        return None, args
    i = args.index(flag)
    j = i + 1
    while j < len(args) and args[j].isdigit():
        j += 1
    if j == i + 1:
        raise ConfigError(f"{flag} needs integers, e.g. {flag} 0 2")
    return [int(a) for a in args[i + 1 : j]], args[:i] + args[j:]


SOFT_NOTE = (
    "stalebound bench: --soft-staleness is the former meaning of --staleness and goes in the next "
    "release; for deadline write --staleness 2N --target N (--staleness is the hard bound η_h, "
    "--target the soft target η_s)"
)
HARD_NOTE = (
    "stalebound bench: --staleness is the hard bound η_h for every policy; under deadline "
    "admission aims at the soft target η_s = η_h // 2 (--target). Before, --staleness N was its "
    "soft target with η_h = 2N: write --staleness 2N --target N for that (or --soft-staleness N, "
    "for one more release)"
)


def _bounds(
    args: list[str],
) -> tuple[list[int], int | None, bool, list[str]]:
    """``--staleness`` / ``--soft-staleness`` and ``--target``: the bounds, the target, whether
    the bounds have the former (soft) meaning, and the other arguments."""
    hard, args = _ints(args, "--staleness")
    soft, args = _ints(args, "--soft-staleness")
    target, args = _ints(args, "--target")
    if hard is not None and soft is not None:
        raise ConfigError(
            "--soft-staleness: the former spelling of --staleness, not to be given with it; "
            "give --staleness N --target M"
        )
    if target is not None and (len(target) != 1 or soft is not None):
        raise ConfigError(
            f"--target {' '.join(map(str, target))}: one soft target η_s, with --staleness "
            "(--soft-staleness sets its own); e.g. --staleness 4 --target 2"
        )
    return (soft or hard or [0, 1, 2, 4]), (target[0] if target else None), soft is not None, args


def _workload(args: list[str]) -> tuple[str, list[str]]:
    """``--workload NAME`` (default ``default``) and the other arguments."""
    if "--workload" not in args:
        return "default", args
    i = args.index("--workload")
    name = args[i + 1] if i + 1 < len(args) else "(nothing)"
    if name not in WORKLOADS:
        raise ConfigError(
            f"--workload {name}: not a bench workload; use one of {', '.join(WORKLOADS)}, e.g. "
            "--workload longtail"
        )
    return name, args[:i] + args[i + 2 :]


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(HELP)
        return 0
    as_json, same_admission = "--json" in args, "--same-admission" in args
    args = [a for a in args if a not in ("--json", "--same-admission")]
    try:
        staleness, target, soft, args = _bounds(args)
    except ConfigError as e:
        print(f"stalebound bench: {e}", file=sys.stderr)
        return 2
    if same_admission and soft:
        print(
            "stalebound bench: --same-admission with --soft-staleness: the former spelling "
            "already runs capacity and buffer at η_s; give --staleness 2N --target N "
            "--same-admission",
            file=sys.stderr,
        )
        return 2
    policies: list[str] | None = None
    if "--policy" in args:
        i = args.index("--policy")
        j = i + 1
        while j < len(args) and not args[j].startswith("-") and "=" not in args[j]:
            if args[j] not in (SYNC, *POLICIES):
                break
            j += 1
        if j == i + 1 or (
            j < len(args)
            and not args[j].startswith("-")
            and "=" not in args[j]
            and not args[j].endswith((".yaml", ".yml"))
        ):
            bad = args[j] if j < len(args) else "(nothing)"
            print(
                f"stalebound bench: --policy {bad}: not a policy; name one or more of "
                f"{', '.join((SYNC, *POLICIES))}, e.g. --policy capacity deadline",
                file=sys.stderr,
            )
            return 2
        policies, args = args[i + 1 : j], args[:i] + args[j:]
    try:
        workload, args = _workload(args)
        paths, overrides = parse_cli_overrides(args)
        if target is not None:
            overrides = [*overrides, f"rollout.deadline.target={target}"]
        cfg = load_config([TRAIN_RECIPE, WORKLOADS[workload], *paths], overrides)
        deadline = "deadline" in (policies or [cfg.rollout.staleness_policy])
        if deadline and not soft:
            for eta in staleness:  # each run's pair, before any run writes anything
                deadline_bounds(cfg.rollout.deadline.target, eta)
    except ConfigError as e:
        print(f"stalebound bench: {e}", file=sys.stderr)
        return 2
    if deadline:
        if soft:
            print(SOFT_NOTE, file=sys.stderr)
        elif cfg.rollout.deadline.target is None:
            print(HARD_NOTE, file=sys.stderr)
    out = (
        Path(cfg.run.run_dir)
        if cfg.run.run_dir
        else default_run_dir().with_name("bench-" + default_run_dir().name)
    )
    runs = run_bench(cfg, staleness, out, policies, soft=soft, same_admission=same_admission)
    (out / "bench.json").write_text(json.dumps({"runs": runs}, indent=2))
    if as_json:
        print(json.dumps({"runs": runs}))
    else:
        Console(width=200).print(_table(runs, cfg.run.target_reward))
    return 0

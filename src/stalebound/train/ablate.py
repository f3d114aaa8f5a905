"""``stalebound ablate``: which objective keeps learning intact at which staleness bound.

One invocation trains a grid — staleness bounds η × objectives × seeds — on the bench workload
(the train recipe plus ``configs/bench.yaml``, then the command line), one run after another
through :func:`~stalebound.train.job.run_training`. Every row writes its run directory and a JSON
file of what it measured; the grid writes ``ablate.json`` (every row and the per-cell summary) and
``ablate.png`` (final reward against η, one line per objective, the median over seeds with its
range). Rows are run one at a time: each run already keeps both cores busy (the engine worker and
the trainer), so parallel rows only share them.

An objective is named ``BASE[+tis][+token|+seq]``:

* ``ppo``: PPO against the behaviour policy (``prox_mode=none``);
* ``recompute``: decoupled PPO, the proximal policy recomputed at the start of each step;
* ``loglinear``: decoupled PPO, the proximal policy interpolated log-linearly in versions;
* ``+tis``: truncated importance sampling of the behaviour weight (``tis_cap``, needs a proximal
  policy); ``+token`` / ``+seq``: token- or sequence-level rejection by importance ratio.

A finished row is reused when the grid is run again into the same directory with the same
settings, so ``--full`` after the default grid trains only the rows it adds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalebound.config import (
    BENCH_RECIPE,
    TRAIN_RECIPE,
    StaleboundConfig,
    dump_yaml,
    load_config,
    parse_cli_overrides,
)
from stalebound.core.errors import ConfigError, StaleboundError
from stalebound.engines.models import load_model, load_tokenizer
from stalebound.tasks.base import make_task
from stalebound.train.checkpoint import atomic_write_text, find_checkpoint
from stalebound.train.outcome import TrainingInterrupted
from stalebound.train.preflight import default_run_dir
from stalebound.train.recipe import run_training

__all__ = [
    "DEFAULT_GRID",
    "FULL_GRID",
    "Grid",
    "Objective",
    "main",
    "plot_grid",
    "run_grid",
    "summarize",
]

_BASES = {"ppo": "none", "recompute": "recompute", "loglinear": "loglinear"}
_REJECTIONS = {"token": "token", "seq": "sequence"}


@dataclass(frozen=True)
class Objective:
    """One loss of the grid: a proximal policy, TIS on or off, a rejection level."""

    prox_mode: str
    tis: bool = False
    rejection: str = "none"

    @property
    def name(self) -> str:
        """``BASE[+tis][+token|+seq]``, the spelling :meth:`parse` reads."""
        base = next(k for k, v in _BASES.items() if v == self.prox_mode)
        rej = next((k for k, v in _REJECTIONS.items() if v == self.rejection), None)
        return base + ("+tis" if self.tis else "") + (f"+{rej}" if rej else "")

    @property
    def same_at_sync(self) -> bool:
        """Whether this objective is the plain PPO loss at η = 0. There every token was sampled
        by the weights the step starts from, so π_behav = π_prox: the behaviour weight is 1, TIS
        caps nothing and a rejection by π_prox/π_behav masks nothing. Only rejection by
        π_θ/π_behav (``ppo+token``, ``ppo+seq``) can still act, on tokens whose ratio left the
        bounds during the step's own optimizer steps."""
        return self.prox_mode != "none" or self.rejection == "none"

    @classmethod
    def parse(cls, text: str) -> Objective:
        """Read ``BASE[+tis][+token|+seq]``; a bad name is a :class:`ConfigError` naming it."""
        base, *mods = text.split("+")
        fix = (
            "use BASE[+tis][+token|+seq] with BASE ppo, recompute or loglinear, e.g. recompute+tis"
        )
        if base not in _BASES:
            raise ConfigError(f"objective={text!r}: unknown base {base!r}; {fix}")
        tis, rejection = False, "none"
        for mod in mods:
            if mod == "tis" and not tis:
                tis = True
            elif mod in _REJECTIONS and rejection == "none":
                rejection = _REJECTIONS[mod]
            else:
                raise ConfigError(f"objective={text!r}: unknown or repeated part {mod!r}; {fix}")
        if tis and base == "ppo":
            raise ConfigError(
                f"objective={text!r}: TIS caps the weight π_prox/π_behav, which is 1 without a "
                "proximal policy; use recompute+tis or loglinear+tis"
            )
        return cls(_BASES[base], tis, rejection)

    def apply(self, cfg: StaleboundConfig, tis_cap: float) -> StaleboundConfig:
        """``cfg`` with this objective's trainer settings (the rest of ``train`` unchanged)."""
        train = dataclasses.replace(
            cfg.train,
            prox_mode=self.prox_mode,  # type: ignore[arg-type]
            tis_cap=tis_cap if self.tis else None,
            rejection=self.rejection,  # type: ignore[arg-type]
        )
        return dataclasses.replace(cfg, train=train)


@dataclass(frozen=True)
class Grid:
    """The bounds, objectives and seeds one invocation trains, and the run length."""

    staleness: tuple[int, ...]
    objectives: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int


DEFAULT_GRID = Grid(
    staleness=(0, 4, 8),
    objectives=("ppo", "recompute+tis"),
    seeds=(0, 1, 2),
    steps=30,
)
"""What ``stalebound ablate`` trains without flags: plain PPO beside the objective that kept the
reward best in the fuller grid (see docs/training.md); 15 runs, 14–23 minutes on 2 shared cores."""

FULL_GRID = Grid(
    staleness=(0, 1, 2, 4, 8),
    objectives=(
        "ppo",
        "ppo+token",
        "ppo+seq",
        "recompute",
        "recompute+tis",
        "recompute+token",
        "recompute+seq",
        "loglinear",
        "loglinear+tis",
    ),
    seeds=(0, 1, 2),
    steps=80,
)
"""What ``stalebound ablate --full`` trains (the bench's 80 steps; hours on 2 cores)."""

ABLATE_SETTINGS = (
    "rollout.staleness_policy=buffer",
    "train.minibatches=4",
    "run.checkpoint_every_steps=0",
    "run.checkpoint_every_s=0",
    "run.keep_checkpoints=1",
    "run.tensorboard=false",
    "run.trace=false",
)
"""What the grid puts on top of the bench workload before the command line: the buffer policy, so
that η is the staleness the data is trained at (nearly all of it at exactly η); several optimizer
steps per training step, so the proximal policy differs from the current one and clipping acts;
one checkpoint, at the end (the final policy is evaluated from it); no TensorBoard files or
traces."""

POLICY_EVAL_PROMPTS = 256
POLICY_EVAL_SAMPLES = 4
POLICY_EVAL_SEED = 1234
"""The final policy's reward is measured on the same prompts in every row: 256 of the task's
prompts (chosen with this seed) × 4 samples at the engine's temperature."""


def _row_key(objective: str, eta: int, seed: int) -> str:
    return f"{objective}-eta{eta}-seed{seed}"


def _mean(values: Iterable[float]) -> float:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def _step_statistics(metrics_file: Path) -> dict[str, float]:
    """Per-run figures of the loss from ``metrics.jsonl``: means over steps, extremes of the
    ratio and of the trajectories' staleness."""
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]

    def col(key: str) -> list[float]:
        return [float(s[key]) for s in steps if key in s and s[key] is not None]

    return {
        "staleness_mean": _mean(col("traj_staleness_mean")),
        "staleness_max": max(col("traj_staleness_max"), default=0.0),
        "token_staleness_mean": _mean(col("staleness_mean")),
        "clip_fraction": _mean(col("clip_fraction")),
        "ratio_mean": _mean(col("ratio_mean")),
        "ratio_max": max((v for v in col("ratio_max") if math.isfinite(v)), default=math.nan),
        "ratio_min": min((v for v in col("ratio_min") if math.isfinite(v)), default=math.nan),
        "masked_fraction": _mean(col("masked_fraction")),
        "behaviour_weight_mean": _mean(col("behaviour_weight_mean")),
        "kl_behaviour": _mean(col("kl_behaviour")),
    }


def final_policy_reward(cfg: StaleboundConfig, run_dir: Path) -> float:
    """Mean sampled reward of the run's final weights (its last checkpoint) on
    :data:`POLICY_EVAL_PROMPTS` prompts × :data:`POLICY_EVAL_SAMPLES` samples.

    The training reward of a step is earned by weights up to η versions older than the trainer's,
    so at the end of a rising curve it lags by up to η steps; this figure scores the same weights
    (version = steps) in every row, whatever η."""
    import torch  # torch loads when a row is scored

    from stalebound.train.rollout import rollout_groups

    checkpoint = find_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError(
            f"run.checkpoint={cfg.run.checkpoint}: the grid evaluates each run's final weights "
            "from its last checkpoint; leave run.checkpoint=true"
        )
    model = load_model(checkpoint.path)
    tokenizer = load_tokenizer(checkpoint.path)
    task = make_task(cfg.task)
    pool = list(task.samples())
    prompts = random.Random(POLICY_EVAL_SEED).sample(pool, min(POLICY_EVAL_PROMPTS, len(pool)))
    torch.manual_seed(POLICY_EVAL_SEED)
    with torch.no_grad():
        groups = rollout_groups(
            model,
            tokenizer,
            task,
            prompts,
            POLICY_EVAL_SAMPLES,
            temperature=cfg.engine.temperature,
        )
    rewards = [t.reward for g in groups for t in g]
    return sum(rewards) / len(rewards)


def row_config(
    base: StaleboundConfig, objective: Objective, eta: int, seed: int, run_dir: Path, tis_cap: float
) -> StaleboundConfig:
    """The config of one row: ``base`` with its η, objective, seed and run directory."""
    cfg = objective.apply(base, tis_cap)
    return dataclasses.replace(
        cfg,
        seed=seed,
        train=dataclasses.replace(cfg.train, seed=seed),
        rollout=dataclasses.replace(cfg.rollout, staleness=eta),
        run=dataclasses.replace(cfg.run, run_dir=str(run_dir), live=False, plots=False),
    )


def finished_row(row_file: Path, config: str) -> dict[str, Any] | None:
    """The row ``row_file`` holds when it was trained with ``config`` (a config dump), else
    ``None``: no file, another config, or a file that is not a whole row."""
    try:
        done = json.loads(row_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict) or done.get("config") != config:
        return None
    return done


def run_row(
    cfg: StaleboundConfig, objective: str, row_file: Path, console: Console
) -> dict[str, Any]:
    """Train one row (or reuse its finished result with the same config) and write its JSON."""
    text = dump_yaml(cfg)
    done = finished_row(row_file, text)
    if done is not None:
        return done
    run_dir = Path(cfg.run.run_dir or "")
    if run_dir.exists():  # an unfinished or differently configured earlier row of this grid
        shutil.rmtree(run_dir)
    result = run_training(cfg, console=console)
    row: dict[str, Any] = {
        "objective": objective,
        "staleness": cfg.rollout.staleness,
        "seed": cfg.seed,
        "policy_reward": final_policy_reward(cfg, run_dir),
        "final_reward": result.reward_last,
        "first_reward": result.reward_first,
        "greedy_before": result.eval_before,
        "greedy_after": result.eval_after,
        "time_to_target_s": result.time_to_target_s,
        "wall_s": result.wall_s,
        "trajectories_per_s": result.trajectories_per_s,
        "violations": result.violations,
        **_step_statistics(run_dir / "metrics.jsonl"),
        "run_dir": str(run_dir),
        "config": text,
    }
    row["staleness_max"] = result.max_staleness
    atomic_write_text(row_file, json.dumps(row, indent=2))  # a killed write leaves no row
    return row


def run_grid(
    base: StaleboundConfig,
    grid: Grid,
    out_dir: Path,
    *,
    tis_cap: float = 2.0,
    progress: Console | None = None,
) -> list[dict[str, Any]]:
    """Train every row of ``grid`` (seed-major, so a cut-short grid has whole seeds) and return
    the rows. Each row's run directory is ``OUT/runs/KEY``, its JSON ``OUT/rows/KEY.json``."""
    objectives = [Objective.parse(name) for name in grid.objectives]
    base = dataclasses.replace(base, run=dataclasses.replace(base.run, steps=grid.steps))
    (out_dir / "rows").mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the process
    rows: list[dict[str, Any]] = []
    total = len(grid.seeds) * len(grid.staleness) * len(objectives)
    t0 = time.monotonic()
    sync_rows: dict[int, dict[str, Any]] = {}
    for seed in grid.seeds:
        for eta in grid.staleness:
            for objective in objectives:
                shared = eta == 0 and objective.same_at_sync
                if shared and seed in sync_rows:
                    rows.append({**sync_rows[seed], "objective": objective.name})
                    continue
                run_as = Objective("none") if shared else objective
                key = _row_key("sync" if shared else objective.name, eta, seed)
                cfg = row_config(base, run_as, eta, seed, out_dir / "runs" / key, tis_cap)
                row = run_row(cfg, objective.name, out_dir / "rows" / f"{key}.json", quiet)
                row = {**row, "objective": objective.name, "trained_as": run_as.name}
                if shared:
                    sync_rows[seed] = row
                rows.append(row)
                if progress is not None:
                    progress.print(
                        f"[{len(rows)}/{total} {time.monotonic() - t0:.0f}s] {key}: final reward "
                        f"{row['final_reward']:.3f}, final policy {row['policy_reward']:.3f}, "
                        f"greedy {row['greedy_after']:.2f}, "
                        f"clip {row['clip_fraction']:.3f}, masked {row['masked_fraction']:.3f}"
                    )
    return rows


def _median_range(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (objective, η), in the rows' order: medians over seeds with their range, the
    loss statistics averaged over seeds, and the gaps of the median final training reward and
    final policy reward to η = 0's."""
    cells: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in rows:
        cells.setdefault((str(r["objective"]), int(r["staleness"])), []).append(r)
    out: list[dict[str, Any]] = []
    for (objective, eta), rs in cells.items():
        reached = [float(r["time_to_target_s"]) for r in rs if r["time_to_target_s"] is not None]
        cell: dict[str, Any] = {
            "objective": objective,
            "staleness": eta,
            "seeds": [r["seed"] for r in rs],
            "final_reward": _median_range([float(r["final_reward"]) for r in rs]),
            "policy_reward": _median_range([float(r["policy_reward"]) for r in rs]),
            "greedy_after": _median_range([float(r["greedy_after"]) for r in rs]),
            "time_to_target_s": statistics.median(reached) if reached else None,
            "reached_target": len(reached),
            "staleness_mean": _mean(float(r["staleness_mean"]) for r in rs),
            "staleness_max": max(int(r["staleness_max"]) for r in rs),
        }
        for key in ("clip_fraction", "ratio_mean", "masked_fraction", "behaviour_weight_mean"):
            cell[key] = _mean(float(r[key]) for r in rs)
        cell["ratio_max"] = max(float(r["ratio_max"]) for r in rs)
        cell["ratio_min"] = min(float(r["ratio_min"]) for r in rs)
        out.append(cell)
    for key, gap in (("final_reward", "gap_to_sync"), ("policy_reward", "policy_gap_to_sync")):
        sync = {c["objective"]: c[key]["median"] for c in out if c["staleness"] == 0}
        for c in out:
            ref = sync.get(c["objective"])
            c[gap] = None if ref is None else c[key]["median"] - ref
    return out


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


COLUMNS = (
    "objective",
    "η",
    "seeds",
    "final reward (train)",
    "Δ vs η=0",
    "final policy reward",
    "Δ vs η=0",
    "greedy acc",
    "time to target (s)",
    "staleness mean/max",
    "clip frac",
    "ratio mean [min, max]",
    "masked frac",
)
"""The summary's columns: figures are medians over seeds [min–max]; the loss statistics are
means over steps and seeds, the ratio π_θ/π_behav's extremes over all of them."""


def table_rows(cells: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The summary as text cells under :data:`COLUMNS`, by objective, then η."""
    out = []
    for c in sorted(cells, key=lambda c: (str(c["objective"]), int(c["staleness"]))):
        fr, pr, ga = c["final_reward"], c["policy_reward"], c["greedy_after"]
        n = len(c["seeds"])
        ttt = c["time_to_target_s"]
        out.append(
            [
                str(c["objective"]),
                str(c["staleness"]),
                str(n),
                f"{fr['median']:.3f} [{fr['min']:.3f}–{fr['max']:.3f}]",
                _fmt(c["gap_to_sync"], "+.3f"),
                f"{pr['median']:.3f} [{pr['min']:.3f}–{pr['max']:.3f}]",
                _fmt(c["policy_gap_to_sync"], "+.3f"),
                f"{ga['median']:.2f} [{ga['min']:.2f}–{ga['max']:.2f}]",
                "not reached" if ttt is None else f"{ttt:.1f} ({c['reached_target']}/{n})",
                f"{c['staleness_mean']:.2f} / {c['staleness_max']}",
                _fmt(c["clip_fraction"], ".3f"),
                f"{_fmt(c['ratio_mean'], '.3f')} [{_fmt(c['ratio_min'], '.2g')}, "
                f"{_fmt(c['ratio_max'], '.3g')}]",
                _fmt(c["masked_fraction"], ".3f"),
            ]
        )
    return out


def summary_table(cells: Sequence[Mapping[str, Any]], target: float) -> Table:
    """The grid as a terminal table: one row per (objective, η)."""
    t = Table(title=f"stalebound ablate: medians over seeds [min–max]; target reward {target}")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "objective" else "right")
    for row in table_rows(cells):
        t.add_row(*row)
    return t


def markdown_table(cells: Sequence[Mapping[str, Any]]) -> str:
    """The grid as a Markdown table (what ``--markdown`` prints, for the docs)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|:--|" + "--:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(cells)]
    return "\n".join(lines)


def plot_grid(cells: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Final reward against η, one line per objective (the median over seeds, a bar from the
    lowest to the highest seed): the training reward of the last 5 steps on the left, the final
    weights' sampled reward on the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2), layout="constrained")
    panels = (
        ("final_reward", "training reward, last 5 steps"),
        ("policy_reward", "final weights' sampled reward"),
    )
    names = list(dict.fromkeys(str(c["objective"]) for c in cells))
    etas = sorted({int(c["staleness"]) for c in cells})
    pos = {eta: i for i, eta in enumerate(etas)}  # η evenly spaced: 0 1 2 4 8
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            mine = sorted(
                (c for c in cells if c["objective"] == name), key=lambda c: int(c["staleness"])
            )
            xs = [pos[int(c["staleness"])] + (i - (len(names) - 1) / 2) * 0.05 for c in mine]
            med = [c[key]["median"] for c in mine]
            lo = [m - c[key]["min"] for m, c in zip(med, mine, strict=True)]
            hi = [c[key]["max"] - m for m, c in zip(med, mine, strict=True)]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.set_xticks(range(len(etas)), [str(e) for e in etas])
        ax.set_xlabel("staleness bound η")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward (median over seeds, bar: min–max)")
    axes[1].legend(fontsize="small")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=80)
    return path


HELP = """usage: stalebound ablate [CONFIG.yaml ...] [key=value ...] [--full]
       [--staleness 0 4 8] [--objective ppo recompute ...] [--seeds 0 1 2] [--steps N]
       [--tis-cap 2] [--json | --markdown]

Trains every (η, objective, seed) of a grid on the bench workload (the train recipe, then
configs/bench.yaml, then the buffer policy, train.minibatches=4 and one checkpoint at the end,
then the command line) and prints, per objective and η, medians over seeds [min–max] with their
gap to η = 0 of the final training reward (last 5 steps) and of the final weights' sampled
reward (256 prompts × 4 samples), greedy accuracy, time to run.target_reward, staleness, clip fraction, the ratio
π_θ/π_behav and the masked fraction (--markdown: as a Markdown table). Writes OUT/ablate.json,
OUT/ablate.png (both rewards against η) and a JSON file and run directory per row (OUT =
run.run_dir, default runs/ablate-DATE-TIME). Rows already finished in OUT with the same
settings are reused, so a larger grid into the same OUT trains only what it adds.

Objectives: BASE[+tis][+token|+seq], BASE one of ppo (PPO against the behaviour policy),
recompute (decoupled PPO, proximal policy recomputed), loglinear (decoupled PPO, proximal policy
interpolated); +tis caps the behaviour weight at --tis-cap; +token/+seq reject tokens or sequences
by importance ratio.

Default grid: η 0 4 8 × ppo recompute+tis × seeds 0 1 2, 30 steps (15 runs: η = 0 is trained once
per seed, every objective there is the same loss; 14 to 23 minutes on 2 shared cores).
--full: η 0 1 2 4 8 × 9 objectives × seeds 0 1 2, 80 steps (hours)."""


def _take_list(args: list[str], flag: str, parse: Any) -> tuple[list[Any] | None, list[str]]:
    """Remove ``flag V1 V2 ...`` from ``args``; the values run up to the next argument that
    starts with ``--`` or has ``=`` or ends in ``.yaml``."""
    if flag not in args:
        return None, args
    i = args.index(flag)
    j = i + 1
    while j < len(args) and not args[j].startswith("--") and "=" not in args[j]:
        if args[j].endswith((".yaml", ".yml")):
            break
        j += 1
    raw = args[i + 1 : j]
    if not raw:
        raise ConfigError(f"{flag}: needs at least one value; see stalebound ablate --help")
    try:
        values = [parse(v) for v in raw]
    except ValueError as exc:
        raise ConfigError(f"{flag} {' '.join(raw)}: {exc}; see stalebound ablate --help") from None
    return values, args[:i] + args[j:]


def _nonneg_int(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a whole number >= 0")
    return int(text)


def _tis_cap_value(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise ValueError(f"{text!r} must be >= 1 (2 is usual)")
    return value


def parse_args(argv: Sequence[str]) -> tuple[Grid, float, bool, list[str]]:
    """The grid, the TIS cap, ``--json`` and the remaining config arguments of the command."""
    args = list(argv)
    as_json = "--json" in args
    full = "--full" in args
    args = [a for a in args if a not in ("--json", "--full", "--markdown")]
    grid = FULL_GRID if full else DEFAULT_GRID
    staleness, args = _take_list(args, "--staleness", _nonneg_int)
    objectives, args = _take_list(args, "--objective", str)
    seeds, args = _take_list(args, "--seeds", _nonneg_int)
    steps, args = _take_list(args, "--steps", _nonneg_int)
    cap, args = _take_list(args, "--tis-cap", _tis_cap_value)
    if steps is not None and (len(steps) != 1 or steps[0] < 1):
        raise ConfigError(f"--steps {' '.join(map(str, steps))}: give one number >= 1, e.g. 40")
    if cap is not None and len(cap) != 1:
        raise ConfigError(f"--tis-cap {' '.join(map(str, cap))}: give one number, e.g. 2")
    grid = Grid(
        staleness=tuple(dict.fromkeys(staleness or grid.staleness)),
        objectives=tuple(
            dict.fromkeys(Objective.parse(o).name for o in objectives or grid.objectives)
        ),
        seeds=tuple(dict.fromkeys(seeds or grid.seeds)),
        steps=steps[0] if steps else grid.steps,
    )
    return grid, cap[0] if cap else 2.0, as_json, args


def main(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(HELP)
        return 0
    try:
        grid, tis_cap, as_json, args = parse_args(argv)
        paths, overrides = parse_cli_overrides(args)
        cfg = load_config([TRAIN_RECIPE, BENCH_RECIPE, *paths], [*ABLATE_SETTINGS, *overrides])
    except ConfigError as e:
        print(f"stalebound ablate: {e}", file=sys.stderr)
        return 2
    default = default_run_dir()
    out = Path(cfg.run.run_dir) if cfg.run.run_dir else default.with_name("ablate-" + default.name)
    console = Console(width=180, stderr=as_json)
    t0 = time.monotonic()
    try:
        rows = run_grid(cfg, grid, out, tis_cap=tis_cap, progress=console)
    except TrainingInterrupted as e:  # finished rows are kept: the same command continues
        print(f"stalebound ablate: {e}\nfinished rows are in {out / 'rows'}", file=sys.stderr)
        return 128 + e.signum
    except ConfigError as e:  # found once a run starts (an unwritable directory)
        print(f"stalebound ablate: {e}", file=sys.stderr)
        return 2
    except StaleboundError as e:
        print(f"stalebound ablate: {e}", file=sys.stderr)
        return 1
    cells = summarize(rows)
    report = {
        "grid": dataclasses.asdict(grid),
        "tis_cap": tis_cap,
        "minibatches": cfg.train.minibatches,
        "wall_s": time.monotonic() - t0,
        "cells": cells,
        "rows": [{k: v for k, v in r.items() if k != "config"} for r in rows],
    }
    (out / "ablate.json").write_text(json.dumps(report, indent=2))
    plot_grid(cells, out / "ablate.png")
    if as_json:
        print(json.dumps(report))
    elif "--markdown" in argv:
        print(markdown_table(cells))
    else:
        console.print(summary_table(cells, cfg.run.target_reward))
        console.print(
            f"{len(rows)} rows in {report['wall_s']:.0f} s; {out / 'ablate.json'}, "
            f"{out / 'ablate.png'}"
        )
    return 0

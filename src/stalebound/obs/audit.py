"""The data audit: what a run trained against what it was offered.

A run offers prompts (the data loader's draws, numbered as the executor takes them in: the items
of ``ledger.jsonl``) and trains some of their trajectories. A staleness policy that cuts or drops
the slow ones can skew what is trained: long answers scored 0 or discarded, hard prompts trained
less often than they are offered. The audit measures that skew from the run's own records:

* ``items.jsonl`` (written here, while the run goes): one line per item drawn, ``{"offered": 17,
  "id": "4", "difficulty": 9.0}`` (the task's :meth:`~stalebound.tasks.Task.difficulty`), and one
  line per step with its trained trajectories, ``{"step": 3, "trained": [[17, 9, 1.0, false],
  ...]}`` (item, response tokens, reward, truncated);
* ``ledger.jsonl``: the items trained, and those that ended untrained by outcome;
* the episode trace (``trace.jsonl``): the response length of every episode generated.

From these :func:`data_audit` computes, per difficulty bucket (powers of two of the difficulty:
1, 2–3, 4–7, …), the items offered, trained, ended (filtered, dropped, …) and pending, the
trained trajectories, how many were truncated, their mean reward and length, the prompts never
trained, and each bucket's share of the trained items against its share of the decided ones
(trained or ended: the items still pending when the run stopped are left out of the shares and of
the prompts never trained, as nothing was decided about them yet). Over
the whole run: the Kolmogorov–Smirnov distance between the lengths of the episodes generated to
their end and of the trajectories trained, and the mean trained length step by step.

Step by step, too, the training reward as trained and at the offered mix: each bucket's mean
reward in the step weighted by the bucket's offered share. A policy that trains the answers that
finish first trains more easy prompts than were offered early and more hard ones when its
stragglers arrive, and its training reward moves with that mix; at the offered mix it does not.
The steps each took to the run's ``run.target_reward``
(:func:`~stalebound.obs.records.reached_target`) are given both ways.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from stalebound.core.errors import ConfigError
from stalebound.obs.records import (
    LEDGER_FILE,
    TARGET_WINDOW,
    first_at_target,
    read_jsonl,
    target_reward,
)
from stalebound.obs.trace import read_run_trace

__all__ = [
    "DATA_AUDIT_PNG",
    "ITEMS_FILE",
    "BucketAudit",
    "DataAudit",
    "ItemLog",
    "OfferedLoader",
    "audit_table",
    "bucket_of",
    "data_audit",
    "ks_distance",
    "plot_data_audit",
    "print_data_audit",
    "target_line",
]

ITEMS_FILE = "items.jsonl"
DATA_AUDIT_PNG = "data_audit.png"
MIN_BUCKET_ITEMS = 10
"""Buckets with fewer decided items are shown but left out of ``worst_share_ratio``."""
UNKNOWN = "?"
"""The bucket of items whose draw the run did not record (a run written before ``items.jsonl``)."""


class ItemLog:
    """Appends ``RUN_DIR/items.jsonl``; safe to call from the executor's and the trainer's
    threads. A resumed run appends (``append``): :func:`data_audit` keeps the first record of an
    item and the last of a step; otherwise the file starts empty."""

    def __init__(
        self, run_dir: str | Path, difficulty: Callable[[Any], float], *, append: bool = False
    ) -> None:
        self.path = Path(run_dir) / ITEMS_FILE
        self._difficulty = difficulty
        self._lock = threading.Lock()
        self._file: IO[str] = self.path.open("a" if append else "w", encoding="utf-8")

    def _write(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()

    def offered(self, item: int, sample: Any) -> None:
        self._write(
            {
                "offered": item,
                "id": str(getattr(sample, "id", item)),
                "difficulty": float(self._difficulty(sample)),
            }
        )

    def trained(self, step: int, trajectories: Iterable[tuple[int, Any]]) -> None:
        """``trajectories``: ``(item, Trajectory)`` pairs of the batch trained at ``step``."""
        rows = []
        for item, traj in trajectories:
            mask = traj.loss_mask
            tokens = sum(mask) if mask is not None else len(traj.output_ids)
            rows.append([item, tokens, float(traj.reward), bool(traj.truncated)])
        self._write({"step": step, "trained": rows})

    def close(self) -> None:
        with self._lock:
            self._file.close()


class OfferedLoader:
    """A data loader that records each item as it is drawn (:meth:`ItemLog.offered`), numbered
    in draw order — the executor's item numbers when, as in ``stalebound train``, every item
    comes from this loader. Lists and tuples (AReaL's loaders) are drawn item by item."""

    def __init__(self, loader: Iterable[Any], log: ItemLog) -> None:
        self.loader = loader
        self._log = log
        self._drawn = 0

    def __iter__(self) -> Iterator[Any]:
        for element in self.loader:
            for item in element if isinstance(element, list | tuple) else (element,):
                self._log.offered(self._drawn, item)
                self._drawn += 1
                yield item


def bucket_of(difficulty: float | None) -> str:
    """The bucket of a difficulty: powers of two (``1``, ``2–3``, ``4–7``, …), ``0`` below 1."""
    if difficulty is None:
        return UNKNOWN
    if difficulty < 1:
        return "0"
    low = 1 << int(math.log2(difficulty))
    return str(low) if low == 1 else f"{low}–{2 * low - 1}"


def _bucket_key(name: str) -> float:
    return math.inf if name == UNKNOWN else float(name.split("–")[0])


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float | None:
    """The two-sample Kolmogorov–Smirnov statistic: the largest gap between the empirical CDFs
    of ``a`` and ``b`` (``None`` when either is empty)."""
    if not a or not b:
        return None
    xs, ys = sorted(a), sorted(b)
    i = j = 0
    gap = 0.0
    while i < len(xs) and j < len(ys):
        x = min(xs[i], ys[j])
        while i < len(xs) and xs[i] == x:
            i += 1
        while j < len(ys) and ys[j] == x:
            j += 1
        gap = max(gap, abs(i / len(xs) - j / len(ys)))
    return gap


@dataclass
class BucketAudit:
    """One difficulty bucket: its items (prompt draws) and trained trajectories."""

    bucket: str
    offered: int = 0
    trained: int = 0
    """Items with trained trajectories."""
    ended: dict[str, int] = field(default_factory=dict)
    """Items that ended untrained, by outcome (filtered, dropped, surplus, failed, …)."""
    pending: int = 0
    """Items neither trained nor ended at the run's last step."""
    prompts: int = 0
    """Distinct prompts with an item trained or ended (pending ones are not yet decided)."""
    never_trained: int = 0
    """Of those, the prompts of which no trajectory was trained."""
    trajectories: int = 0
    truncated: int = 0
    """Trained trajectories cut short (at a deadline or at ``task.max_new_tokens``)."""
    reward_mean: float | None = None
    tokens_mean: float | None = None
    offered_share: float = 0.0
    """The bucket's share of the decided items (trained or ended; pending ones left out)."""
    trained_share: float = 0.0
    """The bucket's share of the trained items."""
    share_ratio: float | None = None
    """``trained_share / offered_share``: below 1, the bucket is trained less than offered."""


@dataclass
class DataAudit:
    """A run's data audit (module docstring); :meth:`to_json` is what ``summary.json`` holds."""

    offered: int
    trained: int
    ended: dict[str, int]
    pending: int
    prompts: int
    never_trained: int
    ks: float | None
    """KS distance between generated (complete episodes, ``trace.jsonl``) and trained lengths."""
    generated_tokens_mean: float | None
    trained_tokens_mean: float | None
    worst_share_ratio: float | None
    """The smallest ``share_ratio`` of the buckets with at least :data:`MIN_BUCKET_ITEMS`
    decided items: the most under-trained bucket (smaller ones are too noisy to rank)."""
    buckets: list[BucketAudit]
    length_by_step: list[tuple[int, float]]
    """The mean response length of each step's trained trajectories."""
    reward_by_step: list[tuple[int, float, float]] = field(default_factory=list)
    """Each step's mean trained reward, and the same at the offered mix: the mean reward of
    each bucket the step trained, weighted by the bucket's ``offered_share``."""
    target_reward: float | None = None
    """The run's ``run.target_reward`` (``None`` when its ``config.yaml`` has none)."""
    steps_to_target: int | None = None
    """The step at which the trained reward reached ``target_reward`` (``None``: never)."""
    steps_to_target_offered_mix: int | None = None
    """The same for the reward at the offered mix."""

    @property
    def never_trained_fraction(self) -> float | None:
        return self.never_trained / self.prompts if self.prompts else None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["never_trained_fraction"] = self.never_trained_fraction
        data["length_by_step"] = [list(p) for p in self.length_by_step]
        data["reward_by_step"] = [list(p) for p in self.reward_by_step]
        return data


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def data_audit(run_dir: str | Path) -> DataAudit:
    """The data audit of ``run_dir`` (module docstring), up to the last step of its ledger."""
    root = Path(run_dir)
    ledger = {int(r["step"]): r for r in read_jsonl(root / LEDGER_FILE)}  # a resume's lines win
    last = max(ledger, default=0)
    offered: dict[int, tuple[str, float]] = {}
    rows: dict[int, list[list[Any]]] = {}
    for r in read_jsonl(root / ITEMS_FILE):
        if "offered" in r:
            offered.setdefault(int(r["offered"]), (str(r["id"]), float(r["difficulty"])))
        elif int(r["step"]) <= last:
            rows[int(r["step"])] = r["trained"]
    outcome: dict[int, str] = {}
    for step in sorted(ledger):
        for item in ledger[step]["trained"]:
            outcome[item] = "trained"
        for name, items in ledger[step]["ended"].items():
            for item in items:
                outcome.setdefault(item, name)
    items = set(offered) | set(outcome)
    by_bucket: dict[str, BucketAudit] = {}
    prompts: dict[str, dict[str, bool]] = {}  # bucket → prompt id → trained at least once

    def bucket(item: int) -> BucketAudit:
        name = bucket_of(offered[item][1]) if item in offered else UNKNOWN
        return by_bucket.setdefault(name, BucketAudit(name))

    for item in sorted(items):
        b, what = bucket(item), outcome.get(item)
        b.offered += 1
        if what == "trained":
            b.trained += 1
        elif what is None:
            b.pending += 1
        else:
            b.ended[what] = b.ended.get(what, 0) + 1
        if what is not None:  # decided: a prompt whose items are all pending is not counted
            prompt = offered[item][0] if item in offered else f"item {item}"
            seen = prompts.setdefault(b.bucket, {})
            seen[prompt] = seen.get(prompt, False) or what == "trained"
    rewards: dict[str, list[float]] = {}
    lengths: dict[str, list[float]] = {}
    trained_lengths: list[float] = []
    by_step: list[tuple[int, float]] = []
    for step in sorted(rows):
        step_lengths = []
        for item, tokens, reward, truncated in rows[step]:
            b = bucket(int(item))
            b.trajectories += 1
            b.truncated += bool(truncated)
            rewards.setdefault(b.bucket, []).append(float(reward))
            lengths.setdefault(b.bucket, []).append(float(tokens))
            step_lengths.append(float(tokens))
        trained_lengths += step_lengths
        if step_lengths:
            by_step.append((step, sum(step_lengths) / len(step_lengths)))
    total_offered = len(items)
    total_trained = sum(b.trained for b in by_bucket.values())
    decided = total_offered - sum(b.pending for b in by_bucket.values())
    for b in by_bucket.values():
        seen = prompts.get(b.bucket, {})
        b.prompts, b.never_trained = len(seen), sum(not t for t in seen.values())
        b.reward_mean = _mean(rewards.get(b.bucket, []))
        b.tokens_mean = _mean(lengths.get(b.bucket, []))
        b.offered_share = (b.offered - b.pending) / decided if decided else 0.0
        b.trained_share = b.trained / total_trained if total_trained else 0.0
        if total_trained and b.offered_share:
            b.share_ratio = b.trained_share / b.offered_share
    reward_by_step = _reward_by_step(rows, bucket)
    target = target_reward(root)
    ratios = [
        b.share_ratio
        for b in by_bucket.values()
        if b.share_ratio is not None and b.offered - b.pending >= MIN_BUCKET_ITEMS
    ]
    generated = [float(r.tokens) for r in read_run_trace(root) if r.complete and not r.failed]
    ended: Counter[str] = Counter()
    for b in by_bucket.values():
        ended.update(b.ended)
    return DataAudit(
        offered=total_offered,
        trained=total_trained,
        ended=dict(ended),
        pending=sum(b.pending for b in by_bucket.values()),
        prompts=sum(b.prompts for b in by_bucket.values()),
        never_trained=sum(b.never_trained for b in by_bucket.values()),
        ks=ks_distance(generated, trained_lengths),
        generated_tokens_mean=_mean(generated),
        trained_tokens_mean=_mean(trained_lengths),
        worst_share_ratio=min(ratios, default=None),
        buckets=sorted(by_bucket.values(), key=lambda b: _bucket_key(b.bucket)),
        length_by_step=by_step,
        reward_by_step=reward_by_step,
        target_reward=target,
        steps_to_target=_steps_to(target, reward_by_step, 1),
        steps_to_target_offered_mix=_steps_to(target, reward_by_step, 2),
    )


def _reward_by_step(
    rows: Mapping[int, list[list[Any]]], bucket: Callable[[int], BucketAudit]
) -> list[tuple[int, float, float]]:
    """Each step's mean trained reward and its reward at the offered mix (``DataAudit``)."""
    out = []
    for step in sorted(rows):
        per: dict[str, tuple[BucketAudit, list[float]]] = {}
        for item, _tokens, reward, _truncated in rows[step]:
            b = bucket(int(item))
            per.setdefault(b.bucket, (b, []))[1].append(float(reward))
        if not per:
            continue
        raw = sum(sum(r) for _, r in per.values()) / sum(len(r) for _, r in per.values())
        total = sum(b.offered_share for b, _ in per.values())
        mix = (
            sum(b.offered_share * sum(r) / len(r) for b, r in per.values()) / total
            if total
            else raw
        )
        out.append((step, raw, mix))
    return out


def _steps_to(
    target: float | None, rewards: Sequence[tuple[int, float, float]], column: int
) -> int | None:
    """The step at which ``rewards``' ``column`` (1: as trained, 2: at the offered mix) reached
    ``target``."""
    if target is None:
        return None
    at = first_at_target([r[column] for r in rewards], target)
    return None if at is None else rewards[at - 1][0]


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def audit_table(audit: DataAudit) -> Any:
    """The audit as a :class:`rich.table.Table`: one row per difficulty bucket and a total."""
    from rich.table import Table

    t = Table(
        title=(
            f"data audit: KS(generated, trained lengths) {_num(audit.ks, '.3f')}, mean length "
            f"{_num(audit.generated_tokens_mean, '.1f')} generated → "
            f"{_num(audit.trained_tokens_mean, '.1f')} trained; worst bucket share ratio "
            f"{_num(audit.worst_share_ratio, '.2f')}; never trained "
            f"{_num(audit.never_trained_fraction, '.1%')} of prompts"
        )
    )
    for col in (
        "difficulty",
        "offered",
        "trained",
        "ended",
        "pending",
        "share offered → trained",
        "ratio",
        "never trained",
        "trajectories",
        "truncated",
        "reward",
        "mean tokens",
    ):
        t.add_column(col, justify="right")

    def ended(counts: Mapping[str, int]) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "0"

    for b in audit.buckets:
        t.add_row(
            b.bucket,
            str(b.offered),
            str(b.trained),
            ended(b.ended),
            str(b.pending),
            f"{b.offered_share:.1%} → {b.trained_share:.1%}",
            _num(b.share_ratio, ".2f"),
            f"{b.never_trained} / {b.prompts}",
            str(b.trajectories),
            str(b.truncated),
            _num(b.reward_mean, ".3f"),
            _num(b.tokens_mean, ".1f"),
        )
    t.add_row(
        "all",
        str(audit.offered),
        str(audit.trained),
        ended(audit.ended),
        str(audit.pending),
        "",
        "",
        f"{audit.never_trained} / {audit.prompts}",
        str(sum(b.trajectories for b in audit.buckets)),
        str(sum(b.truncated for b in audit.buckets)),
        "",
        _num(audit.trained_tokens_mean, ".1f"),
    )
    return t


def target_line(audit: DataAudit) -> str | None:
    """The steps the run's training reward took to its target, as trained and at the offered
    mix; ``None`` for a run with no target."""
    if audit.target_reward is None or not audit.reward_by_step:
        return None

    def at(step: int | None) -> str:
        return "not reached" if step is None else f"step {step}"

    return (
        f"target reward {audit.target_reward:g} (the mean of {TARGET_WINDOW} steps): "
        f"{at(audit.steps_to_target)} as trained, {at(audit.steps_to_target_offered_mix)} at "
        "the offered mix (each bucket's reward in a step weighted by its offered share)"
    )


def plot_data_audit(
    run_dir: str | Path, audit: DataAudit, out_dir: str | Path | None = None
) -> Path:
    """Draw ``data_audit.png``: each bucket's share of the offered and of the trained items, the
    mean trained response length step by step, and the training reward as trained and at the
    offered mix."""
    from matplotlib.figure import Figure

    out = Path(run_dir if out_dir is None else out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(16, 4))
    shares, lengths, rewards = fig.subplots(1, 3)
    names = [b.bucket for b in audit.buckets]
    xs = list(range(len(names)))
    shares.bar(
        [x - 0.2 for x in xs], [b.offered_share for b in audit.buckets], 0.4, label="offered"
    )
    shares.bar(
        [x + 0.2 for x in xs], [b.trained_share for b in audit.buckets], 0.4, label="trained"
    )
    shares.set_xticks(xs, names)
    shares.set_xlabel("difficulty (reference answer length)")
    shares.set_ylabel("share of items")
    shares.legend()
    _by_step(
        lengths,
        {"trained": audit.length_by_step},
        ("generated", audit.generated_tokens_mean),
        "mean response tokens",
    )
    _by_step(
        rewards,
        {
            "as trained": [(step, raw) for step, raw, _ in audit.reward_by_step],
            "at the offered mix": [(step, mix) for step, _, mix in audit.reward_by_step],
        },
        ("target", audit.target_reward),
        "training reward",
    )
    fig.tight_layout()
    path = out / DATA_AUDIT_PNG
    fig.savefig(path)
    return path


def _by_step(
    ax: Any,
    curves: Mapping[str, Sequence[tuple[int, float]]],
    level: tuple[str, float | None],
    ylabel: str,
) -> None:
    """One panel of ``data_audit.png``: ``curves`` over the steps and a dashed ``level``."""
    for label, points in curves.items():
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker=".", label=label)
    if level[1] is not None and any(curves.values()):
        ax.axhline(level[1], ls="--", c="grey", label=level[0])
    if any(curves.values()):
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)


def print_data_audit(run_dir: str | Path) -> int:
    """``stalebound audit --data RUN_DIR``: print the audit table and draw its plot (when the
    ``obs`` extra is installed). Raises :class:`~stalebound.core.errors.ConfigError` for a
    directory with no ledger."""
    from rich.console import Console

    if not (Path(run_dir) / LEDGER_FILE).is_file():
        raise ConfigError(
            f"run_dir={str(run_dir)!r}: holds no {LEDGER_FILE}; give the directory of a run "
            "written by stalebound train"
        )
    audit = data_audit(run_dir)
    console = Console(width=160)
    console.print(audit_table(audit))
    line = target_line(audit)
    if line is not None:
        console.print(line, highlight=False)
    try:
        path = plot_data_audit(run_dir, audit)
    except ImportError as exc:
        console.print(f"no plot ({exc}): pip install 'stalebound[obs]'", highlight=False)
    else:
        console.print(f"wrote {path}", highlight=False)
    return 0

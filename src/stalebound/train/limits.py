"""Size settings checked against the machine's memory before a run starts.

A run holds, at its fullest, what its settings let in: the items queued for admission, the
members of every group generating at once (each a task with its request and its tokens), the
completed groups waiting in the buffers of the admission window, and the batch the trainer
trains on. :func:`estimate` adds these up from the settings (``rollout.*``, ``task.max_new_tokens``,
``train.minibatches``) with per-unit costs on the low side, so a run that fits is never refused;
:func:`memory_problems` refuses a run whose estimate exceeds the memory available, naming the
setting and the largest value of it that fits with the others as they are.

Nothing here allocates: the settings are resolved by the decision core (pure), and the memory
available is read from ``/proc/meminfo`` and the cgroup's limit, where there are such files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

from stalebound.core import ConfigError, resolve_settings

__all__ = ["MemoryUse", "available_memory", "estimate", "memory_problems"]

ITEM_BYTES = 1_000
"""A queued item: its data (a prompt and its columns) and the queue's bookkeeping."""
MEMBER_BYTES = 4_000
"""A member generating: its task, coroutine, request and the coordinator's bookkeeping."""
ENTRY_BYTES = 200
"""A buffer entry and the group it holds."""
TOKEN_BYTES = 64
"""A token held in Python lists: its id, behaviour log-probability and version."""
TRAIN_TOKEN_BYTES = 16
"""Per token and vocabulary entry of a trained minibatch, on a CPU trainer: the logits, their
log-softmax and the gradients of both, 4 bytes each."""
PROMPT_TOKENS = 32
"""Tokens a prompt is taken to have (the tasks' prompts are shorter)."""

SIZE_SETTINGS = {
    "rollout.consumer_batch_size": "batch_size",
    "rollout.group_size": "group_size",
    "rollout.group_redundancy": "group_redundancy",
    "rollout.buffer_size": "buffer_size",
    "rollout.max_concurrent_rollouts": "max_concurrent",
    "rollout.queue_size": "queue_size",
    "rollout.staleness": "staleness",
    "rollout.deadline.slack": "deadline_slack",
    "task.max_new_tokens": None,
}
"""The settings the estimate grows with, and the core's name for each (what an unset one
resolves to)."""
_SMALLEST = {"rollout.staleness": 0, "rollout.deadline.slack": 0}
"""The smallest value of a setting (1 for the others)."""


@dataclass(frozen=True)
class MemoryUse:
    """What a run's settings let it hold at its fullest, in bytes, by part."""

    queued: int
    generating: int
    buffered: int
    training: int

    @property
    def total(self) -> int:
        return self.queued + self.generating + self.buffered + self.training


def estimate(cfg: Any, *, vocab_size: int, trains_on_cpu: bool) -> MemoryUse:
    """The memory the run of ``cfg`` holds at its fullest (see the module docstring);
    ``vocab_size`` of the policy, ``trains_on_cpu``: the training batch's tensors count too."""
    s = resolve_settings(cfg.rollout)
    tokens = PROMPT_TOKENS + cfg.task.max_new_tokens
    members = s.max_concurrent * s.group_redundancy
    window = s.staleness if s.soft_staleness is None else s.soft_staleness
    entries = (window + 1) * (s.buffer_size + s.deadline_slack)
    trained = s.batch_size * s.group_size * tokens
    return MemoryUse(
        queued=min(s.queue_size, s.max_concurrent + 1) * ITEM_BYTES,
        generating=members * (MEMBER_BYTES + tokens * TOKEN_BYTES),
        buffered=entries * (ENTRY_BYTES + s.group_size * tokens * TOKEN_BYTES),
        training=(
            trained * vocab_size * TRAIN_TOKEN_BYTES // cfg.train.minibatches
            if trains_on_cpu
            else 0
        ),
    )


def memory_problems(cfg: Any, available: int, *, vocab_size: int, trains_on_cpu: bool) -> list[str]:
    """``name=value: why, and the fix`` for a run whose :func:`estimate` exceeds ``available``
    bytes: each size setting that alone can make it fit, with the largest value that does; when
    none can, the settings together. Empty when the run fits."""

    def need(c: Any) -> int:
        return estimate(c, vocab_size=vocab_size, trains_on_cpu=trains_on_cpu).total

    total = need(cfg)
    if total <= available:
        return []
    head = f"the run would hold about {_bytes(total)}, more than the {_bytes(available)} of memory"
    head += " available"
    # the setting to name: of those that alone can make the run fit, the one furthest above
    # its default (a run with rollout.staleness=1000000 fits with a batch of 2 groups too, but
    # it is the bound that is out of scale)
    candidates = []
    for key in (k for k in SIZE_SETTINGS if isinstance(attrgetter(k)(cfg), int)):
        value = attrgetter(key)(cfg)
        fits = _largest(cfg, key, lambda c: need(c) <= available)
        if fits is not None and fits < value:
            candidates.append((value / max(1, _default(cfg, key)), key, value, fits))
    if not candidates:
        given = ", ".join(
            f"{k}={attrgetter(k)(cfg)}" for k in SIZE_SETTINGS if attrgetter(k)(cfg) is not None
        )
        return [f"{given}: {head}; make them smaller together"]
    _, key, value, fits = max(candidates)
    return [
        f"{key}={value}: {head}; the largest value that fits is {fits} (with the other settings "
        "as they are)"
    ]


def _default(cfg: Any, key: str) -> int:
    """What ``key`` is in a run of the default settings."""
    defaults = type(cfg)()
    value = attrgetter(key)(defaults)
    core_name = SIZE_SETTINGS[key]
    if value is None and core_name is not None:
        value = getattr(resolve_settings(defaults.rollout), core_name)
    return int(value or 0)


def _largest(cfg: Any, key: str, fits: Callable[[Any], bool]) -> int | None:
    """The largest value of setting ``key`` up to its value in ``cfg`` with which ``fits`` (which
    turns false as the value grows); ``None`` when even its smallest value does not fit."""

    def fits_with(value: int) -> bool:
        try:
            return fits(_with(cfg, key, value))
        except ConfigError:  # a value the setting does not take (null where a number is needed)
            return False

    low, high = _SMALLEST.get(key, 1), attrgetter(key)(cfg)
    if not fits_with(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits_with(mid):
            low = mid
        else:
            high = mid - 1
    return int(low)


def _bytes(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.1f} {unit}"
    return f"{n} bytes"


def _with(cfg: Any, key: str, value: int) -> Any:
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _with(getattr(cfg, head), rest, value)})


def available_memory() -> int | None:
    """Bytes of memory this process may still take: the kernel's ``MemAvailable``, less when a
    cgroup limit leaves less; ``None`` where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(used))
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        with contextlib.suppress(OSError, ValueError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(found) if found else None

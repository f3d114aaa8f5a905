"""Replay of a recorded trace: the recorded trajectories, re-timed under a modelled workload.

:class:`ReplaySource` keeps the workload and re-times it: each group launched for the k-th prompt
draws its members from the complete records of the k-th prompt of the trace (cycling through them),
and the engine model of the chosen workload decides how long they take. When the trace runs out of
prompts it starts again from its first one and counts the wrap. The file format is
:mod:`stalebound.obs.trace`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from stalebound.core.errors import ConfigError
from stalebound.obs.trace import TrajectoryRecord
from stalebound.sim.workload import TrajectorySpec, split_turns

__all__ = ["ReplaySource", "decode_steps", "id_key", "record_spec", "trace_means"]

log = logging.getLogger(__name__)


def record_spec(rec: TrajectoryRecord) -> TrajectorySpec:
    """The spec a complete record replays as: its tokens split around its tool calls."""
    turns = len(rec.tool_latencies) + 1
    tokens = max(1, rec.tokens)
    segments = split_turns(tokens, turns)
    tools = rec.tool_latencies[: len(segments) - 1]
    return TrajectorySpec(tuple(segments), tools, rec.failed)


def decode_steps(rec: TrajectoryRecord) -> int:
    """The decode steps a record's episode took: its tokens less each turn's first, which comes
    with the turn's prefill (:mod:`stalebound.sim.engine`)."""
    return max(0, rec.tokens - 1 - len(rec.tool_latencies))


class ReplaySource:
    """Trajectory specs from a trace, by prompt in order of first appearance (module docstring)."""

    def __init__(self, records: list[TrajectoryRecord], group_launch: int) -> None:
        prompts: dict[Any, list[TrajectorySpec]] = {}
        skipped = 0
        for rec in records:
            if not rec.complete:
                skipped += 1
                continue
            prompts.setdefault(id_key(rec.prompt_id), []).append(record_spec(rec))
        if not prompts:
            raise ConfigError(
                "replay: the trace holds no complete trajectory records; record a run whose "
                "trajectories finish (complete: true)"
            )
        self._prompts = list(prompts.values())
        self._launch = group_launch
        self.skipped = skipped
        self.wraps = 0
        self._seen = 0
        if skipped:
            log.info("replay: %d incomplete records skipped (their lengths are censored)", skipped)

    @property
    def prompts(self) -> int:
        return len(self._prompts)

    def spec(self, prompt: int, attempt: int, member: int) -> TrajectorySpec:
        n = len(self._prompts)
        if prompt >= self._seen:
            self._seen = prompt + 1
            if prompt and prompt % n == 0:
                self.wraps += 1
                log.info("replay: trace prompts used up; starting again (wrap %d)", self.wraps)
        specs = self._prompts[prompt % n]
        return specs[(attempt * self._launch + member) % len(specs)]


def trace_means(records: list[TrajectoryRecord]) -> tuple[float, float, float, float]:
    """Per attempt over the complete records: mean tokens, mean :func:`decode_steps`, mean tool
    seconds, failure rate."""
    done = [r for r in records if r.complete]
    if not done:
        raise ConfigError("replay: the trace holds no complete trajectory records")
    n = len(done)
    tokens = sum(r.tokens for r in done) / n
    steps = sum(decode_steps(r) for r in done) / n
    tools = sum(sum(r.tool_latencies) for r in done) / n
    failed = sum(r.failed for r in done) / n
    return tokens, steps, tools, failed


def id_key(value: Any) -> Any:
    """A trace's prompt or group id as a dict key (a list or mapping as its JSON text)."""
    return json.dumps(value, sort_keys=True) if isinstance(value, list | dict) else value

"""The admitted groups and what becomes of their members: trained, or ended untrained and
counted (with what they generated wasted), and recorded in the trace when one is written.

Accounting is per trajectory (group member): every member launched ends trained, dropped, failed or
cancelled (surplus, retried, aborted with its group), or is still in flight or waiting at the end;
:meth:`Fleet.conservation` counts the last three.
"""

from __future__ import annotations

from typing import cast

from stalebound.core import MemberId
from stalebound.core.events import HandOverBatch
from stalebound.obs.trace import TraceRecorder, TrajectoryRecord
from stalebound.sim.engine_model import (
    CUTTING,
    DECODING,
    FINISHED,
    GONE,
    RUNNING,
    TOOL_CALL,
    EngineModel,
    Group,
    Member,
)
from stalebound.sim.results import Meter

__all__ = ["COUNTED_AS", "Fleet"]

COUNTED_AS = {"abandoned": "aborted", "failed": "aborted"}
"""How the coordinator's causes are counted per member (the simulator's result keys): a member
stopped or thrown away with its failed group is "aborted"; "failed" counts its own failures."""


class Fleet:
    """The groups in flight (by id) and the fates of their members, counted in ``meter``."""

    def __init__(self, meter: Meter, recorder: TraceRecorder | None) -> None:
        self.groups: dict[int, Group] = {}
        self.meter = meter
        self.recorder = recorder

    def member(self, mid: MemberId) -> Member:
        return self.groups[cast(int, mid.group_id)].members[mid.number]

    def train(self, a: HandOverBatch, now: float) -> float:
        """The batch ``a`` is trained: count its members and their staleness, let its groups go;
        returns its tokens."""
        meter = self.meter
        tokens = 0.0
        trained = truncated = 0
        for hg in a.groups:
            continued = hg.group_id in a.continued
            for r, _, cut in hg.members:
                m: Member = r.result
                m.state = GONE
                tokens += m.tokens
                trained += 1
                truncated += cut
                if cut:
                    meter.tokens["truncated"] += m.tokens
                meter.histogram[a.version - r.version] += 1
                if continued:
                    meter.continued[a.version - r.version] += 1
                if self.recorder is not None:
                    self.record(m, "trained", not cut, now)
            g = self.groups.pop(hg.group_id)
            g.members = {}  # break the group ↔ member cycles
        meter.counts["trained"] += trained
        meter.counts["truncated_trained"] += truncated
        meter.tokens["trained"] += tokens
        return tokens

    def gone(
        self, m: Member, outcome: str, now: float, *, complete: bool, generated: bool = True
    ) -> None:
        """``m`` ended untrained (``outcome``); what it generated is wasted."""
        tokens = self.meter.tokens
        if generated and m.state != FINISHED:
            m.end = now
            tokens["generated"] += m.tokens
        m.state = GONE
        self.meter.counts[outcome] += 1
        tokens["wasted"] += m.tokens
        if self.recorder is not None:
            self.record(m, outcome, complete, now)

    def leave(self, g: Group, cause: str, now: float) -> None:
        """The group left untrained: what its finished members generated is wasted."""
        outcome = COUNTED_AS.get(cause, cause)
        for m in g.members.values():
            if m.state == FINISHED:
                self.gone(m, outcome, now, complete=not m.truncated)
        del self.groups[g.gid]
        g.members = {}  # break the group ↔ member cycles
        self.meter.counts[f"groups_{outcome}"] += 1

    def record(self, m: Member, outcome: str, complete: bool, now: float) -> None:
        assert self.recorder is not None
        waits = m.spec.tools[: m.tools]
        rewarded = m.spec.reward_wait and m.tools == len(m.spec.tools)  # its last wait the reward's
        self.recorder.record(
            TrajectoryRecord(
                prompt_id=m.group.prompt,
                group_id=m.group.gid,
                member=m.number,
                start=m.start,
                end=m.end if m.end >= 0 else now,
                tokens=round(m.tokens),
                tool_latencies=tuple(waits[:-1] if rewarded else waits),
                failed=m.spec.failed and complete,
                version=m.version,
                complete=complete,
                outcome=outcome,
                reward_latency=waits[-1] if rewarded else 0.0,
            )
        )

    def record_unfinished(self, engines: EngineModel, now: float) -> None:
        """End of run: record what is still in flight, so a trace keeps every trajectory."""
        for g in self.groups.values():
            for m in g.members.values():
                if m.state in (DECODING, TOOL_CALL):
                    m.tokens = engines.progress(m, now)
                    self.record(m, "running", False, now)
                elif m.state in (FINISHED, CUTTING):
                    self.record(m, "finished", not m.truncated, now)

    def conservation(self, group_size: int) -> dict[str, int]:
        """Members still in flight (``running``), finished in an incomplete group
        (``finished_pending``), or in a complete group not yet consumed (``waiting``)."""
        running = finished_pending = waiting = 0
        for g in self.groups.values():
            done = 0
            for m in g.members.values():
                if m.state in RUNNING:
                    running += 1
                elif m.state == FINISHED:
                    done += 1
            if g.finished >= group_size:
                waiting += done
            else:
                finished_pending += done
        return {"running": running, "finished_pending": finished_pending, "waiting": waiting}

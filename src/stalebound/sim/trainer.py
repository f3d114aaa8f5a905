"""The trainer model: one batch at a time, with hand-over, training, publication and contention."""

from __future__ import annotations

from typing import NamedTuple

from stalebound.sim.config import WorkloadConfig

__all__ = ["StepTimes", "TrainerModel"]


class StepTimes(NamedTuple):
    """One step on the virtual clock: asked for its batch, trained from ``start`` to
    ``trained`` (``work`` seconds of it uncontended), published until ``end``."""

    asked: float
    start: float
    trained: float
    end: float
    work: float


class TrainerModel:
    """The trainer: one batch at a time. ``handoff`` seconds pass before it starts (counted as
    idle), then ``step_time + per_token × trained tokens`` seconds of training and ``publish``
    seconds handing the weights to the engines (both busy).

    With ``contention`` the training runs ``1 + contention × s`` times slower while a share ``s``
    of the replicas has work: :meth:`reshare` is told each change of ``s`` and returns the step's
    new end (the simulator moves the step's end event, superseding the old one by ``ticket``)."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        t = cfg.trainer
        self.step_time = t.step_time
        self.per_token = t.per_token
        self.handoff = t.handoff
        self.publish = t.publish
        self.contention = t.contention
        self.publish_per_start = t.publish_per_start
        self.training = False
        self.steps_done = 0
        self.ticket = 0
        """Numbers the step's end event; a moved end supersedes the earlier event."""
        self._busy = 0.0
        self._start = 0.0
        self._work = 0.0
        """Training left at ``_mark``, in seconds on an uncontended processor."""
        self._mark = 0.0
        self._slow = 1.0
        self._free_since = 0.0
        self.waits: list[float] = []
        """Each step's wait, from the trainer asking for a batch to training (the hand-over)."""
        self.log: list[StepTimes] = []
        """Each finished step's times, as a real run's metrics record them."""
        self._asked = 0.0
        self._uncontended = 0.0

    def start(self, now: float, tokens: float, share: float = 0.0) -> float:
        """Take a batch of ``tokens`` tokens while a share ``share`` of the replicas has work;
        returns when the step (publication included) ends."""
        self.training = True
        self.ticket += 1
        self._start = self._mark = now + self.handoff
        self.waits.append(self._start - self._free_since)
        self._asked = self._free_since
        self._work = self._uncontended = self.step_time + self.per_token * tokens
        self._slow = 1.0 + self.contention * share
        return self._end()

    def _end(self) -> float:
        return self._mark + self._work * self._slow + self.publish

    def reshare(self, now: float, share: float) -> float | None:
        """The share of replicas with work changed at ``now``: the step's new end, or ``None``
        when it does not move (no contention, no step, or the training is over)."""
        slow = 1.0 + self.contention * share
        if not self.training or slow == self._slow:
            return None
        if now > self._mark:  # training since the mark (not still in the hand-over)
            done = (now - self._mark) / self._slow
            if done >= self._work:
                return None  # publishing
            self._work -= done
            self._mark = now
        self._slow = slow
        self.ticket += 1
        return self._end()

    def done(self, now: float) -> None:
        self.log.append(
            StepTimes(self._asked, self._start, now - self.publish, now, self._uncontended)
        )
        self.training = False
        self._busy += now - self._start
        self._free_since = now
        self.steps_done += 1

    def busy_until(self, now: float) -> float:
        return self._busy + (max(0.0, now - self._start) if self.training else 0.0)

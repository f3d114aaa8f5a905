"""The batched inference-replica model (and, for older imports, the clock's
:class:`~stalebound.sim.clock.EventQueue`).

:class:`Replica` models continuous batching without one event per token. All active sequences of a
replica advance together, one token per decode step, and a step takes ``a + b × active`` seconds.
The replica keeps a *step counter* ``progress`` (steps taken since start, a real number between
events) and each sequence's finishing step ``join progress + tokens``; a min-heap of those gives the
next completion, whose time follows analytically while the active count stays fixed. A join or a
leave changes the step time, so the replica re-derives its next completion then (one event per
change, superseded events are ignored by a ticket number). Cost: O(log n) per join and finish.

With ``per_ctx`` a step also costs ``per_ctx × active × context`` seconds, where ``context`` is
the tokens the oldest active sequence has decoded in its segment: an engine that keeps its batch's
KV cache as one padded tensor (the embedded engine pads every row to the longest live context)
attends over that many positions for every row. The context grows by one token per step, so
between two events a step's time grows linearly with progress, and the time to a given progress
(and the progress at a given time) follows in closed form (a quadratic).

Three costs beyond the decode step, each 0 unless a workload sets it (calibration fits them):

* ``prefill``: seconds each joining sequence stalls the whole replica before it decodes (a
  continuous-batching engine prefills newcomers between two decode steps);
* ``max_batch``: sequences decoded at once; later ones wait, first come first served, and join
  (prefill included) when one leaves;
* :meth:`Replica.stall`: the replica stops decoding for a while (installing new weights).

With ``cohort_padding`` the replica decodes in cohorts as the embedded engine on a CPU does
(:mod:`stalebound.sim.cohorts`): each step runs one forward pass per cohort and pays ``step_base``
once per pass, and ``per_ctx`` for each cohort's rows × its own width (the context of its oldest
row) rather than every row × the oldest context. The cohorts change only when a sequence joins
or leaves, so between two events the step time stays linear in progress and the closed form
holds.

A sequence's first token comes with its prefill, as in a real engine (the prefill's logits give
it): a sequence of ``tokens`` tokens takes ``tokens − 1`` decode steps, so a one-token answer
finishes when its prefill ends. A sequence of 0 tokens (a wait modelled as a segment, like a
reward) finishes at once, with no prefill.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any

from stalebound.sim.clock import EventQueue
from stalebound.sim.cohorts import Cohort, Cohorts

__all__ = ["EventQueue", "Replica", "Sequence"]


class Sequence:
    """One decode segment on a replica: it finishes when the replica's progress reaches ``finish``.

    A sequence waiting for a batch place has ``waiting`` set; ``start`` and ``finish`` are set
    when it joins the batch."""

    __slots__ = ("cancelled", "cohort", "finish", "owner", "start", "steps", "tokens", "waiting")

    def __init__(self, owner: Any, start: float, tokens: int) -> None:
        self.owner = owner
        self.start = start
        self.tokens = tokens
        self.steps = max(0, tokens - 1)  # decode steps: the first token comes with the prefill
        self.finish = start + self.steps
        self.cancelled = False
        self.waiting = False
        self.cohort: Cohort | None = None


class Replica:
    """One inference replica with continuous batching (see the module docstring).

    ``slots`` counts the sequences placed on the replica, whether decoding or waiting on a tool;
    ``active`` counts those decoding, which set the step time.
    """

    __slots__ = (
        "_cohorts",
        "_heap",
        "_oldest",
        "_seq",
        "_waiting",
        "active",
        "busy_time",
        "index",
        "last",
        "max_batch",
        "max_slots",
        "per_ctx",
        "per_seq",
        "prefill",
        "progress",
        "slots",
        "stalled_until",
        "step_base",
        "ticket",
        "tokens",
        "waiting",
    )

    def __init__(
        self,
        index: int,
        max_slots: int,
        step_base: float,
        per_seq: float,
        *,
        prefill: float = 0.0,
        max_batch: int | None = None,
        per_ctx: float = 0.0,
        cohort_padding: float | None = None,
    ) -> None:
        self.index = index
        self.max_slots = max_slots
        self.step_base = step_base
        self.per_seq = per_seq
        self.per_ctx = per_ctx
        self.prefill = prefill
        self.max_batch = max_slots if max_batch is None else max_batch
        self.slots = 0
        self.active = 0
        self.waiting = 0
        """Sequences waiting for a batch place (not cancelled)."""
        self.stalled_until = 0.0
        """Decoding resumes at this time (prefills and weight installs stall it until then)."""
        self._waiting: deque[Sequence] = deque()
        self.progress = 0.0
        self.last = 0.0
        self.tokens = 0.0
        """Tokens decoded so far (all sequences), for utilisation."""
        self.busy_time = 0.0
        """Seconds with at least one active sequence."""
        self.ticket = 0
        self._heap: list[tuple[float, int, Sequence]] = []
        self._oldest: list[tuple[float, int, Sequence]] = []
        """The active sequences by the progress they joined at (kept only with ``per_ctx`` and
        without cohorts)."""
        self._seq = 0
        self._cohorts = None if cohort_padding is None else Cohorts(cohort_padding)
        """The decode cohorts (``cohort_padding`` set): ``step_base`` is paid once per cohort."""

    def advance(self, now: float) -> None:
        """Bring ``progress`` and the counters up to ``now``."""
        last = self.last
        if now > last and (self.active or self.waiting):
            self.busy_time += now - last
            dt = now - max(last, self.stalled_until)
            if dt > 0 and self.active:
                steps = self._steps_in(dt)
                self.progress += steps
                self.tokens += steps * self.active
        self.last = now

    def _costs(self) -> tuple[float, float]:
        """The current step's seconds and what each further step adds (the context's growth)."""
        cohorts = self._cohorts
        passes = cohorts.count(self.progress) if cohorts is not None else 1
        first = self.step_base * passes + self.per_seq * self.active
        if not self.per_ctx:
            return first, 0.0
        growth = self.per_ctx * self.active
        if cohorts is not None:  # each cohort attends its own width
            return first + self.per_ctx * cohorts.slots(self.progress), growth
        oldest = self._oldest
        while oldest and oldest[0][2].cancelled:
            heapq.heappop(oldest)
        context = self.progress - oldest[0][0] if oldest else 0.0
        return first + growth * context, growth

    def _steps_in(self, seconds: float) -> float:
        """Decode steps taken in ``seconds`` of decoding from the current progress."""
        first, growth = self._costs()
        if not growth:
            return seconds / first
        # growth/2 × n² + first × n = seconds, solved without cancellation
        return 2 * seconds / (first + math.sqrt(first * first + 2 * growth * seconds))

    def _seconds_for(self, steps: float) -> float:
        """Seconds of decoding the next ``steps`` steps take from the current progress."""
        first, growth = self._costs()
        return steps * first + growth * steps * steps / 2

    def stall(self, seconds: float) -> None:
        """Stop decoding for ``seconds`` from now (after earlier stalls); call :meth:`advance`
        first."""
        if seconds > 0:
            self.stalled_until = max(self.last, self.stalled_until) + seconds

    def join(self, owner: Any, tokens: int) -> Sequence:
        """Start decoding ``tokens`` tokens for ``owner`` (or queue it while the batch is full);
        call :meth:`advance` first."""
        s = Sequence(owner, self.progress, tokens)
        if tokens and self.active >= self.max_batch:
            s.waiting = True
            self.waiting += 1
            self._waiting.append(s)
            return s
        self._begin(s)
        return s

    def _begin(self, s: Sequence) -> None:
        s.waiting = False
        s.start = self.progress
        s.finish = s.start + s.steps
        if s.tokens:
            self.stall(self.prefill)
        self._seq += 1
        heapq.heappush(self._heap, (s.finish, self._seq, s))
        if self.per_ctx and self._cohorts is None:  # cohorts keep their own widths
            heapq.heappush(self._oldest, (s.start, self._seq, s))
        if self._cohorts is not None and s.tokens:
            s.cohort = self._cohorts.join(s.start)
        self.active += 1

    def _fill(self) -> None:
        """Waiting sequences take the batch places that came free."""
        queue = self._waiting
        while queue and self.active < self.max_batch:
            s = queue.popleft()
            if not s.cancelled:
                self.waiting -= 1
                self._begin(s)

    def decoded(self, s: Sequence) -> float:
        """Tokens ``s`` has decoded so far (call :meth:`advance` first)."""
        if s.waiting or not s.tokens:
            return 0.0
        return 1.0 + min(self.progress, s.finish) - s.start  # the prefill's token, then a step's

    def cancel(self, s: Sequence) -> float:
        """Stop a sequence; returns the tokens it decoded. Call :meth:`advance` first."""
        done = self.decoded(s)
        s.cancelled = True
        if s.waiting:
            self.waiting -= 1
        else:
            self.active -= 1
            self._leave(s)
            self._fill()
        return done

    def _leave(self, s: Sequence) -> None:
        if s.cohort is not None and self._cohorts is not None:
            self._cohorts.leave(s.cohort, s.start)
            s.cohort = None

    def next_finish(self, now: float) -> float | None:
        """When the next active sequence finishes at the current step time, or ``None``."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if not heap:
            return None
        remaining = heap[0][0] - self.progress
        start = max(now, self.stalled_until)
        if remaining <= 0:  # a one-token answer: done when its prefill (the stall) ends
            return start
        return start + self._seconds_for(remaining)

    def pop_finished(self) -> list[Sequence]:
        """Sequences whose finishing step has been reached (a tiny tolerance absorbs rounding)."""
        done: list[Sequence] = []
        heap = self._heap
        limit = self.progress + 1e-6
        while heap and heap[0][0] <= limit:
            s = heapq.heappop(heap)[2]
            if not s.cancelled:
                s.cancelled = True  # finished: no longer cancellable
                self._leave(s)
                done.append(s)
        self.active -= len(done)
        if self._waiting:
            self._fill()
        return done

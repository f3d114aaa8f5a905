"""Several engine replicas behind one engine: least-loaded placement, oldest V_traj first.

:class:`Router` implements :class:`~stalebound.engines.protocol.MigratableEngine` over any
replicas that implement :class:`~stalebound.engines.protocol.InferenceEngine` (migration needs
replicas that are migratable too). Placement and queueing are decided here, by the router's own
count of the requests it has in flight on each replica:

* A request goes to the replica with the fewest in-flight requests; ties go to the lowest index
  (deterministic).
* With ``max_in_flight_per_engine`` set, a request that finds every replica full waits in the
  router's queue, ordered by ``priority_version`` (the trajectory's V_traj; a request without one
  counts as the router's version when it arrived), then by arrival. So the stalest trajectories
  get a slot first, before they fall out of the staleness window. Without a limit, requests go to
  the replicas at once and each replica's own queue applies the same order.
* ``pause``/``resume``/``update_weights`` go to every replica; ``get_version`` is the lowest
  replica version (the version every replica has reached).
* :meth:`Router.migrate` moves a running request to another replica; the caller's pending
  ``agenerate`` keeps waiting and returns the whole sequence. The request keeps its V_traj and
  its tokens keep their versions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.engines.protocol import (
    Continuation,
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    MigratableEngine,
    WeightSource,
)

__all__ = ["Router", "RouterStatistics"]


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    """A snapshot of the router's counters."""

    in_flight: tuple[int, ...]
    """Requests in flight on each replica (by replica index)."""
    queued: int
    routed: tuple[int, ...]
    """Requests (and continuations) placed on each replica, cumulative."""
    aborted_queued: int
    migrations: int


@dataclass(eq=False)
class _Waiter:
    request_id: str
    slot: asyncio.Future[int]
    partial: GenerateResponse
    """What the request returns if it is aborted before it reaches a replica."""


class Router:
    """Route requests over ``engines`` (see the module docstring)."""

    def __init__(
        self,
        engines: Sequence[InferenceEngine],
        *,
        max_in_flight_per_engine: int | None = None,
    ) -> None:
        problems = []
        if not engines:
            problems.append("engines=[]: a router needs at least one engine replica")
        candidates: Sequence[object] = engines  # checked at run time: callers may pass anything
        for i, engine in enumerate(candidates):
            if not isinstance(engine, InferenceEngine):
                problems.append(
                    f"engines[{i}]={type(engine).__name__}: does not implement the "
                    "InferenceEngine protocol (agenerate, abort, pause, resume, "
                    "update_weights, get_version)"
                )
        if max_in_flight_per_engine is not None and max_in_flight_per_engine < 1:
            problems.append(
                f"max_in_flight_per_engine={max_in_flight_per_engine!r}: must be >= 1, or None "
                "for no limit"
            )
        if problems:
            raise ConfigError(problems)
        self.engines: tuple[InferenceEngine, ...] = tuple(engines)
        self._limit = max_in_flight_per_engine
        self._load = [0] * len(self.engines)
        self._routed = [0] * len(self.engines)
        self._where: dict[str, int] = {}
        self._queue: list[tuple[int, int, _Waiter]] = []
        self._queued: dict[str, _Waiter] = {}
        self._moves: dict[str, asyncio.Future[tuple[int, Continuation] | None]] = {}
        self._arrivals = itertools.count()
        self._aborted_queued = 0
        self._migrations = 0

    # -- placement ----------------------------------------------------------------------------

    def _least_loaded(self, exclude: int | None = None) -> int | None:
        best: int | None = None
        for i, load in enumerate(self._load):
            if i == exclude or (self._limit is not None and load >= self._limit):
                continue
            if best is None or load < self._load[best]:
                best = i
        return best

    def _take(self, index: int, request_id: str) -> None:
        self._load[index] += 1
        self._routed[index] += 1
        self._where[request_id] = index

    def _release(self, index: int, request_id: str) -> None:
        self._load[index] -= 1
        if self._where.get(request_id) == index:
            del self._where[request_id]
        # Hand the freed slot to the oldest waiting request.
        while self._queue:
            target = self._least_loaded()
            if target is None:
                return
            _, _, waiter = heapq.heappop(self._queue)
            if self._queued.pop(waiter.request_id, None) is None or waiter.slot.done():
                continue  # aborted or cancelled while queued
            self._take(target, waiter.request_id)
            waiter.slot.set_result(target)

    async def _acquire(self, request: GenerateRequest, partial: GenerateResponse) -> int | None:
        """A replica index for the request, waiting in the queue if all are full; ``None`` when
        the request was aborted while it waited."""
        rid = request.request_id
        if rid in self._where or rid in self._queued:
            raise ProtocolError(
                f"request_id={rid!r} is already in flight on this router; request ids must be "
                "unique among in-flight requests"
            )
        index = self._least_loaded()
        if index is not None and not self._queue:
            self._take(index, rid)
            return index
        priority = request.priority_version
        waiter = _Waiter(rid, asyncio.get_running_loop().create_future(), partial)
        key = self.get_version() if priority is None else priority
        heapq.heappush(self._queue, (key, next(self._arrivals), waiter))
        self._queued[rid] = waiter
        try:
            return await waiter.slot
        except asyncio.CancelledError:
            self._queued.pop(rid, None)
            if waiter.slot.done() and not waiter.slot.cancelled():
                self._release(waiter.slot.result(), rid)
            raise
        except _AbortedWhileQueued:
            return None

    # -- the engine protocol ------------------------------------------------------------------

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        """Generate on the least-loaded replica; follows the request if it is migrated."""
        return await self._run(request, None)

    async def _run(
        self, request: GenerateRequest, continuation: Continuation | None
    ) -> GenerateResponse:
        rid = request.request_id
        partial = _partial(continuation or Continuation.of(request))
        index = await self._acquire(request, partial)
        if index is None:
            return partial
        try:
            engine = self.engines[index]
            if continuation is None:
                response = await engine.agenerate(request)
            else:
                response = await _migratable(engine, index).acontinue(continuation)
            while response.finish_reason == "abort" and rid in self._moves:
                move = await self._moves.pop(rid)
                if move is None:
                    break
                target, moved = move
                self._load[index] -= 1
                self._take(target, rid)
                index = target
                response = await _migratable(self.engines[target], target).acontinue(moved)
            return response
        finally:
            self._release(index, rid)

    async def abort(self, request_id: str) -> GenerateResponse | None:
        """Abort on whichever replica holds the request (or drop it from the router's queue)."""
        waiter = self._queued.pop(request_id, None)
        if waiter is not None:
            waiter.slot.set_exception(_AbortedWhileQueued())
            self._aborted_queued += 1
            return waiter.partial
        index = self._where.get(request_id)
        if index is None:
            return None
        return await self.engines[index].abort(request_id)

    async def pause(self) -> None:
        """Pause every replica."""
        await asyncio.gather(*(e.pause() for e in self.engines))

    async def resume(self) -> None:
        """Resume every replica."""
        await asyncio.gather(*(e.resume() for e in self.engines))

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Update every replica (concurrently)."""
        await asyncio.gather(*(e.update_weights(source, version) for e in self.engines))

    def get_version(self) -> int:
        """The lowest version among the replicas."""
        return min(e.get_version() for e in self.engines)

    # -- migration ----------------------------------------------------------------------------

    async def export_continuation(self, request_id: str) -> Continuation | None:
        """Take a request out of its replica (its ``agenerate`` returns the partial output)."""
        index = self._where.get(request_id)
        if index is None:
            return None
        return await _migratable(self.engines[index], index).export_continuation(request_id)

    async def acontinue(self, continuation: Continuation) -> GenerateResponse:
        """Resume an exported request on the least-loaded replica."""
        return await self._run(continuation.request, continuation)

    async def migrate(self, request_id: str, to: int | None = None) -> bool:
        """Move a running request to replica ``to`` (default: the least-loaded other one).

        The caller's ``agenerate`` keeps waiting and returns the complete sequence. Returns
        ``False`` if the request is not running on a replica (unknown, queued or finished).
        """
        source = self._where.get(request_id)
        if source is None or request_id in self._moves:
            return False
        target = to
        if target is None:
            target = _lowest(self._load, exclude=source)
            if target is None:
                return False
        if not 0 <= target < len(self.engines) or target == source:
            raise ProtocolError(
                f"migrate({request_id!r}, to={to!r}): the target must be another replica index "
                f"in [0, {len(self.engines)}), not the source {source}"
            )
        _migratable(self.engines[target], target)
        move: asyncio.Future[tuple[int, Continuation] | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._moves[request_id] = move
        try:
            continuation = await _migratable(self.engines[source], source).export_continuation(
                request_id
            )
        except BaseException:
            self._moves.pop(request_id, None)
            move.set_result(None)
            raise
        if continuation is None:
            self._moves.pop(request_id, None)
            move.set_result(None)
            return False
        self._migrations += 1
        move.set_result((target, continuation))
        return True

    def statistics(self) -> RouterStatistics:
        """A frozen snapshot of the counters."""
        return RouterStatistics(
            in_flight=tuple(self._load),
            queued=len(self._queued),
            routed=tuple(self._routed),
            aborted_queued=self._aborted_queued,
            migrations=self._migrations,
        )


class _AbortedWhileQueued(Exception):
    """Internal: wakes a request that was aborted before it reached a replica."""


def _lowest(load: list[int], *, exclude: int) -> int | None:
    candidates = [(n, i) for i, n in enumerate(load) if i != exclude]
    return min(candidates)[1] if candidates else None


def _migratable(engine: Any, index: int) -> MigratableEngine:
    if not isinstance(engine, MigratableEngine):
        raise ProtocolError(
            f"engine replica {index} ({type(engine).__name__}) does not support migration "
            "(export_continuation / acontinue); use replicas such as LocalEngine"
        )
    return engine


def _partial(continuation: Continuation) -> GenerateResponse:
    return GenerateResponse(
        request_id=continuation.request.request_id,
        input_ids=continuation.request.input_ids,
        output_ids=continuation.output_ids,
        output_logprobs=continuation.output_logprobs,
        output_versions=continuation.output_versions,
        finish_reason="abort",
        resubmits=continuation.resubmits,
    )

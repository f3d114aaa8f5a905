"""The executor's asyncio plumbing for running episodes: no staleness decision is made here.

* :class:`GroupTasks` / :class:`MemberTask` — the tasks of one admitted group and of each of its
  members (what the coordinator calls a group and a member, seen as asyncio work).
* :class:`MemberEngine` — the engine as one member's workflow sees it: it remembers the ids of the
  requests in flight, so the executor can abort them on the engine, and reports progress.
* :class:`EpisodeDeadlines` — episode timeouts, bucketed into few loop timers.
* :class:`ItemSource` — an endless stream of items from a data loader (``prepare_batch``).
* Small readers of engine answers: :func:`token_versions`, :func:`request_id`,
  :func:`output_tokens`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from stalebound.core import ConfigError, MemberId

__all__ = [
    "EpisodeDeadlines",
    "GroupTasks",
    "ItemSource",
    "MemberEngine",
    "MemberTask",
    "ShouldAccept",
    "WorkflowProtocol",
    "call_abort",
    "output_tokens",
    "request_id",
    "token_versions",
]


class WorkflowProtocol(Protocol):
    """A rollout workflow: one call generates one trajectory (``None`` rejects it)."""

    async def arun_episode(self, engine: Any, data: Any) -> Any: ...


ShouldAccept = Callable[[list[Any]], bool]
"""Called with a completed group's trajectories (the workflows' return values, in finish order);
``False`` discards the group (counted as ``filtered_groups``)."""


class GroupTasks:
    """The running members of one admitted group, and its item."""

    __slots__ = ("data", "deadlines", "gid", "members", "start_key", "workflow")

    def __init__(self, gid: int, data: Any, workflow: WorkflowProtocol, start_key: int) -> None:
        self.gid = gid
        self.data = data
        self.workflow = workflow
        self.members: dict[int, MemberTask] = {}
        self.deadlines: list[int] = []  # the timeout buckets it is in
        self.start_key = start_key  # the timeout bucket of the members launched with the group


class MemberTask:
    """One running episode."""

    __slots__ = (
        "cause",
        "deadline",
        "engine",
        "episode",
        "group",
        "mid",
        "started",
        "task",
        "truncated",
    )

    def __init__(self, group: GroupTasks, mid: MemberId, deadline: int) -> None:
        self.group = group
        self.mid = mid
        self.deadline = deadline  # its timeout bucket
        self.episode: Any = None  # what arun_episode returned (a coroutine)
        self.engine: MemberEngine | None = None
        self.started = False
        self.task: asyncio.Task[Any] | None = None
        self.cause: str | None = None  # set when it is stopped on purpose
        self.truncated = False  # its requests are aborted as they come; its output is kept


def request_id(request: Any) -> Any:
    """The id of an engine request (attribute or key ``request_id``), or ``None``."""
    if isinstance(request, dict):
        return request.get("request_id")
    return getattr(request, "request_id", None)


def output_tokens(response: Any) -> int:
    """How many tokens a (partial) engine response holds: ``len(output_ids)``, 0 if unknown."""
    if response is None:
        return 0
    ids = response.get("output_ids") if isinstance(response, dict) else None
    if ids is None:
        ids = getattr(response, "output_ids", None)
    try:
        return len(ids) if ids is not None else 0
    except TypeError:
        return 0


def token_versions(result: Any) -> tuple[int, ...] | None:
    """Per-token versions from a trajectory: key or attribute ``token_versions`` or ``versions``."""
    if isinstance(result, (dict, Mapping)):  # dict first: the ABC check is slow
        tv = result.get("token_versions")
        if tv is None:
            tv = result.get("versions")
    else:
        tv = getattr(result, "token_versions", None)
        if tv is None:
            tv = getattr(result, "versions", None)
    if tv is None:
        return None
    if hasattr(tv, "tolist"):  # a tensor or an array, possibly [1, seqlen]
        tv = tv.tolist()
    if tv and isinstance(tv[0], list | tuple):  # one row per sequence: flatten
        return tuple(int(x) for row in tv for x in row)
    return tuple(tv)


async def call_abort(abort: Callable[[Any], Any], rid: Any) -> Any:
    result = abort(rid)
    if inspect.isawaitable(result):
        result = await result
    return result


class MemberEngine:
    """The inference engine as one member's workflow sees it.

    Every attribute is the real engine's, except ``agenerate``, which also remembers the ids of the
    requests in flight, so the executor can abort them on the engine (surplus, retry, truncate)
    without workflows exposing ids, and reports each answer as progress (the watchdog's clock). A
    member stopped on purpose may send no new request; a truncated one has each new request
    aborted as soon as the engine has taken it.
    """

    __slots__ = ("_count_abort", "_engine", "_member", "_progress", "inflight")

    def __init__(
        self,
        engine: Any,
        member: MemberTask,
        progress: Callable[[MemberId], None],
        count_abort: Callable[[str], None],
    ) -> None:
        self._engine = engine
        self._member = member
        self._progress = progress
        self._count_abort = count_abort  # counts an aborted request by cause
        self.inflight: dict[Any, None] = {}  # request ids, in issue order

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, request: Any) -> Any:
        m = self._member
        if m.cause is not None:  # stopped on purpose; its task is being cancelled
            raise asyncio.CancelledError(f"member {m.mid} was settled ({m.cause})")
        rid = request_id(request)
        if rid is None:
            response = await self._engine.agenerate(request)
        else:
            self.inflight[rid] = None
            try:
                if m.truncated:
                    response = await self._truncated(request, rid)
                else:
                    response = await self._engine.agenerate(request)
            finally:
                self.inflight.pop(rid, None)
        self._progress(m.mid)
        return response

    async def _truncated(self, request: Any, rid: Any) -> Any:
        """A request issued after its member was truncated: let the engine take it, then abort
        it at once, so the workflow gets whatever the engine had (possibly nothing)."""
        task = asyncio.ensure_future(self._engine.agenerate(request))
        await asyncio.sleep(0)  # the engine registers the request
        if not task.done():
            await call_abort(self._engine.abort, rid)
            self._count_abort("truncated")
        return await task


class EpisodeDeadlines:
    """Episode timeouts, bucketed: one loop timer per ``timeout / 64`` seconds, not per episode.

    A member expires at most one bucket (≈1.6 % of the timeout) after its own deadline. Buckets
    hold groups, not members: members launched together share a bucket, so the per-episode cost
    is one integer. A group leaves its buckets when it settles, so memory stays proportional to
    the running groups. Expiry only turns the passage of time into a member failure (cause
    ``timeout``); what follows is the coordinator's decision.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: float,
        expire: Callable[[MemberTask], None],
    ) -> None:
        self.loop = loop
        self.expire = expire
        self.timeout = timeout
        self.resolution = max(timeout / 64, 0.001)
        self.buckets: dict[int, set[GroupTasks]] = {}

    def key(self) -> int:
        """The bucket of an episode starting now: it fires at or after the episode's deadline."""
        return int((self.loop.time() + self.timeout) / self.resolution) + 1

    def watch(self, group: GroupTasks, key: int) -> None:
        if key in group.deadlines:
            return
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = set()
            self.loop.call_at(key * self.resolution, self._fire, key)
        bucket.add(group)
        group.deadlines.append(key)

    def forget(self, group: GroupTasks) -> None:
        for key in group.deadlines:
            bucket = self.buckets.get(key)
            if bucket is not None:
                bucket.discard(group)

    def _fire(self, key: int) -> None:
        for group in list(self.buckets.pop(key, ())):
            group.deadlines.remove(key)
            # lists: expiring one member may settle the group and cancel the others
            for m in list(group.members.values()):
                if m.deadline <= key and m.cause is None:
                    self.expire(m)


Item = tuple[Any, WorkflowProtocol, ShouldAccept | None, int, int]
"""``(data, workflow, should_accept_fn, retries, sample_index)``: ``retries`` counts
proactive-filter retries; the sample index numbers items in intake order."""


class ItemSource:
    """An endless stream of items from a data loader (``prepare_batch``), epoch after epoch."""

    def __init__(
        self, dataloader: Iterable[Any], workflow: WorkflowProtocol, accept: ShouldAccept | None
    ) -> None:
        self.dataloader = dataloader
        self.workflow = workflow
        self.accept = accept
        self.drawn = 0  # items taken from the loader (cycled), for resuming at the same place
        self._items = self._cycle()

    def _cycle(self) -> Iterator[Any]:
        while True:
            empty = True
            for batch in self.dataloader:
                # AReaL's loaders yield lists of items; a bare item is one item.
                if isinstance(batch, list | tuple):
                    for item in batch:
                        empty = False
                        yield item
                else:
                    empty = False
                    yield batch
            if empty:
                raise ConfigError(
                    f"prepare_batch(dataloader={self.dataloader!r}): the data loader yielded no "
                    "items; pass a non-empty, re-iterable data loader"
                )

    def next_item(self, sample_index: int) -> Item:
        data = next(self._items)
        self.drawn += 1
        return (data, self.workflow, self.accept, 0, sample_index)

    def skip(self, count: int) -> None:
        """Draw and discard ``count`` items: continue a resumed run where its loader stood."""
        for _ in range(count):
            next(self._items)
        self.drawn += count

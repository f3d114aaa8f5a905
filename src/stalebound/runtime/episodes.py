"""The executor's asyncio plumbing for running episodes: no staleness decision is made here.

* :class:`GroupTasks` / :class:`MemberTask` — the tasks of one admitted group and of each of its
  members (what the coordinator calls a group and a member, seen as asyncio work).
* :class:`MemberEngine` — the engine as one member's workflow sees it: it remembers the ids of the
  requests in flight, so the executor can abort them on the engine, and reports progress.
* :class:`EpisodeDeadlines` — episode timeouts, bucketed into few loop timers.
* :class:`ItemSource` — an endless stream of items from a data loader (``prepare_batch``).
* Small readers of engine answers: :func:`token_versions`, :func:`request_id`,
  :func:`output_tokens`; and :func:`mask_tokens`, which takes tokens out of a trajectory's loss.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from stalebound.core import ConfigError, MemberId, ProtocolError
from stalebound.core import events as ev
from stalebound.runtime.cut import CutSignal

logger = logging.getLogger("stalebound.runtime.executor")  # the executor's log, as before

__all__ = [
    "EpisodeDeadlines",
    "Episodes",
    "GroupTasks",
    "ItemSource",
    "MemberEngine",
    "MemberTask",
    "ShouldAccept",
    "WorkflowProtocol",
    "call_abort",
    "mask_tokens",
    "need_workflow",
    "outcome_event",
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


class MemberTask(CutSignal):
    """One running episode (its :class:`~stalebound.runtime.cut.CutSignal` is what
    :func:`~stalebound.runtime.cut.interruptible` waits on)."""

    __slots__ = (
        "cause",
        "deadline",
        "engine",
        "episode",
        "group",
        "started",
        "task",
    )
    mid: MemberId  # always given here

    def __init__(self, group: GroupTasks, mid: MemberId, deadline: int) -> None:
        super().__init__(mid)  # not truncated
        self.group = group
        self.deadline = deadline  # its timeout bucket
        self.episode: Any = None  # what arun_episode returned (a coroutine)
        self.engine: MemberEngine | None = None
        self.started = False
        self.task: asyncio.Task[Any] | None = None
        self.cause: str | None = None  # set when it is stopped on purpose


def need_workflow(op: str, workflow: Any) -> None:
    """Refuse an object that is not a workflow (no ``arun_episode``), naming the call."""
    if not callable(getattr(workflow, "arun_episode", None)):
        raise ProtocolError(
            f"{op}(workflow={workflow!r}): a workflow must have an async "
            "arun_episode(engine, data) method"
        )


def outcome_event(
    m: MemberTask,
    result: Any,
    failure: BaseException | str | None,
    now: float,
    version: Callable[[], int],
) -> ev.MemberFinished | ev.MemberFailed:
    """The coordinator's event for an episode that ended by itself: finished with a trajectory,
    or failed (``rejected`` when it returned ``None``, the cause given, the exception's own
    ``cause`` attribute, or ``error:<Type>``).
    ``version()`` is the generation version now (a relaunch starts at it)."""
    if failure is None:
        if result is not None:
            return ev.MemberFinished(m.mid, now, result, token_versions(result))
        return ev.MemberFailed(m.mid, now, "rejected", version())
    if isinstance(failure, str):
        return ev.MemberFailed(m.mid, now, failure, version())
    logger.debug("episode %s failed: %r", m.mid, failure, exc_info=failure)
    # an exception may name its own cause (stalebound.tasks.EpisodeFailed: reward:timeout, ...)
    named = getattr(failure, "cause", None)
    cause = named if isinstance(named, str) and named else f"error:{type(failure).__name__}"
    return ev.MemberFailed(m.mid, now, cause, version(), repr(failure))


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
    if type(result) is dict or isinstance(result, Mapping):  # dict first: the ABC check is slow
        tv = result.get("token_versions")
        if tv is None:
            tv = result.get("versions")
    else:
        tv = getattr(result, "token_versions", None)
        if tv is None:
            tv = getattr(result, "versions", None)
    if tv is None:
        return None
    if (type(tv) is tuple or type(tv) is list) and (not tv or type(tv[0]) is int):
        return tuple(tv)  # the common case: a flat sequence of ints
    if hasattr(tv, "tolist"):  # a tensor or an array, possibly [1, seqlen]
        tv = tv.tolist()
    if tv and isinstance(tv[0], (list, tuple)):  # one row per sequence: flatten
        return tuple(int(x) for row in tv for x in row)
    return tuple(tv)


def mask_tokens(result: Any, positions: Iterable[int], length: int) -> int:
    """Set the ``loss_mask`` (key or attribute) of ``result`` to 0 at ``positions``; return how
    many of those tokens were in the loss. ``length`` is the number of token versions reported:
    a mask of another length cannot be lined up with them (:class:`ProtocolError`). A missing or
    ``None`` mask stands for all ones and is replaced by a list; a list or tuple by a new list; a
    tensor or array is changed in place (any shape, e.g. ``[1, seqlen]``)."""
    mapping = type(result) is dict or isinstance(result, Mapping)
    mask: Any = result.get("loss_mask") if mapping else getattr(result, "loss_mask", None)
    if mask is None:
        mask = [1] * length
    elif isinstance(mask, (list, tuple)):
        mask = list(mask)
    flat = mask.reshape(-1) if hasattr(mask, "reshape") else mask
    if len(flat) != length:
        raise ProtocolError(
            f"a continued trajectory reports {length} token versions and a loss_mask of "
            f"{len(flat)} tokens: the executor masks the tokens staler than the bound by position, "
            "so give loss_mask and token_versions (or versions) one entry per token each"
        )
    masked = 0
    for i in positions:
        if flat[i]:
            flat[i] = 0
            masked += 1
    if flat is not mask:  # a tensor's flat view, or its copy where it is not contiguous
        mask[...] = flat.reshape(mask.shape)
    try:
        if mapping:
            result["loss_mask"] = mask
        else:
            result.loss_mask = mask
    except (TypeError, AttributeError) as e:
        raise ProtocolError(
            f"a continued trajectory's loss_mask cannot be set on a {type(result).__name__} "
            f"({e}): the executor masks the tokens staler than the bound in it, so return a dict "
            "or an object whose loss_mask can be assigned"
        ) from None
    return masked


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
        try:
            await asyncio.sleep(0)  # the engine registers the request
            if not task.done():
                try:
                    await call_abort(self._engine.abort, rid)
                except Exception as e:  # as in Episodes: it may have finished meanwhile
                    logger.warning("engine.abort(%r) for %s failed: %r", rid, self._member.mid, e)
                else:
                    self._count_abort("truncated")
            return await task
        finally:
            task.cancel()  # a no-op once done; a cancelled member leaves no request running


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


Ended = Callable[[MemberTask, Any, BaseException | str | None], None]
"""Told when an episode ends by itself: ``(member, result, failure)``; ``failure`` is the
exception, or a cause (``timeout``, ``cancelled``), or ``None`` with the result."""


class Episodes:
    """The running episodes of the admitted groups, as asyncio tasks.

    Carries out the coordinator's member actions — start (:meth:`launch`), stop on purpose
    (:meth:`stop`: abort the engine requests, then cancel), cut short (:meth:`truncate`) — and
    reports each episode that ends by itself to ``ended`` (already detached from its group).
    Requests aborted on the engine and the tokens they wasted are counted here, by cause.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        engine: Any,
        ended: Ended,
        progressed: Callable[[MemberId], None],
        timeout: float | None,
    ) -> None:
        self.loop = loop
        self.engine = engine
        abort = getattr(engine, "abort", None)
        self.abort: Callable[[Any], Any] | None = abort if callable(abort) else None
        self.ended = ended
        self.progressed = progressed
        self.deadlines = EpisodeDeadlines(loop, timeout, self._expire) if timeout else None
        self.groups: dict[Hashable, GroupTasks] = {}
        self.aborted_requests: Counter[str] = Counter()
        self.aborted_tokens: Counter[str] = Counter()
        self._background: set[asyncio.Task[Any]] = set()  # engine aborts in progress

    def start_group(self, gid: int, data: Any, workflow: WorkflowProtocol) -> None:
        deadlines = self.deadlines
        key = deadlines.key() if deadlines is not None else 0
        group = self.groups[gid] = GroupTasks(gid, data, workflow, key)
        if deadlines is not None:
            deadlines.watch(group, key)

    def launch(self, a: ev.LaunchMember) -> None:
        mid, relaunch = a.member, a.relaunch
        gid, number = mid
        group = self.groups[gid]
        key = group.start_key
        if relaunch and self.deadlines is not None:
            key = self.deadlines.key()
            self.deadlines.watch(group, key)
        m = group.members[number] = MemberTask(group, mid, key)
        engine = self.engine
        if self.abort is not None:  # only then are request ids of any use
            engine = m.engine = MemberEngine(engine, m, self.progressed, self._count_abort)
        try:
            m.episode = group.workflow.arun_episode(engine, group.data)
        except Exception as e:  # raised before its first await: fail it on the next turn
            self.loop.call_soon(self._early_failure, m, e)
            return
        m.task = self.loop.create_task(self._run(m))

    def stop(self, a: ev.AbortRequest) -> None:
        """Stop a member on purpose: abort its engine requests (their partial outputs are counted
        as wasted), then cancel its task; at shutdown cancel the task at once."""
        mid, cause = a.member, a.cause
        group = self.groups.get(mid.group_id)
        m = group.members.pop(mid.number, None) if group is not None else None
        if m is None:
            return
        m.cause = cause
        if not m.started and inspect.iscoroutine(m.episode):
            m.episode.close()  # never awaited: close it, or Python warns
        if m.task is not None and (
            cause == "shutdown" or not self._abort_requests(m, cause, cancel=True)
        ):
            m.task.cancel()
        self.forget_if_idle(m.group)

    def truncate(self, a: ev.TruncateMember) -> None:
        mid, cause = a.member, a.cause
        group = self.groups.get(mid.group_id)
        m = group.members.get(mid.number) if group is not None else None
        if m is not None:
            m.cut()  # ends a wait in `interruptible`
            self._abort_requests(m, cause, cancel=False)

    def forget_if_idle(self, group: GroupTasks) -> None:
        """Drop a group that has no episode running any more."""
        if not group.members and self.groups.get(group.gid) is group:
            del self.groups[group.gid]
            if self.deadlines is not None:
                self.deadlines.forget(group)

    def requests_in_flight(self, gid: int) -> list[Any]:
        group = self.groups.get(gid)
        members = group.members.values() if group is not None else ()
        return [rid for m in members if m.engine for rid in m.engine.inflight]

    def tasks(self) -> list[asyncio.Task[Any]]:
        return [m.task for g in self.groups.values() for m in g.members.values() if m.task]

    async def _run(self, m: MemberTask) -> None:
        """One episode. Members stopped on purpose are accounted for when they are stopped
        (``m.cause`` set), so nothing here depends on the task having started."""
        m.started = True
        m.enter()  # this task's context only: `interruptible` finds its member
        try:
            result = await m.episode
        except asyncio.CancelledError:
            if m.cause is None:  # cancelled by someone else (the engine, say)
                self._ended(m, None, "cancelled")
            raise
        except Exception as e:
            if m.cause is None:
                self._ended(m, None, e)
        else:
            if m.cause is None:  # _ended, inlined: this is the path of every trajectory
                group = m.group
                del group.members[m.mid[1]]
                self.ended(m, result, None)
                if not group.members:
                    self.forget_if_idle(group)

    def _ended(self, m: MemberTask, result: Any, failure: BaseException | str | None) -> None:
        group = m.group
        del group.members[m.mid.number]
        self.ended(m, result, failure)
        if not group.members:
            self.forget_if_idle(group)

    def _early_failure(self, m: MemberTask, exc: Exception) -> None:
        if m.cause is None:  # not stopped with its group meanwhile
            self._ended(m, None, exc)

    def _expire(self, m: MemberTask) -> None:
        m.cause = "timeout"
        if m.task is not None and not self._abort_requests(m, "timeout", cancel=True):
            m.task.cancel()
        self._ended(m, None, "timeout")

    def _count_abort(self, cause: str) -> None:
        self.aborted_requests[cause] += 1

    def _abort_requests(self, m: MemberTask, cause: str, *, cancel: bool) -> bool:
        """Abort ``m``'s engine requests in flight in the background (then cancel its task when
        ``cancel``); False when there is nothing to abort on the engine."""
        abort = self.abort
        rids = list(m.engine.inflight) if m.engine is not None else []
        if abort is None or not rids:
            return False
        task = self.loop.create_task(self._abort_then(m, abort, rids, cause, cancel))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def _abort_then(
        self, m: MemberTask, abort: Callable[[Any], Any], rids: list[Any], cause: str, cancel: bool
    ) -> None:
        try:
            for rid in rids:
                try:
                    partial = await call_abort(abort, rid)
                except Exception as e:  # the engine may have finished it meanwhile
                    logger.warning("engine.abort(%r) for %s (%s) failed: %r", rid, m.mid, cause, e)
                    continue
                self.aborted_requests[cause] += 1
                if cancel:  # truncated output is kept by the workflow, not wasted
                    self.aborted_tokens[cause] += output_tokens(partial)
        finally:
            if cancel and m.task is not None:
                m.task.cancel()

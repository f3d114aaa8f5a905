"""The workflow executor: runs rollout workflows on an asyncio loop, admitted by a staleness policy.

:class:`WorkflowExecutor` has AReaL's surface (``initialize``, ``submit``, ``wait``,
``collect_results``, ``rollout_batch``, ``prepare_batch``, ``pause``, ``resume``, ``destroy``,
``get_capacity``) over either staleness policy of :mod:`stalebound.core.policy`:

* ``staleness_policy: buffer`` (default) — PSRL's staleness buffer. Every trained trajectory is at
  most η versions staler than the batch it is trained in, whatever order rollouts finish in.
* ``staleness_policy: capacity`` — AReaL's count-based admission, results consumed first-in,
  first-out by completion. The bound holds in aggregate only; ``reject_stale_results`` drops
  results already staler than η (counted as wasted).

How it runs. One event loop in a background thread owns every piece of state: the policy, the
:class:`~stalebound.core.GroupTracker`, the running tasks. Public methods called from other threads
hop onto that loop (``call_soon_threadsafe``), so the core is only ever touched by one thread; in
the capacity policy the counters are also guarded by the
:class:`~stalebound.runtime.StalenessManager`'s lock, since users may read them from any thread.

Each submitted item is one *group*: the policy admits it at version ``V = min(engine version,
training version)``; the executor launches N′ members (``workflow.arun_episode(engine, data)``
once per member, each returning one trajectory, ``None`` meaning rejected); at N finished members
the group is complete, the surplus members are cancelled, and the group goes to the policy. The
trainer takes batches with :meth:`~WorkflowExecutor.wait` / :meth:`~WorkflowExecutor.prepare_batch`;
taking a batch *consumes* it, which advances the training version. The trainer then publishes new
weights and calls :meth:`~WorkflowExecutor.set_version`.

The dispatcher is a task that sleeps on an :class:`asyncio.Event` and is woken by whatever can
open capacity: a submission, a completion or failure, a consumed batch, ``set_version``,
``resume``. It never polls.

Filters (``docs/filters.md``). A completed group first passes ``should_accept_fn`` and the
configured group post-processor (``rollout.group_post_process``, e.g. the dynamic sampling
filter); a dropped group's entry returns to EMPTY and the dispatcher draws another prompt. After
``rollout.max_consecutive_filtered`` drops in a row the executor stops with an error that names the
filter and the fix. With the buffer policy, the proactive filter
(``rollout.proactive_filter``) watches the head buffer whenever it may have changed (a
completion, an abort, a consume, a reservation) and, with ``stuck_timeout_s``, on one timer at the
deadline: ``retry`` aborts its last reservations, pulls finished groups forward from later
buffers and queues the prompts again first in line; ``truncate`` aborts their engine requests so
the workflows return partial outputs (``Trajectory.truncated``). A watchdog logs groups silent for
``rollout.watchdog_timeout_s``, and a progress line per buffer is logged every
``rollout.progress_log_s`` while work is in flight.

Engine requests. When the engine has ``abort(request_id)``, each member's workflow gets a thin
proxy of it that forwards every call and remembers the ``request_id`` of each ``agenerate`` request
in flight (a workflow that checks the engine's type sees the proxy). Members cancelled on purpose
(surplus of N′ > N or of B′ > B, retried, abandoned, timed out) have those requests aborted with
``await engine.abort(request_id)`` first — the partial outputs it returns are counted as wasted
tokens — and their tasks are then cancelled; engines without ``abort``, requests without ids and
``destroy`` fall back to cancelling the task, delivered as :class:`asyncio.CancelledError` at the
workflow's pending ``await``. Workflows that hold other resources must release them on
cancellation too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, TypeVar, cast

from stalebound.config import RolloutConfig
from stalebound.core import (
    BufferPolicy,
    BufferState,
    CapacityPolicy,
    ConfigError,
    GroupComplete,
    GroupTracker,
    MemberId,
    MemberResult,
    PolicyStatistics,
    ProtocolError,
    Relaunch,
    RolloutStat,
    StaleboundError,
    StalenessBuffer,
    StalenessPolicy,
)
from stalebound.core.filters import (
    GroupPostProcess,
    StragglerClock,
    StuckTimer,
    buffer_progress,
    eligible_targets,
    get_group_post_process,
    proactive_filter_targets,
)
from stalebound.runtime.staleness_manager import StalenessManager

__all__ = [
    "OUTCOMES",
    "STATE_FORMAT",
    "ExecutorStatistics",
    "RolloutError",
    "Trajectory",
    "WorkflowExecutor",
    "WorkflowProtocol",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_RECENT_FAILURES = 8

DEFAULT_BATCHES_IN_FLIGHT = 8
"""Without ``max_concurrent_rollouts``, at most this many batches (``8·B′`` groups) generate at
once, however large η is. The window allows ``(η + 1)·B′``, but beyond a few batches admission only
floods the engines: with ``η = 1000`` it would launch 1001 batches at once, and the first step
would wait for the last of them (its head buffer is reserved last). Set
``max_concurrent_rollouts`` to go beyond it."""


class WorkflowProtocol(Protocol):
    """A rollout workflow: one call generates one trajectory (``None`` rejects it)."""

    async def arun_episode(self, engine: Any, data: Any) -> Any: ...


ShouldAccept = Callable[[list[Any]], bool]
"""Called with a completed group's trajectories (the workflows' return values, in finish order);
``False`` discards the group (counted as ``filtered_groups``)."""


class RolloutError(StaleboundError, RuntimeError):
    """The executor stopped: too many groups failed in a row, or it could not go on."""


class Trajectory(NamedTuple):
    """One trained trajectory and where it stands in versions (an immutable record).

    ``staleness = consumed_version − version``; under the buffer policy it is never more than η.
    A named tuple rather than a frozen dataclass: one is built per trained trajectory, and this
    is several times cheaper to build.
    """

    data: Any
    """What the workflow returned."""
    group_id: int
    member: int
    """The member's launch index within its group."""
    version: int
    """V_traj: the policy version when its generation started."""
    consumed_version: int
    """The training version of the batch it was handed out in."""
    staleness: int
    token_versions: tuple[int, ...] | None = None
    """Per-token policy versions as the engine reported them (``token_versions`` or AReaL's
    ``versions``, key or attribute); ``None`` when it reported none."""
    truncated: bool = False
    """The proactive filter (``truncate``) cut its generation short: the engine request was
    aborted and the workflow returned the partial output. A loss may mask or keep it."""
    sample_index: int = -1
    """Which data item it came from: items are numbered from 0 in the order the executor took
    them in (``submit`` calls and data-loader draws), across resumes (see ``drain_outcomes``)."""


@dataclass(frozen=True)
class ExecutorStatistics:
    """A frozen snapshot of the executor's counters and its policy's statistics."""

    policy: PolicyStatistics
    manager: RolloutStat | None
    """The :class:`StalenessManager`'s counters, when there is one."""
    version: int
    """The training version: the next batch handed out is consumed at this version."""
    generation_version: int
    """The version new groups are admitted at: ``min(engine version, version)``."""
    paused: bool
    stopped: str | None
    """Why the executor stopped, or ``None`` while it runs."""
    queued: int
    """Submitted items waiting for admission."""
    submitted: int
    dispatched_groups: int
    running_groups: int
    running_members: int
    launched_members: int
    finished_members: int
    member_failures: Mapping[str, int]
    """Failed member episodes by cause: ``timeout``, ``rejected`` (returned ``None``),
    ``cancelled``, ``error:<ExceptionType>``."""
    cancelled_members: Mapping[str, int]
    """Members cancelled on purpose, by cause: ``surplus``, ``shutdown``, ``stopped``."""
    relaunched_members: int
    completed_groups: int
    failed_groups: int
    filtered_groups: int
    """Groups discarded by ``should_accept_fn`` or the group post-processor."""
    consecutive_filtered: int
    """Groups filtered in a row; the executor stops at ``rollout.max_consecutive_filtered``."""
    retried_groups: int
    """Groups aborted by the proactive filter (``retry``); their prompts were dispatched again."""
    pulled_forward_groups: int
    """Finished groups moved into the head buffer from later buffers when retrying."""
    truncated_groups: int
    """Groups force-completed by the proactive filter (``truncate``)."""
    truncated_trajectories: int
    """Trajectories whose generation was cut short by ``truncate`` (``Trajectory.truncated``)."""
    aborted_requests: Mapping[str, int]
    """Engine requests aborted through ``engine.abort(request_id)``, by cause (``surplus``,
    ``retried``, ``truncated``, ``abandoned``, ...)."""
    aborted_tokens: Mapping[str, int]
    """Tokens generated by aborted requests and thrown away, by cause (from the partial outputs
    ``engine.abort`` returned; truncated tokens are kept, so not counted here)."""
    discarded_members: Mapping[str, int]
    """Finished trajectories thrown away with their group, by cause: ``filtered`` (the whole
    group), ``retried`` and ``surplus`` (members that had finished before the group was aborted).
    With ``cancelled_members`` this is the work wasted."""
    stuck_seconds: float
    """Total time the head buffer spent STUCK (buffer policy), the open interval included."""
    stuck_seconds_by_buffer: Mapping[int, float]
    """The same, per buffer version."""
    watchdog_stalls: int
    """Times the watchdog reported a group that produced nothing for ``rollout.watchdog_timeout_s``."""
    dropped_groups: int
    """Completed groups the policy discarded (no admissible place, or staler than η)."""
    surplus_groups: int
    """Reservations aborted when their buffer was consumed (batch-level redundancy)."""
    consumed_batches: int
    consumed_groups: int
    consumed_trajectories: int
    waiting_groups: int
    """Consumed groups not yet handed out (a ``wait`` smaller than the batch leaves some)."""
    consecutive_failures: int
    dispatch_wakeups: int
    """How often the dispatcher woke up: once per burst of events, never on a timer."""
    resumed_groups: int = 0
    """Groups that were running when the state was saved and were dispatched again after
    :meth:`WorkflowExecutor.load_state_dict` (their partial work is lost with the process)."""


@dataclass(frozen=True)
class _Settings:
    policy: str
    eta: int
    batch_size: int
    buffer_size: int
    group_size: int
    group_redundancy: int
    max_concurrent: int
    queue_size: int
    request_timeout: float | None
    max_failures: int
    drop_stale: bool
    proactive: str
    threshold: int
    stuck_timeout: float | None
    max_retries: int
    post_process: GroupPostProcess | None
    post_process_name: str
    metric: str
    max_filtered: int
    watchdog: float | None
    progress_log: float | None


def _per_rank(name: str, value: object, dp: int, problems: list[str]) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        problems.append(f"rollout.{name}={value!r}: must be an integer ≥ 1")
        return 1
    if value % dp:
        problems.append(
            f"rollout.{name}={value}: not divisible by train_data_parallel_size={dp}; each data-"
            f"parallel rank gets an equal share, so choose a multiple of {dp}"
        )
        return max(1, value // dp)
    return value // dp


def _resolve(config: RolloutConfig, dp: int) -> _Settings:
    """The per-rank settings; every problem is reported at once."""
    problems: list[str] = []
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(
            f"train_data_parallel_size={dp!r}: must be an integer ≥ 1 (1 without data parallelism)"
        )
    if config.staleness_policy not in ("buffer", "capacity"):
        problems.append(
            f"rollout.staleness_policy={config.staleness_policy!r}: must be 'buffer' (per-"
            "trajectory bound) or 'capacity' (AReaL's aggregate bound)"
        )
    eta = config.max_head_offpolicyness
    if not isinstance(eta, int) or isinstance(eta, bool) or eta < 0:
        problems.append(f"rollout.max_head_offpolicyness={eta!r}: must be an integer ≥ 0")
        eta = 0
    batch = _per_rank("consumer_batch_size", config.consumer_batch_size, dp, problems)
    buffer_size = (
        batch
        if config.buffer_size is None
        else _per_rank("buffer_size", config.buffer_size, dp, problems)
    )
    if config.max_concurrent_rollouts is not None:
        concurrent = _per_rank(
            "max_concurrent_rollouts", config.max_concurrent_rollouts, dp, problems
        )
    elif config.staleness_policy == "capacity":
        concurrent = batch  # AReaL's fallback: max_concurrent_rollouts or consumer_batch_size
    else:
        concurrent = min(eta + 1, DEFAULT_BATCHES_IN_FLIGHT) * buffer_size
    queue = 16 * concurrent if config.queue_size is None else config.queue_size
    if not isinstance(queue, int) or isinstance(queue, bool) or queue < 1:
        problems.append(f"rollout.queue_size={queue!r}: must be an integer ≥ 1, or None")
    timeout = config.request_timeout
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        problems.append(
            f"rollout.request_timeout={timeout!r}: must be a number of seconds > 0 (or a very "
            "large one to never time out)"
        )
    k = config.max_consecutive_failures
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        problems.append(f"rollout.max_consecutive_failures={k!r}: must be an integer ≥ 1")
    n = config.group_size
    redundancy = n if config.group_redundancy is None else config.group_redundancy
    pf = config.proactive_filter
    if pf.method not in ("null", "retry", "truncate"):
        problems.append(
            f"rollout.proactive_filter.method={pf.method!r}: must be 'null', 'retry' or 'truncate'"
        )
    elif pf.method != "null" and config.staleness_policy != "buffer":
        problems.append(
            f"rollout.proactive_filter.method={pf.method!r}: acts on STUCK buffers, which only "
            f"staleness_policy=buffer has (not {config.staleness_policy!r}); set it to null, or "
            "use staleness_policy=buffer"
        )
    post: GroupPostProcess | None = None
    if config.group_post_process.enable:
        try:
            post = get_group_post_process(config.group_post_process.name)
        except ConfigError as e:
            problems.extend(e.problems)
    for name in ("watchdog_timeout_s", "progress_log_s"):
        value = getattr(config, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
        ):
            problems.append(f"rollout.{name}={value!r}: must be a number of seconds > 0, or None")
    if problems:
        raise ConfigError(problems)
    return _Settings(
        policy=config.staleness_policy,
        eta=eta,
        batch_size=batch,
        buffer_size=buffer_size,
        group_size=n,
        group_redundancy=redundancy,
        max_concurrent=concurrent,
        queue_size=queue,
        request_timeout=None if timeout is None or timeout == float("inf") else float(timeout),
        max_failures=k,
        drop_stale=config.reject_stale_results,
        proactive=pf.method,
        threshold=pf.threshold,
        stuck_timeout=pf.stuck_timeout_s,
        max_retries=pf.max_retries,
        post_process=post,
        post_process_name=config.group_post_process.name,
        metric=config.filter_groups.metric,
        max_filtered=config.max_consecutive_filtered,
        watchdog=config.watchdog_timeout_s,
        progress_log=config.progress_log_s,
    )


def _token_versions(result: Any) -> tuple[int, ...] | None:
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


class _Group:
    __slots__ = (
        "deadlines",
        "gid",
        "item",
        "members",
        "progress",
        "reported",
        "truncated",
        "truncating",
        "version",
    )

    def __init__(self, gid: int, item: _Item, version: int, now: float) -> None:
        self.gid = gid
        self.item = item
        self.version = version
        self.members: dict[int, _Member] = {}
        self.deadlines: list[int] = []  # the timeout buckets it is in
        self.progress = now  # when it last produced something (the watchdog's clock)
        self.reported = -1.0  # the progress time the watchdog last reported it at
        self.truncating = False
        self.truncated: set[int] | None = None  # member numbers cut short by truncate


class _Member:
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
        "version",
    )

    def __init__(self, group: _Group, mid: MemberId, version: int) -> None:
        self.group = group
        self.mid = mid
        self.version = version
        self.episode: Any = None  # what arun_episode returned (a coroutine)
        self.engine: _MemberEngine | None = None
        self.started = False
        self.task: asyncio.Task[Any] | None = None
        self.deadline = 0  # its timeout bucket
        self.cause: str | None = None  # set when we cancel it on purpose
        self.truncated = False  # truncate: abort its requests as they come, keep the output


def _request_id(request: Any) -> Any:
    """The id of an engine request (attribute or key ``request_id``), or ``None``."""
    if isinstance(request, dict):
        return request.get("request_id")
    return getattr(request, "request_id", None)


def _output_tokens(response: Any) -> int:
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


async def _call_abort(abort: Callable[[Any], Any], rid: Any) -> Any:
    result = abort(rid)
    if inspect.isawaitable(result):
        result = await result
    return result


class _MemberEngine:
    """The inference engine as one member's workflow sees it.

    Every attribute is the real engine's, except ``agenerate``, which also remembers the ids of the
    requests in flight, so the executor can abort them on the engine (surplus, retry, truncate)
    without workflows exposing ids, and marks the group's progress for the watchdog. A member
    settled on purpose may send no new request.
    """

    __slots__ = ("_aborted", "_clock", "_engine", "_member", "inflight")

    def __init__(
        self, engine: Any, member: _Member, clock: Callable[[], float], aborted: Counter[str]
    ) -> None:
        self._engine = engine
        self._member = member
        self._clock = clock
        self._aborted = aborted  # the executor's aborted_requests counter
        self.inflight: dict[Any, None] = {}  # request ids, in issue order

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, request: Any) -> Any:
        m = self._member
        if m.cause is not None:  # cancelled on purpose; its task is being cancelled
            raise asyncio.CancelledError(f"member {m.mid} was settled ({m.cause})")
        rid = _request_id(request)
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
        m.group.progress = self._clock()
        return response

    async def _truncated(self, request: Any, rid: Any) -> Any:
        """A request issued after its member was truncated: let the engine take it, then abort
        it at once, so the workflow gets whatever the engine had (possibly nothing)."""
        task = asyncio.ensure_future(self._engine.agenerate(request))
        await asyncio.sleep(0)  # the engine registers the request
        if not task.done():
            await _call_abort(self._engine.abort, rid)
            self._aborted["truncated"] += 1
        return await task


class _Deadlines:
    """Episode timeouts, bucketed: one loop timer per ``timeout / 64`` seconds, not per episode.

    A member expires at most one bucket (≈1.6 % of the timeout) after its own deadline. Buckets
    hold groups, not members: members launched together share a bucket, so the per-episode cost
    is one integer. A group leaves its buckets when it settles, so memory stays proportional to
    the running groups.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: float,
        expire: Callable[[_Member], None],
    ) -> None:
        self.loop = loop
        self.expire = expire
        self.timeout = timeout
        self.resolution = max(timeout / 64, 0.001)
        self.buckets: dict[int, set[_Group]] = {}

    def key(self) -> int:
        """The bucket of an episode starting now: it fires at or after the episode's deadline."""
        return int((self.loop.time() + self.timeout) / self.resolution) + 1

    def watch(self, group: _Group, key: int) -> None:
        if key in group.deadlines:
            return
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = set()
            self.loop.call_at(key * self.resolution, self._fire, key)
        bucket.add(group)
        group.deadlines.append(key)

    def forget(self, group: _Group) -> None:
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


_Item = tuple[Any, WorkflowProtocol, ShouldAccept | None, int, int]
"""``(data, workflow, should_accept_fn, retries, sample_index)``: ``retries`` counts
proactive-filter retries; the sample index numbers items in intake order."""

STATE_FORMAT = 1
"""The format of :meth:`WorkflowExecutor.state_dict`; :meth:`~WorkflowExecutor.load_state_dict`
refuses any other."""

OUTCOMES = ("filtered", "failed", "dropped", "surplus", "stopped")
"""How an item can end without being trained (:meth:`WorkflowExecutor.drain_outcomes`)."""

# Release causes after which the item goes on (queued again, or the state is being torn down).
_NOT_AN_OUTCOME = frozenset({"retried", "resumed", "shutdown"})
_Payload = tuple[tuple[MemberResult, tuple[int, ...] | None, bool], ...]


class _Source:
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

    def next_item(self, sample_index: int) -> _Item:
        data = next(self._items)
        self.drawn += 1
        return (data, self.workflow, self.accept, 0, sample_index)

    def skip(self, count: int) -> None:
        """Draw and discard ``count`` items: continue a resumed run where its loader stood."""
        for _ in range(count):
            next(self._items)
        self.drawn += count


class WorkflowExecutor:
    """Runs rollout workflows concurrently, admitted and batched by a staleness policy.

    ``inference_engine`` is passed to every ``arun_episode`` call; its ``get_version()`` (when it
    has one) is the version new groups are generated with — it is called on the loop thread at
    every dispatch, so it must be cheap and must not block — and ``set_version(v)`` (when it has
    one) is forwarded from :meth:`set_version`. New groups start at ``min(engine version,
    training version)``: the trainer must call :meth:`set_version` after publishing weights, or
    admission stops once the engine lags the training version by more than η. ``staleness_manager`` replaces the one built from
    ``config`` (AReaL's custom-manager hook): with the capacity policy its counters and limits are
    the policy's; with the buffer policy it is an extra admission gate, driven through its
    lifecycle callbacks.

    Call :meth:`initialize` first and :meth:`destroy` at the end (or use ``with``).
    """

    def __init__(
        self,
        config: RolloutConfig,
        inference_engine: Any,
        staleness_manager: StalenessManager | None = None,
    ) -> None:
        self.config = config
        self.inference_engine = inference_engine
        self.staleness_manager: StalenessManager | None = staleness_manager
        self._custom_manager = staleness_manager is not None
        getter = getattr(inference_engine, "get_version", None)
        self._engine_version: Callable[[], int] | None = getter if callable(getter) else None
        setter = getattr(inference_engine, "set_version", None)
        self._engine_set_version: Callable[[int], Any] | None = setter if callable(setter) else None
        self._published = 0
        self._settings: _Settings | None = None
        self._policy: StalenessPolicy | None = None
        self._tracker: GroupTracker | None = None
        self._guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        self._drive_manager = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop_tid: int | None = None
        self._closed = False
        # Touched by the loop thread only, except the inbox (a deque: appends from any thread).
        self._inbox: deque[_Item] = deque()
        self._source: _Source | None = None
        self._groups: dict[int, _Group] = {}
        self._output: deque[tuple[Trajectory, ...]] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._wake: asyncio.Event | None = None
        self._deadlines: _Deadlines | None = None
        self._kick_pending = False
        self._paused = False
        self._stopped: RolloutError | None = None
        self._source_error: Exception | None = None
        self._next_gid = 0
        # Sample indices: taken under a lock, since submit() runs on callers' threads.
        self._intake_lock = threading.Lock()
        self._next_sample = 0
        self._sample_of: dict[Hashable, int] = {}  # group id → sample index, until settled
        # Settled untrained, not yet drained: appended on the loop thread, drained from any
        # (deque appends and pops are atomic, so draining needs no hop onto the loop).
        self._outcomes: deque[tuple[int, str]] = deque()
        self._resume_skip: int | None = None  # data-loader items to skip after load_state_dict
        self._recent: deque[str] = deque(maxlen=_RECENT_FAILURES)
        self._member_failures: Counter[str] = Counter()
        self._cancelled: Counter[str] = Counter()
        self._n = Counter[str]()  # plain event counters, named as in ExecutorStatistics
        self._running_members = 0
        self._launched = 0  # hot counters: plain ints
        self._finished = 0
        self._consecutive = 0
        self._consecutive_filtered = 0
        abort = getattr(inference_engine, "abort", None)
        self._engine_abort: Callable[[Any], Any] | None = abort if callable(abort) else None
        self._aborted_requests: Counter[str] = Counter()
        self._aborted_tokens: Counter[str] = Counter()
        self._discarded: Counter[str] = Counter()
        self._background: set[asyncio.Task[Any]] = set()  # engine aborts in progress
        self._buffer: StalenessBuffer | None = None  # the buffer policy's, for the filters
        self._stuck = StuckTimer()
        self._stragglers: StragglerClock | None = None  # proactive filter acting at once
        self._checking = False
        self._stuck_handle: asyncio.TimerHandle | None = None
        self._stuck_due = -1.0  # when the armed STUCK timeout fires
        self._watchdog_handle: asyncio.TimerHandle | None = None
        self._progress_handle: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, train_data_parallel_size: int = 1) -> WorkflowExecutor:
        """Build the policy for this data-parallel rank and start the event loop thread.

        ``max_concurrent_rollouts``, ``consumer_batch_size`` (and ``buffer_size``) are divided by
        ``train_data_parallel_size``; the staleness bound η is not.
        """
        if self._thread is not None or self._closed:
            raise ProtocolError(
                "initialize(): the executor is already initialized (or destroyed); build a new "
                "WorkflowExecutor to start again"
            )
        s = _resolve(self.config, train_data_parallel_size)
        if s.proactive == "truncate" and self._engine_abort is None:
            raise ConfigError(
                f"rollout.proactive_filter.method='truncate': the inference engine "
                f"{type(self.inference_engine).__name__} has no abort(request_id), so running "
                "generations cannot be cut short; use method=retry, or an engine with abort"
            )
        start = self._engine_version() if self._engine_version is not None else 0
        self._published = start
        self._tracker = GroupTracker(s.group_size, s.group_redundancy)
        if s.policy == "buffer":
            buffer = StalenessBuffer(
                s.batch_size,
                s.eta,
                group_size=s.group_size,
                buffer_size=s.buffer_size,
                group_redundancy=s.group_redundancy,
                start_version=start,
            )
            self._policy = BufferPolicy(buffer, max_concurrent=s.max_concurrent)
            self._buffer = buffer
            if s.proactive != "null" and s.stuck_timeout is None:
                self._stragglers = StragglerClock()
            self._drive_manager = self.staleness_manager is not None
        else:
            manager = self.staleness_manager
            if manager is None:
                manager = StalenessManager(self, s.max_concurrent, s.batch_size, s.eta, strict=True)
                self.staleness_manager = manager
            self._guard = manager.lock
            with manager.lock:
                self._policy = CapacityPolicy(
                    manager.counter, drop_stale=s.drop_stale, start_version=start
                )
            # the manager's limits are the policy's: report what is actually enforced
            s = replace(s, batch_size=self._policy.batch_size, eta=manager.max_staleness)
        self._settings = s
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run_loop, args=(started,), name="stalebound-executor", daemon=True
        )
        self._thread.start()
        started.wait()
        return self

    def destroy(self) -> None:
        """Cancel everything running, stop the loop and join its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if threading.get_ident() == self._loop_tid:
            raise ProtocolError("destroy(): call it from outside the executor's own workflows")
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

    def __enter__(self) -> WorkflowExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int:
        """The training version: the next batch handed out is consumed at this version."""
        return self._require_policy().version

    def get_version(self) -> int:
        """The version new groups are generated with: ``min(engine version, training version)``.

        The engine's ``get_version()`` when it has one, else the last :meth:`set_version`. This is
        also the :class:`VersionProvider` of the manager built for the capacity policy.
        """
        ev = self._engine_version() if self._engine_version is not None else self._published
        policy = self._policy
        if policy is None:
            return ev
        v = policy.version
        return ev if ev < v else v

    def set_version(self, version: int) -> None:
        """New weights of ``version`` are published: forward to the engine and wake the dispatcher.

        Call it after each weight update (the dispatcher cannot see an engine's version change
        otherwise until its next event).
        """
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ProtocolError(f"set_version({version!r}): the version must be an int ≥ 0")
        if self._engine_set_version is not None:
            self._engine_set_version(version)
        self._published = version
        self._kick_threadsafe()

    # ------------------------------------------------------------------ submission

    def get_capacity(self) -> int:
        """How many more :meth:`submit` calls would be admitted now (may be ≤ 0).

        The policy's capacity (and the injected manager's, when there is one) minus the items
        already waiting in the input queue.
        """
        return self._call(self._capacity)

    def submit(
        self, data: Any, workflow: WorkflowProtocol, should_accept_fn: ShouldAccept | None = None
    ) -> None:
        """Queue one item; it becomes one group of N′ ``arun_episode`` calls once admitted.

        Raises :class:`ProtocolError` when the input queue already holds ``queue_size`` items.
        """
        s = self._require_running()
        if not callable(getattr(workflow, "arun_episode", None)):
            raise ProtocolError(
                f"submit(workflow={workflow!r}): a workflow must have an async "
                "arun_episode(engine, data) method"
            )
        if self._stopped is not None:
            raise self._stopped
        if len(self._inbox) >= s.queue_size:
            raise ProtocolError(
                f"submit(): the input queue is full ({s.queue_size} items waiting for admission, "
                f"rollout.queue_size={self.config.queue_size!r}); submit no more than "
                "get_capacity() allows, take results with wait()/prepare_batch(), or raise "
                "rollout.queue_size"
            )
        with self._intake_lock:
            self._inbox.append((data, workflow, should_accept_fn, 0, self._next_sample))
            self._next_sample += 1
        self._kick_threadsafe()

    def wait(self, count: int, timeout: float | None = None) -> list[Trajectory]:
        """Block until ``count`` groups are trained-ready; return their trajectories.

        Batches are consumed from the policy in version order as needed (each consume advances the
        training version by one; leftovers wait for the next call, so ask for multiples of
        ``consumer_batch_size``). Raises :class:`TimeoutError` after ``timeout`` seconds (nothing
        is taken then) and :class:`RolloutError` if the executor has stopped.
        """
        self._require_running()
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ProtocolError(f"wait(count={count!r}): count must be an integer ≥ 0")
        return self._request(count, timeout, None)

    def collect_results(self) -> list[Trajectory]:
        """Non-blocking: the next batch (``consumer_batch_size`` groups) if one is ready, else []."""
        return self._call(self._collect)

    def rollout_batch(
        self,
        data: Sequence[Any],
        workflow: WorkflowProtocol,
        should_accept_fn: ShouldAccept | None = None,
    ) -> list[Trajectory]:
        """Submit every item of ``data`` and wait for as many groups."""
        for item in data:
            self.submit(item, workflow, should_accept_fn)
        return self.wait(len(data))

    def prepare_batch(
        self,
        dataloader: Iterable[Any],
        workflow: WorkflowProtocol,
        should_accept_fn: ShouldAccept | None = None,
    ) -> list[Trajectory]:
        """Keep generating from ``dataloader`` (cycled) and return the next batch.

        The dispatcher draws items from the data loader whenever capacity opens, also while the
        caller trains, so the next batch is under way; the loader is iterated on the executor's
        thread. Each element the loader yields is a list/tuple of items (AReaL's loaders) or one
        item. Calling again with the same loader and workflow continues where it left off.
        """
        s = self._require_running()
        if not callable(getattr(workflow, "arun_episode", None)):
            raise ProtocolError(
                f"prepare_batch(workflow={workflow!r}): a workflow must have an async "
                "arun_episode(engine, data) method"
            )
        return self._request(s.batch_size, None, _Source(dataloader, workflow, should_accept_fn))

    def pause(self) -> None:
        """Stop admitting new groups (running ones go on). Returns once no admission can follow."""
        self._call(self._set_paused, True)

    def resume(self) -> None:
        """Admit again; wakes the dispatcher."""
        self._call(self._set_paused, False)

    @property
    def paused(self) -> bool:
        return self._paused

    def statistics(self) -> ExecutorStatistics:
        """A frozen snapshot of every counter, the policy's statistics and the manager's.

        Also works after :meth:`destroy` (the final counts)."""
        if self._closed and self._thread is not None and not self._thread.is_alive():
            return self._statistics()  # the loop is gone: nothing else touches the state
        return self._call(self._statistics)

    def inspect_policy(self, fn: Callable[[StalenessPolicy], _T]) -> _T:
        """Run a read-only ``fn(policy)`` on the loop thread (the only thread that touches the
        policy) and return its result: how a live view reads the buffers safely."""
        policy = self._require_policy()
        return self._call(fn, policy)

    def run_coroutine(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the executor's event loop from another thread and wait for its result,
        e.g. ``engine.update_weights(...)`` for the engine the workflows share."""
        self._require_running()
        if threading.get_ident() == self._loop_tid:
            raise ProtocolError("run_coroutine(): call it from outside the executor's loop thread")
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def drain_outcomes(self) -> list[tuple[int, str]]:
        """Items that ended without being trained since the last call, as ``(sample_index,
        outcome)`` with the outcome one of :data:`OUTCOMES`. With the sample indices of the
        trajectories handed out, every item taken in is accounted for once: trained, one of
        these, or still pending (in :meth:`state_dict`). Retried items are not ended."""
        self._require_running()
        out = []
        outcomes = self._outcomes
        while outcomes:
            out.append(outcomes.popleft())
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a restarted executor needs to continue exactly here (:meth:`load_state_dict`).

        Taken in one hop on the loop thread, so it is consistent: the policy's snapshot (the
        buffers' reservations, and the completed groups with their results), the items of the
        groups running now and of the input queue (data and retry counts), the consumed groups not
        yet handed out, the data loader's position, the outcomes not yet drained and every
        counter. Running episodes are not interrupted. Workflows and filters are not saved. The
        training job's checkpoints store it as JSON data (:mod:`stalebound.train.statejson`): the
        items and results must then be plain data or the tasks' ``Sample`` / ``Trajectory``.
        """
        return self._call(self._state_dict)

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        workflow: WorkflowProtocol,
        should_accept_fn: ShouldAccept | None = None,
    ) -> None:
        """Continue from :meth:`state_dict` output; call it after :meth:`initialize`, before
        anything is submitted.

        Completed groups go back into their buffers (or the capacity policy's queue) at their
        versions; groups that were running are aborted in the policy (cause ``resumed``, counted
        as ``resumed_groups``) and their items queued first, to be generated again from the start
        at the current version; then the queued items; the next :meth:`prepare_batch` skips the
        items its data loader had already yielded. Re-dispatched items run ``workflow`` (and
        ``should_accept_fn``). Sample indices, group ids and counters continue. A state of another
        format or policy raises :class:`ProtocolError` and changes nothing.
        """
        self._require_running()
        if not callable(getattr(workflow, "arun_episode", None)):
            raise ProtocolError(
                f"load_state_dict(workflow={workflow!r}): a workflow must have an async "
                "arun_episode(engine, data) method"
            )
        self._call(self._load_state, state, workflow, should_accept_fn)

    # ------------------------------------------------------------------ thread plumbing

    def _require_policy(self) -> StalenessPolicy:
        if self._policy is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")
        return self._policy

    def _require_running(self) -> _Settings:
        if self._closed:
            raise ProtocolError("the executor was destroyed; build a new WorkflowExecutor")
        if self._settings is None or self._loop is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")
        return self._settings

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the loop thread and return its result."""
        self._require_running()
        if threading.get_ident() == self._loop_tid:
            return fn(*args)
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(run)
        return future.result()

    def _request(
        self, count: int, timeout: float | None, source: _Source | None
    ) -> list[Trajectory]:
        """One hop onto the loop: answer at once when enough is ready, else wait there."""
        loop = self._loop
        assert loop is not None
        if threading.get_ident() == self._loop_tid:
            raise ProtocolError(
                "wait(): would block the executor's own loop; call it from another thread"
            )
        future: concurrent.futures.Future[list[Trajectory]] = concurrent.futures.Future()

        def done(task: asyncio.Task[list[Trajectory]]) -> None:
            if task.cancelled():
                future.set_exception(ProtocolError("wait(): the executor was destroyed"))
            elif (exc := task.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(task.result())

        def run() -> None:
            future.set_running_or_notify_cancel()
            try:
                if source is not None:
                    self._set_source(source)
                if self._fill(count):
                    future.set_result(self._pop(count))
                    return
                loop.create_task(self._take(count, timeout)).add_done_callback(done)
            except BaseException as e:
                future.set_exception(e)

        loop.call_soon_threadsafe(run)
        return future.result()

    def _kick_threadsafe(self) -> None:
        loop = self._loop
        if loop is None or self._closed:
            return
        if threading.get_ident() == self._loop_tid:
            self._kick()
        elif not self._kick_pending:
            # at most one pending hop: a burst of submissions costs one wake-up
            self._kick_pending = True
            loop.call_soon_threadsafe(self._kicked)

    def _kicked(self) -> None:
        self._kick_pending = False
        self._kick()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _run_loop(self, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._loop_tid = threading.get_ident()
        self._wake = asyncio.Event()
        timeout = self._settings.request_timeout if self._settings else None
        self._deadlines = _Deadlines(loop, timeout, self._expire) if timeout is not None else None
        dispatcher = loop.create_task(self._dispatch_forever())
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        finally:
            # Cancel what is left (the dispatcher, waits of other threads) and run the loop until
            # their callbacks have run, so that no caller is left blocked on a dead loop.
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, dispatcher, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    # ------------------------------------------------------------------ loop thread: dispatch

    async def _dispatch_forever(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            self._n["dispatch_wakeups"] += 1
            try:
                self._dispatch()
            except Exception as e:  # a bug of ours or a broken data loader: stop loudly
                logger.exception("dispatcher failed")
                self._stop(f"the dispatcher failed: {e!r}")

    def _admission_version(self) -> int:
        return self.get_version()

    def _dispatch(self) -> None:
        """Admit queued items while the policy (and the manager) have capacity."""
        if self._paused or self._stopped is not None or self._closed:
            return
        if self._admit():  # a reservation in the head buffer can make it STUCK
            self._check_head()

    def _admit(self) -> bool:
        """The admission loop; whether any group was reserved in the head buffer."""
        head = False
        policy = self._policy
        assert policy is not None
        inbox = self._inbox
        gate = self.staleness_manager
        guard = self._guard
        version = self._admission_version()
        # The manager's capacity drops by exactly one per admission (running + 1), so asking it
        # once per pass and admitting that many is the same as asking before each admission.
        budget = gate.get_capacity() if gate is not None else None
        while budget is None or budget > 0:
            if not inbox:
                if self._source is None:
                    return head
                try:
                    with self._intake_lock:
                        inbox.append(self._source.next_item(self._next_sample))
                        self._next_sample += 1
                except Exception as e:  # the data loader failed: the trainer hears of it
                    self._source = None
                    self._source_error = e
                    self._notify()
                    return head
            if budget is not None:
                budget -= 1
            gid = self._next_gid
            self._next_gid = gid + 1
            with guard:
                admission = policy.try_admit(gid, version)
            if admission is None:
                return head
            item = inbox.popleft()
            self._n["dispatched_groups"] += 1
            if self._stragglers is not None:
                self._stragglers.reserved(gid)
            self._start_group(gid, item, admission.version)
            if admission.buffer_version == policy.version:
                head = True
        return head

    def _start_group(self, gid: int, item: _Item, version: int) -> None:
        tracker = self._tracker
        assert tracker is not None
        loop = self._loop
        assert loop is not None
        group = _Group(gid, item, version, loop.time())
        self._groups[gid] = group
        self._sample_of[gid] = item[4]
        self._arm_timers()
        if self._drive_manager:
            assert self.staleness_manager is not None
            self.staleness_manager.on_rollout_enqueued()
            self.staleness_manager.on_rollout_submitted()
        deadlines = self._deadlines
        key = 0
        if deadlines is not None:
            key = deadlines.key()
            deadlines.watch(group, key)
        for mid in tracker.start(gid, version):
            self._launch(group, mid, version, key)

    def _unlist(self, gid: int) -> _Group | None:
        """Take a settled group out of the table (and its timeout buckets)."""
        group = self._groups.pop(gid, None)
        if group is not None and self._deadlines is not None:
            self._deadlines.forget(group)
        return group

    def _launch(self, group: _Group, mid: MemberId, version: int, deadline: int) -> None:
        loop = self._loop
        assert loop is not None
        m = _Member(group, mid, version)
        m.deadline = deadline
        if group.truncating:  # a relaunch of a group being truncated: cut it short too
            m.truncated = True
            if group.truncated is None:
                group.truncated = set()
            group.truncated.add(mid.number)
        group.members[mid.number] = m
        self._running_members += 1
        self._launched += 1
        data, workflow = group.item[0], group.item[1]
        engine = self.inference_engine
        if self._engine_abort is not None:  # only then are request ids of any use
            engine = m.engine = _MemberEngine(engine, m, loop.time, self._aborted_requests)
        try:
            m.episode = workflow.arun_episode(engine, data)
        except Exception as e:  # raised before its first await: fail it on the next turn
            loop.call_soon(self._early_failure, m, e)
            return
        m.task = loop.create_task(self._run_member(m))

    async def _run_member(self, m: _Member) -> None:
        """One episode. Outcomes are handled here, in the task, not in a done callback: one
        scheduling step less per trajectory. Members cancelled on purpose are settled when they
        are cancelled (``m.cause`` set), so nothing here depends on the task having started."""
        m.started = True
        try:
            result = await m.episode
        except asyncio.CancelledError:
            if m.cause is None:  # cancelled by someone else (the engine, say)
                self._member_outcome(m, None, "cancelled")
            raise
        except Exception as e:
            if m.cause is None:
                self._member_outcome(m, None, e)
        else:
            if m.cause is None:
                self._member_outcome(m, result, None)

    def _early_failure(self, m: _Member, exc: Exception) -> None:
        if m.cause is None:  # not cancelled with its group meanwhile
            self._member_outcome(m, None, exc)

    def _detach(self, m: _Member) -> None:
        del m.group.members[m.mid.number]
        self._running_members -= 1

    def _expire(self, m: _Member) -> None:
        m.cause = "timeout"
        if m.task is not None and not self._abort_requests(m, "timeout", cancel=True):
            m.task.cancel()
        self._member_outcome(m, None, "timeout")

    def _member_outcome(self, m: _Member, result: Any, failure: BaseException | str | None) -> None:
        """A member ended by itself (or timed out): finish it, or fail (and maybe relaunch) it."""
        self._detach(m)
        try:
            if failure is not None:
                if isinstance(failure, str):
                    self._member_failed(m, failure, None)
                else:
                    self._member_failed(m, _cause(failure), failure)
            elif result is None:
                self._member_failed(m, "rejected", None)
            else:
                self._finished += 1
                if m.engine is None:  # no proxy marks progress: the finish does
                    m.group.progress = self._loop.time()  # type: ignore[union-attr]
                tracker = self._tracker
                assert tracker is not None
                done = tracker.finish(m.mid, result)
                if done is not None:
                    self._group_complete(m.group, done)
        except Exception as e:
            logger.exception("handling the outcome of %r failed", m.mid)
            self._stop(f"handling the outcome of {m.mid} failed: {e!r}")

    def _member_failed(self, m: _Member, cause: str, exc: BaseException | None) -> None:
        self._member_failures[cause] += 1
        if exc is not None:
            logger.debug("episode %s failed: %r", m.mid, exc, exc_info=exc)
        group = m.group
        if self._groups.get(group.gid) is not group:  # settled meanwhile
            return
        tracker = self._tracker
        assert tracker is not None
        outcome = tracker.fail(m.mid, cause, version=self._admission_version())
        if outcome is None:
            return
        if isinstance(outcome, Relaunch):
            self._n["relaunched_members"] += 1
            key = 0
            if self._deadlines is not None:
                key = self._deadlines.key()
                self._deadlines.watch(group, key)
            self._launch(group, outcome.member, outcome.version, key)
            return
        why = f"group {group.gid}: {', '.join(outcome.causes)}"
        if exc is not None:
            why += f" (last: {exc!r})"
        logger.warning("%s", why)
        self._group_failed(group, "failed", why)

    def _group_complete(self, group: _Group, done: GroupComplete) -> None:
        policy = self._policy
        assert policy is not None
        self._unlist(group.gid)
        self._cancel_members(group, "surplus")
        accept = group.item[2]
        if accept is not None:
            try:
                keep = accept([r.result for r in done.members])
            except Exception as e:
                self._settle_failed(group, "failed", f"group {group.gid}: should_accept_fn {e!r}")
                return
            if not keep:
                self._filtered(group, len(done.members), "should_accept_fn returned False")
                return
        s = self._settings
        assert s is not None
        if s.post_process is not None:
            try:
                decision = s.post_process([r.result for r in done.members], s.metric)
            except ConfigError as e:  # a metric the trajectories lack: no group can pass
                self._release(group.gid, "failed")
                self._n["failed_groups"] += 1
                self._stop(str(e))
                return
            except Exception as e:
                why = f"group {group.gid}: group_post_process {s.post_process_name!r} {e!r}"
                self._settle_failed(group, "failed", why)
                return
            if not decision.keep:
                self._filtered(
                    group, len(done.members), f"{s.post_process_name}: {decision.reason}"
                )
                return
        truncated = group.truncated
        payload: _Payload
        if truncated is None:
            payload = tuple((r, _token_versions(r.result), False) for r in done.members)
        else:
            payload = tuple(
                (r, _token_versions(r.result), r.member.number in truncated) for r in done.members
            )
            self._n["truncated_trajectories"] += sum(1 for _, _, t in payload if t)
        segments = {v for _, tv, _ in payload if tv is not None for v in tv if v >= 0}
        try:
            with self._guard:
                kept = policy.complete(group.gid, payload, segment_versions=segments)
        except ProtocolError as e:  # the engine reported versions outside [V, v]
            self._settle_failed(group, "bad_versions", f"group {group.gid}: {e}")
            return
        if self._stragglers is not None:
            assert self._buffer is not None
            self._stragglers.forget(group.gid)
            where = self._buffer.lookup(group.gid)
            if where is not None:
                self._stragglers.landed(where[1])
        self._n["completed_groups"] += 1
        self._consecutive = 0
        self._consecutive_filtered = 0
        if kept:
            if self._drive_manager:
                assert self.staleness_manager is not None
                self.staleness_manager.on_rollout_accepted()
        else:  # counted here; the consume that reports it again skips it
            self._n["dropped_groups"] += 1
            self._settle_sample(group.gid, "dropped")
        self._notify()
        self._kick()
        self._check_head()

    def _filtered(self, group: _Group, members: int, reason: str) -> None:
        """Drop a completed group (its entry returns to EMPTY); stop after too many in a row."""
        self._n["filtered_groups"] += 1
        self._discarded["filtered"] += members
        self._consecutive_filtered += 1
        logger.debug("group %d filtered: %s", group.gid, reason)
        self._release(group.gid, "filtered")
        s = self._settings
        assert s is not None
        if self._consecutive_filtered >= s.max_filtered:
            post = (
                f"group_post_process {s.post_process_name!r} on filter_groups.metric={s.metric!r}"
                if s.post_process is not None
                else "should_accept_fn"
            )
            self._stop(
                f"{self._consecutive_filtered} groups in a row were filtered out by {post} "
                f"(rollout.max_consecutive_filtered={s.max_filtered}; the last: {reason}), so "
                "the data would be cycled forever without a batch; check that the reward varies "
                "within a group (a larger rollout.group_size helps), choose another metric, or "
                "disable the filter (rollout.group_post_process.enable=false)"
            )

    # ------------------------------------------------------------------ loop thread: proactive filter

    def _check_head(self, timer: bool = False) -> None:
        """Whenever the head buffer may have changed: time its STUCK spell and, when the proactive
        filter names targets, retry or truncate them. ``timer``: the STUCK timeout fired."""
        buf = self._buffer
        s = self._settings
        loop = self._loop
        if buf is None or s is None or loop is None or self._checking:
            return
        now = loop.time()
        stuck_for = self._stuck.observe(buf, now)
        if s.proactive == "null" or self._stopped is not None:
            return
        if buf.state(buf.version) is not BufferState.STUCK:
            self._disarm_stuck()
            return
        timeout = s.stuck_timeout
        if timer and timeout is not None:  # the timer may fire a clock tick early
            stuck_for = max(stuck_for, timeout)
        targets = proactive_filter_targets(
            buf, s.threshold, stuck_for=stuck_for, stuck_timeout_s=timeout
        )
        if not targets:
            if timeout is not None and stuck_for < timeout:
                self._arm_stuck(now - stuck_for + timeout)
            return
        if self._stragglers is not None:  # acting at once: only on overtaken groups
            targets = self._stragglers.overtaken(targets, buf.version)
        self._disarm_stuck()
        groups = self._groups
        if s.proactive == "retry":
            tries: dict[Hashable, int] = {g: groups[g].item[3] for g in targets if g in groups}
            chosen = eligible_targets(targets, tries, s.max_retries)
        else:
            being: dict[Hashable, int] = {
                g: 1 for g in targets if g in groups and groups[g].truncating
            }
            chosen = eligible_targets(targets, being, 1)
        chosen = tuple(g for g in chosen if g in groups)
        if not chosen:
            return
        self._checking = True
        try:
            if s.proactive == "retry":
                self._retry(buf, [groups[cast(int, g)] for g in chosen], stuck_for)
            else:
                self._truncate([groups[cast(int, g)] for g in chosen], buf.version, stuck_for)
        finally:
            self._checking = False
        self._stuck.observe(buf, loop.time())

    def _retry(self, buf: StalenessBuffer, chosen: list[_Group], stuck_for: float) -> None:
        """Abort the head buffer's last reservations, pull finished groups forward into the freed
        entries, and queue the prompts again, first in line (new group ids, new V)."""
        tracker = self._tracker
        assert tracker is not None
        items = []
        for group in chosen:
            self._unlist(group.gid)
            self._discarded["retried"] += len(tracker.partial(group.gid))
            tracker.cancel(group.gid)
            self._cancel_members(group, "retried")
            self._release(group.gid, "retried")
            self._n["retried_groups"] += 1
            data, workflow, accept, retries, sample = group.item
            items.append((data, workflow, accept, retries + 1, sample))
        with self._guard:
            moved = buf.pull_forward()
        self._n["pulled_forward_groups"] += len(moved)
        if moved and self._stragglers is not None:
            self._stragglers.landed(buf.version)
        logger.info(
            "proactive filter: buffer %d STUCK for %.3g s; retrying groups %s, pulled %d "
            "finished groups forward",
            buf.version,
            stuck_for,
            [g.gid for g in chosen],
            len(moved),
        )
        for item in reversed(items):
            self._inbox.appendleft(item)
        self._notify()
        self._kick()

    def _truncate(self, chosen: list[_Group], version: int, stuck_for: float) -> None:
        """Cut the head buffer's last groups short: abort their engine requests, so each workflow
        returns its partial output and the group completes (members marked truncated)."""
        for group in chosen:
            group.truncating = True
            self._n["truncated_groups"] += 1
            if group.truncated is None:
                group.truncated = set()
            for m in group.members.values():
                m.truncated = True
                group.truncated.add(m.mid.number)
                self._abort_requests(m, "truncated", cancel=False)
        logger.info(
            "proactive filter: buffer %d STUCK for %.3g s; truncating groups %s",
            version,
            stuck_for,
            [g.gid for g in chosen],
        )

    def _arm_stuck(self, when: float) -> None:
        if self._stuck_handle is not None and self._stuck_due == when:
            return
        self._disarm_stuck()
        loop = self._loop
        assert loop is not None
        self._stuck_due = when
        self._stuck_handle = loop.call_at(when, self._stuck_fired)

    def _disarm_stuck(self) -> None:
        if self._stuck_handle is not None:
            self._stuck_handle.cancel()
            self._stuck_handle = None

    def _stuck_fired(self) -> None:
        self._stuck_handle = None
        try:
            self._check_head(timer=True)
        except Exception as e:
            logger.exception("the proactive filter failed")
            self._stop(f"the proactive filter failed: {e!r}")

    # ------------------------------------------------------------------ loop thread: watchdog

    def _arm_timers(self) -> None:
        """Start the watchdog and progress timers when work starts; they re-arm only while
        groups are running."""
        s = self._settings
        loop = self._loop
        assert s is not None and loop is not None
        if s.watchdog is not None and self._watchdog_handle is None:
            self._watchdog_handle = loop.call_later(s.watchdog, self._watchdog)
        if s.progress_log is not None and self._progress_handle is None:
            self._progress_handle = loop.call_later(s.progress_log, self._progress)

    def _watchdog(self) -> None:
        """Log every group that has produced nothing for ``watchdog_timeout_s`` (once per stall)."""
        self._watchdog_handle = None
        s = self._settings
        loop = self._loop
        assert s is not None and s.watchdog is not None and loop is not None
        now = loop.time()
        limit = s.watchdog
        wake = now + limit
        for group in self._groups.values():
            if group.reported == group.progress:  # reported; wait for new progress
                continue
            if now - group.progress >= limit:
                group.reported = group.progress
                self._n["watchdog_stalls"] += 1
                requests = [
                    rid for m in group.members.values() if m.engine for rid in m.engine.inflight
                ]
                logger.warning(
                    "watchdog: group %d (V=%d, training version %d) has produced nothing for "
                    "%.3g s; members %s running on %s, engine requests in flight %s",
                    group.gid,
                    group.version,
                    self._require_policy().version,
                    now - group.progress,
                    sorted(group.members),
                    type(self.inference_engine).__name__,
                    requests,
                )
            else:
                wake = min(wake, group.progress + limit)
        if self._groups and not self._closed:
            self._watchdog_handle = loop.call_at(wake, self._watchdog)

    def _progress(self) -> None:
        """One log line on the buffers' progress, then again in ``progress_log_s`` if busy."""
        self._progress_handle = None
        s = self._settings
        loop = self._loop
        assert s is not None and s.progress_log is not None and loop is not None
        if not self._groups:  # idle: no line, and no timer until work starts again
            return
        running = f"{len(self._groups)} groups ({self._running_members} members) running"
        if self._buffer is not None:
            logger.info("buffers %s; %s", buffer_progress(self._buffer), running)
        else:
            p = self._require_policy().statistics()
            logger.info(
                "policy %s version %d: %d waiting; %s", p.policy, p.version, p.waiting, running
            )
        if not self._closed:
            self._progress_handle = loop.call_later(s.progress_log, self._progress)

    def _group_failed(self, group: _Group, cause: str, why: str) -> None:
        self._unlist(group.gid)
        self._cancel_members(group, "abandoned")
        self._settle_failed(group, cause, why)

    def _settle_failed(self, group: _Group, cause: str, why: str) -> None:
        """The group is out of the tracker and the table: abort its entry and count a failure."""
        self._release(group.gid, cause)
        self._n["failed_groups"] += 1
        self._consecutive += 1
        self._recent.append(why)
        limit = self._settings.max_failures if self._settings else 1
        if self._consecutive >= limit:
            self._stop(
                f"{self._consecutive} groups failed in a row (rollout.max_consecutive_failures="
                f"{limit}); the last causes: {'; '.join(self._recent)}"
            )
        self._notify()

    def _release(self, gid: int, cause: str) -> None:
        """Return a group's policy slot (abort), tell the manager, and wake the dispatcher."""
        policy = self._policy
        assert policy is not None
        with self._guard:
            policy.abort(gid, cause)
        self._settle_sample(gid, "failed" if cause == "bad_versions" else cause)
        if self._stragglers is not None:
            self._stragglers.forget(gid)
        if self._drive_manager:
            assert self.staleness_manager is not None
            self.staleness_manager.on_rollout_rejected()
        self._kick()
        self._check_head()

    def _cancel_members(self, group: _Group, cause: str) -> None:
        """Cancel a settled group's running members; they are accounted for here and now.

        Their engine requests in flight are aborted on the engine first (``engine.abort``), which
        returns the partial output (its tokens are counted as wasted); then the tasks are
        cancelled. At shutdown the tasks are cancelled at once."""
        for m in list(group.members.values()):
            m.cause = cause
            self._detach(m)
            self._cancelled[cause] += 1
            if not m.started and inspect.iscoroutine(m.episode):
                m.episode.close()  # never awaited: close it, or Python warns
            if m.task is None:
                continue
            if cause != "shutdown" and self._abort_requests(m, cause, cancel=True):
                continue
            m.task.cancel()

    def _abort_requests(self, m: _Member, cause: str, *, cancel: bool) -> bool:
        """Abort ``m``'s engine requests in flight in the background (then cancel its task when
        ``cancel``); False when there is nothing to abort on the engine."""
        abort = self._engine_abort
        rids = list(m.engine.inflight) if m.engine is not None else []
        if abort is None or not rids:
            return False
        loop = self._loop
        assert loop is not None
        task = loop.create_task(self._abort_then(m, abort, rids, cause, cancel))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def _abort_then(
        self, m: _Member, abort: Callable[[Any], Any], rids: list[Any], cause: str, cancel: bool
    ) -> None:
        try:
            for rid in rids:
                try:
                    partial = await _call_abort(abort, rid)
                except Exception as e:  # the engine may have finished it meanwhile
                    logger.warning("engine.abort(%r) for %s (%s) failed: %r", rid, m.mid, cause, e)
                    continue
                self._aborted_requests[cause] += 1
                if cancel:  # truncated output is kept by the workflow, not wasted
                    self._aborted_tokens[cause] += _output_tokens(partial)
        finally:
            if cancel and m.task is not None:
                m.task.cancel()

    def _stop(self, why: str) -> None:
        """Stop for good: cancel every running group; wait/prepare_batch raise from now on."""
        if self._stopped is not None:
            return
        self._stopped = RolloutError(f"the executor stopped: {why}")
        logger.error("%s", self._stopped)
        self._abort_all("stopped")
        self._notify()

    def _abort_all(self, cause: str) -> None:
        tracker = self._tracker
        assert tracker is not None
        for gid, group in list(self._groups.items()):
            self._unlist(gid)
            tracker.cancel(gid)
            self._cancel_members(group, cause)
            with contextlib.suppress(ProtocolError):  # already out of the policy
                self._release(gid, cause)

    async def _shutdown(self) -> None:
        tasks = [m.task for g in self._groups.values() for m in g.members.values() if m.task]
        self._abort_all("shutdown")
        self._notify()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ loop thread: results

    def _notify(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)

    def _fill(self, count: int) -> bool:
        """Consume ready batches until ``count`` groups are waiting; whether there are enough."""
        policy = self._policy
        assert policy is not None
        while len(self._output) < count:
            with self._guard:
                if not policy.ready():
                    return False
                batch = policy.consume()
            v = batch.version
            if self._stragglers is not None:
                self._stragglers.consumed(v + 1)
            for gid in batch.aborted:  # surplus reservations of the consumed buffer
                group = self._unlist(cast(int, gid))
                if group is not None:
                    assert self._tracker is not None
                    self._discarded["surplus"] += len(self._tracker.partial(gid))
                    self._tracker.cancel(gid)
                    self._cancel_members(group, "surplus")
                    if self._drive_manager:
                        assert self.staleness_manager is not None
                        self.staleness_manager.on_rollout_rejected()
                if self._stragglers is not None:
                    self._stragglers.forget(gid)
                self._n["surplus_groups"] += 1
                self._settle_sample(gid, "surplus")
            for gid in batch.dropped:
                if gid in self._sample_of:  # not counted yet (the capacity policy counts at once)
                    self._n["dropped_groups"] += 1
                    self._settle_sample(gid, "dropped")
            self._n["consumed_batches"] += 1
            out = self._output
            n = 0
            samples = self._sample_of
            for g in batch.groups:
                gid = cast(int, g.group_id)
                members: _Payload = g.payload
                sample = samples.pop(gid, -1)
                out.append(
                    tuple(
                        Trajectory(
                            r.result,
                            gid,
                            r.member.number,
                            r.version,
                            v,
                            v - r.version,
                            tv,
                            cut,
                            sample,
                        )
                        for r, tv, cut in members
                    )
                )
                n += len(members)
            self._n["consumed_groups"] += len(batch.groups)
            self._n["consumed_trajectories"] += n
            self._kick()
            self._check_head()
        return True

    def _pop(self, count: int) -> list[Trajectory]:
        out = self._output
        result: list[Trajectory] = []
        for _ in range(count):
            result.extend(out.popleft())
        return result

    async def _take(self, count: int, timeout: float | None) -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._fill(count):
            self._raise_source_error()
            if self._stopped is not None:
                raise self._stopped
            if self._closed:
                raise ProtocolError("wait(): the executor was destroyed while waiting")
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            if deadline is None:
                await waiter
                continue
            left = deadline - loop.time()
            handle = loop.call_later(max(0.0, left), _settle, waiter)
            try:
                await waiter
            finally:
                handle.cancel()
            if loop.time() >= deadline and not self._fill(count):
                raise TimeoutError(
                    f"wait(count={count}, timeout={timeout}): only {len(self._output)} groups "
                    f"ready after {timeout} s ({self._describe()})"
                )
        return self._pop(count)

    def _raise_source_error(self) -> None:
        error, self._source_error = self._source_error, None
        if error is not None:
            raise error

    def _collect(self) -> list[Trajectory]:
        s = self._settings
        assert s is not None
        if self._fill(s.batch_size):
            return self._pop(s.batch_size)
        if self._stopped is not None:
            raise self._stopped
        return []

    def _set_source(self, new: _Source) -> None:
        src = self._source
        if src is None or src.dataloader is not new.dataloader:
            skip, self._resume_skip = self._resume_skip, None
            if skip:
                new.skip(skip)
            self._source = new
        else:  # the same loader: continue where it is, with this call's workflow
            src.workflow, src.accept = new.workflow, new.accept
        self._kick()

    def _settle_sample(self, gid: Hashable, cause: str) -> None:
        sample = self._sample_of.pop(gid, None)
        if sample is not None and cause not in _NOT_AN_OUTCOME:
            self._outcomes.append((sample, cause if cause in OUTCOMES else "failed"))

    def _state_dict(self) -> dict[str, Any]:
        policy = self._require_policy()
        with self._guard:
            snapshot = policy.snapshot()
        with self._intake_lock:
            queued = [(item[4], item[0], item[3]) for item in self._inbox]
            next_sample = self._next_sample
        running = sorted(self._groups.items())
        drawn = self._source.drawn if self._source is not None else (self._resume_skip or 0)
        return {
            "format": STATE_FORMAT,
            "policy": policy.name,
            "version": policy.version,
            "policy_state": snapshot,
            # in admission order, then the input queue: the order they are dispatched again in
            "pending": [(g.item[4], g.item[0], g.item[3]) for _, g in running] + queued,
            "running_groups": [gid for gid, _ in running],
            # the sample indices of the completed groups the policy holds
            "samples": {g: i for g, i in self._sample_of.items() if g not in self._groups},
            "waiting": list(self._output),
            "loader_position": drawn,
            "next_sample": next_sample,
            "next_group_id": self._next_gid,
            "outcomes": list(self._outcomes),
            "counters": {
                "events": dict(self._n),
                "member_failures": dict(self._member_failures),
                "cancelled_members": dict(self._cancelled),
                "aborted_requests": dict(self._aborted_requests),
                "aborted_tokens": dict(self._aborted_tokens),
                "discarded_members": dict(self._discarded),
                "launched_members": self._launched,
                "finished_members": self._finished,
            },
        }

    def _load_state(
        self, state: Mapping[str, Any], workflow: WorkflowProtocol, accept: ShouldAccept | None
    ) -> None:
        policy = self._require_policy()
        if self._next_gid or self._groups or self._inbox or self._output or self._source:
            raise ProtocolError(
                "load_state_dict(): the executor has already taken work; load the state right "
                "after initialize(), before submit() or prepare_batch()"
            )
        try:
            fmt = state["format"]
            if fmt != STATE_FORMAT:
                raise ProtocolError(
                    f"load_state_dict(): state format {fmt!r} is not supported (this stalebound "
                    f"reads format {STATE_FORMAT}); resume with the version that wrote it"
                )
            if state["policy"] != policy.name:
                raise ProtocolError(
                    f"load_state_dict(): the state was written under "
                    f"rollout.staleness_policy={state['policy']!r}, this executor runs "
                    f"{policy.name!r}; resume with the policy it was written with"
                )
            pending = [(int(i), data, int(r)) for i, data, r in state["pending"]]
            running = [int(gid) for gid in state["running_groups"]]
            samples: dict[Hashable, int] = {int(gid): int(i) for gid, i in state["samples"].items()}
            waiting = [tuple(t) for t in state["waiting"]]
            position = int(state["loader_position"])
            next_sample, next_gid = int(state["next_sample"]), int(state["next_group_id"])
            outcomes = [(int(i), str(o)) for i, o in state["outcomes"]]
            c = state["counters"]
            counters = [
                Counter({str(k): int(n) for k, n in c[name].items()})
                for name in (
                    "events",
                    "member_failures",
                    "cancelled_members",
                    "aborted_requests",
                    "aborted_tokens",
                    "discarded_members",
                )
            ]
            launched, finished = int(c["launched_members"]), int(c["finished_members"])
            with self._guard:
                policy.load_snapshot(state["policy_state"])
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ProtocolError(
                f"load_state_dict(): the state is damaged or not an executor state "
                f"({type(exc).__name__}: {exc}); load one written by state_dict()"
            ) from exc
        if isinstance(policy, BufferPolicy):
            self._buffer = policy.buffer
        with self._guard:
            for gid in running:  # their episodes died with the old process: run them again
                if policy.is_running(gid):
                    policy.abort(gid, "resumed")
        (
            self._n,
            self._member_failures,
            self._cancelled,
            self._aborted_requests,
            self._aborted_tokens,
            self._discarded,
        ) = counters
        self._n["resumed_groups"] += len(running)
        self._launched, self._finished = launched, finished
        self._sample_of = samples
        self._output = deque(waiting)
        self._outcomes = deque(outcomes)
        self._next_gid = next_gid
        self._resume_skip = position
        with self._intake_lock:
            self._next_sample = next_sample
            for sample, data, retries in pending:
                self._inbox.append((data, workflow, accept, retries, sample))
        logger.info(
            "resumed at version %d: %d groups waiting in the policy, %d items to dispatch again, "
            "%d queued",
            policy.version,
            len(samples),
            len(running),
            len(pending) - len(running),
        )
        self._kick()

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        if not paused:
            self._kick()

    def _capacity(self) -> int:
        policy = self._policy
        assert policy is not None
        with self._guard:
            cap = policy.capacity(self._admission_version())
        if self.staleness_manager is not None:
            cap = min(cap, self.staleness_manager.get_capacity())
        return cap - len(self._inbox)

    def _describe(self) -> str:
        p = self._require_policy().statistics()
        generation = self._admission_version()
        hint = ""
        if generation < p.version:
            hint = (
                f"; new groups are generated at version {generation}, behind the training version "
                f"{p.version}: after publishing weights, call set_version({p.version})"
            )
        return (
            f"policy {p.policy} at version {p.version}: {p.running} running, {p.waiting} waiting, "
            f"{len(self._inbox)} queued, paused={self._paused}{hint}"
        )

    def _statistics(self) -> ExecutorStatistics:
        policy = self._require_policy()
        with self._guard:
            ps = policy.statistics()
        n = self._n
        manager = self.staleness_manager
        now = self._loop.time() if self._loop is not None else 0.0
        stuck = dict(self._stuck.total_stuck_s)
        for b, since in self._stuck.open_intervals().items():
            stuck[b] = stuck.get(b, 0.0) + now - since
        stuck_total = sum(stuck.values())
        return ExecutorStatistics(
            policy=ps,
            manager=manager.get_stats() if manager is not None else None,
            version=ps.version,
            generation_version=self._admission_version(),
            paused=self._paused,
            stopped=str(self._stopped) if self._stopped is not None else None,
            queued=len(self._inbox),
            submitted=n["dispatched_groups"] + len(self._inbox),
            dispatched_groups=n["dispatched_groups"],
            running_groups=len(self._groups),
            running_members=self._running_members,
            launched_members=self._launched,
            finished_members=self._finished,
            member_failures=MappingProxyType(dict(self._member_failures)),
            cancelled_members=MappingProxyType(dict(self._cancelled)),
            relaunched_members=n["relaunched_members"],
            completed_groups=n["completed_groups"],
            failed_groups=n["failed_groups"],
            filtered_groups=n["filtered_groups"],
            consecutive_filtered=self._consecutive_filtered,
            retried_groups=n["retried_groups"],
            pulled_forward_groups=n["pulled_forward_groups"],
            truncated_groups=n["truncated_groups"],
            truncated_trajectories=n["truncated_trajectories"],
            aborted_requests=MappingProxyType(dict(self._aborted_requests)),
            aborted_tokens=MappingProxyType(dict(self._aborted_tokens)),
            discarded_members=MappingProxyType(dict(self._discarded)),
            stuck_seconds=stuck_total,
            stuck_seconds_by_buffer=MappingProxyType(stuck),
            watchdog_stalls=n["watchdog_stalls"],
            dropped_groups=n["dropped_groups"],
            surplus_groups=n["surplus_groups"],
            consumed_batches=n["consumed_batches"],
            consumed_groups=n["consumed_groups"],
            consumed_trajectories=n["consumed_trajectories"],
            waiting_groups=len(self._output),
            consecutive_failures=self._consecutive,
            dispatch_wakeups=n["dispatch_wakeups"],
            resumed_groups=n["resumed_groups"],
        )


def _cause(exc: BaseException) -> str:
    return f"error:{type(exc).__name__}"


def _settle(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)

"""Engine replicas as Ray actors, a protocol client per replica, and a router that survives losses.

* :class:`RayEngineActor` hosts one embedded engine. It runs a
  :class:`~stalebound.engines.LocalEngine` inside the actor rather than driving the model on the
  actor's own threads: the engine's decode loop is GIL-bound Python between small matrix products,
  and in its own worker process it leaves the actor's event loop free to take new requests, aborts
  and weight updates between tokens (the same reason the local backend runs it in a worker). It
  also reuses the tested batching, abort and migration code unchanged. The cost is one more
  process per replica.
* :class:`RayEngine` implements the engine protocol (and migration) over one actor handle: each
  call is an actor task whose ``ObjectRef`` it awaits, so it works from any asyncio loop of the
  driver (the executor's included). ``get_version`` answers from the version of the last
  acknowledged update, without a round trip.
* :class:`RayRouter` is a :class:`~stalebound.engines.Router` over such clients that publishes
  weights once through the object store (``ray.put``; every replica gets the reference) and stops
  routing to a replica whose actor died. Requests in flight on a dead replica raise
  :class:`ReplicaLostError`: the executor counts each as a member failure
  (``error:ReplicaLostError``) and relaunches the member, which the router places on a live
  replica. Their partial output died with the actor, so they restart from the prompt; the loss is
  counted in :meth:`RayRouter.ray_statistics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stalebound.core.errors import ConfigError
from stalebound.distributed.cluster import import_ray, init_ray
from stalebound.engines.protocol import (
    Continuation,
    EngineClosedError,
    GenerateRequest,
    GenerateResponse,
    WeightSource,
)
from stalebound.engines.router import Router

if TYPE_CHECKING:
    from stalebound.config import StaleboundConfig

__all__ = [
    "PublishedWeights",
    "RayEngine",
    "RayEngineActor",
    "RayRouter",
    "RayRouterStatistics",
    "ReplicaLostError",
    "make_ray_engine",
]

_log = logging.getLogger(__name__)


class ReplicaLostError(EngineClosedError):
    """An engine replica's actor died; requests that were running on it are lost.

    ``replica`` names the replica, ``request_id`` the request (``None`` for a control call).
    Retrying the request goes to the router, which places it on a live replica.
    """

    def __init__(self, replica: str, request_id: str | None, cause: str) -> None:
        self.replica = replica
        self.request_id = request_id
        what = f"request {request_id!r}" if request_id is not None else "the call"
        super().__init__(
            f"engine replica {replica!r} died ({cause}); {what} was lost with it. Retry it: the "
            "router sends it to a live replica (the executor relaunches failed members itself)"
        )


class PublishedWeights(Mapping[str, Any]):
    """A state dict that lives in the Ray object store: a mapping fetched on first access.

    :class:`RayRouter` hands :attr:`ref` to its replicas without fetching the weights into the
    driver; any other consumer (a local engine, a checkpoint writer) reads it like a dict.
    """

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self._value: Mapping[str, Any] | None = None

    def _get(self) -> Mapping[str, Any]:
        if self._value is None:
            self._value = import_ray().get(self.ref)
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


class _EngineHost:
    """The body of :class:`RayEngineActor` (an async actor: its methods run on one event loop)."""

    def __init__(self, model_path: str, options: Mapping[str, Any]) -> None:
        from stalebound.engines.local import LocalEngine

        self._engine = LocalEngine(model_path, **options)

    async def ready(self) -> int:
        """Wait until the model is loaded; returns the engine worker's process id."""
        await asyncio.to_thread(self._engine.wait_ready)
        info = await self._engine._info()
        return info.pid

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        return await self._engine.agenerate(request)

    async def abort(self, request_id: str) -> GenerateResponse | None:
        return await self._engine.abort(request_id)

    async def pause(self) -> None:
        await self._engine.pause()

    async def resume(self) -> None:
        await self._engine.resume()

    async def update_weights(self, source: WeightSource, version: int) -> float:
        """Install weights (a state dict resolved from the object store, or a checkpoint
        directory); returns the seconds the update took inside the actor."""
        started = time.perf_counter()
        await self._engine.update_weights(source, version)
        return time.perf_counter() - started

    async def export_continuation(self, request_id: str) -> Continuation | None:
        return await self._engine.export_continuation(request_id)

    async def acontinue(self, continuation: Continuation) -> GenerateResponse:
        return await self._engine.acontinue(continuation)

    def get_version(self) -> int:
        return self._engine.get_version()

    def statistics(self) -> Any:
        return self._engine.statistics()

    def close(self) -> None:
        self._engine.close()


_ACTOR_CLASS: Any = None


def RayEngineActor() -> Any:
    """The Ray actor class hosting one embedded engine (built on first use, so importing this
    module does not import ray). Create replicas with
    ``RayEngineActor().options(num_cpus=...).remote(model_path, options)``."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = import_ray().remote(_EngineHost)
    return _ACTOR_CLASS


def _is_actor_death(exc: BaseException) -> bool:
    ray = import_ray()
    return isinstance(exc, ray.exceptions.RayActorError)


class RayEngine:
    """The engine protocol over one :class:`RayEngineActor` handle (see the module docstring).

    After its actor died, every call raises :class:`ReplicaLostError` and :attr:`alive` is false.
    """

    def __init__(self, actor: Any, *, name: str, version: int = 0) -> None:
        self.actor = actor
        self.name = name
        self._version = version
        self._dead: str | None = None
        self.lost_requests = 0
        """Requests that failed here because the actor died (running, or sent before the death
        was known)."""

    @property
    def alive(self) -> bool:
        """Whether the actor was alive at the last call."""
        return self._dead is None

    def mark_dead(self, cause: str, *, closed: bool = False) -> None:
        """Record that the actor died, or was ``closed`` (the router then stops routing here)."""
        if self._dead is None:
            self._dead = cause
            if not closed:
                _log.warning("engine replica %r died: %s", self.name, cause)

    async def _await(self, ref: Any, request_id: str | None) -> Any:
        if self._dead is not None:
            raise ReplicaLostError(self.name, request_id, self._dead)
        try:
            return await ref
        except Exception as exc:
            if not _is_actor_death(exc):
                raise
            self.mark_dead(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            if request_id is not None:
                self.lost_requests += 1
            raise ReplicaLostError(self.name, request_id, self._dead or "") from exc

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        """Generate on the actor; cancelling the call aborts the request there."""
        if self._dead is not None:
            raise ReplicaLostError(self.name, request.request_id, self._dead)
        ref = self.actor.agenerate.remote(request)
        try:
            response: GenerateResponse = await self._await(ref, request.request_id)
        except asyncio.CancelledError:
            if self._dead is None:
                self.actor.abort.remote(request.request_id)  # stop spending tokens on it
            raise
        return response

    async def abort(self, request_id: str) -> GenerateResponse | None:
        """Abort on the actor; ``None`` if unknown there (or the actor is gone: the pending
        ``agenerate`` then raises :class:`ReplicaLostError`)."""
        if self._dead is not None:
            return None
        try:
            response: GenerateResponse | None = await self._await(
                self.actor.abort.remote(request_id), None
            )
        except ReplicaLostError:
            return None
        return response

    async def pause(self) -> None:
        await self._await(self.actor.pause.remote(), None)

    async def resume(self) -> None:
        await self._await(self.actor.resume.remote(), None)

    async def update_weights(self, source: WeightSource | Any, version: int) -> None:
        """Install weights: a state dict, a checkpoint directory, a :class:`PublishedWeights` or
        an ``ObjectRef`` of a state dict (the actor reads it from the object store)."""
        await self.update_weights_timed(source, version)

    async def update_weights_timed(self, source: WeightSource | Any, version: int) -> float:
        """:meth:`update_weights`; returns the seconds the update took inside the actor."""
        if isinstance(source, PublishedWeights):
            source = source.ref
        seconds: float = await self._await(self.actor.update_weights.remote(source, version), None)
        self._version = max(self._version, version)
        return seconds

    def get_version(self) -> int:
        """The version of the last acknowledged update."""
        return self._version

    async def export_continuation(self, request_id: str) -> Continuation | None:
        if self._dead is not None:
            return None
        continuation: Continuation | None = await self._await(
            self.actor.export_continuation.remote(request_id), None
        )
        return continuation

    async def acontinue(self, continuation: Continuation) -> GenerateResponse:
        rid = continuation.request.request_id
        if self._dead is not None:
            raise ReplicaLostError(self.name, rid, self._dead)
        ref = self.actor.acontinue.remote(continuation)
        try:
            response: GenerateResponse = await self._await(ref, rid)
        except asyncio.CancelledError:
            if self._dead is None:
                self.actor.abort.remote(rid)
            raise
        return response

    async def statistics(self) -> Any:
        """The hosted engine's :class:`~stalebound.engines.EngineStatistics`."""
        return await self._await(self.actor.statistics.remote(), None)


@dataclass(frozen=True, slots=True)
class RayRouterStatistics:
    """What the Ray router adds to :class:`~stalebound.engines.RouterStatistics`."""

    alive: tuple[bool, ...]
    lost_requests: tuple[int, ...]
    """Requests that failed on each replica because its actor died (each raised
    :class:`ReplicaLostError` to its caller)."""
    weight_updates: int
    publish_s: tuple[float, ...]
    """Wall time of each recent publication: ``ray.put`` plus every replica's acknowledgement."""
    put_s: tuple[float, ...]
    """The ``ray.put`` part of each recent publication (zero when the weights were already in the
    object store)."""


_KEPT = 256


class RayRouter(Router):
    """A :class:`~stalebound.engines.Router` over :class:`RayEngine` replicas (module docstring).

    Placement skips dead replicas. ``update_weights``, ``pause`` and ``resume`` go to the live
    ones; ``get_version`` is the lowest live version. With no live replica left, requests raise
    :class:`ReplicaLostError`.
    """

    engines: tuple[RayEngine, ...]

    def __init__(
        self, engines: Sequence[RayEngine], *, max_in_flight_per_engine: int | None = None
    ) -> None:
        super().__init__(engines, max_in_flight_per_engine=max_in_flight_per_engine)
        self._publish_s: list[float] = []
        self._put_s: list[float] = []

    @property
    def live(self) -> tuple[RayEngine, ...]:
        """The replicas whose actors have not been seen dead."""
        return tuple(e for e in self.engines if e.alive)

    # Router's placement calls this for every new or queued request: a dead replica is never full
    # enough to pick, so requests (and relaunches) go to the live ones.
    def _least_loaded(self, exclude: int | None = None) -> int | None:
        best: int | None = None
        for i, load in enumerate(self._load):
            if i == exclude or not self.engines[i].alive:
                continue
            if self._limit is not None and load >= self._limit:
                continue
            if best is None or load < self._load[best]:
                best = i
        return best

    def _check_live(self, request_id: str | None) -> None:
        if not self.live:
            causes = "; ".join(f"{e.name}: {e._dead}" for e in self.engines)
            raise ReplicaLostError("all", request_id, f"no engine replica is alive ({causes})")

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        """Generate on the least-loaded live replica."""
        self._check_live(request.request_id)
        try:
            return await super().agenerate(request)
        except ReplicaLostError:
            self._fail_queued_if_none_live()
            raise

    async def acontinue(self, continuation: Continuation) -> GenerateResponse:
        """Resume an exported request on the least-loaded live replica."""
        self._check_live(continuation.request.request_id)
        return await super().acontinue(continuation)

    def _fail_queued_if_none_live(self) -> None:
        if self.live:
            return
        for waiter in list(self._queued.values()):
            if not waiter.slot.done():
                waiter.slot.set_exception(
                    ReplicaLostError("all", waiter.request_id, "no engine replica is alive")
                )
        self._queued.clear()
        self._queue.clear()

    async def pause(self) -> None:
        """Pause every live replica."""
        await self._each_live(lambda e: e.pause())

    async def resume(self) -> None:
        """Resume every live replica."""
        await self._each_live(lambda e: e.resume())

    async def update_weights(self, source: WeightSource | Any, version: int) -> None:
        """Put the state dict in the object store once and send the reference to every live
        replica (a checkpoint directory is sent as its path)."""
        started = time.perf_counter()
        ray = import_ray()
        if isinstance(source, PublishedWeights):
            payload: Any = source.ref
        elif isinstance(source, Mapping):
            payload = await asyncio.to_thread(ray.put, dict(source))
        else:
            payload = source  # a path, or already an ObjectRef
        put_s = time.perf_counter() - started
        await self._each_live(lambda e: e.update_weights(payload, version))
        self._publish_s = [*self._publish_s[-(_KEPT - 1) :], time.perf_counter() - started]
        self._put_s = [*self._put_s[-(_KEPT - 1) :], put_s]

    async def _each_live(self, call: Any) -> None:
        self._check_live(None)
        results = await asyncio.gather(*(call(e) for e in self.live), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        lost = [r for r in errors if isinstance(r, ReplicaLostError)]
        for error in errors:
            if not isinstance(error, ReplicaLostError):
                raise error
        if lost:
            self._fail_queued_if_none_live()
            self._check_live(None)  # a call that reached no replica at all is an error

    def get_version(self) -> int:
        """The lowest version among the live replicas."""
        live = self.live or self.engines
        return min(e.get_version() for e in live)

    def ray_statistics(self) -> RayRouterStatistics:
        """Liveness, losses and publication times (a frozen snapshot)."""
        return RayRouterStatistics(
            alive=tuple(e.alive for e in self.engines),
            lost_requests=tuple(e.lost_requests for e in self.engines),
            weight_updates=len(self._publish_s),
            publish_s=tuple(self._publish_s),
            put_s=tuple(self._put_s),
        )

    def close(self) -> None:
        """Stop every replica's engine and kill its actor. Idempotent."""
        ray = import_ray()
        for engine in self.engines:
            if engine.alive:
                try:
                    ray.get(engine.actor.close.remote(), timeout=30)
                except Exception as exc:  # already gone: nothing left to stop
                    _log.debug("closing replica %r: %r", engine.name, exc)
                engine.mark_dead("closed", closed=True)
            ray.kill(engine.actor)


def make_ray_engine(
    config: StaleboundConfig, *, model_path: str | None = None, version: int = 0
) -> RayRouter:
    """``config.engine.replicas`` engine actors serving ``model_path`` (default:
    ``config.engine.model_path``, else the default model built in ``config.engine.cache_dir``),
    behind a :class:`RayRouter`. Connects to Ray per ``config.ray`` first and returns once every
    replica has loaded the model. Close it with :meth:`RayRouter.close`.
    """
    e = config.engine
    if e.kind != "local":
        raise ConfigError(
            f"engine.kind={e.kind!r} with backend=ray: Ray actors host the embedded engine; use "
            "engine.kind=local, or backend=local to address vLLM/SGLang servers directly"
        )
    path = model_path or e.model_path
    if path is None:
        from stalebound.engines.models import build_default_model

        path = str(build_default_model(e.cache_dir, seed=config.seed))
    ray = init_ray(config.ray)
    options = {
        "version": version,
        "seed": config.seed,
        "max_batch_size": e.max_batch_size,
        "interrupt_mode": e.interrupt_mode,
        "num_threads": e.num_threads,
    }
    actor_class = RayEngineActor()
    clients = []
    for i in range(e.replicas):
        name = f"ray-engine-{i}"
        actor = actor_class.options(num_cpus=config.ray.engine_num_cpus).remote(
            str(path), {**options, "name": name}
        )
        clients.append(RayEngine(actor, name=name, version=version))
    ray.get([c.actor.ready.remote() for c in clients])
    return RayRouter(clients, max_in_flight_per_engine=e.max_in_flight_per_engine)

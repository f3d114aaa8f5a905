"""Router placement and queueing, over in-process stand-in engines the test finishes by hand.

(The router over real local engines is tested in test_engine_local.py.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.engines import (
    Continuation,
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    MigratableEngine,
    Router,
    SamplingParams,
    WeightSource,
)


class HeldEngine:
    """An engine whose requests run until the test calls :meth:`finish` (or aborts them)."""

    def __init__(self, version: int = 0, log: list[str] | None = None) -> None:
        self.version = version
        self.received: list[str] = []
        self.log = log if log is not None else []
        self.continued: list[Continuation] = []
        self.running: dict[str, tuple[GenerateRequest, asyncio.Future[GenerateResponse]]] = {}
        self.paused = False

    def _response(self, request: GenerateRequest, finish: Any, n: int = 3) -> GenerateResponse:
        return GenerateResponse(
            request.request_id,
            request.input_ids,
            tuple(range(n)),
            (0.0,) * n,
            (self.version,) * n,
            finish,
        )

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        self.received.append(request.request_id)
        self.log.append(request.request_id)
        future: asyncio.Future[GenerateResponse] = asyncio.get_running_loop().create_future()
        self.running[request.request_id] = (request, future)
        try:
            return await future
        finally:
            self.running.pop(request.request_id, None)

    def finish(self, request_id: str) -> None:
        request, future = self.running[request_id]
        future.set_result(self._response(request, "length"))

    async def abort(self, request_id: str) -> GenerateResponse | None:
        if request_id not in self.running:
            return None
        request, future = self.running[request_id]
        response = self._response(request, "abort", n=1)
        future.set_result(response)
        return response

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def update_weights(self, source: WeightSource, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    async def export_continuation(self, request_id: str) -> Continuation | None:
        if request_id not in self.running:
            return None
        request, future = self.running[request_id]
        future.set_result(self._response(request, "abort", n=1))
        return Continuation(request, (7,), (-1.0,), (self.version,), seed=5)

    async def acontinue(self, continuation: Continuation) -> GenerateResponse:
        self.continued.append(continuation)
        return await self.agenerate(continuation.request)


def req(rid: str, priority: int | None = None) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2), SamplingParams(max_new_tokens=3), priority_version=priority)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_stand_in_implements_the_protocols() -> None:
    assert isinstance(HeldEngine(), InferenceEngine)
    assert isinstance(HeldEngine(), MigratableEngine)
    assert isinstance(Router([HeldEngine()]), MigratableEngine)


def test_requests_go_to_the_least_loaded_replica_lowest_index_on_ties() -> None:
    engines = [HeldEngine(), HeldEngine(), HeldEngine()]
    router = Router(engines)

    async def scenario() -> None:
        tasks = {}
        for rid in ("r1", "r2", "r3", "r4"):
            tasks[rid] = asyncio.create_task(router.agenerate(req(rid)))
            await settle()
        assert [e.received for e in engines] == [["r1", "r4"], ["r2"], ["r3"]]
        engines[1].finish("r2")
        engines[0].finish("r1")
        await settle()
        assert router.statistics().in_flight == (1, 0, 1)
        tasks["r5"] = asyncio.create_task(router.agenerate(req("r5")))
        await settle()
        assert engines[1].received == ["r2", "r5"]
        for engine in engines:
            for rid in list(engine.running):
                engine.finish(rid)
        results = await asyncio.gather(*tasks.values())
        assert [r.finish_reason for r in results] == ["length"] * 5
        assert router.statistics().in_flight == (0, 0, 0)
        assert router.statistics().routed == (2, 2, 1)

    asyncio.run(scenario())


def test_full_replicas_queue_requests_oldest_version_first() -> None:
    log: list[str] = []
    engines = [HeldEngine(version=3, log=log), HeldEngine(version=3, log=log)]
    router = Router(engines, max_in_flight_per_engine=1)

    async def scenario() -> None:
        tasks = [asyncio.create_task(router.agenerate(req(r))) for r in ("busy0", "busy1")]
        await settle()
        for rid, priority in [("new", 5), ("old", 1), ("unversioned", None), ("old2", 1)]:
            tasks.append(asyncio.create_task(router.agenerate(req(rid, priority))))
            await settle()
        assert router.statistics().queued == 4
        assert log == ["busy0", "busy1"]
        while not all(t.done() for t in tasks):
            engine = next(e for e in engines if e.running)
            engine.finish(next(iter(engine.running)))
            await settle()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    # V_traj 1 first (in arrival order), then the unversioned one at the router's version 3.
    assert log == ["busy0", "busy1", "old", "old2", "unversioned", "new"]


def test_abort_of_a_queued_request_returns_an_empty_partial_and_counts() -> None:
    engine = HeldEngine()
    router = Router([engine], max_in_flight_per_engine=1)

    async def scenario() -> None:
        running = asyncio.create_task(router.agenerate(req("running")))
        queued = asyncio.create_task(router.agenerate(req("queued")))
        await settle()
        partial = await router.abort("queued")
        assert partial is not None and partial.finish_reason == "abort"
        assert partial.output_ids == ()
        assert await queued == partial
        assert await router.abort("queued") is None
        aborted = await router.abort("running")
        assert aborted is not None and aborted.output_ids == (0,)
        assert await running == aborted
        assert engine.received == ["running"]
        assert router.statistics().aborted_queued == 1
        assert router.statistics().in_flight == (0,)

    asyncio.run(scenario())


def test_cancelled_queued_request_leaves_no_trace() -> None:
    engine = HeldEngine()
    router = Router([engine], max_in_flight_per_engine=1)

    async def scenario() -> None:
        running = asyncio.create_task(router.agenerate(req("a")))
        queued = asyncio.create_task(router.agenerate(req("b")))
        await settle()
        queued.cancel()
        await settle()
        engine.finish("a")
        await running
        assert router.statistics().in_flight == (0,)
        assert router.statistics().queued == 0
        assert engine.received == ["a"]

    asyncio.run(scenario())


def test_migrate_keeps_the_callers_await_and_uses_the_target() -> None:
    engines = [HeldEngine(), HeldEngine()]
    router = Router(engines)

    async def scenario() -> None:
        task = asyncio.create_task(router.agenerate(req("m")))
        await settle()
        assert await router.migrate("m")
        await settle()
        assert router.statistics().in_flight == (0, 1)
        assert engines[1].continued[0].output_ids == (7,)
        engines[1].finish("m")
        response = await task
        assert response.finish_reason == "length"
        assert router.statistics().migrations == 1
        assert router.statistics().in_flight == (0, 0)
        assert not await router.migrate("m")
        with pytest.raises(ProtocolError, match="another replica index"):
            other = asyncio.create_task(router.agenerate(req("x")))
            await settle()
            try:
                await router.migrate("x", to=0)
            finally:
                engines[0].finish("x")
                await other

    asyncio.run(scenario())


def test_control_calls_fan_out_and_version_is_the_minimum() -> None:
    engines = [HeldEngine(version=2), HeldEngine(version=4)]
    router = Router(engines)
    assert router.get_version() == 2

    async def scenario() -> None:
        await router.pause()
        assert all(e.paused for e in engines)
        await router.resume()
        assert not any(e.paused for e in engines)
        await router.update_weights({}, 5)

    asyncio.run(scenario())
    assert router.get_version() == 5


def test_duplicate_request_ids_are_refused() -> None:
    router = Router([HeldEngine()])

    async def scenario() -> None:
        task = asyncio.create_task(router.agenerate(req("d")))
        await settle()
        with pytest.raises(ProtocolError, match="already in flight"):
            await router.agenerate(req("d"))
        await router.abort("d")
        await task

    asyncio.run(scenario())


def test_bad_router_settings_are_all_reported() -> None:
    with pytest.raises(ConfigError) as info:
        Router([object()], max_in_flight_per_engine=0)  # type: ignore[list-item]
    assert len(info.value.problems) == 2
    assert "does not implement the InferenceEngine protocol" in info.value.problems[0]
    with pytest.raises(ConfigError, match="at least one engine"):
        Router([])

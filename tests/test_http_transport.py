"""The HTTP transport against a scripted server (``httpx.MockTransport``): statuses, streams, and
the one retry helper every retry waits through.

Waits are not slept: the module's clock and ``asyncio.sleep`` are replaced by a fake clock that
records each wait and moves on by it, so a test reads the exact backoff schedule.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from stalebound.engines import http_transport  # noqa: E402
from stalebound.engines.http_transport import (  # noqa: E402
    EngineAPIError,
    EngineUnavailableError,
    HTTPTransport,
    StreamBroken,
)
from stalebound.engines.protocol import EngineClosedError  # noqa: E402

URL = "http://server.test"


class FakeClock:
    """Monotonic time that moves only when the transport waits; ``waits`` lists each wait."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(round(seconds, 6))
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(http_transport, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    real_asyncio = http_transport.asyncio
    monkeypatch.setattr(
        http_transport,
        "asyncio",
        types.SimpleNamespace(
            sleep=fake.sleep,
            get_running_loop=real_asyncio.get_running_loop,
            AbstractEventLoop=real_asyncio.AbstractEventLoop,
        ),
    )
    return fake


Handler = Callable[[httpx.Request], httpx.Response]


def scripted(
    *answers: Handler | httpx.Response | Exception,
) -> tuple[httpx.MockTransport, list[str]]:
    """A server that gives ``answers`` in order (the last one for ever); ``seen`` lists each
    request as ``METHOD path``."""
    seen: list[str] = []
    queue = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, httpx.Response):
            return answer
        return answer(request)

    return httpx.MockTransport(handle), seen


def transport(wire: httpx.MockTransport, *, retries: int = 4, backoff: float = 0.25) -> Any:
    return HTTPTransport(
        URL,
        name="Toy",
        start_hint="start it with `toy serve`",
        timeout=30.0,
        connect_timeout=5.0,
        retries=retries,
        backoff=backoff,
        max_connections=4,
        wire=wire,
    )


def refused() -> httpx.ConnectError:
    return httpx.ConnectError("[Errno 111] Connection refused")


def test_a_call_is_retried_on_5xx_with_doubling_waits(clock: FakeClock) -> None:
    wire, seen = scripted(
        httpx.Response(503, text="busy"),
        httpx.Response(502, text="gateway"),
        httpx.Response(200, json={"ok": True}),
    )
    http = transport(wire)

    async def main() -> Any:
        data = await http.call_json("POST", "/pause", json_body={"mode": "keep"})
        await http.aclose()
        return data

    assert asyncio.run(main()) == {"ok": True}
    assert seen == ["POST /pause"] * 3
    assert clock.waits == [0.25, 0.5]
    assert http.retried == 2


def test_an_unreachable_server_is_retried_then_named_with_how_to_start_it(
    clock: FakeClock,
) -> None:
    wire, seen = scripted(refused())
    http = transport(wire, retries=4)

    async def main() -> None:
        with pytest.raises(EngineUnavailableError) as info:
            await http.call("GET", "/v1/models")
        assert str(info.value) == (
            f"Toy server {URL} unreachable: GET /v1/models failed 5 times (ConnectError: [Errno "
            "111] Connection refused); is it running? start it with `toy serve`"
        )
        assert isinstance(info.value.__cause__, httpx.ConnectError)

    asyncio.run(main())
    assert len(seen) == 5
    assert clock.waits == [0.25, 0.5, 1.0, 2.0]
    assert http.retried == 4


def test_a_persistent_5xx_says_how_many_attempts_and_no_retries_means_one(
    clock: FakeClock,
) -> None:
    wire, seen = scripted(httpx.Response(503, text="overloaded"))
    http = transport(wire, retries=0)

    async def main() -> None:
        with pytest.raises(EngineUnavailableError, match=r"POST /x answered 503 after 1 attempts"):
            await http.call("POST", "/x")

    asyncio.run(main())
    assert seen == ["POST /x"] and clock.waits == [] and http.retried == 0


def test_a_missing_endpoint_is_not_retried_and_says_what_to_enable(clock: FakeClock) -> None:
    wire, seen = scripted(httpx.Response(404, json={"detail": "Not Found"}))
    http = transport(wire)

    async def main() -> None:
        with pytest.raises(EngineAPIError) as info:
            await http.call("POST", "/pause", hint="start it with DEV_MODE=1")
        assert str(info.value) == (
            f'Toy server {URL}: POST /pause answered 404 ({{"detail":"Not Found"}}); start it '
            "with DEV_MODE=1"
        )
        rejects, _ = scripted(httpx.Response(400, text="bad seed"))
        with pytest.raises(EngineAPIError, match=r"rejected the request with 400: bad seed"):
            await transport(rejects).call("POST", "/generate")
        html, _ = scripted(httpx.Response(200, text="<html>"))
        with pytest.raises(EngineAPIError, match=r"/v1/models: answered 200 with a body that is"):
            await transport(html).call_json("GET", "/v1/models")

    asyncio.run(main())
    assert seen == ["POST /pause"] and clock.waits == []


def sse(*events: str) -> bytes:
    return b"".join(f"{event}\n\n".encode() for event in events)


def test_a_stream_yields_each_json_event_up_to_done(clock: FakeClock) -> None:
    body = sse(": keep-alive", 'data: {"n": 1}', 'data:{"n": 2}', "data: [DONE]", 'data: {"n": 3}')
    wire, seen = scripted(httpx.Response(503), httpx.Response(200, content=body))
    http = transport(wire)

    async def main() -> list[Any]:
        return [obj async for obj in http.stream("/generate", {"p": 1}, "hint")]

    assert asyncio.run(main()) == [{"n": 1}, {"n": 2}]
    assert seen == ["POST /generate"] * 2 and clock.waits == [0.25] and http.retried == 1


def test_a_stream_chunk_that_is_not_json_names_the_endpoint(clock: FakeClock) -> None:
    wire, _ = scripted(httpx.Response(200, content=sse("data: {oops")))

    async def main() -> None:
        with pytest.raises(EngineAPIError, match=r"/generate: a stream chunk is not JSON"):
            async for _ in transport(wire).stream("/generate", {}, "hint"):
                pass

    asyncio.run(main())


class _BreaksAfter(httpx.AsyncByteStream):
    """A response body that sends ``first`` and then loses the connection."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        raise httpx.ReadError("connection lost")


def test_a_stream_that_breaks_after_data_is_not_retried_here(clock: FakeClock) -> None:
    wire, seen = scripted(httpx.Response(200, stream=_BreaksAfter(sse('data: {"n": 1}'))))
    got: list[Any] = []

    async def main() -> None:
        with pytest.raises(StreamBroken, match="ReadError: connection lost"):
            async for obj in transport(wire).stream("/generate", {}, "hint"):
                got.append(obj)

    asyncio.run(main())
    # the engine continues such a stream as a new segment, with what arrived
    assert got == [{"n": 1}] and seen == ["POST /generate"] and clock.waits == []


def test_the_health_wait_backs_off_to_two_seconds_and_reports_the_wait_once(
    clock: FakeClock,
) -> None:
    answers: list[Any] = [refused()] * 7 + [httpx.Response(200)]
    wire, seen = scripted(*answers)
    http = transport(wire)
    told: list[str] = []

    async def main() -> str | None:
        return await http.wait_healthy("/health", 60.0, on_wait=told.append)

    assert asyncio.run(main()) is None
    assert clock.waits == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert told == ["ConnectError: [Errno 111] Connection refused"]
    assert seen == ["GET /health"] * 8


def test_the_health_wait_probes_last_at_its_deadline_and_says_what_it_got(
    clock: FakeClock,
) -> None:
    wire, seen = scripted(httpx.Response(503))
    http = transport(wire)

    async def main() -> list[str | None]:
        return [await http.wait_healthy("/health", 1.0), await http.wait_healthy("/health", 0)]

    # 0.1 + 0.2 + 0.4, then the rest of the second: the last probe is at the deadline
    assert asyncio.run(main()) == ["HTTP 503", "HTTP 503"]
    assert clock.waits == [0.1, 0.2, 0.4, 0.3]
    assert len(seen) == 5 + 1  # timeout 0: one probe, no wait


def test_a_closed_transport_refuses_every_call(clock: FakeClock) -> None:
    wire, seen = scripted(httpx.Response(200))
    http = transport(wire)

    async def main() -> None:
        await http.call("GET", "/health")
        await http.aclose()
        await http.aclose()  # idempotent
        with pytest.raises(EngineClosedError, match=f"Toy engine for {URL} is closed"):
            await http.call("GET", "/health")

    asyncio.run(main())
    assert seen == ["GET /health"]


def test_a_new_event_loop_gets_a_new_pool() -> None:
    wire, seen = scripted(httpx.Response(200))
    http = transport(wire)
    pools: list[Any] = []

    async def main() -> None:
        pools.append(http.client())
        await http.call("GET", "/health")

    asyncio.run(main())
    asyncio.run(main())  # the first pool belongs to a loop that is gone
    assert pools[0] is not pools[1] and seen == ["GET /health"] * 2

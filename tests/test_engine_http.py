"""The HTTP engines' request/response shaping, retries and errors, against a fake server.

The fake is a small threaded HTTP server written here that speaks SGLang's native API (``/generate``
streaming, ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/get_weight_version``) with a deterministic toy "model". It checks
the exact bodies the engine sends and answers in SGLang's shapes. This is **not** a test against a
real SGLang server (none runs on this machine); the vLLM engine is tested against a real vLLM
server in tests/vllm.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("httpx")

import stalebound.engines.http as http_module
from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.engines import GenerateRequest, InferenceEngine, Router, SamplingParams
from stalebound.engines.protocol import EngineClosedError
from stalebound.engines.vllm import (
    EngineAPIError,
    EngineUnavailableError,
    SGLangEngine,
    VLLMEngine,
)


def _next_token(context: list[int], weights: int) -> int:
    """The toy model: a deterministic function of the context and the installed weights."""
    return (sum(context) * 31 + len(context) * 7 + weights * 13) % 50 + 4


def _logprob(token: int, weights: int) -> float:
    return -0.01 * token - 0.5 * weights


@dataclass
class FakeSGLang:
    """State of the fake server (shared with its handler threads)."""

    weights: int = 0
    weight_version: str = "default"
    paused: bool = False
    incremental: bool = False
    fail_next_generate: int = 0
    break_after: int | None = None
    """Drop the connection of the next /generate after this many tokens."""
    hold_at: int | None = None
    """Hold the next /generate after this many tokens (sent) until ``release`` is set: the test
    decides what happens before its next token."""
    holding: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    bodies: list[tuple[str, Any]] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    resumed: threading.Event = field(default_factory=threading.Event)


def _handler(state: FakeSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            body = json.loads(raw) if raw else None
            with state.lock:
                state.bodies.append((self.path, body))
            return body

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {})
            elif self.path == "/get_weight_version":
                self._json(200, {"weight_version": state.weight_version})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/generate":
                try:
                    self._generate(body)
                except (BrokenPipeError, ConnectionResetError):  # the client closed the stream
                    self.close_connection = True
            elif self.path == "/abort_request":
                state.aborted.add(body["rid"])
                self._json(200, {})
            elif self.path == "/pause_generation":
                state.paused = True
                state.resumed.clear()
                self._json(200, {"status": "ok"})
            elif self.path == "/continue_generation":
                state.paused = False
                state.resumed.set()
                self._json(200, {"status": "ok"})
            elif self.path == "/update_weights_from_disk":
                state.weights = int(body["model_path"].rsplit("-", 1)[1])
                state.weight_version = body["weight_version"]
                self._json(200, {"success": True, "message": "ok", "num_paused_requests": 0})
            else:
                self._json(404, {"detail": "Not Found"})

        def _generate(self, body: dict[str, Any]) -> None:
            with state.lock:
                if state.fail_next_generate:
                    state.fail_next_generate -= 1
                    self._json(503, {"error": "overloaded"})
                    return
            rid = body["rid"]
            params = body["sampling_params"]
            context = list(body["input_ids"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            ids: list[int] = []
            triples: list[list[Any]] = []
            reason: dict[str, Any] | None = None
            while reason is None:
                if state.paused:
                    state.resumed.wait(10)
                if rid in state.aborted:
                    reason = {"type": "abort", "message": "aborted"}
                    new_ids: list[int] = []
                else:
                    token = _next_token(context + ids, state.weights)
                    ids.append(token)
                    triples.append([_logprob(token, state.weights), token, None])
                    new_ids = [token]
                    if token in params["stop_token_ids"]:
                        reason = {"type": "stop", "matched": token}
                    elif len(ids) >= params["max_new_tokens"]:
                        reason = {"type": "length", "length": len(ids)}
                meta = {
                    "id": rid,
                    "finish_reason": reason,
                    "completion_tokens": len(ids),
                    "weight_version": state.weight_version,
                    "output_token_logprobs": (
                        [triples[-1]] if state.incremental and new_ids else list(triples)
                    ),
                }
                if state.incremental and not new_ids:
                    meta["output_token_logprobs"] = []
                out = {"output_ids": new_ids if state.incremental else list(ids), "meta_info": meta}
                self._chunk(b"data: " + json.dumps(out).encode() + b"\n\n")
                if state.break_after is not None and len(ids) >= state.break_after:
                    state.break_after = None
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with state.lock:
                    hold = reason is None and state.hold_at == len(ids)
                    if hold:
                        state.hold_at = None
                if hold:
                    state.holding.set()
                    state.release.wait(20)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


@pytest.fixture
def fake() -> Iterator[tuple[FakeSGLang, str]]:
    state = FakeSGLang()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        state.resumed.set()
        state.release.set()
        server.shutdown()
        server.server_close()


async def until(condition: Callable[[], Any], what: str) -> None:
    """Wait for an event the test caused (the deadline only turns a hang into a failure)."""
    for _ in range(4000):
        if await condition() if asyncio.iscoroutinefunction(condition) else condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def held(engine: SGLangEngine, state: FakeSGLang, rid: str, tokens: int) -> None:
    """The server holds ``rid`` after ``tokens`` tokens, and the engine has received them all."""

    async def received() -> bool:
        return (await engine.progress(rid) or 0) >= tokens

    await until(state.holding.is_set, f"the server holds {rid!r}")
    await until(received, f"{rid!r} delivered {tokens} tokens")


def _expected(prompt: list[int], n: int, weights: int) -> list[int]:
    ids: list[int] = []
    for _ in range(n):
        ids.append(_next_token(prompt + ids, weights))
    return ids


def _request(rid: str, tokens: int = 8, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(rid, (1, 5, 9), SamplingParams(max_new_tokens=tokens, **sampling))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("incremental", [False, True])
def test_sglang_generate_request_and_response_shapes(
    fake: tuple[FakeSGLang, str], incremental: bool
) -> None:
    state, url = fake
    state.incremental = incremental

    async def main() -> None:
        engine = SGLangEngine(url, seed=3)
        assert isinstance(engine, InferenceEngine)
        await engine.start(timeout=10)
        response = await engine.agenerate(
            _request("r1", 6, temperature=0.5, top_p=0.9, seed=11, ignore_eos=True)
        )
        await engine.aclose()
        assert response.output_ids == tuple(_expected([1, 5, 9], 6, 0))
        assert response.output_logprobs == pytest.approx(
            [_logprob(t, 0) for t in response.output_ids]
        )
        assert response.output_versions == (0,) * 6
        assert response.finish_reason == "length"

    asyncio.run(main())
    body = next(b for p, b in state.bodies if p == "/generate")
    assert body["input_ids"] == [1, 5, 9]
    assert body["stream"] is True and body["return_logprob"] is True
    assert body["sampling_params"] == {
        "max_new_tokens": 6,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop_token_ids": [],
        "ignore_eos": True,
        "sampling_seed": 11,
    }
    assert body["rid"].endswith("-r1-1")


def test_sglang_stop_token_ends_with_stop(fake: tuple[FakeSGLang, str]) -> None:
    _, url = fake
    expected = _expected([1, 5, 9], 8, 0)
    stop = expected[3]
    cut = expected.index(stop) + 1

    async def main() -> None:
        async with SGLangEngine(url) as engine:
            response = await engine.agenerate(_request("s", 8, stop_token_ids=(stop,)))
        assert response.finish_reason == "stop"
        assert response.output_ids == tuple(expected[:cut])

    asyncio.run(main())


def test_sglang_weight_update_labels_tokens_with_versions(fake: tuple[FakeSGLang, str]) -> None:
    state, url = fake
    state.hold_at = 5

    async def main() -> None:
        engine = SGLangEngine(url, interrupt_mode="continue")
        await engine.start(timeout=10)
        assert engine.get_version() == 0  # "default" counts as the initial version
        task = asyncio.create_task(engine.agenerate(_request("u", 40, ignore_eos=True)))
        await held(engine, state, "u", 5)
        await engine.update_weights("/ckpt/weights-3", version=7)  # lands after token 5
        state.release.set()
        response = await task
        await engine.aclose()
        assert engine.get_version() == 7
        versions = response.output_versions
        boundary = versions.index(7)
        assert set(versions[:boundary]) == {0} and set(versions[boundary:]) == {7}
        assert boundary == 5
        # Tokens after the boundary come from the new weights, continuing the same sequence.
        ids = list(response.output_ids)
        assert ids[:boundary] == _expected([1, 5, 9], boundary, 0)
        assert ids[boundary] == _next_token([1, 5, 9, *ids[:boundary]], 3)

    asyncio.run(main())
    paths = [p for p, _ in state.bodies]
    i = paths.index("/pause_generation")
    assert paths[i : i + 3] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    bodies = dict(state.bodies)
    assert bodies["/pause_generation"] == {"mode": "in_place"}
    assert bodies["/update_weights_from_disk"] == {
        "model_path": "/ckpt/weights-3",
        "weight_version": "7",
        "abort_all_requests": False,
    }


def test_update_statistics_keep_only_the_recent_stalls(
    fake: tuple[FakeSGLang, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = fake
    monkeypatch.setattr(http_module, "_UPDATES_KEPT", 4)  # 256 in use; 4 keeps the test short

    async def main() -> None:
        engine = SGLangEngine(url)
        await engine.start(timeout=10)
        for version in range(1, 7):
            await engine.update_weights(f"/ckpt/weights-{version}", version=version)
        stats = engine.statistics()
        await engine.aclose()
        assert stats.weight_updates == 6
        assert len(stats.update_seconds) == 4  # a long run's statistics stay small
        assert all(s >= 0 for s in stats.update_seconds)

    asyncio.run(main())


def test_sglang_resubmit_mode_restarts_with_prompt_plus_partial(
    fake: tuple[FakeSGLang, str],
) -> None:
    state, url = fake
    state.hold_at = 4

    async def main() -> None:
        engine = SGLangEngine(url, interrupt_mode="resubmit")
        await engine.start(timeout=10)
        task = asyncio.create_task(engine.agenerate(_request("v", 30, ignore_eos=True)))
        await held(engine, state, "v", 4)
        await engine.update_weights("/ckpt/weights-2", version=1)  # lands after token 4
        state.release.set()  # the old stream was closed: the held handler just ends
        response = await task
        await engine.aclose()
        assert response.resubmits == 1
        assert len(response.output_ids) == 30
        boundary = response.output_versions.index(1)
        ids = list(response.output_ids)
        assert ids[:boundary] == _expected([1, 5, 9], boundary, 0)
        assert ids[boundary:] == _expected([1, 5, 9, *ids[:boundary]], 30 - boundary, 2)

    asyncio.run(main())
    generates = [b for p, b in state.bodies if p == "/generate"]
    assert len(generates) == 2
    second = generates[1]
    n = len(second["input_ids"]) - 3
    assert second["input_ids"][:3] == [1, 5, 9] and n == 4
    assert second["sampling_params"]["max_new_tokens"] == 30 - n
    assert dict(state.bodies)["/pause_generation"] == {"mode": "abort"}


def test_sglang_abort_returns_partial_output(fake: tuple[FakeSGLang, str]) -> None:
    state, url = fake
    state.hold_at = 3

    async def main() -> None:
        engine = SGLangEngine(url)
        await engine.start(timeout=10)
        task = asyncio.create_task(engine.agenerate(_request("a", 200, ignore_eos=True)))
        await held(engine, state, "a", 3)
        abort = asyncio.create_task(engine.abort("a"))
        await until(lambda: bool(state.aborted), "the abort reached the server")
        state.release.set()  # the next step sees the abort: no fourth token
        partial = await abort
        response = await task
        assert partial == response
        assert response.finish_reason == "abort"
        assert len(response.output_ids) == 3
        assert list(response.output_ids) == _expected([1, 5, 9], len(response.output_ids), 0)
        assert await engine.abort("a") is None
        assert engine.statistics().aborts == 1
        await engine.aclose()

    asyncio.run(main())
    assert next(b for p, b in state.bodies if p == "/abort_request")["rid"].endswith("-a-1")


def test_transient_503_is_retried_and_counted(fake: tuple[FakeSGLang, str]) -> None:
    state, url = fake
    state.fail_next_generate = 2

    async def main() -> None:
        async with SGLangEngine(url, retries=3, backoff=0.001) as engine:
            response = await engine.agenerate(_request("t", 4))
            assert len(response.output_ids) == 4
            assert engine.statistics().retries == 2

    asyncio.run(main())


def test_a_broken_stream_continues_as_a_new_segment(fake: tuple[FakeSGLang, str]) -> None:
    state, url = fake
    state.break_after = 4

    async def main() -> None:
        async with SGLangEngine(url, backoff=0.001) as engine:
            response = await engine.agenerate(_request("b", 10))
            assert engine.statistics().stream_retries == 1
        # The toy model is a function of the context, so the resumed sequence is the same.
        assert list(response.output_ids) == _expected([1, 5, 9], 10, 0)
        assert response.finish_reason == "length" and response.resubmits == 0

    asyncio.run(main())


def test_persistent_503_raises_unavailable(fake: tuple[FakeSGLang, str]) -> None:
    state, url = fake
    state.fail_next_generate = 10

    async def main() -> None:
        async with SGLangEngine(url, retries=1, backoff=0.001) as engine:
            with pytest.raises(EngineUnavailableError, match="503"):
                await engine.agenerate(_request("t", 4))

    asyncio.run(main())


def test_missing_endpoint_names_it(fake: tuple[FakeSGLang, str]) -> None:
    _, url = fake

    async def main() -> None:
        # The fake speaks SGLang, not vLLM: /v1/models is missing.
        engine = VLLMEngine(url, retries=0)
        with pytest.raises(EngineAPIError, match=r"GET /v1/models answered 404"):
            await engine.start(timeout=5)
        engine.model = "m"
        with pytest.raises(EngineAPIError, match=r"/pause answered 404.*VLLM_SERVER_DEV_MODE=1"):
            await engine.pause()
        await engine.aclose()

    asyncio.run(main())


def test_server_down_raises_unavailable_with_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"

    async def main() -> None:
        engine = VLLMEngine(url, model="m", retries=1, backoff=0.001, connect_timeout=1.0)
        with pytest.raises(EngineUnavailableError, match=r"unreachable.*serve-vllm"):
            await engine.agenerate(_request("x", 4))
        with pytest.raises(EngineUnavailableError, match=r"not ready after"):
            await engine.start(timeout=0.3)
        assert engine.statistics().retries >= 1
        await engine.aclose()
        with pytest.raises(EngineClosedError, match="closed"):
            await engine.agenerate(_request("y", 4))

    asyncio.run(main())


def test_router_over_http_replicas(fake: tuple[FakeSGLang, str]) -> None:
    _, url = fake

    async def main() -> None:
        engines = [SGLangEngine(url), SGLangEngine(url)]
        for engine in engines:
            await engine.start(timeout=10)
        router = Router(engines)
        responses = await asyncio.gather(
            *(router.agenerate(_request(f"g{i}", 5)) for i in range(6))
        )
        assert {len(r.output_ids) for r in responses} == {5}
        assert router.statistics().routed == (3, 3)
        for engine in engines:
            await engine.aclose()

    asyncio.run(main())


def test_configuration_errors_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        VLLMEngine("localhost:8000", retries=-1, timeout=0)
    text = str(info.value)
    assert "url='localhost:8000'" in text and "retries=-1" in text and "timeout=0" in text
    with pytest.raises(ConfigError, match="interrupt_mode='continue' with api='completions'"):
        VLLMEngine("http://127.0.0.1:1", interrupt_mode="continue")
    # the vLLM engine's own arguments and the shared ones, in one error
    with pytest.raises(ConfigError) as info:
        VLLMEngine("localhost:8000", api="grpc", timeout=0)  # type: ignore[arg-type]
    text = str(info.value)
    assert "api='grpc'" in text and "url='localhost:8000'" in text and "timeout=0" in text


def test_state_dict_updates_and_n_are_rejected(fake: tuple[FakeSGLang, str]) -> None:
    _, url = fake

    async def main() -> None:
        async with SGLangEngine(url) as engine:
            with pytest.raises(ProtocolError, match="checkpoint directory"):
                await engine.update_weights({"w": 1}, 1)
            with pytest.raises(ProtocolError, match="split_n"):
                await engine.agenerate(_request("n", 4, n=2))

    asyncio.run(main())

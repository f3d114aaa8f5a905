"""The HTTP engine base: what the vLLM and SGLang engines share.

Both implement :class:`~stalebound.engines.protocol.InferenceEngine` with an ``httpx.AsyncClient``
(one connection pool per engine and event loop). Every request is streamed, so the tokens received
so far are always at hand: an abort, a weight update or a dropped connection keeps them. A stream
stops being read at its ``[DONE]`` event, which closes its connection instead of returning it to the
pool. So the pool holds only the control calls' connections (health, pause, reload, ...), and a
stream never starts on a pooled connection that the server has meanwhile closed for idleness (vLLM's
uvicorn does so after 5 s; a raw client that pools its streams meets those as ``ReadError`` s). It
is also cheaper: with 64 concurrent streams on loopback, a client that pools them spent about twice
the CPU per request (httpcore re-checks every pooled connection on each request event) —
``bench/vllm_overhead.py``, ``raw-stream`` vs ``raw-stream-close``: 22.6 vs 11.7 ms per trajectory.

Sampling: ``seed=None`` derives a seed from the engine's ``seed`` and the request id. A resubmitted
segment ``k`` uses ``seed + k`` (mod 2**31): it continues with a fresh random stream, not the one the
uninterrupted request would have drawn (vLLM's per-request generator cannot be advanced remotely).

Errors: an unreachable server (connection refused, timeouts) is retried with exponential backoff,
and so are 5xx answers; when the retries are used up the call raises
:class:`EngineUnavailableError`. A stream that breaks after tokens arrived is resumed as a new
segment (prompt + tokens so far), counted in ``statistics().stream_retries``. A server that answers
with a different API (404/405 on an endpoint, 403 on the scale-out endpoint, an unexpected body)
raises :class:`EngineAPIError` naming the endpoint and what to enable. After :meth:`aclose` every
call raises :class:`~stalebound.engines.protocol.EngineClosedError`. Every retry, of a call or of a broken stream, waits through one helper
(:meth:`HTTPEngine._wait_before_retry`): ``backoff * 2**(k-1)`` seconds before the k-th retry.

The concrete engines fill in the wire format: :class:`~stalebound.engines.vllm.VLLMEngine` and
:class:`~stalebound.engines.sglang.SGLangEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal, TypeAlias

import httpx

from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.engines.protocol import (
    EngineClosedError,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    WeightSource,
)

__all__ = [
    "EngineAPIError",
    "EngineUnavailableError",
    "HTTPEngine",
    "HTTPEngineStatistics",
    "InterruptMode",
]

_log = logging.getLogger(__name__)
_UPDATES_KEPT = 256

InterruptMode: TypeAlias = Literal["resubmit", "continue"]

_SEED_MOD: Final[int] = 2**31
_TRANSIENT_STATUS: Final[frozenset[int]] = frozenset({500, 502, 503, 504})


class EngineUnavailableError(EngineClosedError):
    """The server is down or unreachable (after the configured retries); start it or fix the URL."""


class EngineAPIError(ProtocolError):
    """The server answered, but not with the API this engine speaks (missing endpoint, unexpected
    body, a rejected request); the message names the endpoint and the fix."""


@dataclass(frozen=True, slots=True)
class HTTPEngineStatistics:
    """A snapshot of an HTTP engine's counters."""

    url: str
    version: int
    in_flight: int
    requests: int
    """``agenerate`` calls started."""
    segments: int
    """Streams opened (a request has more than one after a resubmit or a broken stream)."""
    resubmits: int
    """Segments restarted because a weight update interrupted them (``resubmit`` mode)."""
    stream_retries: int
    """Segments restarted because the stream broke (a transient error)."""
    retries: int
    """HTTP attempts repeated after a transient error (connect error, timeout, 5xx)."""
    aborts: int
    """Requests aborted (by :meth:`abort` or :meth:`aclose`)."""
    weight_updates: int
    update_seconds: tuple[float, ...]
    """Wall time of each recent weight update, pause to resume (the generation stall), oldest
    first; the last 256 are kept, so a long run's statistics stay small."""
    output_tokens: int
    abort_timeouts: int = 0
    """Server-side aborts whose final chunk did not arrive within ``abort_timeout`` (the
    request was then disconnected instead)."""


@dataclass(slots=True)
class _Counts:
    """The engine's running counters, named as :class:`HTTPEngineStatistics` reports them."""

    requests: int = 0
    segments: int = 0
    resubmits: int = 0
    stream_retries: int = 0
    retries: int = 0
    aborts: int = 0
    weight_updates: int = 0
    output_tokens: int = 0
    abort_timeouts: int = 0


@dataclass(eq=False)
class _Chunk:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    spans: list[tuple[str, int, int]] | None = None
    """``(version label, start, end)`` over this segment's output tokens (final chunk only)."""
    version_label: str | None = None
    """The server's weight version when it sent this chunk (SGLang)."""


@dataclass(eq=False)
class _Live:
    request: GenerateRequest
    seed: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segment_start: int = 0
    segments: int = 0
    resubmits: int = 0
    server_rid: str | None = None
    task: asyncio.Task[str | None] | None = None
    aborted: bool = False
    interrupted: bool = False
    server_abort_sent: bool = False
    result: asyncio.Future[GenerateResponse] | None = None

    def is_aborted(self) -> bool:
        # A method, not the attribute: abort() flips the flag while _run awaits, which a type
        # checker's narrowing of the attribute does not see.
        return self.aborted


def _derive_seed(engine_seed: int, request_id: str) -> int:
    return (engine_seed * 1_000_003 + zlib.crc32(request_id.encode())) % _SEED_MOD


class HTTPEngine:
    """What the vLLM and SGLang engines share: the client, retries, the request lifecycle."""

    _name: str = "HTTP"

    def __init__(
        self,
        url: str,
        *,
        interrupt_mode: InterruptMode = "resubmit",
        initial_version: int = 0,
        seed: int = 0,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        retries: int = 4,
        backoff: float = 0.25,
        max_connections: int = 512,
        abort_timeout: float = 5.0,
        problems: Sequence[str] = (),
    ) -> None:
        # ``problems``: what a subclass found in its own arguments, reported with these at once
        problems = list(problems)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            problems.append(f"url={url!r}: must be an http(s) URL such as 'http://127.0.0.1:8000'")
        if interrupt_mode not in ("resubmit", "continue"):
            problems.append(f"interrupt_mode={interrupt_mode!r}: must be 'resubmit' or 'continue'")
        for name, value in (
            ("timeout", timeout),
            ("connect_timeout", connect_timeout),
            ("abort_timeout", abort_timeout),
        ):
            if not value > 0:
                problems.append(f"{name}={value!r}: must be > 0 seconds")
        if not isinstance(retries, int) or retries < 0:
            problems.append(f"retries={retries!r}: must be an int >= 0 (0: no retry)")
        if not backoff >= 0:
            problems.append(f"backoff={backoff!r}: must be >= 0 seconds")
        if not isinstance(max_connections, int) or max_connections < 1:
            problems.append(f"max_connections={max_connections!r}: must be an int >= 1")
        if problems:
            raise ConfigError(problems)
        self.url = url.rstrip("/")
        self.interrupt_mode: InterruptMode = interrupt_mode
        self._initial_version = int(initial_version)
        self._version = int(initial_version)
        self._seed = int(seed)
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._retries = retries
        self._backoff = backoff
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._abort_timeout = abort_timeout
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, _Live] = {}
        self._gate: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._user_paused = False
        self._closed = False
        self._counts = _Counts()
        self._update_seconds: deque[float] = deque(maxlen=_UPDATES_KEPT)
        self._tag = f"sb{os.getpid():x}{id(self) & 0xFFFFFF:x}"

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    async def start(self, timeout: float = 120.0) -> None:
        """Wait until the server is healthy (``GET /health``), then read what it serves.

        Raises :class:`EngineUnavailableError` if it is not healthy within ``timeout`` seconds."""
        await self.wait_ready(timeout)
        await self._after_ready()

    async def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll the server's health endpoint until it answers 200 (with backoff up to 2 s)."""
        self._check_open()
        deadline = time.monotonic() + timeout
        delay = 0.1
        last = "no answer yet"
        while True:
            try:
                reply = await self._http().get(self.url + self._health_path)
                if reply.status_code == 200:
                    return
                last = f"HTTP {reply.status_code}"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise EngineUnavailableError(
                    f"{self._name} server {self.url} not ready after {timeout:.0f} s (last: {last}); "
                    f"is it running? {self._start_hint}"
                )
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def _after_ready(self) -> None:
        label = await self._server_version_label()
        if label is not None:
            self._version = self._parse_version(label, "at start")

    async def aclose(self) -> None:
        """Abort every in-flight request (each ``agenerate`` returns its partial output) and close
        the connection pool. Idempotent."""
        if self._closed:
            return
        for rid in list(self._live):
            with contextlib.suppress(Exception):
                await self.abort(rid)
        self._closed = True
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
        self._client = None

    async def __aenter__(self) -> HTTPEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the engine protocol --------------------------------------------------------------------

    def get_version(self) -> int:
        """The version of the weights now installed on the server (as set through this engine)."""
        return self._version

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        """Generate one sequence (see the module docstring for versions and interruptions)."""
        self._check_open()
        if request.sampling.n != 1:
            raise ProtocolError(
                f"request {request.request_id!r}: sampling.n={request.sampling.n}; engines take "
                "one sequence per request, expand it with stalebound.engines.split_n"
            )
        rid = request.request_id
        if rid in self._live:
            raise ProtocolError(
                f"request_id={rid!r} is already in flight on {self.url}; request ids must be "
                "unique among in-flight requests"
            )
        seed = request.sampling.seed
        live = _Live(
            request=request,
            seed=_derive_seed(self._seed, rid) if seed is None else seed % _SEED_MOD,
            result=asyncio.get_running_loop().create_future(),
        )
        self._live[rid] = live
        self._counts.requests += 1
        try:
            response = await self._run(live)
        except BaseException as exc:
            if live.result is not None and not live.result.done():
                live.result.set_exception(exc)
                live.result.exception()  # mark retrieved: abort() may never look at it
            raise
        finally:
            self._live.pop(rid, None)
        if live.result is not None and not live.result.done():
            live.result.set_result(response)
        return response

    async def abort(self, request_id: str) -> GenerateResponse | None:
        """Stop ``request_id`` and return its partial output (what its ``agenerate`` returns), or
        ``None`` if it is unknown or already finished."""
        live = self._live.get(request_id)
        if live is None or live.result is None:
            return None
        if not live.aborted:
            live.aborted = True
            self._counts.aborts += 1
            await self._stop_segment(live)
        try:
            return await asyncio.shield(live.result)
        except Exception:
            return None

    async def pause(self) -> None:
        """Freeze generation on the server between tokens (``/pause?mode=keep``); in-flight
        requests are kept and new ones wait. Needs the dev-mode endpoints."""
        self._check_open()
        await self._pause_server(keep=True)
        self._user_paused = True

    async def resume(self) -> None:
        """Continue after :meth:`pause`."""
        self._check_open()
        await self._resume_server()
        self._user_paused = False

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Reload the weights from the checkpoint directory ``source`` (a path the *server* can
        read) and set the version; see the module docstring for in-flight requests."""
        self._check_open()
        if not isinstance(version, int) or isinstance(version, bool):
            raise ProtocolError(f"update_weights(version={version!r}): must be an int")
        path: str | _IPCHandles
        if isinstance(source, Mapping):
            path = self._state_dict_source(source, version)
        else:
            path = os.path.abspath(os.fspath(source))
        lock = self._lock()
        async with lock:
            started = time.monotonic()
            gate = self._gate_event()
            gate.clear()
            try:
                await self._swap_weights(path, version)
            finally:
                gate.set()
            self._version = version
            self._counts.weight_updates += 1
            self._update_seconds.append(time.monotonic() - started)
        _log.info("%s %s: weights from %s, version %d", self._name, self.url, path, version)

    # -- statistics -----------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests in flight on this engine."""
        return len(self._live)

    async def progress(self, request_id: str) -> int | None:
        """How many tokens of ``request_id`` have arrived so far; ``None`` if it is not in flight."""
        live = self._live.get(request_id)
        return None if live is None else len(live.ids)

    def statistics(self) -> HTTPEngineStatistics:
        """A frozen snapshot of the counters."""
        return HTTPEngineStatistics(
            url=self.url,
            version=self._version,
            in_flight=len(self._live),
            update_seconds=tuple(self._update_seconds),
            **dataclasses.asdict(self._counts),
        )

    # -- request lifecycle ----------------------------------------------------------------------

    async def _run(self, live: _Live) -> GenerateResponse:
        request = live.request
        budget = request.sampling.max_new_tokens
        finish: FinishReason | None = None
        stream_failures = 0
        while finish is None:
            await self._gate_event().wait()
            if live.aborted:
                finish = "abort"
                break
            remaining = budget - len(live.ids)
            if remaining <= 0 or self._context_full(len(request.input_ids) + len(live.ids)):
                finish = "length"
                break
            live.interrupted = False
            live.segment_start = len(live.ids)
            version = self._version
            live.segments += 1
            self._counts.segments += 1
            task = asyncio.create_task(self._segment(live, remaining, version))
            live.task = task
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise
            finally:
                live.task = None
            broken: str | None = None
            reason: str | None = None
            if not task.cancelled():
                try:
                    reason = task.result()
                except _StreamBroken as exc:
                    broken = str(exc)
            if live.is_aborted():
                finish = "abort"
            elif live.interrupted:
                # A weight update ended the segment (resubmit mode): continue as a new one.
                if reason in ("stop", "length"):
                    finish = "length" if reason == "length" else "stop"
                elif live.ids and live.ids[-1] in request.sampling.stop_token_ids:
                    finish = "stop"
                else:
                    live.resubmits += 1
                    self._counts.resubmits += 1
            elif reason in ("stop", "length"):
                finish = "length" if reason == "length" else "stop"
            elif reason == "abort":
                finish = "abort"  # aborted on the server by someone else
            elif reason is None:
                # The stream broke or ended without a finish reason: continue as a new segment.
                stream_failures += 1
                if stream_failures > self._retries:
                    raise EngineUnavailableError(
                        f"{self._name} server {self.url}: the stream of request "
                        f"{request.request_id!r} ended early {stream_failures} times "
                        f"({broken or 'no finish reason'}); is the server overloaded or "
                        "restarting?"
                    )
                self._counts.stream_retries += 1
                await self._wait_before_retry(stream_failures)
            else:
                raise EngineAPIError(
                    f"{self._name} server {self.url}: request {request.request_id!r} finished "
                    f"with finish_reason={reason!r}; the server log says why"
                )
        self._counts.output_tokens += len(live.ids)
        return GenerateResponse(
            request_id=request.request_id,
            input_ids=request.input_ids,
            output_ids=tuple(live.ids),
            output_logprobs=tuple(live.logprobs),
            output_versions=tuple(live.versions),
            finish_reason=finish,
            resubmits=live.resubmits,
        )

    async def _segment(self, live: _Live, max_tokens: int, version: int) -> str | None:
        """Stream one segment; returns the server's finish reason (``None``: stream ended without
        one). Raises :class:`_StreamBroken` on a transport error after the stream opened."""
        request = live.request
        prompt = [*request.input_ids, *live.ids]
        seed = (live.seed + live.segments - 1) % _SEED_MOD
        live.server_rid = f"{self._tag}-{request.request_id}-{live.segments}"
        path, body = self._generate_body(live, prompt, max_tokens, seed)
        finish: str | None = None
        async for chunk in self._stream(path, body):
            n = len(chunk.token_ids)
            if n:
                if len(chunk.logprobs) != n:
                    raise EngineAPIError(
                        f"{self._name} server {self.url}{path}: a chunk had {n} token ids but "
                        f"{len(chunk.logprobs)} log-probs; the server does not return per-token "
                        "log-probs as expected"
                    )
                label = chunk.version_label
                token_version = version if label is None else self._parse_version(label, path)
                live.ids.extend(chunk.token_ids)
                live.logprobs.extend(chunk.logprobs)
                live.versions.extend([token_version] * n)
            if chunk.spans is not None:
                self._apply_spans(live, chunk.spans, path)
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
        return finish

    def _apply_spans(self, live: _Live, spans: list[tuple[str, int, int]], path: str) -> None:
        base = live.segment_start
        for label, start, end in spans:
            if not 0 <= start <= end <= len(live.ids) - base:
                raise EngineAPIError(
                    f"{self._name} server {self.url}{path}: weight_versions span "
                    f"[{start}, {end}) is outside the {len(live.ids) - base} tokens received"
                )
            version = self._parse_version(label, path)
            for i in range(base + start, base + end):
                live.versions[i] = version

    async def _stop_segment(self, live: _Live) -> None:
        """End the live segment of an aborted or interrupted request."""
        task = live.task
        if task is None or task.done():
            return
        try:
            asked = await self._server_abort(live)
        except (EngineAPIError, EngineUnavailableError) as exc:
            # Disconnecting still stops the request; only the final chunk is lost.
            _log.warning(
                "%s %s: server-side abort failed (%s); disconnecting", self._name, self.url, exc
            )
            asked = False
        if asked:
            # The server ends the stream itself (with its final chunk); wait for it.
            done, _ = await asyncio.wait({task}, timeout=self._abort_timeout)
            if done:
                return
            self._counts.abort_timeouts += 1
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({task})

    async def _interrupt_all(self) -> None:
        """Resubmit mode: end every running segment before the weights change."""
        lives = [live for live in self._live.values() if live.task is not None]
        for live in lives:
            live.interrupted = True
        for live in lives:
            task = live.task
            if task is not None and not task.done():
                task.cancel()
        for live in lives:
            task = live.task
            if task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait({task})

    # -- HTTP -----------------------------------------------------------------------------------

    async def _wait_before_retry(self, attempt: int) -> None:
        """The one retry policy: wait ``backoff * 2**(attempt - 1)`` seconds before retry number
        ``attempt`` (from 1). The caller has checked ``attempt`` against ``retries`` and counted
        the retry."""
        await asyncio.sleep(self._backoff * 2 ** (attempt - 1))

    def _http(self) -> httpx.AsyncClient:
        self._check_open()
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # A pool belongs to one event loop; a caller that moves to another loop (a second
            # asyncio.run) gets a fresh pool instead of sockets bound to a dead loop.
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
            self._client_loop = loop
        return self._client

    def _gate_event(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        return self._gate

    def _lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(
                f"{self._name} engine for {self.url} is closed; create a new engine to continue"
            )

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        hint: str = "",
        timeout: float | None = None,
    ) -> httpx.Response:
        """One request with retries on transient errors; raises the engine's errors."""
        attempt = 0
        while True:
            try:
                reply = await self._http().request(
                    method,
                    self.url + path,
                    json=json_body,
                    params=params,
                    timeout=self._timeout if timeout is None else timeout,
                )
            except httpx.TransportError as exc:
                if attempt >= self._retries:
                    raise EngineUnavailableError(
                        f"{self._name} server {self.url} unreachable: {method} {path} failed "
                        f"{attempt + 1} times ({type(exc).__name__}: {exc}); is it running? "
                        f"{self._start_hint}"
                    ) from exc
            else:
                if reply.status_code not in _TRANSIENT_STATUS or attempt >= self._retries:
                    self._raise_for_status(reply, method, path, hint)
                    return reply
            attempt += 1
            self._counts.retries += 1
            await self._wait_before_retry(attempt)

    def _raise_for_status(self, reply: httpx.Response, method: str, path: str, hint: str) -> None:
        code = reply.status_code
        if code < 400:
            return
        detail = reply.text[:500].strip()
        if code in (404, 405) or (code == 403 and hint):
            raise EngineAPIError(
                f"{self._name} server {self.url}: {method} {path} answered {code} "
                f"({detail or 'no body'}); {hint or 'the server does not offer this endpoint'}"
            )
        if code >= 500:
            raise EngineUnavailableError(
                f"{self._name} server {self.url}: {method} {path} answered {code} after "
                f"{self._retries + 1} attempts ({detail}); see the server log"
            )
        raise EngineAPIError(
            f"{self._name} server {self.url}: {method} {path} rejected the request with {code}: "
            f"{detail}"
        )

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[_Chunk]:
        """POST ``body`` and yield the parsed chunks of the server-sent-event stream."""
        attempt = 0
        while True:
            received = False
            try:
                async with self._http().stream("POST", self.url + path, json=body) as reply:
                    if reply.status_code >= 400:
                        await reply.aread()
                        if reply.status_code in _TRANSIENT_STATUS and attempt < self._retries:
                            raise _Retry()
                        self._raise_for_status(reply, "POST", path, self._generate_hint)
                    async for line in reply.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        try:
                            obj = json.loads(data)
                        except ValueError as exc:
                            raise EngineAPIError(
                                f"{self._name} server {self.url}{path}: a stream chunk is not "
                                f"JSON ({data[:200]!r})"
                            ) from exc
                        chunk = self._parse_chunk(obj, path)
                        received = True
                        yield chunk
                    return
            except _Retry:
                pass
            except httpx.TransportError as exc:
                if received:
                    raise _StreamBroken(f"{type(exc).__name__}: {exc}") from exc
                if attempt >= self._retries:
                    raise EngineUnavailableError(
                        f"{self._name} server {self.url} unreachable: POST {path} failed "
                        f"{attempt + 1} times ({type(exc).__name__}: {exc}); is it running? "
                        f"{self._start_hint}"
                    ) from exc
            attempt += 1
            self._counts.retries += 1
            await self._wait_before_retry(attempt)

    def _parse_version(self, label: Any, where: str) -> int:
        if label is None or label == "default":
            return self._initial_version
        try:
            return int(str(label))
        except ValueError:
            raise EngineAPIError(
                f"{self._name} server {self.url}: weight version {label!r} ({where}) is not an "
                "integer; stalebound labels weights with integer versions, so reset it through "
                "update_weights or restart the server"
            ) from None

    # -- hooks the concrete engines fill in -----------------------------------------------------

    _health_path: str = "/health"
    _start_hint: str = ""
    _generate_hint: str = ""

    def _generate_body(
        self, live: _Live, prompt: list[int], max_tokens: int, seed: int
    ) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _parse_chunk(self, obj: Any, path: str) -> _Chunk:
        raise NotImplementedError

    def _context_full(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens leaves no room in the model's context."""
        return False

    async def _server_abort(self, live: _Live) -> bool:
        """Ask the server to abort ``live``'s segment; ``False`` if the engine aborts by
        disconnecting instead."""
        return False

    async def _server_version_label(self) -> str | None:
        raise NotImplementedError

    async def _pause_server(self, *, keep: bool) -> None:
        raise NotImplementedError

    async def _resume_server(self) -> None:
        raise NotImplementedError

    def _state_dict_source(self, source: Mapping[str, Any], version: int) -> _IPCHandles:
        raise ProtocolError(
            f"update_weights(source=<state dict>, version={version}): an HTTP engine reloads "
            "weights from a checkpoint directory the server can read; save the state dict "
            "with save_pretrained (or safetensors) into a directory and pass its path"
        )

    async def _reload(self, path: str | _IPCHandles, version: int) -> None:
        """Load the weights in ``path`` on the paused server and label them ``version``."""
        raise NotImplementedError

    async def _swap_weights(self, path: str | _IPCHandles, version: int) -> None:
        """Interrupt (resubmit mode) or keep (continue mode) what is in flight, pause the server
        unless the user already has, reload, and resume."""
        continue_mode = self.interrupt_mode == "continue"
        if not continue_mode:
            await self._interrupt_all()
        if not self._user_paused:
            await self._pause_server(keep=continue_mode)
        try:
            await self._reload(path, version)
        finally:
            if not self._user_paused:
                await self._resume_server()


class _Retry(Exception):
    """Internal: a transient status before any chunk; try the stream again."""


class _StreamBroken(Exception):
    """Internal: the stream broke after tokens arrived; resume as a new segment."""


@dataclass(frozen=True)
class _IPCHandles:
    """A state dict on the server's GPU, as CUDA IPC handles (and the tensors they point at, kept
    alive until the server has loaded them)."""

    handles: str
    tensors: Mapping[str, Any]

    def __str__(self) -> str:
        return "<CUDA IPC state dict>"


def _json(reply: httpx.Response, path: str, url: str, *, allow_empty: bool = False) -> Any:
    if allow_empty and not reply.content:
        return None
    try:
        return reply.json()
    except ValueError:
        raise EngineAPIError(
            f"server {url}{path}: answered {reply.status_code} with a body that is not JSON "
            f"({reply.text[:200]!r})"
        ) from None

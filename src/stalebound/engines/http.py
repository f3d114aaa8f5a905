"""The HTTP engine: an inference engine over a server, composed of a transport and an adapter.

:class:`HTTPEngine` implements :class:`~stalebound.engines.protocol.InferenceEngine` for a server
reached over HTTP. It is made of three parts:

* the **transport** (:class:`~stalebound.engines.http_transport.HTTPTransport`): the
  ``httpx.AsyncClient`` (one connection pool per engine and event loop), statuses, JSON, streams,
  the health probe, and the one retry helper every retry waits through;
* a **server adapter** (:class:`~stalebound.engines.http_adapter.ServerAdapter`) per server kind:
  request bodies, stream chunks, weight-update and pause endpoints, version labels, what a state
  dict becomes — :class:`~stalebound.engines.vllm.VLLMAdapter`,
  :class:`~stalebound.engines.sglang.SGLangAdapter`;
* the **engine** itself (this module): request bookkeeping, abort, pause, weight updates,
  versions and statistics.

:class:`~stalebound.engines.vllm.VLLMEngine` and :class:`~stalebound.engines.sglang.SGLangEngine`
are this engine with their adapter. Before a run starts,
:func:`~stalebound.engines.endpoints.check_endpoints` checks that the servers answer.

Every request is streamed, so the tokens received so far are always at hand: an abort, a weight
update or a dropped connection keeps them. A stream's connection closes at its ``[DONE]`` event
(see :meth:`~stalebound.engines.http_transport.HTTPTransport.stream` for why: with 64 streams on
loopback a client that pools them spent about twice the CPU per request, 22.6 vs 11.7 ms per
trajectory in ``bench/vllm_overhead.py``).

Sampling: ``seed=None`` derives a seed from the engine's ``seed`` and the request id. A resubmitted
segment ``k`` uses ``seed + k`` (mod 2**31): it continues with a fresh random stream, not the one the
uninterrupted request would have drawn (vLLM's per-request generator cannot be advanced remotely).

Errors: connection errors, timeouts and 5xx answers are retried (``retries`` times, waiting
``backoff * 2**(k-1)`` s before the k-th retry); when the retries are used up the call raises
:class:`EngineUnavailableError`. A stream that breaks after tokens arrived is resumed as a new
segment (prompt + tokens so far), counted in ``statistics().stream_retries``. A server that answers
with a different API raises :class:`EngineAPIError` naming the endpoint and what to enable. After
:meth:`HTTPEngine.aclose` every call raises
:class:`~stalebound.engines.protocol.EngineClosedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Generic, Literal, TypeAlias, TypeVar

from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.engines.http_adapter import Chunk, IPCHandles, SegmentRequest, ServerAdapter
from stalebound.engines.http_transport import (
    EngineAPIError,
    EngineUnavailableError,
    HTTPTransport,
    StreamBroken,
)
from stalebound.engines.protocol import (
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

A = TypeVar("A", bound=ServerAdapter)
_E = TypeVar("_E", bound="HTTPEngine[Any]")


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
    """The engine's running counters, named as :class:`HTTPEngineStatistics` reports them (the
    transport counts ``retries``)."""

    requests: int = 0
    segments: int = 0
    resubmits: int = 0
    stream_retries: int = 0
    aborts: int = 0
    weight_updates: int = 0
    output_tokens: int = 0
    abort_timeouts: int = 0


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
    result: asyncio.Future[GenerateResponse] | None = None

    def is_aborted(self) -> bool:
        # A method, not the attribute: abort() flips the flag while _run awaits, which a type
        # checker's narrowing of the attribute does not see.
        return self.aborted


def _derive_seed(engine_seed: int, request_id: str) -> int:
    return (engine_seed * 1_000_003 + zlib.crc32(request_id.encode())) % _SEED_MOD


class HTTPEngine(Generic[A]):
    """An engine over the server at ``url`` that ``adapter`` speaks to (see the module docstring).

    ``interrupt_mode``: what a weight update does to in-flight requests (``resubmit`` or
    ``continue``; see docs/vllm.md). ``initial_version``: the version of a server that reports
    none. ``seed``: derives per-request seeds for requests without one. ``timeout`` /
    ``connect_timeout``: seconds per HTTP operation (a stream's read timeout is the longest pause
    between two chunks). ``retries`` and ``backoff``: transient errors are retried ``retries``
    times, waiting ``backoff * 2**k`` s. ``max_connections``: the size of the connection pool
    (one connection per streaming request in flight). ``abort_timeout``: how long a server-side
    abort waits for the server's final chunk before it disconnects instead.

    Call ``await engine.start()`` (or use ``async with``) before generating.
    """

    def __init__(
        self,
        url: str,
        adapter: A,
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
    ) -> None:
        problems = list(adapter.problems(interrupt_mode))
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
        self.adapter: A = adapter
        self.http = HTTPTransport(
            url,
            name=adapter.name,
            start_hint=adapter.start_hint(url),
            timeout=timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            backoff=backoff,
            max_connections=max_connections,
        )
        self.url = self.http.url
        self.interrupt_mode: InterruptMode = interrupt_mode
        self._initial_version = int(initial_version)
        self._version = int(initial_version)
        self._seed = int(seed)
        self._abort_timeout = abort_timeout
        self._live: dict[str, _Live] = {}
        self._gate: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._user_paused = False
        self._counts = _Counts()
        self._update_seconds: deque[float] = deque(maxlen=_UPDATES_KEPT)
        self._tag = f"sb{os.getpid():x}{id(self) & 0xFFFFFF:x}"

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self.http.closed

    async def start(self, timeout: float = 120.0) -> None:
        """Wait until the server is healthy (:meth:`wait_ready`), then learn what it serves and
        its weight version. Cancelling the call ends the wait."""
        await self.wait_ready(timeout)
        label = await self.adapter.connect(self.http)
        if label is not None:
            self._version = self._parse_version(label, f"{self.url} (at start)")

    async def wait_ready(
        self, timeout: float = 120.0, *, on_wait: Callable[[str], None] | None = None
    ) -> None:
        """Probe the server's health endpoint until it answers 200 (backoff up to 2 s); raises
        :class:`EngineUnavailableError` if it does not within ``timeout`` seconds.
        ``on_wait(why)`` is called once if the first probe fails and the wait begins."""
        self.http.check_open()
        path = self.adapter.health_path
        last = await self.http.wait_healthy(path, timeout, on_wait=on_wait)
        if last is not None:
            raise EngineUnavailableError(
                f"{self.adapter.name} server {self.url} not ready after {timeout:g} s (GET "
                f"{path}: {last}); is it running? {self.http.start_hint}"
            )

    async def aclose(self) -> None:
        """Abort every in-flight request (each ``agenerate`` returns its partial output) and close
        the connection pool. Idempotent."""
        if self.closed:
            return
        for rid in list(self._live):
            with contextlib.suppress(Exception):
                await self.abort(rid)
        await self.http.aclose()

    async def __aenter__(self: _E) -> _E:
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
        self.http.check_open()
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
        """Freeze generation on the server between tokens; in-flight requests are kept and new
        ones wait."""
        self.http.check_open()
        await self.adapter.pause(self.http, keep=True)
        self._user_paused = True

    async def resume(self) -> None:
        """Continue after :meth:`pause`."""
        self.http.check_open()
        await self.adapter.resume(self.http)
        self._user_paused = False

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Reload the weights from the checkpoint directory ``source`` (a path the *server* can
        read) and set the version; see docs/vllm.md for in-flight requests."""
        self.http.check_open()
        if not isinstance(version, int) or isinstance(version, bool):
            raise ProtocolError(f"update_weights(version={version!r}): must be an int")
        path: str | IPCHandles
        if isinstance(source, Mapping):
            path = self.adapter.state_dict_source(source, version)
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
        _log.info("%s %s: weights from %s, version %d", self.adapter.name, self.url, path, version)

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
            retries=self.http.retried,
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
            if remaining <= 0 or self.adapter.context_full(len(request.input_ids) + len(live.ids)):
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
                except StreamBroken as exc:
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
                await self.http.retry(
                    stream_failures,
                    EngineUnavailableError(
                        f"{self.adapter.name} server {self.url}: the stream of request "
                        f"{request.request_id!r} ended early {stream_failures} times "
                        f"({broken or 'no finish reason'}); is the server overloaded or "
                        "restarting?"
                    ),
                )
                self._counts.stream_retries += 1
            else:
                raise EngineAPIError(
                    f"{self.adapter.name} server {self.url}: request {request.request_id!r} finished "
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
        one). Raises :class:`StreamBroken` on a transport error after the stream opened."""
        request = live.request
        live.server_rid = f"{self._tag}-{request.request_id}-{live.segments}"
        path, body = self.adapter.generate_body(
            SegmentRequest(
                request,
                live.server_rid,
                [*request.input_ids, *live.ids],
                max_tokens,
                (live.seed + live.segments - 1) % _SEED_MOD,
            )
        )
        where = self.url + path
        finish: str | None = None
        async for obj in self.http.stream(path, body, self.adapter.generate_hint):
            chunk = self.adapter.parse_chunk(obj, where, len(live.ids) - live.segment_start)
            self._take(live, chunk, version, where)
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
        return finish

    def _take(self, live: _Live, chunk: Chunk, version: int, where: str) -> None:
        """Add ``chunk``'s tokens to ``live``, each with the version that sampled it."""
        name = self.adapter.name
        n = len(chunk.token_ids)
        if n:
            if len(chunk.logprobs) != n:
                raise EngineAPIError(
                    f"{name} server {where}: a chunk had {n} token ids but "
                    f"{len(chunk.logprobs)} log-probs; the server does not return per-token "
                    "log-probs as expected"
                )
            label = chunk.version_label
            token_version = version if label is None else self._parse_version(label, where)
            live.ids.extend(chunk.token_ids)
            live.logprobs.extend(chunk.logprobs)
            live.versions.extend([token_version] * n)
        base = live.segment_start
        for label, start, end in chunk.spans or ():
            if not 0 <= start <= end <= len(live.ids) - base:
                raise EngineAPIError(
                    f"{name} server {where}: weight_versions span [{start}, {end}) is outside "
                    f"the {len(live.ids) - base} tokens received"
                )
            span_version = self._parse_version(label, where)
            for i in range(base + start, base + end):
                live.versions[i] = span_version

    async def _stop_segment(self, live: _Live) -> None:
        """End the live segment of an aborted or interrupted request."""
        task = live.task
        if task is None or task.done():
            return
        try:
            rid = live.server_rid
            asked = rid is not None and await self.adapter.abort(self.http, rid)
        except (EngineAPIError, EngineUnavailableError) as exc:
            # Disconnecting still stops the request; only the final chunk is lost.
            _log.warning(
                "%s %s: server-side abort failed (%s); disconnecting",
                self.adapter.name,
                self.url,
                exc,
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

    # -- helpers --------------------------------------------------------------------------------

    def _gate_event(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        return self._gate

    def _lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    def _parse_version(self, label: Any, where: str) -> int:
        if label is None or label == "default":
            return self._initial_version
        try:
            return int(str(label))
        except ValueError:
            raise EngineAPIError(
                f"{self.adapter.name} server {where}: weight version {label!r} is not an "
                "integer; stalebound labels weights with integer versions, so reset it through "
                "update_weights or restart the server"
            ) from None

    async def _swap_weights(self, path: str | IPCHandles, version: int) -> None:
        """Interrupt (resubmit mode) or keep (continue mode) what is in flight, pause the server
        unless the user already has, reload, and resume."""
        continue_mode = self.interrupt_mode == "continue"
        if not continue_mode:
            await self._interrupt_all()
        if not self._user_paused:
            await self.adapter.pause(self.http, keep=continue_mode)
        try:
            await self.adapter.reload(self.http, path, version)
        finally:
            if not self._user_paused:
                await self.adapter.resume(self.http)

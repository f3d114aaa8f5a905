"""How an HTTP engine talks to its server: one ``httpx.AsyncClient``, statuses, JSON and retries.

:class:`HTTPTransport` knows nothing of vLLM or SGLang. It owns the connection pool (one per event
loop: a caller that moves to another loop gets a fresh pool instead of sockets bound to a dead
one), turns answers into the engine's errors, reads server-sent-event streams as JSON objects,
and waits for a health endpoint. Every retry — of a call, of a stream that did not open, of a
stream that broke (the engine's new segment), of a health probe — waits through one helper,
:meth:`HTTPTransport.retry`, so the policy is in one place.

Errors: an unreachable server (connection refused, timeouts) and 5xx answers are retried with
exponential backoff; when the retries are used up the call raises
:class:`EngineUnavailableError`. A server that answers with a different API (404/405 on an
endpoint, 403 on an endpoint that needs a server option, an unexpected body) raises
:class:`EngineAPIError` naming the endpoint and what to enable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final

import httpx

from stalebound.core.errors import ProtocolError
from stalebound.engines.protocol import EngineClosedError

__all__ = [
    "EngineAPIError",
    "EngineUnavailableError",
    "HTTPTransport",
    "StreamBroken",
]

TRANSIENT_STATUS: Final[frozenset[int]] = frozenset({500, 502, 503, 504})
_HEALTH_FIRST_WAIT: Final[float] = 0.1
_HEALTH_LONGEST_WAIT: Final[float] = 2.0


class EngineUnavailableError(EngineClosedError):
    """The server is down or unreachable (after the configured retries); start it or fix the URL."""


class EngineAPIError(ProtocolError):
    """The server answered, but not with the API this engine speaks (missing endpoint, unexpected
    body, a rejected request); the message names the endpoint and the fix."""


class StreamBroken(Exception):
    """The stream broke after data arrived: the engine continues it as a new segment."""


class _Transient(Exception):
    """Internal: a transient status before any chunk; open the stream again (``error``: what
    to raise when the retries are used up)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _NotYet(Exception):
    """Internal: the health wait's time is up."""


def failure(exc: BaseException) -> str:
    """A transport error as a message names it: its type and what it says."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class HTTPTransport:
    """The client side of one server at ``url``; ``name`` (``vLLM``, ``SGLang``) and
    ``start_hint`` (how to start one) go into its error messages.

    ``timeout`` / ``connect_timeout``: seconds per HTTP operation (a stream's read timeout is the
    longest pause between two chunks). ``retries`` / ``backoff``: see :meth:`retry`. ``wire``:
    what carries the requests (default: httpx's own, over TCP; a test scripts a server with
    ``httpx.MockTransport``).
    """

    def __init__(
        self,
        url: str,
        *,
        name: str,
        start_hint: str,
        timeout: float,
        connect_timeout: float,
        retries: int,
        backoff: float,
        max_connections: int,
        wire: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.start_hint = start_hint
        self.retries = retries
        self.backoff = backoff
        self.retried = 0
        """HTTP attempts repeated after a transient error (connect error, timeout, 5xx)."""
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._connect_timeout = connect_timeout
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._wire = wire
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    # -- the pool ---------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError(
                f"{self.name} engine for {self.url} is closed; create a new engine to continue"
            )

    def client(self) -> httpx.AsyncClient:
        self.check_open()
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                timeout=self._timeout, limits=self._limits, transport=self._wire
            )
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        """Close the pool; every later call raises :class:`EngineClosedError`. Idempotent."""
        self.closed = True
        client, self._client = self._client, None
        if client is not None:
            # a pool bound to a loop that is gone has nothing left to close
            with contextlib.suppress(Exception):
                await client.aclose()

    # -- the one retry policy ----------------------------------------------------------------------

    async def retry(
        self,
        attempt: int,
        give_up: BaseException,
        *,
        first: float | None = None,
        longest: float = math.inf,
        deadline: float | None = None,
    ) -> None:
        """Wait before retry number ``attempt`` (from 1), or raise ``give_up`` when there is
        none: the wait is ``first * 2**(attempt - 1)`` seconds (``first`` defaults to
        ``backoff``), at most ``longest``. Without a ``deadline`` (a ``time.monotonic()``) there
        are ``retries`` retries; with one, retries until it (the last wait ends at it)."""
        delay = min(longest, (self.backoff if first is None else first) * 2 ** (attempt - 1))
        if deadline is None:
            if attempt > self.retries:
                raise give_up
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise give_up
            delay = min(delay, left)
        await asyncio.sleep(delay)

    def unreachable(self, what: str, attempts: int, exc: BaseException) -> EngineUnavailableError:
        return EngineUnavailableError(
            f"{self.name} server {self.url} unreachable: {what} failed {attempts} times "
            f"({failure(exc)}); is it running? {self.start_hint}"
        )

    # -- calls -----------------------------------------------------------------------------------

    async def call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        hint: str = "",
        timeout: float | None = None,
    ) -> httpx.Response:
        """One request, retried on transient errors; raises the engine's errors."""
        attempt = 0
        while True:
            try:
                reply = await self.client().request(
                    method,
                    self.url + path,
                    json=json_body,
                    params=params,
                    timeout=self._timeout if timeout is None else timeout,
                )
            except httpx.TransportError as exc:
                error: BaseException = self.unreachable(f"{method} {path}", attempt + 1, exc)
                error.__cause__ = exc
            else:
                if reply.status_code not in TRANSIENT_STATUS:
                    self.raise_for_status(reply, method, path, hint)
                    return reply
                error = self._status_error(reply, method, path, hint)
            attempt += 1
            await self.retry(attempt, error)
            self.retried += 1

    async def call_json(
        self, method: str, path: str, *, hint: str = "", allow_empty: bool = False, **kw: Any
    ) -> Any:
        """:meth:`call`, and the answer's JSON (``None`` for an empty body if ``allow_empty``)."""
        reply = await self.call(method, path, hint=hint, **kw)
        return self.json(reply, path, allow_empty=allow_empty)

    def json(self, reply: httpx.Response, path: str, *, allow_empty: bool = False) -> Any:
        if allow_empty and not reply.content:
            return None
        try:
            return reply.json()
        except ValueError:
            raise EngineAPIError(
                f"{self.name} server {self.url}{path}: answered {reply.status_code} with a body "
                f"that is not JSON ({reply.text[:200]!r})"
            ) from None

    def raise_for_status(self, reply: httpx.Response, method: str, path: str, hint: str) -> None:
        if reply.status_code >= 400:
            raise self._status_error(reply, method, path, hint)

    def _status_error(
        self, reply: httpx.Response, method: str, path: str, hint: str
    ) -> EngineAPIError | EngineUnavailableError:
        code = reply.status_code
        detail = reply.text[:500].strip()
        if code in (404, 405) or (code == 403 and hint):
            return EngineAPIError(
                f"{self.name} server {self.url}: {method} {path} answered {code} "
                f"({detail or 'no body'}); {hint or 'the server does not offer this endpoint'}"
            )
        if code >= 500:
            return EngineUnavailableError(
                f"{self.name} server {self.url}: {method} {path} answered {code} after "
                f"{self.retries + 1} attempts ({detail}); see the server log"
            )
        return EngineAPIError(
            f"{self.name} server {self.url}: {method} {path} rejected the request with {code}: "
            f"{detail}"
        )

    async def stream(self, path: str, body: dict[str, Any], hint: str) -> AsyncIterator[Any]:
        """POST ``body`` and yield the JSON objects of the server-sent-event stream, up to its
        ``[DONE]`` event. Opening is retried; a transport error after data arrived raises
        :class:`StreamBroken`.

        The stream's connection is closed at ``[DONE]`` instead of returning to the pool, so the
        pool holds only the control calls' connections, and a stream never starts on a pooled
        connection the server has meanwhile closed for idleness (vLLM's uvicorn does so after
        5 s; a raw client that pools its streams meets those as ``ReadError`` s). It is also
        cheaper: httpcore re-checks every pooled connection on each request event."""
        attempt = 0
        while True:
            received = False
            error: BaseException
            try:
                async with self.client().stream("POST", self.url + path, json=body) as reply:
                    if reply.status_code >= 400:
                        await reply.aread()
                        error = self._status_error(reply, "POST", path, hint)
                        if reply.status_code in TRANSIENT_STATUS:
                            raise _Transient(error)
                        raise error
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
                                f"{self.name} server {self.url}{path}: a stream chunk is not "
                                f"JSON ({data[:200]!r})"
                            ) from exc
                        received = True
                        yield obj
                    return
            except _Transient as transient:
                error = transient.error
            except httpx.TransportError as exc:
                if received:
                    raise StreamBroken(failure(exc)) from exc
                error = self.unreachable(f"POST {path}", attempt + 1, exc)
                error.__cause__ = exc
            attempt += 1
            await self.retry(attempt, error)
            self.retried += 1

    # -- health ----------------------------------------------------------------------------------

    async def probe(self, path: str, timeout: float) -> str | None:
        """``GET path`` once; ``None`` when it answers 200, else what went wrong."""
        try:
            reply = await self.client().get(self.url + path, timeout=timeout)
        except httpx.TransportError as exc:
            return failure(exc)
        return None if reply.status_code == 200 else f"HTTP {reply.status_code}"

    async def wait_healthy(
        self,
        path: str,
        timeout: float,
        *,
        probe_timeout: float | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> str | None:
        """Probe ``path`` until it answers 200 (waits from 0.1 s doubling to 2 s, through
        :meth:`retry`) for up to ``timeout`` seconds (``0``: probe once), the last probe at the
        end of that time. Returns ``None`` once it answered, else what the last probe got. Each
        probe waits at most ``probe_timeout`` (default: the connect timeout). ``on_wait(why)`` is called once, when the first probe
        fails and the wait begins. Cancelling the call ends the wait."""
        deadline = time.monotonic() + timeout
        probe_timeout = self._connect_timeout if probe_timeout is None else probe_timeout
        attempt = 0
        while True:
            last = await self.probe(path, probe_timeout)
            if last is None:
                return None
            attempt += 1
            if attempt == 1 and time.monotonic() < deadline and on_wait is not None:
                on_wait(last)
            try:
                await self.retry(
                    attempt,
                    _NotYet(),
                    first=_HEALTH_FIRST_WAIT,
                    longest=_HEALTH_LONGEST_WAIT,
                    deadline=deadline,
                )
            except _NotYet:
                return last

"""Whether the servers a run is pointed at answer, checked before the run starts anything.

:func:`check_endpoints` probes each server's health endpoint with a short timeout and returns one
problem per server that does not answer, in the form of a configuration error (the setting, what
was tried, and the fix). A server that is still starting refuses connections for a while (a
vLLM server on two busy cores: a minute or two); ``wait_s`` gives such servers that long to come
up. ``stalebound train`` calls it with ``engine.startup_timeout_s`` before it loads the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from stalebound.engines.http_adapter import ServerAdapter
from stalebound.engines.http_transport import HTTPTransport
from stalebound.engines.sglang import SGLangAdapter
from stalebound.engines.vllm import VLLMAdapter

__all__ = ["check_endpoints"]

_KINDS: Final[Mapping[str, Callable[[], ServerAdapter]]] = {
    "vllm": VLLMAdapter,
    "sglang": SGLangAdapter,
}


def check_endpoints(
    urls: Sequence[str],
    timeout_s: float = 5.0,
    *,
    kind: str = "vllm",
    wait_s: float = 0.0,
    on_wait: Callable[[str], None] | None = None,
    setting: str = "engine.urls",
) -> list[str]:
    """The problems of the ``kind`` servers (``vllm``, ``sglang``) at ``urls``: one line per
    server whose health endpoint does not answer 200, naming ``setting[i]``, the URL, what was
    tried and the fix; ``[]`` when every one answers.

    Each probe waits at most ``timeout_s`` seconds. A server that does not answer is probed again
    (waits from 0.1 s doubling to 2 s) until ``wait_s`` seconds have passed (``0``: one probe
    each); the servers are probed side by side. ``on_wait(message)`` is called once per server
    that did not answer its first probe, when its wait begins.

    It blocks the calling thread (and runs its own event loop): an exception a signal handler
    raises (``KeyboardInterrupt``) ends it at once.
    """
    adapter = _KINDS[kind]()

    async def check(index: int, url: str) -> str | None:
        http = HTTPTransport(
            url,
            name=adapter.name,
            start_hint=adapter.start_hint(url),
            timeout=timeout_s,
            connect_timeout=timeout_s,
            retries=0,
            backoff=0.0,
            max_connections=1,
        )
        label = f"{setting}[{index}]={url!r}"
        tried = f"GET {adapter.health_path}"

        def waiting(why: str) -> None:
            if on_wait is not None:
                on_wait(
                    f"{label}: no {adapter.name} server answers yet ({tried}: {why}); waiting up "
                    f"to {wait_s:g} s for it to start"
                )

        try:
            last = await http.wait_healthy(
                adapter.health_path, wait_s, probe_timeout=timeout_s, on_wait=waiting
            )
        finally:
            await http.aclose()
        if last is None:
            return None
        waited = f" for {wait_s:g} s" if wait_s > 0 else ""
        still_starting = (
            "; if it is still starting, give it longer with engine.startup_timeout_s"
            if wait_s > 0
            else "; if it is still starting, wait for it with engine.startup_timeout_s=300"
        )
        return (
            f"{label}: no {adapter.name} server answers there ({tried}{waited}: {last}); "
            f"{http.start_hint}, or fix {setting}{still_starting}"
        )

    async def check_all() -> list[str | None]:
        return list(await asyncio.gather(*(check(i, url) for i, url in enumerate(urls))))

    return [problem for problem in asyncio.run(check_all()) if problem is not None]

"""What an HTTP engine needs to know about one kind of server: :class:`ServerAdapter`.

The engine (:class:`~stalebound.engines.http.HTTPEngine`) does the request bookkeeping, aborts,
pauses, versions and statistics; the transport (:class:`~stalebound.engines.http_transport.
HTTPTransport`) carries the bytes. An adapter holds the rest, per server kind: the request bodies,
how a stream chunk reads, the weight-update and pause endpoints, where the version label is, and
what a state dict becomes. The adapters: :class:`~stalebound.engines.vllm.VLLMAdapter` and
:class:`~stalebound.engines.sglang.SGLangAdapter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from stalebound.core.errors import ProtocolError
from stalebound.engines.http_transport import HTTPTransport
from stalebound.engines.protocol import GenerateRequest

__all__ = [
    "Chunk",
    "IPCHandles",
    "SegmentRequest",
    "ServerAdapter",
    "directories_only",
    "url_port",
]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stream chunk, as the engine reads it: the tokens it adds to the segment."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    spans: list[tuple[str, int, int]] | None = None
    """``(version label, start, end)`` over this segment's output tokens (final chunk only)."""
    version_label: str | None = None
    """The server's weight version when it sent this chunk (SGLang)."""


@dataclass(frozen=True, slots=True)
class SegmentRequest:
    """What one stream of a request asks for: ``prompt`` is the request's input ids and the
    tokens already generated; ``server_rid`` names the stream on the server."""

    request: GenerateRequest
    server_rid: str
    prompt: list[int]
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class IPCHandles:
    """A state dict on the server's GPU, as CUDA IPC handles (and the tensors they point at, kept
    alive until the server has loaded them)."""

    handles: str
    tensors: Mapping[str, Any]

    def __str__(self) -> str:
        return "<CUDA IPC state dict>"


def url_port(url: str) -> int | None:
    """The port ``url`` names, if it names a valid one."""
    try:
        return urlsplit(url).port
    except ValueError:
        return None


def directories_only(version: int) -> ProtocolError:
    """The error for a state dict given to a server that reloads weights from directories."""
    return ProtocolError(
        f"update_weights(source=<state dict>, version={version}): an HTTP engine reloads "
        "weights from a checkpoint directory the server can read; save the state dict "
        "with save_pretrained (or safetensors) into a directory and pass its path"
    )


class ServerAdapter(Protocol):
    """The wire format and endpoints of one server kind.

    ``where`` in the parsing methods is the URL and path a message names. Methods that talk to
    the server get the engine's transport; they raise its errors.
    """

    name: str
    """How messages name the server: ``vLLM``, ``SGLang``."""
    health_path: str
    """The endpoint that answers 200 once the server serves."""
    generate_hint: str
    """What to enable when the generate endpoint is missing."""

    def start_hint(self, url: str) -> str:
        """How to start a server at ``url`` (ends an 'is it running?' message)."""
        ...

    def problems(self, interrupt_mode: str) -> list[str]:
        """The adapter's settings that are wrong (alone or with ``interrupt_mode``)."""
        ...

    async def connect(self, http: HTTPTransport) -> str | None:
        """Learn what the healthy server serves; return its weight version label (``None``:
        it has none)."""
        ...

    def generate_body(self, segment: SegmentRequest) -> tuple[str, dict[str, Any]]:
        """The path and body that stream ``segment``."""
        ...

    def parse_chunk(self, obj: Any, where: str, received: int) -> Chunk:
        """Read one stream chunk; ``received``: tokens of this segment read so far."""
        ...

    def context_full(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens leaves no room in the model's context."""
        ...

    async def abort(self, http: HTTPTransport, server_rid: str) -> bool:
        """Abort the stream ``server_rid`` on the server; ``False`` if the engine aborts by
        disconnecting instead (the server then sends no final chunk)."""
        ...

    async def pause(self, http: HTTPTransport, *, keep: bool) -> None:
        """Pause generation: in-flight requests kept (``keep``) or aborted."""
        ...

    async def resume(self, http: HTTPTransport) -> None: ...

    def state_dict_source(self, source: Mapping[str, Any], version: int) -> IPCHandles:
        """What a state dict becomes on the wire; raises :func:`directories_only`'s error when
        the server reloads from directories only."""
        ...

    async def reload(self, http: HTTPTransport, source: str | IPCHandles, version: int) -> None:
        """Load the weights in ``source`` on the paused server and label them ``version``."""
        ...

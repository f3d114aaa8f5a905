"""An engine over an SGLang server's native API (:class:`SGLangEngine`).

:class:`SGLangEngine` speaks SGLang's native API where its shapes match: ``POST /generate`` with
``input_ids`` and ``return_logprob`` (streamed), ``POST /abort_request``, ``POST
/pause_generation`` / ``POST /continue_generation``, ``POST /update_weights_from_disk`` (with
``weight_version``), ``GET /get_weight_version``. **It is not tested against a real SGLang server**
(SGLang needs a GPU build that does not run on the CPU machines this project is tested on); its
request and response shaping is unit-tested against a fake server. See its docstring. The wire
format is :class:`SGLangAdapter`; the engine is :class:`~stalebound.engines.http.HTTPEngine` with it.

"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stalebound.engines.http import EngineAPIError, HTTPEngine
from stalebound.engines.http_adapter import (
    Chunk,
    IPCHandles,
    SegmentRequest,
    directories_only,
    url_port,
)
from stalebound.engines.http_transport import HTTPTransport

__all__ = ["SGLangAdapter", "SGLangEngine"]


class SGLangAdapter:
    """SGLang's native API (a :class:`~stalebound.engines.http_adapter.ServerAdapter`); see
    :class:`SGLangEngine` for what it sends and what is untested."""

    name = "SGLang"
    health_path = "/health"
    generate_hint = "not an SGLang server (no native /generate endpoint)"

    def start_hint(self, url: str) -> str:
        port = url_port(url)
        return (
            f"start it with python -m sglang.launch_server --model-path ... --port {port or '...'}"
        )

    def problems(self, interrupt_mode: str) -> list[str]:
        return []

    async def connect(self, http: HTTPTransport) -> str | None:
        """The weight version (``GET /get_weight_version``; ``None`` on a server without it)."""
        try:
            data = await http.call_json("GET", "/get_weight_version")
        except EngineAPIError:
            return None
        label = data.get("weight_version") if isinstance(data, dict) else None
        return None if label is None else str(label)

    def context_full(self, length: int) -> bool:
        return False  # the server answers 'length' itself

    def generate_body(self, segment: SegmentRequest) -> tuple[str, dict[str, Any]]:
        sampling = segment.request.sampling
        return "/generate", {
            "rid": segment.server_rid,
            "input_ids": segment.prompt,
            "sampling_params": {
                "max_new_tokens": segment.max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": sampling.ignore_eos,
                "sampling_seed": segment.seed,
            },
            "return_logprob": True,
            "stream": True,
        }

    def parse_chunk(self, obj: Any, where: str, received: int) -> Chunk:
        if not isinstance(obj, dict) or not isinstance(obj.get("meta_info"), dict):
            if isinstance(obj, dict) and "error" in obj:
                raise EngineAPIError(f"SGLang server {where}: {obj['error']}")
            raise EngineAPIError(
                f"SGLang server {where}: unexpected chunk {str(obj)[:200]!r} (no "
                "meta_info); is this an SGLang server?"
            )
        meta = obj["meta_info"]
        ids = obj.get("output_ids") or []
        triples = meta.get("output_token_logprobs") or []
        total = meta.get("completion_tokens")
        # Cumulative chunks hold every token so far; incremental ones only the new tokens.
        # A cumulative chunk is recognised by holding completion_tokens ids.
        if isinstance(total, int) and len(ids) == total and total >= received:
            new_ids = ids[received:]
            new_triples = triples[received:] if len(triples) == total else triples[-len(new_ids) :]
        else:
            new_ids = ids
            new_triples = triples
        if not new_ids:
            new_triples = []
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        version = meta.get("weight_version")
        return Chunk(
            token_ids=[int(t) for t in new_ids],
            logprobs=[float(t[0]) for t in new_triples],
            finish_reason=None if reason is None else str(reason),
            version_label=None if version is None else str(version),
        )

    async def abort(self, http: HTTPTransport, server_rid: str) -> bool:
        await http.call("POST", "/abort_request", json_body={"rid": server_rid})
        return True

    async def pause(self, http: HTTPTransport, *, keep: bool) -> None:
        await http.call(
            "POST", "/pause_generation", json_body={"mode": "in_place" if keep else "abort"}
        )

    async def resume(self, http: HTTPTransport) -> None:
        await http.call("POST", "/continue_generation", json_body={})

    def state_dict_source(self, source: Mapping[str, Any], version: int) -> IPCHandles:
        raise directories_only(version)

    async def reload(self, http: HTTPTransport, source: str | IPCHandles, version: int) -> None:
        data = await http.call_json(
            "POST",
            "/update_weights_from_disk",
            json_body={
                "model_path": source,
                "weight_version": str(version),
                "abort_all_requests": False,
            },
        )
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineAPIError(
                f"SGLang server {http.url}: update_weights_from_disk({source!r}) failed: "
                f"{data.get('message')}"
            )


class SGLangEngine(HTTPEngine[SGLangAdapter]):
    """An engine backed by an SGLang server's native API. **Untested against a real SGLang server**.

    What it sends (shapes taken from SGLang's ``http_server.py`` / ``io_struct.py``, only
    unit-tested against a fake server in this project's tests):

    * ``POST /generate`` with ``{"rid", "input_ids", "sampling_params": {"max_new_tokens",
      "temperature", "top_p", "stop_token_ids", "ignore_eos", "sampling_seed"}, "return_logprob":
      true, "stream": true}``; each ``data:`` chunk's ``output_ids`` and
      ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples) are read either as
      cumulative (SGLang's default) or incremental (``--incremental-streaming-output``) — told apart
      by ``meta_info.completion_tokens``; ``meta_info.finish_reason.type`` is ``stop`` / ``length``
      / ``abort``; ``meta_info.weight_version`` labels the tokens of each chunk.
    * ``POST /abort_request`` ``{"rid"}``; ``POST /pause_generation`` ``{"mode": "in_place"}``
      (``continue`` mode and :meth:`pause`) or ``{"mode": "abort"}`` (``resubmit`` mode);
      ``POST /continue_generation``; ``POST /update_weights_from_disk`` ``{"model_path",
      "weight_version", "abort_all_requests": false}``; ``GET /get_weight_version``; ``GET
      /health``.

    Untested here, so unknown: whether ``sampling_seed`` is honoured by the server's sampling
    backend; whether SGLang's log-probs are of the raw logits (SGLang returns log-probs after
    temperature scaling unless ``--enable-return-raw-logprobs``-style options exist in your
    version); the exact per-token version boundary in ``continue`` mode (chunks are labelled with
    the version current when the server sent them); older servers whose ``/pause_generation``
    ignores the body.
    """

    def __init__(self, url: str, **kwargs: Any) -> None:
        """``kwargs``: the :class:`~stalebound.engines.http.HTTPEngine` settings."""
        super().__init__(url, SGLangAdapter(), **kwargs)

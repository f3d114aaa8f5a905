"""The inference-engine protocol every engine implements, and its request/response value objects.

This module imports neither torch nor anything heavy, so the executor, the simulator's adapters and
other engines can depend on it freely.

Contract:

* ``await engine.agenerate(request)`` generates one sequence and returns a :class:`GenerateResponse`
  with the generated token ids, the **raw model log-probability** of each generated token, and the
  **policy version** that produced each token. It returns (never raises) when the request is
  aborted: ``finish_reason == "abort"`` with the partial output.
* ``await engine.abort(request_id)`` stops a request and returns its partial output (the same
  response the ``agenerate`` call returns), or ``None`` when the id is unknown or already finished.
  It is ``async`` because an engine may need a round trip (to a worker process, a server) to learn
  what was generated so far.
* ``await engine.pause()`` stops making progress between tokens (in-flight requests are kept);
  ``await engine.resume()`` continues. New requests are accepted while paused and wait.
* ``await engine.update_weights(source, version)`` installs new weights (a state dict or a local
  checkpoint directory) and sets the engine's version. In-flight requests continue with the new
  weights from the next token on (partial rollout); every token keeps the version that produced it.
* ``engine.get_version()`` is the version of the weights now installed (synchronous and cheap, so an
  engine can serve as the executor's version provider).

Engines that support migration also implement :class:`MigratableEngine`:
``await export_continuation(request_id)`` removes a request from the engine and returns a
:class:`Continuation`; ``await acontinue(continuation)`` resumes it (on any engine serving the same
model) and returns the full response — the tokens generated before the move keep their log-probs and
versions.

Log-probabilities: ``output_logprobs[i]`` is ``log softmax(logits)[output_ids[i]]`` of the model's
raw logits — temperature 1, before top-p filtering — under the weights of ``output_versions[i]``.
That is what a trainer recomputes, so behaviour and training log-probs are directly comparable.

``SamplingParams.n``: one request is one sequence. Engines accept only ``n == 1``; a caller that
wants ``n`` samples of a prompt calls :func:`split_n`, which expands a request into ``n`` requests
(ids ``"<id>/<i>"``, seeds ``seed + i``), each abortable, migratable and versioned on its own — what
a staleness-aware executor needs to treat group members independently.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

from stalebound.core.errors import ProtocolError

__all__ = [
    "Continuation",
    "EngineClosedError",
    "FinishReason",
    "GenerateRequest",
    "GenerateResponse",
    "InferenceEngine",
    "MigratableEngine",
    "SamplingParams",
    "WeightSource",
    "split_n",
]

FinishReason: TypeAlias = Literal["stop", "length", "abort"]
"""``stop``: a stop token was generated (it is the last output token); ``length``: ``max_new_tokens``
(or the model's context) was reached; ``abort``: aborted or exported, the output is partial."""

WeightSource: TypeAlias = str | os.PathLike[str] | Mapping[str, Any]
"""A local checkpoint directory, or a state dict (parameter name → tensor) of the served model."""


class EngineClosedError(ProtocolError):
    """The engine was closed (or its worker died); create a new engine to continue."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one sequence.

    ``temperature == 0`` is greedy decoding (``top_p`` and ``seed`` are then unused). ``top_p`` keeps
    the smallest set of most likely tokens whose probability reaches ``top_p`` (1.0 keeps all).
    Generation stops after ``max_new_tokens`` tokens or after a token in ``stop_token_ids`` (which is
    included in the output); engines also stop at the model's end-of-sequence token unless
    ``ignore_eos``. ``seed`` makes sampling reproducible; ``None`` lets the engine derive one from
    its own seed and the request id. ``n`` must be 1 for an engine call (see :func:`split_n`).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
        if not self.temperature >= 0.0:
            problems.append(f"temperature={self.temperature!r}: must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p!r}: must be in (0, 1] (1 keeps every token)")
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n={self.n!r}: must be an int >= 1")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids={self.stop_token_ids!r}: must be non-negative ints")
        if problems:
            raise ProtocolError("invalid SamplingParams: " + "; ".join(problems))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Whether this is greedy decoding (temperature 0)."""
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One sequence to generate from the prompt ``input_ids``.

    ``request_id`` must be unique among the engine's in-flight requests. ``priority_version`` is the
    trajectory's V_traj when known: engines and routers that queue requests serve lower (older)
    versions first, so the stalest trajectories finish before they fall out of the staleness window.
    """

    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority_version: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ProtocolError(
                f"request_id={self.request_id!r}: must be a non-empty str; give every request a "
                "unique id (e.g. f'{group_id}/{member}')"
            )
        ids = tuple(self.input_ids)
        if not ids:
            raise ProtocolError(
                f"request {self.request_id!r}: input_ids is empty; a prompt needs at least one "
                "token (tokenizers of the default model prepend <bos>)"
            )
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ProtocolError(
                f"request {self.request_id!r}: input_ids={ids[:8]!r}...: must be non-negative ints"
            )
        object.__setattr__(self, "input_ids", ids)


@dataclass(frozen=True, slots=True)
class GenerateResponse:
    """The result of one request: ``output_ids[i]`` was sampled by the weights of version
    ``output_versions[i]`` and has raw model log-probability ``output_logprobs[i]``."""

    request_id: str
    input_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_versions: tuple[int, ...]
    finish_reason: FinishReason
    resubmits: int = 0
    """How many times a weight update in ``resubmit`` mode restarted this request's decoding."""

    def __post_init__(self) -> None:
        if not len(self.output_ids) == len(self.output_logprobs) == len(self.output_versions):
            raise ProtocolError(
                f"response {self.request_id!r}: output_ids ({len(self.output_ids)}), "
                f"output_logprobs ({len(self.output_logprobs)}) and output_versions "
                f"({len(self.output_versions)}) must have the same length"
            )

    @property
    def num_output_tokens(self) -> int:
        """The number of generated tokens."""
        return len(self.output_ids)


@dataclass(frozen=True, slots=True)
class Continuation:
    """Everything needed to resume a request elsewhere (rollout migration).

    ``request`` is the original request (its prompt, sampling parameters and priority — the
    trajectory keeps its V_traj). ``output_*`` are the tokens generated so far with their log-probs
    and versions. ``seed`` is the sampling seed the request was using: engines that draw the i-th
    token's randomness from ``(seed, i)`` alone (as the local engine does) continue the exact random
    stream, so a migrated request produces the same tokens it would have produced in place.
    """

    request: GenerateRequest
    output_ids: tuple[int, ...] = ()
    output_logprobs: tuple[float, ...] = ()
    output_versions: tuple[int, ...] = ()
    seed: int | None = None
    resubmits: int = 0

    def __post_init__(self) -> None:
        if not len(self.output_ids) == len(self.output_logprobs) == len(self.output_versions):
            raise ProtocolError(
                f"continuation of {self.request.request_id!r}: output_ids, output_logprobs and "
                "output_versions must have the same length"
            )
        if len(self.output_ids) >= self.request.sampling.max_new_tokens:
            raise ProtocolError(
                f"continuation of {self.request.request_id!r}: already has "
                f"{len(self.output_ids)} tokens, max_new_tokens="
                f"{self.request.sampling.max_new_tokens}; it is finished, nothing to continue"
            )

    @classmethod
    def of(cls, request: GenerateRequest) -> Continuation:
        """A continuation of a request that has generated nothing yet."""
        return cls(request=request, seed=request.sampling.seed)


def split_n(request: GenerateRequest) -> tuple[GenerateRequest, ...]:
    """Expand a request with ``sampling.n = k`` into ``k`` requests with ``n = 1``.

    Member ``i`` has id ``f"{request_id}/{i}"`` and seed ``seed + i`` (``None`` stays ``None``: the
    engine then derives distinct seeds from the distinct ids). A request with ``n == 1`` is returned
    unchanged, as a 1-tuple.
    """
    k = request.sampling.n
    if k == 1:
        return (request,)
    members = []
    for i in range(k):
        seed = None if request.sampling.seed is None else request.sampling.seed + i
        sampling = dataclasses.replace(request.sampling, n=1, seed=seed)
        members.append(
            dataclasses.replace(request, request_id=f"{request.request_id}/{i}", sampling=sampling)
        )
    return tuple(members)


@runtime_checkable
class InferenceEngine(Protocol):
    """What the executor needs from an engine (see the module docstring for the contract)."""

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        """Generate one sequence; an aborted request returns its partial output."""
        ...

    async def abort(self, request_id: str) -> GenerateResponse | None:
        """Stop ``request_id``; its partial output, or ``None`` if unknown or already finished."""
        ...

    async def pause(self) -> None:
        """Stop making progress between tokens; in-flight requests are kept."""
        ...

    async def resume(self) -> None:
        """Continue after :meth:`pause`."""
        ...

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Install new weights between tokens and set the version; in-flight requests continue."""
        ...

    def get_version(self) -> int:
        """The version of the installed weights."""
        ...


@runtime_checkable
class MigratableEngine(InferenceEngine, Protocol):
    """An engine whose requests can move to another instance (rollout migration)."""

    async def export_continuation(self, request_id: str) -> Continuation | None:
        """Remove ``request_id`` and return its state, or ``None`` if unknown or finished.

        The pending ``agenerate`` call of the request returns its partial output with
        ``finish_reason == "abort"``."""
        ...

    async def acontinue(self, continuation: Continuation) -> GenerateResponse:
        """Resume an exported request; the response holds all its tokens, old and new."""
        ...

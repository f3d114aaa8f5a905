"""Inference engines: the engine protocol, the embedded local engine, and a replica router.

Importing this package does not import torch; ``LocalEngine`` and the model helpers are loaded on
first access (they need the ``torch`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalebound._lazy import lazy_attributes
from stalebound.engines.protocol import (
    Continuation,
    EngineClosedError,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    MigratableEngine,
    SamplingParams,
    WeightSource,
    split_n,
)
from stalebound.engines.router import Router, RouterStatistics

if TYPE_CHECKING:
    from stalebound.engines.local import EngineStatistics, LocalEngine
    from stalebound.engines.models import (
        build_default_model,
        build_default_tokenizer,
        load_model,
        load_tokenizer,
    )

__all__ = [
    "Continuation",
    "EngineClosedError",
    "EngineStatistics",
    "FinishReason",
    "GenerateRequest",
    "GenerateResponse",
    "InferenceEngine",
    "LocalEngine",
    "MigratableEngine",
    "Router",
    "RouterStatistics",
    "SamplingParams",
    "WeightSource",
    "build_default_model",
    "build_default_tokenizer",
    "load_model",
    "load_tokenizer",
    "split_n",
]

_LAZY = {
    "EngineStatistics": "local",
    "LocalEngine": "local",
    "build_default_model": "models",
    "build_default_tokenizer": "models",
    "load_model": "models",
    "load_tokenizer": "models",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

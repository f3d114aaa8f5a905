"""Inference engines: the engine protocol, the embedded local engine, and a replica router.

Importing this package does not import torch; ``LocalEngine`` and the model helpers are loaded on
first access (they need the ``torch`` extra).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    "EngineStatistics": "stalebound.engines.local",
    "LocalEngine": "stalebound.engines.local",
    "build_default_model": "stalebound.engines.models",
    "build_default_tokenizer": "stalebound.engines.models",
    "load_model": "stalebound.engines.models",
    "load_tokenizer": "stalebound.engines.models",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stalebound.engines' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

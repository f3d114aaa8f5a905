"""The ``engine`` section of the config tree: which inference engines generate the rollouts and
how they sample (a pure dataclass, one docstring per field)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from stalebound.engines.devices import device_problems
from stalebound.typedconfig import Invalid, bounds, problems_as_invalid

__all__ = ["EngineConfig"]


@dataclass
class EngineConfig:
    """The inference engines that generate rollouts."""

    kind: Literal["local", "vllm", "sglang"] = "local"
    """``local``: the embedded engine (a Hugging Face model in worker processes). ``vllm`` /
    ``sglang``: OpenAI-compatible servers at ``urls``."""
    model_path: str | None = None
    """A local Hugging Face checkpoint directory; ``None`` builds the default tiny model in
    ``cache_dir``. Nothing is downloaded."""
    cache_dir: str = ".stalebound/models"
    """Where the default model is built and reused."""
    replicas: int = field(default=1, metadata=bounds(ge=1, fix="run at least one engine"))
    """Local engine worker processes behind the router."""
    urls: list[str] = field(default_factory=list)
    """Server base URLs for ``vllm`` / ``sglang`` (one replica each)."""
    startup_timeout_s: float = field(
        default=0.0,
        metadata=bounds(ge=0, le=3600, fix="e.g. 300 for servers still starting, 0 to check once"),
    )
    """How long a run waits for the servers at ``urls`` to answer their health check before it
    loads anything (a server that is still starting refuses connections; a vLLM server takes
    25 s to a few minutes). ``0`` checks once: a server that does not answer stops the run with
    nothing written. SIGINT/SIGTERM end the wait."""
    max_batch_size: int = field(default=256, metadata=bounds(ge=1, fix="e.g. 256 (the default)"))
    """Requests decoded together per local worker."""
    max_in_flight_per_engine: int | None = field(
        default=None, metadata=bounds(ge=1, fix="give a count, or null for no limit")
    )
    """The router's per-replica limit; further requests queue, oldest V_traj first."""
    interrupt_mode: Literal["continue", "resubmit"] = "continue"
    """On a weight update: ``continue`` in-flight requests with the new weights (partial rollout;
    every token keeps its version), or abort and ``resubmit`` prompt + partial output."""
    num_threads: int = field(default=1, metadata=bounds(ge=1, fix="e.g. 1 per worker"))
    """torch threads per local worker."""
    device: str = "auto"
    """Where local engine workers run: ``auto`` (a CUDA GPU when there is one, else the CPU),
    ``cpu``, ``cuda`` or ``cuda:N``. On the trainer's CUDA device, weights are published to the
    worker device to device (no copy through the CPU)."""
    weight_transfer: Literal["disk", "cuda_ipc"] = "disk"
    """How a step's weights reach ``vllm`` servers: ``disk`` writes a checkpoint directory the
    servers reload; ``cuda_ipc`` hands the trainer's GPU tensors to a server on the same GPU
    without the CPU (the server needs ``--worker-extension-cls
    stalebound.engines.vllm_ipc.WeightIPC``; see docs/models.md)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the local engines' weights and KV cache. Log-probabilities are computed in
    float32 from the logits either way; lower precision makes them differ more from the
    trainer's (see docs/models.md). ``float16`` needs a CUDA device."""
    temperature: float = field(default=1.0, metadata=bounds(ge=0, fix="0 is greedy, 1 samples"))
    """Sampling temperature of rollouts."""
    top_p: float = field(default=1.0, metadata=bounds(gt=0, le=1, fix="1 keeps every token"))
    """Nucleus sampling of rollouts."""

    def _validate(self) -> Iterator[Invalid]:
        if self.kind == "local":
            yield from problems_as_invalid(
                device_problems("engine", self.device, self.dtype), "engine"
            )
        if self.weight_transfer == "cuda_ipc" and self.kind != "vllm":
            yield Invalid(
                "weight_transfer",
                f"cuda_ipc is for vllm servers (kind={self.kind}); local engines on the trainer's "
                "GPU take its tensors device to device already",
                "set engine.weight_transfer=disk, or engine.kind=vllm",
            )
        if self.kind != "local" and not self.urls:
            yield Invalid(
                "urls",
                f"kind={self.kind} needs at least one server URL",
                "set engine.urls=[http://127.0.0.1:8000], or use engine.kind=local",
            )

"""The ``ray`` section of the config tree: the Ray backend's cluster and actors (a pure dataclass;
nothing here imports ray)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stalebound.typedconfig import bounds

__all__ = ["RayConfig"]


@dataclass
class RayConfig:
    """The Ray backend (``backend: ray``): engine replicas and trainer ranks as Ray actors."""

    address: str | None = None
    """A cluster to join (``auto`` finds the one ``ray start`` runs on this node, or
    ``HOST:PORT``); ``None`` starts a local instance bound to 127.0.0.1."""
    num_cpus: int | None = field(
        default=None, metadata=bounds(ge=1, fix="give a count, or null for every core")
    )
    """CPUs of a local instance; ``None`` lets Ray count the cores."""
    object_store_memory: int | None = field(
        default=None,
        metadata=bounds(ge=78643200, fix="give bytes (at least 75 MiB), or null for Ray's default"),
    )
    """Object store size of a local instance in bytes; weights are published through it."""
    engine_num_cpus: float = field(
        default=1.0, metadata=bounds(ge=0, fix="e.g. 1 (a core per replica) or 0.5")
    )
    """CPUs reserved per engine actor (``engine.replicas`` of them)."""
    trainer_num_cpus: float = field(
        default=1.0, metadata=bounds(ge=0, fix="e.g. 1 (a core per rank) or 0.5")
    )
    """CPUs reserved per trainer rank (their count is ``train.world_size``)."""
    trainer_num_gpus: float = field(
        default=0.0,
        metadata=bounds(ge=0, fix="e.g. 1 (a GPU per rank), or 0 to train on the CPU"),
    )
    """GPUs reserved per trainer rank; with one or more, each rank trains on its GPU (NCCL
    between the ranks), with 0 on the CPU (gloo)."""

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
    """CPUs reserved per trainer rank."""
    train_data_parallel_size: int = field(
        default=1, metadata=bounds(ge=1, fix="use 1 for a single trainer rank")
    )
    """Trainer ranks; each step's groups are split across them and their gradients averaged."""
    rank_timeout_s: float = field(
        default=600.0, metadata=bounds(gt=0, fix="give seconds, e.g. 600 (the default)")
    )
    """How long a trainer rank waits for the others in a collective before failing."""

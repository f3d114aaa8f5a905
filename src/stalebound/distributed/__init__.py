"""The Ray backend: engine replicas and data-parallel trainer ranks as Ray actors.

Importing this package does not import ray (nor torch); the names below load their modules on
first access and need the ``ray`` extra (``pip install 'stalebound[ray]'``). See
``docs/scale-out.md`` for launching on a cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalebound._lazy import lazy_attributes

if TYPE_CHECKING:
    from stalebound.distributed.cluster import import_ray, init_ray
    from stalebound.distributed.engine import (
        PublishedWeights,
        RayEngine,
        RayEngineActor,
        RayRouter,
        RayRouterStatistics,
        ReplicaLostError,
        make_ray_engine,
    )
    from stalebound.distributed.trainer import (
        RayRanks,
        RayTrainerGroup,
        TrainerRankError,
        make_ray_trainer,
        split_groups,
    )

__all__ = [
    "PublishedWeights",
    "RayEngine",
    "RayEngineActor",
    "RayRanks",
    "RayRouter",
    "RayRouterStatistics",
    "RayTrainerGroup",
    "ReplicaLostError",
    "TrainerRankError",
    "import_ray",
    "init_ray",
    "make_ray_engine",
    "make_ray_trainer",
    "split_groups",
]

_LAZY = {
    "import_ray": "cluster",
    "init_ray": "cluster",
    "PublishedWeights": "engine",
    "RayEngine": "engine",
    "RayEngineActor": "engine",
    "RayRouter": "engine",
    "RayRouterStatistics": "engine",
    "ReplicaLostError": "engine",
    "make_ray_engine": "engine",
    "RayRanks": "trainer",
    "RayTrainerGroup": "trainer",
    "TrainerRankError": "trainer",
    "make_ray_trainer": "trainer",
    "split_groups": "trainer",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

"""Trainer ranks as Ray actors: the same ranks as ``backend=local``, placed by Ray.

:class:`RayRanks` starts ``train.world_size`` actors, each the body of one
:class:`~stalebound.train.parallel.rank.TrainerRank`: it joins a torch.distributed process
group (gloo on the CPU, NCCL when the actor holds a GPU, ``ray.trainer_num_gpus``), builds its
share of the model and trains with FSDP2 or DDP (``train.parallel``) exactly as a local rank
process does. :class:`RayTrainerGroup` is a
:class:`~stalebound.train.parallel.driver.ShardedTrainer` over them, so a step, its statistics,
its checkpoints (sharded, resumable at another world size) and its failure handling are the
local ranks' (see that module). What differs is the transport:

* the group's store listens on rank 0's node (its address and a free port), so the ranks may sit
  on several machines;
* rank 0 puts the gathered full weights into the object store and the publish hooks receive a
  :class:`~stalebound.distributed.PublishedWeights`, which a
  :class:`~stalebound.distributed.RayRouter` forwards to its replicas without copying them
  through the driver;
* a rank whose actor dies, whose call raises, or which does not answer within
  ``train.rank_timeout_s`` and a minute stops the group (every actor is killed) and
  :class:`TrainerRankError` names it.

Sharded checkpoints are written by every rank into the run directory, so on a cluster of several
machines the run directory must be on a file system they share.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stalebound.core.errors import ConfigError
from stalebound.distributed.cluster import import_ray
from stalebound.distributed.engine import PublishedWeights
from stalebound.train.parallel.driver import (
    ShardedTrainer,
    StoppingRanks,
    TrainerRankError,
    split_groups,
)
from stalebound.train.parallel.rank import RankSpec, TrainerRank

if TYPE_CHECKING:
    from stalebound.config import StaleboundConfig
    from stalebound.train.config import TrainConfig

__all__ = [
    "RayRanks",
    "RayTrainerGroup",
    "TrainerRankError",
    "make_ray_trainer",
    "split_groups",
]

_log = logging.getLogger(__name__)

_GRACE_S = 60.0
"""How much longer than the process group's timeout the driver waits for a rank: a rank stuck
in a collective fails by itself first and says why."""


class _RayRank(TrainerRank):
    """A :class:`TrainerRank` in a Ray actor: it names the group's store address and hands its
    gathered weights over as an object-store reference."""

    def __init__(self, rank: int, spec: RankSpec, device: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        super().__init__(rank, spec, device)

    def rendezvous(self) -> str:
        """``host:port`` for the process group's store: this node's address and a free port."""
        ray = import_ray()
        host: str = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"{host}:{port}"

    def weights(self) -> Any:
        """The full weights, gathered (a collective), as an object-store reference on rank 0."""
        state = super().weights()
        return None if state is None else import_ray().put(state)


_RANK_CLASS: Any = None


def _rank_class() -> Any:
    global _RANK_CLASS
    if _RANK_CLASS is None:
        _RANK_CLASS = import_ray().remote(_RayRank)
    return _RANK_CLASS


class RayRanks(StoppingRanks):
    """``spec.world_size`` trainer rank actors (module docstring); each reserves ``num_cpus``
    CPUs and ``num_gpus`` GPUs, and trains on its GPU when it has one."""

    def __init__(self, spec: RankSpec, *, num_cpus: float = 1.0, num_gpus: float = 0.0) -> None:
        import_ray()
        self.world_size = spec.world_size
        self._timeout_s = spec.config.rank_timeout_s + _GRACE_S
        device = "cuda:0" if num_gpus > 0 else "cpu"  # Ray shows an actor only its own GPUs
        cls = _rank_class().options(num_cpus=num_cpus, num_gpus=num_gpus)
        self.actors = [cls.remote(r, spec, device) for r in range(self.world_size)]
        try:
            master = self._gather([self.actors[0].rendezvous.remote()])[0]
            self.call("join", [(master,)] * self.world_size)
        except BaseException:
            self._kill()
            raise

    def call(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        self._check_open()
        return self._gather(
            [getattr(a, method).remote(*args[r]) for r, a in enumerate(self.actors)]
        )

    def weights(self, payload: Any) -> Mapping[str, Any]:
        return PublishedWeights(payload)

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every result, or stop the group at the first failure and name the rank."""
        ray = import_ray()
        index = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=self._timeout_s)
            if not done:
                late = min(index[ref] for ref in pending)
                self._fail(late, f"no reply within {self._timeout_s:.0f} s")
            try:
                ray.get(done[0])
            except Exception as exc:
                self._fail(index[done[0]], f"{type(exc).__name__}: {_first_line(exc)}")
        return list(ray.get(refs))

    def _kill(self) -> None:
        ray = import_ray()
        for actor in self.actors:
            ray.kill(actor)

    def close(self) -> None:
        """Leave the process group and kill the rank actors. Idempotent."""
        if self._closed is not None:
            return
        self._closed = "closed"
        ray = import_ray()
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception as exc:  # a rank is already gone: killing is all that is left
            _log.debug("closing trainer ranks: %r", exc)
        self._kill()


class RayTrainerGroup(ShardedTrainer):
    """``world_size`` trainer rank actors behind a trainer's surface (module docstring).

    ``model_path`` is the checkpoint rank 0 loads (the others receive its weights);
    ``pad_token_id`` pads batches (the tokenizer's pad or end-of-sequence id). Ray must be
    connected (:func:`~stalebound.distributed.init_ray`). Close it with :meth:`close`.
    """

    def __init__(
        self,
        model_path: str,
        train_config: TrainConfig | None = None,
        *,
        world_size: int = 1,
        pad_token_id: int = 0,
        version: int = 0,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
    ) -> None:
        from stalebound.train.config import TrainConfig

        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"train.world_size={world_size!r}: must be an integer >= 1")
        import_ray()  # fail early, with the extra to install
        config = (train_config or TrainConfig()).validate()
        spec = RankSpec(str(model_path), config, pad_token_id, version, world_size)
        super().__init__(
            RayRanks(spec, num_cpus=num_cpus, num_gpus=num_gpus), config, version=version
        )

    @property
    def actors(self) -> list[Any]:
        """The rank actors, rank 0 first."""
        ranks: RayRanks = self.ranks  # type: ignore[assignment]
        return ranks.actors


def make_ray_trainer(
    config: StaleboundConfig,
    model_path: str | os.PathLike[str],
    *,
    pad_token_id: int = 0,
    version: int = 0,
) -> RayTrainerGroup:
    """``config.train.world_size`` trainer rank actors on the checkpoint at ``model_path``
    with the ``train`` settings, after connecting to Ray per ``config.ray``."""
    from stalebound.distributed.cluster import init_ray

    init_ray(config.ray)
    return RayTrainerGroup(
        str(model_path),
        config.train,
        world_size=config.train.world_size,
        pad_token_id=pad_token_id,
        version=version,
        num_cpus=config.ray.trainer_num_cpus,
        num_gpus=config.ray.trainer_num_gpus,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # A RayTaskError carries the remote traceback; its last line is the original exception.
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__

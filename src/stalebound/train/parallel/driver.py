"""The job's side of a group of trainer ranks: the surface of a :class:`~stalebound.train.Trainer`.

:class:`ShardedTrainer` has what the job uses of a trainer (``version``, ``step``, ``publish``,
``state_dict_for_engines``, the optimizer's checkpoint hooks, ``close``) over ranks reached
through a :class:`Ranks` launcher: processes on this machine
(:class:`~stalebound.train.parallel.launch.ProcessRanks`) or Ray actors
(:class:`~stalebound.distributed.trainer.RayRanks`). One step:

1. the batch is split **by group** into ``world_size`` contiguous shards of equal size (a group
   stays on one rank, where its advantages are computed), each told where its rows sit in the
   whole batch;
2. every rank trains on its shard (:meth:`TrainerRank.step`): minibatches are chunks of the whole
   batch, losses are divided by the whole batch's normalisers, gradients are averaged by DDP or
   reduced-scattered by FSDP; the step is the one a single trainer takes on the whole batch;
3. rank 0 gathers the new full weights once (to its CPU, parameter by parameter) and hands them
   to the publish hooks: through shared memory from a local rank, or as an object-store reference
   from a Ray actor (a :class:`~stalebound.distributed.PublishedWeights`).

A rank that fails (its process or actor dies, its step raises, or it does not answer within
``train.rank_timeout_s`` and a minute) stops the group: every rank is killed (the others would
wait for it in a collective) and :class:`TrainerRankError` names the rank and the cause.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from stalebound.core.errors import ConfigError, StaleboundError

if TYPE_CHECKING:
    from stalebound.tasks.base import Trajectory
    from stalebound.train.config import TrainConfig
    from stalebound.train.trainer import StepStats

__all__ = ["Ranks", "ShardedTrainer", "StoppingRanks", "TrainerRankError", "split_groups"]

_log = logging.getLogger(__name__)

PublishCallback = Callable[[Mapping[str, Any], int], None]


class TrainerRankError(StaleboundError, RuntimeError):
    """A trainer rank failed; the group is stopped. ``rank`` names it."""

    def __init__(self, rank: int, cause: str) -> None:
        self.rank = rank
        super().__init__(
            f"trainer rank {rank} failed: {cause}. The trainer group is stopped (its other ranks "
            "were killed); restart the run from its last checkpoint"
        )


def split_groups(groups: Sequence[Any], world_size: int) -> list[list[Any]]:
    """``groups`` in ``world_size`` contiguous shards whose sizes differ by at most one."""
    if len(groups) < world_size:
        raise ConfigError(
            f"train.world_size={world_size}: a batch of {len(groups)} groups cannot give every "
            f"rank a group; use a consumer_batch_size of at least {world_size} (a multiple of it "
            "balances the ranks)"
        )
    base, extra = divmod(len(groups), world_size)
    shards, start = [], 0
    for r in range(world_size):
        n = base + (1 if r < extra else 0)
        shards.append(list(groups[start : start + n]))
        start += n
    return shards


class Ranks(Protocol):
    """How the driver reaches its ranks."""

    world_size: int

    def call(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Call ``method(*args[r])`` on every rank r at once; every rank's result, or
        :class:`TrainerRankError` (the group stopped) at the first failure."""
        ...

    def weights(self, payload: Any) -> Mapping[str, Any]:
        """Rank 0's gathered weights as the publish hooks receive them."""
        ...

    def close(self) -> None:
        """Leave the process group and stop every rank (idempotent)."""
        ...


class StoppingRanks:
    """What every launcher shares: the first failure stops the whole group, naming the rank."""

    _closed: str | None = None
    """Why the group is stopped (``"closed"`` once closed), or ``None`` while it runs."""

    def _kill(self) -> None:
        """Stop every rank at once."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed is not None:
            raise TrainerRankError(-1, f"the group is stopped ({self._closed})")

    def _fail(self, rank: int, cause: str) -> NoReturn:
        self._closed = f"rank {rank}: {cause}"
        self._kill()
        _log.error("trainer group stopped: %s", self._closed)
        raise TrainerRankError(rank, cause)


class ShardedTrainer:
    """Trainer ranks behind a trainer's surface (see the module docstring)."""

    def __init__(self, ranks: Ranks, config: TrainConfig, *, version: int = 0) -> None:
        self.ranks = ranks
        self.world_size = ranks.world_size
        self.config = config
        self._version = version
        self._hooks: list[PublishCallback] = []
        self._weights: Mapping[str, Any] | None = None
        self.last_step_s = 0.0

    @property
    def version(self) -> int:
        """The policy version of the ranks' weights."""
        return self._version

    def publish(self, callback: PublishCallback) -> None:
        """Call ``callback(weights, version)`` after every step with the full new weights."""
        self._hooks.append(callback)

    def step(
        self, groups: Sequence[Sequence[Trajectory]], *, batch_version: int | None = None
    ) -> StepStats:
        """Train on ``groups`` across the ranks, bump the version, publish, return the step's
        statistics (the whole batch's: every rank computes the same)."""
        from stalebound.train.trainer import RowSpan

        started = time.perf_counter()
        shards = split_groups(groups, self.world_size)
        total = sum(len(g) for g in groups)
        publish = bool(self._hooks)  # every rank enters the gather; rank 0 returns the weights
        args, start = [], 0
        for shard in shards:
            args.append((shard, batch_version, RowSpan(start, total), publish))
            start += sum(len(g) for g in shard)
        results = self.ranks.call("step", args)
        stats: StepStats = results[0][0]
        self._version = stats.version
        self._weights = None
        self.last_step_s = time.perf_counter() - started
        # the ranks' threads wait for each other in the collectives: their CPU time does not
        # measure contention (NaN: none placed)
        stats = dataclasses.replace(stats, step_time_s=self.last_step_s, step_cpu_s=math.nan)
        if publish:
            weights = self._weights = self.ranks.weights(results[0][1])
            for hook in self._hooks:
                hook(weights, self._version)
        return stats

    def state_dict_for_engines(self) -> Mapping[str, Any]:
        """The full weights of the current version (gathered by the last step, or now)."""
        weights = self._weights
        if weights is None:
            payload = self.ranks.call("weights", [()] * self.world_size)[0]
            weights = self._weights = self.ranks.weights(payload)
        return weights

    # -- checkpoints ---------------------------------------------------------------------------

    def optimizer_state(self) -> None:
        """Nothing for ``trainer_state.pt``: the ranks write their shards themselves
        (:meth:`save_optimizer`)."""
        return None

    def save_optimizer(self, checkpoint: Path) -> None:
        """Every rank writes its shards of the optimizer state into ``checkpoint/optimizer``."""
        from stalebound.train.parallel.checkpoint import OPTIMIZER_DIR

        directory = str(checkpoint / OPTIMIZER_DIR)
        self.ranks.call("save_optimizer", [(directory,)] * self.world_size)

    def load_optimizer(self, checkpoint: Path, state: Mapping[str, Any] | None) -> None:
        """Continue from ``checkpoint``'s optimizer state, written at any world size."""
        self.ranks.call("load_optimizer", [(str(checkpoint), state)] * self.world_size)

    def close(self) -> None:
        """Leave the process group and stop the ranks. Idempotent."""
        self._weights = None
        self.ranks.close()

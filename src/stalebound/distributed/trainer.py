"""Data-parallel trainer ranks as Ray actors.

:class:`RayTrainerGroup` has the surface of :class:`~stalebound.train.Trainer` (``version``,
``step(groups, batch_version=)``, ``publish``, ``state_dict_for_engines``) over
``world_size`` rank actors, each holding a full replica of the model, its own
:class:`~stalebound.train.Trainer` and optimizer. One step:

1. The driver splits the batch **by group** into ``world_size`` contiguous shards (sizes differ by
   at most one group), so a group's advantages are computed where all its members are.
2. Each rank runs ``Trainer.step`` on its shard. Between each backward pass and the gradient
   clipping, the rank's gradients are combined with the others' in one ``all_reduce`` (torch
   distributed, gloo over TCP on the nodes' addresses; 127.0.0.1 on one machine).
3. The combination reproduces the gradient of the whole batch's loss: the trainer's loss is a
   mean over kept tokens (``token-mean``) or over sequences (``seq-mean-token-mean``), so rank r's
   gradient is weighted by its share ``d_r / Σ d`` of that denominator before the sum. The shares
   are exchanged in a small ``all_reduce`` first. Every rank then holds the same gradient, clips
   it the same way and takes the same optimizer step: the replicas stay identical.
4. The driver merges the ranks' :class:`~stalebound.train.StepStats` (sums, weighted means,
   extremes); rank 0 puts the new weights in the object store and the publish hooks receive them
   as a :class:`~stalebound.distributed.PublishedWeights` mapping, which a
   :class:`~stalebound.distributed.RayRouter` forwards to its replicas without copying them
   through the driver.

With ``train.minibatches == 1`` (the default) a step equals the single-process trainer's step on
the same batch up to float rounding. With more minibatches each rank splits its own shard, so the
k-th optimizer step sees the union of the ranks' k-th chunks: correct data-parallel SGD, but not
the same chunks as one process would take. With ratio rejection, a rank finds its denominator
with one extra forward pass (rejection depends on the current log-probs).

A rank that fails (its actor dies, or its step raises) stops the group: the other ranks are killed
(they would wait for it in the collective) and :class:`TrainerRankError` names the rank and the
cause. Resume from the last checkpoint with a new group.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from stalebound.core.errors import ConfigError
from stalebound.distributed.cluster import import_ray
from stalebound.distributed.engine import PublishedWeights
from stalebound.train.parallel.driver import TrainerRankError, split_groups

if TYPE_CHECKING:
    from stalebound.config import StaleboundConfig
    from stalebound.tasks.base import Trajectory
    from stalebound.train.config import TrainConfig
    from stalebound.train.trainer import StepStats

__all__ = [
    "RayTrainerGroup",
    "TrainerRankError",
    "make_ray_trainer",
    "merge_step_stats",
    "split_groups",
]

_log = logging.getLogger(__name__)

PublishCallback = Callable[[Mapping[str, Any], int], None]


class _TrainerRank:
    """The body of one rank actor: a Trainer whose gradients are all-reduced with its peers'."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_path: str,
        train_config: TrainConfig,
        pad_token_id: int | None,
        version: int,
        timeout_s: float,
    ) -> None:
        import torch

        from stalebound.engines.models import load_model
        from stalebound.train.trainer import Trainer

        self.rank = rank
        self.world_size = world_size
        self._timeout_s = timeout_s
        torch.set_num_threads(train_config.num_threads or 1)
        self.model = load_model(model_path)
        self.trainer = Trainer(
            self.model, None, train_config, version=version, pad_token_id=pad_token_id
        )
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._pending: set[int] = set()
        self._shares: list[float] = []
        self._share = 1.0
        self._minibatch = 0
        self._reduced = 0
        self._batch_version: int | None = None
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
        # One forward with gradients per minibatch: it selects that minibatch's share.
        self.model.register_forward_pre_hook(self._on_forward)

    def rendezvous(self) -> str:
        """``host:port`` for the process group's store: this node's address and a free port."""
        import ray

        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"{host}:{port}"

    def connect(self, master: str) -> int:
        """Join the process group at ``master`` (every rank calls it at the same time)."""
        import torch.distributed as dist

        if master.startswith("127."):
            # On one machine keep gloo's connections on loopback too, not the host's address.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self._timeout_s),
        )
        return self.rank

    # -- gradient combination ------------------------------------------------------------------

    def _on_forward(self, module: Any, args: Any) -> None:
        import torch

        if torch.is_grad_enabled() and module.training:
            self._share = self._shares[self._minibatch] if self._shares else 1.0
            self._minibatch += 1
            self._pending = {id(p) for p in self._params}

    def _on_grad(self, param: Any) -> None:
        # Hooks fire in autograd's order, which may differ between ranks: the collective waits
        # for the last parameter, then reduces all gradients flattened in one fixed order.
        self._pending.discard(id(param))
        if self._pending:
            return
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in self._params if p.grad is not None]
        if len(grads) != len(self._params):
            raise RuntimeError(f"rank {self.rank}: a parameter has no gradient after backward")
        flat = torch.cat([g.reshape(-1) for g in grads]) * self._share
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
        self._reduced += 1

    def _local_denominators(self, groups: Sequence[Sequence[Trajectory]]) -> list[float]:
        """This rank's loss denominator per minibatch (kept tokens, or sequences with one)."""
        import torch

        from stalebound.train.losses import loglinear_proximal_logprobs, rejection_mask
        from stalebound.train.trainer import build_batch, token_logprobs

        c = self.trainer.config
        trajs = [t for g in groups for t in g]
        batch = build_batch(trajs, self.trainer.pad_token_id)
        keep_seq = [0.0 if (c.mask_truncated and t.truncated) else 1.0 for t in trajs]
        mask = batch.loss_mask * torch.tensor(keep_seq)[:, None]
        if c.rejection != "none":
            with torch.no_grad():
                lp, _ = token_logprobs(
                    self.model, batch.input_ids, batch.attention_mask, with_entropy=False
                )
            behav = batch.behaviour_logprobs
            if c.prox_mode == "loglinear":
                v = self.trainer.version if self._batch_version is None else self._batch_version
                prox = loglinear_proximal_logprobs(
                    behav, lp, batch.versions, proximal_version=v, current_version=v
                )
                log_rho = prox - behav
            else:
                log_rho = lp - behav
            mask = rejection_mask(
                log_rho, mask, level=c.rejection, low=c.rejection_low, high=c.rejection_high
            )
        parts = [p for p in torch.arange(len(trajs)).chunk(c.minibatches) if p.numel()]
        if c.loss_agg == "token-mean":
            return [float(mask[p].sum()) for p in parts]
        return [float((mask[p].sum(-1) > 0).sum()) for p in parts]

    def step(
        self, groups: Sequence[Sequence[Trajectory]], batch_version: int | None, publish: bool
    ) -> tuple[StepStats, Any]:
        """Train on this rank's shard; returns its stats and (rank 0, when ``publish``) an
        ``ObjectRef`` of the new weights."""
        import torch
        import torch.distributed as dist

        c = self.trainer.config
        self._batch_version = batch_version
        n_trajs = sum(len(g) for g in groups)
        if n_trajs < c.minibatches:
            raise ConfigError(
                f"train.minibatches={c.minibatches}: rank {self.rank} got {n_trajs} trajectories; "
                "every rank needs at least one per minibatch (fewer minibatches, or more groups)"
            )
        local = self._local_denominators(groups)
        totals = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(totals)
        # Rank r's loss is its sum over its own denominator: weight it by its share of the total.
        self._shares = [
            (d / t) if t > 0 else 1.0 / self.world_size
            for d, t in zip(local, totals.tolist(), strict=True)
        ]
        self._minibatch = 0
        self._reduced = 0
        stats = self.trainer.step(groups, batch_version=batch_version)
        if self._reduced != len(local):
            raise RuntimeError(
                f"rank {self.rank}: {self._reduced} gradient reductions for {len(local)} "
                "minibatches (a parameter received no gradient?)"
            )
        ref = None
        if publish:
            ref = import_ray().put(self.trainer.state_dict_for_engines())
        return stats, ref

    def state_dict(self) -> Any:
        return self.trainer.state_dict_for_engines()

    def optimizer_state(self) -> Any:
        return self.trainer.optimizer.state_dict()

    def load_optimizer_state(self, state: Any) -> None:
        self.trainer.optimizer.load_state_dict(state)

    def version(self) -> int:
        return self.trainer.version

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


_RANK_CLASS: Any = None


def _rank_class() -> Any:
    global _RANK_CLASS
    if _RANK_CLASS is None:
        _RANK_CLASS = import_ray().remote(_TrainerRank)
    return _RANK_CLASS


class RayTrainerGroup:
    """``world_size`` trainer ranks as Ray actors, trained data-parallel (module docstring).

    ``model_path`` is the checkpoint every rank loads (so all start identical); ``pad_token_id``
    pads batches (the tokenizer's pad or end-of-sequence id). Ray must be connected
    (:func:`~stalebound.distributed.init_ray`). Close it with :meth:`close`.
    """

    def __init__(
        self,
        model_path: str,
        train_config: TrainConfig | None = None,
        *,
        world_size: int = 1,
        pad_token_id: int | None = None,
        version: int = 0,
        num_cpus: float = 1.0,
        rank_timeout_s: float = 600.0,
    ) -> None:
        from stalebound.train.config import TrainConfig

        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"train_data_parallel_size={world_size!r}: must be an integer >= 1")
        import_ray()  # fail early, with the extra to install
        self.world_size = world_size
        self.config = (train_config or TrainConfig()).validate()
        self._version = version
        self._hooks: list[PublishCallback] = []
        self._closed: str | None = None
        self._weights: PublishedWeights | None = None
        self.last_step_s = 0.0
        cls = _rank_class().options(num_cpus=num_cpus)
        self.ranks = [
            cls.remote(
                r,
                world_size,
                str(model_path),
                self.config,
                pad_token_id,
                version,
                rank_timeout_s,
            )
            for r in range(world_size)
        ]
        if world_size > 1:
            master = self._gather([self.ranks[0].rendezvous.remote()])[0]
            self._gather([rank.connect.remote(master) for rank in self.ranks])
        else:
            self._gather([rank.version.remote() for rank in self.ranks])

    @property
    def version(self) -> int:
        """The policy version of the ranks' weights."""
        return self._version

    def publish(self, callback: PublishCallback) -> None:
        """Call ``callback(weights, version)`` after every step; ``weights`` is a
        :class:`~stalebound.distributed.PublishedWeights` (a mapping kept in the object store)."""
        self._hooks.append(callback)

    def state_dict_for_engines(self) -> Mapping[str, Any]:
        """Rank 0's weights (all ranks hold the same)."""
        self._check_open()
        if self._weights is not None:
            return self._weights
        result: Mapping[str, Any] = self._gather([self.ranks[0].state_dict.remote()])[0]
        return result

    def step(
        self, groups: Sequence[Sequence[Trajectory]], *, batch_version: int | None = None
    ) -> StepStats:
        """Train on ``groups`` across the ranks, bump the version, publish, return merged stats."""
        self._check_open()
        started = time.perf_counter()
        shards = split_groups(groups, self.world_size)
        refs = [
            rank.step.remote(shard, batch_version, r == 0)
            for r, (rank, shard) in enumerate(zip(self.ranks, shards, strict=True))
        ]
        results = self._gather(refs)
        per_rank = [stats for stats, _ in results]
        self._version = per_rank[0].version
        self._weights = PublishedWeights(results[0][1])
        self.last_step_s = time.perf_counter() - started
        merged = merge_step_stats(per_rank, shards, self.config, self.last_step_s)
        for hook in self._hooks:
            hook(self._weights, self._version)
        return merged

    def optimizer_state(self) -> dict[str, Any]:
        """Rank 0's optimizer state (every rank's is the same), for ``trainer_state.pt``."""
        return self.optimizer.state_dict()

    def save_optimizer(self, checkpoint: Any) -> None:
        """Nothing beside :meth:`optimizer_state`."""

    def load_optimizer(self, checkpoint: Any, state: Mapping[str, Any] | None) -> None:
        """Give every rank the optimizer state of a resumed run."""
        if state is not None:
            self.optimizer.load_state_dict(state)

    @property
    def optimizer(self) -> _RankOptimizer:
        """Rank 0's optimizer, for checkpoints (``optimizer.state_dict()``; every rank's is the
        same)."""
        return _RankOptimizer(self)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise TrainerRankError(-1, f"the group is stopped ({self._closed})")

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every result, or stop the group at the first failure and name the rank."""
        ray = import_ray()
        index = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:
                rank = index[done[0]]
                cause = f"{type(exc).__name__}: {_first_line(exc)}"
                self._stop(f"rank {rank}: {cause}")
                raise TrainerRankError(rank, cause) from exc
        return list(ray.get(refs))

    def _stop(self, why: str) -> None:
        self._closed = why
        ray = import_ray()
        for rank in self.ranks:
            ray.kill(rank)
        _log.error("trainer group stopped: %s", why)

    def close(self) -> None:
        """Leave the process group and kill the rank actors. Idempotent."""
        if self._closed is not None:
            return
        ray = import_ray()
        try:
            ray.get([rank.close.remote() for rank in self.ranks], timeout=30)
        except Exception as exc:  # a rank is already gone: killing is all that is left
            _log.debug("closing trainer ranks: %r", exc)
        self._closed = "closed"
        for rank in self.ranks:
            ray.kill(rank)


class _RankOptimizer:
    """What a checkpoint needs of the ranks' optimizer: its state, fetched from rank 0."""

    def __init__(self, group: RayTrainerGroup) -> None:
        self._group = group

    def state_dict(self) -> dict[str, Any]:
        self._group._check_open()
        state: dict[str, Any] = self._group._gather(
            [self._group.ranks[0].optimizer_state.remote()]
        )[0]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give every rank this optimizer state (a resumed run's)."""
        self._group._check_open()
        self._group._gather([rank.load_optimizer_state.remote(state) for rank in self._group.ranks])


def make_ray_trainer(
    config: StaleboundConfig,
    model_path: str | os.PathLike[str],
    *,
    pad_token_id: int | None = None,
    version: int = 0,
) -> RayTrainerGroup:
    """``config.train.world_size`` trainer ranks on the checkpoint at ``model_path``
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
        rank_timeout_s=config.train.rank_timeout_s,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # A RayTaskError carries the remote traceback; its last line is the original exception.
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _weighted(values: Sequence[float], weights: Sequence[float]) -> float:
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if w > 0 and not math.isnan(v)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else float("nan")


def merge_step_stats(
    per_rank: Sequence[StepStats],
    shards: Sequence[Sequence[Sequence[Trajectory]]],
    config: TrainConfig,
    step_time_s: float,
) -> StepStats:
    """The batch's :class:`~stalebound.train.StepStats` from the ranks' (one per shard): counts
    are summed, means weighted by what each rank averaged over, extremes taken across ranks."""
    import dataclasses

    trajs = [sum(len(g) for g in shard) for shard in shards]
    # Tokens each rank's token means ran over: trained positions (truncated ones dropped if masked).
    tokens = [
        float(
            sum(
                t.num_trained_tokens
                for g in shard
                for t in g
                if not (config.mask_truncated and t.truncated)
            )
        )
        for shard in shards
    ]
    valid = [float(sum(t.num_trained_tokens for g in shard for t in g)) for shard in shards]
    kept = [float(s.num_trained_tokens) for s in per_rank]
    if config.loss_agg == "token-mean":
        loss_w = kept
    else:
        loss_w = [float(s.num_trajectories) for s in per_rank]
    mean_r = _weighted([s.reward_mean for s in per_rank], trajs)
    second = _weighted([s.reward_std**2 + s.reward_mean**2 for s in per_rank], trajs)
    n_valid = sum(valid)

    def nanmax(xs: list[float]) -> float:
        ok = [x for x in xs if not math.isnan(x)]
        return max(ok) if ok else float("nan")

    def nanmin(xs: list[float]) -> float:
        ok = [x for x in xs if not math.isnan(x)]
        return min(ok) if ok else float("nan")

    first = per_rank[0]
    return dataclasses.replace(
        first,
        num_groups=sum(s.num_groups for s in per_rank),
        num_trajectories=sum(s.num_trajectories for s in per_rank),
        num_trained_tokens=sum(s.num_trained_tokens for s in per_rank),
        loss=_weighted([s.loss for s in per_rank], loss_w) if sum(loss_w) else 0.0,
        reward_mean=mean_r,
        reward_std=math.sqrt(max(0.0, second - mean_r**2)),
        accuracy=_weighted([s.accuracy for s in per_rank], trajs),
        response_length=_weighted([s.response_length for s in per_rank], trajs),
        truncated_fraction=_weighted([s.truncated_fraction for s in per_rank], trajs),
        zero_advantage_fraction=_weighted([s.zero_advantage_fraction for s in per_rank], trajs),
        entropy=_weighted([s.entropy for s in per_rank], tokens),
        ratio_mean=_weighted([s.ratio_mean for s in per_rank], tokens),
        ratio_max=nanmax([s.ratio_max for s in per_rank]),
        ratio_min=nanmin([s.ratio_min for s in per_rank]),
        clip_fraction=_weighted([s.clip_fraction for s in per_rank], kept),
        masked_fraction=1.0 - sum(kept) / n_valid if n_valid else 0.0,
        behaviour_weight_mean=_weighted([s.behaviour_weight_mean for s in per_rank], kept),
        kl_behaviour=_weighted([s.kl_behaviour for s in per_rank], tokens),
        staleness_mean=_weighted([s.staleness_mean for s in per_rank], tokens),
        staleness_max=max(s.staleness_max for s in per_rank),
        traj_staleness_mean=_weighted([s.traj_staleness_mean for s in per_rank], trajs),
        traj_staleness_max=max(s.traj_staleness_max for s in per_rank),
        grad_norm=first.grad_norm,
        step_time_s=step_time_s,
    )

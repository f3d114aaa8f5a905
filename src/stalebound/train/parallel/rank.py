"""The body of one trainer rank, whoever launched it (a local process or a Ray actor).

A rank joins the process group (gloo on the CPU, NCCL on GPUs, with ``train.rank_timeout_s`` as
the group's timeout so a lost peer ends every wait), builds its share of the model and trains
its share of each batch with :class:`~stalebound.train.trainer.Trainer`.

The model is read from disk once per group: rank 0 loads the checkpoint on its CPU, the other
ranks build the same architecture on the meta device (no memory), every rank applies the
parallelism (:func:`~stalebound.train.parallel.context.parallelize`), and rank 0's weights and
buffers are then broadcast into the others' shards. No rank but rank 0 ever holds the whole model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from stalebound.tasks.base import Trajectory
    from stalebound.train.config import TrainConfig
    from stalebound.train.trainer import RowSpan, StepStats

__all__ = ["RankSpec", "TrainerRank"]


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a group is built from."""

    model_path: str
    """The checkpoint rank 0 loads (the others build its architecture and receive its weights)."""
    config: TrainConfig
    pad_token_id: int
    version: int
    world_size: int


class TrainerRank:
    """One rank: :meth:`join` the group, then :meth:`step` on each share of a batch."""

    def __init__(self, rank: int, spec: RankSpec, device: str) -> None:
        import torch

        self.rank = rank
        self.spec = spec
        self.device = torch.device(device)
        torch.set_num_threads(spec.config.num_threads or 1)
        self.trainer: Any = None

    def join(self, master: str) -> int:
        """Join the process group whose store listens at ``master`` (``host:port``; every rank
        calls it at the same time), then build the model and the trainer. Returns the pid."""
        import torch
        import torch.distributed as dist

        host, port = master.rsplit(":", 1)
        # torchrun's variables, for code in the rank that reads them
        os.environ.update(
            MASTER_ADDR=host,
            MASTER_PORT=port,
            RANK=str(self.rank),
            LOCAL_RANK=str(self.rank),
            WORLD_SIZE=str(self.spec.world_size),
        )
        if host.startswith("127."):  # on one machine keep gloo's connections on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{master}",
            rank=self.rank,
            world_size=self.spec.world_size,
            timeout=timedelta(seconds=self.spec.config.rank_timeout_s),
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self._build()
        return os.getpid()

    def _build(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from stalebound.train.parallel.context import parallelize
        from stalebound.train.trainer import Trainer

        c = self.spec.config
        full: dict[str, Any] = {}
        if self.rank == 0:
            from stalebound.engines.models import load_model

            model = load_model(self.spec.model_path)
            full = dict(model.state_dict())  # kept alive until broadcast below
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.spec.model_path, local_files_only=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    config, dtype=torch.float32
                )
        if c.parallel == "fsdp":  # shard first: the meta model's shards take no memory
            context = parallelize(model, c.parallel, dtype=c.dtype, device=self.device)
            self._materialise(model)
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, full, options=options)
        else:  # DDP broadcasts rank 0's parameters when it wraps the model
            self._materialise(model)
            context = parallelize(model, c.parallel, dtype=c.dtype, device=self.device)
        del full
        with torch.no_grad():
            for buffer in model.buffers():  # non-persistent ones (rotary) are in no state dict
                dist.broadcast(buffer, src=0)
        self.trainer = Trainer(
            model,
            None,
            c,
            version=self.spec.version,
            pad_token_id=self.spec.pad_token_id,
            rank=context,
        )

    def _materialise(self, model: Any) -> None:
        if self.rank == 0:
            model.to(self.device)
        else:
            model.to_empty(device=self.device)

    def step(
        self,
        groups: Sequence[Sequence[Trajectory]],
        batch_version: int | None,
        rows: RowSpan,
        publish: bool,
    ) -> tuple[StepStats, Any]:
        """Train on this rank's share; returns the whole batch's statistics and, when
        ``publish``, the new full weights (rank 0; ``None`` on the others)."""
        stats = self.trainer.step(groups, batch_version=batch_version, rows=rows)
        return stats, (self.weights() if publish else None)

    def weights(self) -> Any:
        """The full weights, gathered onto rank 0's CPU (``None`` on the others); a
        collective."""
        state = self.trainer.rank.full_state_dict()
        return state if self.rank == 0 else None

    def save_optimizer(self, directory: str) -> None:
        """Write the optimizer state, sharded as it is, into ``directory`` (a collective)."""
        from stalebound.train.parallel.checkpoint import save_optimizer

        save_optimizer(self.trainer.model, self.trainer.optimizer, Path(directory))

    def load_optimizer(self, checkpoint: str, state: Mapping[str, Any] | None) -> None:
        """Continue from the optimizer state of ``checkpoint``: a sharded one (any world size)
        or ``state``, one trainer's whole optimizer state (a collective)."""
        from stalebound.train.parallel.checkpoint import load_optimizer

        load_optimizer(self.trainer.model, self.trainer.optimizer, Path(checkpoint), state)

    def version(self) -> int:
        return int(self.trainer.version)

    def memory(self) -> dict[str, float]:
        """This rank's memory, in bytes: what its parameters, gradients and optimizer state take
        (its shards), its resident set now and at its peak (``VmRSS`` / ``VmHWM``), and on a GPU
        the most the device allocator held."""
        import torch

        def local(t: Any) -> int:
            t = getattr(t, "_local_tensor", t)
            return int(t.numel() * t.element_size())

        params = list(self.trainer.model.parameters())
        state = [
            v for s in self.trainer.optimizer.state.values() for v in s.values() if v.dim() > 0
        ]
        status = Path("/proc/self/status").read_text().splitlines()
        kb = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if "kB" in line}
        return {
            "parameters": float(sum(local(p) for p in params)),
            "gradients": float(sum(local(p.grad) for p in params if p.grad is not None)),
            "optimizer": float(sum(local(v) for v in state)),
            "rss": float(kb.get("VmRSS", 0)),
            "peak_rss": float(kb.get("VmHWM", 0)),
            "cuda_peak": float(torch.cuda.max_memory_allocated())
            if self.device.type == "cuda"
            else 0.0,
        }

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

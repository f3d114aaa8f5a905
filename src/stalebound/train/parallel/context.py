"""One rank's view of a data-parallel trainer: how its model is wrapped and how it meets the others.

:func:`parallelize` applies the parallelism in one place (the model code knows nothing of it):

* ``fsdp``: :func:`torch.distributed.fsdp.fully_shard` on every transformer block, then on the
  root, so parameters, gradients and the optimizer state built over them are sharded across the
  ranks. ``train.dtype=bfloat16`` (or ``float16``) becomes FSDP's mixed-precision policy:
  parameters cast to it for the forward and backward passes, gradients reduced in float32, the
  sharded master weights and AdamW state kept in float32.
* ``ddp``: :class:`torch.nn.parallel.DistributedDataParallel`; every rank keeps a full replica and
  gradients are all-reduced in buckets during the backward pass. ``train.dtype`` stays autocast.

The returned :class:`RankContext` is what :class:`~stalebound.train.trainer.Trainer` needs of the
group: sums and maxima of a few numbers across ranks (the loss's global normalisers and the step's
statistics), a switch that defers gradient reduction between micro-batches, and a stand-in pass
for a rank that has run out of rows, because every forward and backward pass of a sharded model
is a collective that all ranks must enter the same number of times.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Parallelism", "RankContext", "parallelize", "transformer_blocks"]

Parallelism = Literal["ddp", "fsdp"]


def transformer_blocks(model: Any) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class Hugging Face lists as not to be split
    (``_no_split_modules``: ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...), else the members
    of its largest ``ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else []


def _mixed_precision(dtype: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)


def parallelize(
    model: Any, parallel: Parallelism, *, dtype: str, device: torch.device
) -> RankContext:
    """Wrap ``model`` (already on ``device``, or on the meta device for FSDP) for ``parallel`` in
    the default process group; return the rank's context."""
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = _mixed_precision(dtype)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return RankContext(model, model, "fsdp", autocast=False)
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # Buffers (rotary frequencies) are the same everywhere; broadcasting them on every forward
    # would be a collective per pass, which ranks with fewer micro-batches would not enter.
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    no_sync: dict[str, Any] = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
    wrapped = DistributedDataParallel(model, device_ids=ids, **no_sync)
    return RankContext(model, wrapped, "ddp", autocast=True)


class RankContext:
    """The group as a :class:`~stalebound.train.trainer.Trainer` on one rank sees it."""

    def __init__(self, model: Any, forward: Any, parallel: Parallelism, *, autocast: bool) -> None:
        self.model = model
        """The module whose parameters the optimizer steps (sharded under FSDP)."""
        self.forward = forward
        """What the forward passes call (the DDP wrapper, or the sharded model itself)."""
        self.parallel = parallel
        self.autocast = autocast
        """Whether the trainer runs its passes under autocast (FSDP casts by its own policy)."""
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        device = next(self.model.parameters()).device
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        return [float(x) for x in t.tolist()]

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums across the ranks."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def all_max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maxima across the ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    @contextlib.contextmanager
    def accumulating(self, defer: bool) -> Iterator[None]:
        """A backward pass inside keeps its gradient local when ``defer`` (a micro-batch before the
        minibatch's last), and reduces the accumulated gradients across the ranks otherwise."""
        if self.parallel == "fsdp":
            self.model.set_requires_gradient_sync(not defer)
            yield
        elif defer:
            with self.forward.no_sync():
                yield
        else:
            yield

    def stand_in_pass(self, pad_token_id: int, *, backward: bool) -> None:
        """A pass that contributes nothing (a zero loss) but enters every collective a real pass
        enters: for a rank with fewer micro-batches than the others."""
        ids = torch.full((1, 2), pad_token_id, dtype=torch.long, device=self.device)
        if not backward:
            with torch.no_grad():
                self.forward(input_ids=ids, use_cache=False)
            return
        logits = self.forward(input_ids=ids, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    @property
    def device(self) -> torch.device:
        device: torch.device = next(self.model.parameters()).device
        return device

    def norm_value(self, norm: Tensor) -> float:
        """The global gradient norm ``clip_grad_norm_`` returned (a replicated DTensor under
        FSDP) as a float."""
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's weights on rank 0's CPU (an empty dict on the other ranks), gathered
        parameter by parameter: no rank ever holds a second full copy on its device."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Any] = get_model_state_dict(self.model, options=options)
        if self.parallel == "ddp" and self.rank == 0:  # DDP's are views of the live parameters
            state = {k: v.detach().clone() for k, v in state.items()}
        return state

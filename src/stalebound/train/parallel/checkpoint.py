"""The optimizer state of a checkpoint, sharded or whole, readable at any world size.

A checkpoint's policy is always the whole model in Hugging Face's layout (``model.safetensors``
beside ``config.json`` and the tokenizer), which every world size, the engines and vLLM read.
Its optimizer state is kept one of two ways:

* a trainer in the job's own process keeps it whole in ``trainer_state.pt`` (as always);
* trainer ranks keep it as they hold it, sharded, with :mod:`torch.distributed.checkpoint` in
  ``optimizer/`` (each rank writes its shards; ``.metadata`` says which rank wrote what).

:func:`load_optimizer` takes either into any trainer: :mod:`torch.distributed.checkpoint` reshards
a sharded state for the reading world size (one process included), and a whole state is cut to each
rank's shards of the parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["OPTIMIZER_DIR", "has_sharded_optimizer", "load_optimizer", "save_optimizer"]

OPTIMIZER_DIR = "optimizer"
"""The directory of a checkpoint that holds a sharded optimizer state."""


def has_sharded_optimizer(checkpoint: Path) -> bool:
    return (checkpoint / OPTIMIZER_DIR / ".metadata").is_file()


def save_optimizer(model: Any, optimizer: Any, directory: Path) -> None:
    """Write ``optimizer``'s state as it is sharded into ``directory`` (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    state = get_optimizer_state_dict(model, optimizer)
    save({"optimizer": state}, checkpoint_id=str(directory))


def _sharded_like(state: Mapping[str, Any], optimizer: Any) -> dict[str, Any]:
    """One trainer's whole ``optimizer.state_dict()`` with each of a parameter's state tensors
    (AdamW's moments) cut to this rank's shard of that parameter (FSDP's parameters are DTensors;
    a replicated parameter takes its state as it is)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    # copies throughout: a state that came through shared memory is its sender's own tensors

    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded: dict[int, Any] = {}
    for index, values in state["state"].items():
        param = params[int(index)]
        sharded[int(index)] = {
            key: distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            if isinstance(param, DTensor) and getattr(value, "shape", None) == param.shape
            else (value.clone() if isinstance(value, torch.Tensor) else value)
            for key, value in values.items()
        }
    return {"state": sharded, "param_groups": state["param_groups"]}


def load_optimizer(
    model: Any, optimizer: Any, checkpoint: Path, state: Mapping[str, Any] | None
) -> None:
    """Continue ``optimizer`` (over ``model``, sharded or not) from ``checkpoint``: its sharded
    optimizer state when it has one, else ``state`` (one trainer's whole state, or ``None``:
    nothing to restore). Every rank of a group calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    if has_sharded_optimizer(checkpoint):
        # the template's shapes and placements say how to reshard what was written
        target = get_optimizer_state_dict(model, optimizer)
        load(
            {"optimizer": target},
            checkpoint_id=str(checkpoint / OPTIMIZER_DIR),
            no_dist=not dist.is_initialized(),
        )
        set_optimizer_state_dict(model, optimizer, target)
    elif state is not None:
        optimizer.load_state_dict(_sharded_like(state, optimizer))

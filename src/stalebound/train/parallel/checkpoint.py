"""The optimizer state of a checkpoint, sharded or whole, readable at any world size.

A checkpoint's policy is always the whole model in Hugging Face's layout (``model.safetensors``
beside ``config.json`` and the tokenizer), which every world size, the engines and vLLM read.
Its optimizer state is kept one of two ways:

* a trainer in the job's own process keeps it whole in ``trainer_state.pt`` (as always);
* trainer ranks keep it as they hold it, sharded, with :mod:`torch.distributed.checkpoint` in
  ``optimizer/`` (each rank writes its shards; ``.metadata`` says which rank wrote what).

:func:`load_optimizer` takes either into any trainer: :mod:`torch.distributed.checkpoint` reshards
a sharded state for the reading world size (one process included), and a whole state is handed
to ranks under parameter names (torch's own optimizer state counts parameters by position).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["OPTIMIZER_DIR", "by_name", "has_sharded_optimizer", "load_optimizer", "save_optimizer"]

OPTIMIZER_DIR = "optimizer"
"""The directory of a checkpoint that holds a sharded optimizer state."""


def has_sharded_optimizer(checkpoint: Path) -> bool:
    return (checkpoint / OPTIMIZER_DIR / ".metadata").is_file()


def save_optimizer(model: Any, optimizer: Any, directory: Path) -> None:
    """Write ``optimizer``'s state as it is sharded into ``directory`` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": state}, checkpoint_id=str(directory))


def by_name(state: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """One trainer's ``optimizer.state_dict()`` (parameters counted by position, in the order of
    ``model.parameters()`` that train) keyed by parameter name instead."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(i)] for i in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def load_optimizer(
    model: Any, optimizer: Any, checkpoint: Path, state: Mapping[str, Any] | None
) -> None:
    """Continue ``optimizer`` (over ``model``, sharded or not) from ``checkpoint``: its sharded
    optimizer state when it has one, else ``state`` (one trainer's whole state, or ``None``:
    nothing to restore). Every rank of a group calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if has_sharded_optimizer(checkpoint):
        # the template's shapes and placements say how to reshard what was written
        target = get_optimizer_state_dict(model, optimizer)
        dcp.load(
            {"optimizer": target},
            checkpoint_id=str(checkpoint / OPTIMIZER_DIR),
            no_dist=not dist.is_initialized(),
        )
        set_optimizer_state_dict(model, optimizer, target)
    elif state is not None and not dist.is_initialized():
        optimizer.load_state_dict(state)
    elif state is not None:
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, by_name(state, model), options=options)

"""Low-rank adapters (``train.lora``) on the trainer's model, with ``peft``.

:func:`with_adapters` freezes a model and attaches LoRA adapters to the linear layers
``train.lora.target_modules`` names; the trainer's optimizer then holds only the adapters.
:func:`merged_state_dict` gives what the engines and checkpoints take: every weight of the
original model under its original name, each adapted one being the frozen weight plus the
adapter's scaled product, computed without touching the model (merging in place and back would
add rounding to the frozen weights at every step). :func:`save_adapter` and :func:`load_adapter`
write and read the adapter itself (peft's layout, ``ADAPTER_DIR`` of a checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalebound._extras import import_extra
from stalebound.core.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

    from stalebound.train.config import LoraConfig

__all__ = [
    "ADAPTER_DIR",
    "has_adapter",
    "import_peft",
    "load_adapter",
    "lora_with_ranks",
    "merged_state_dict",
    "save_adapter",
    "with_adapters",
]

ADAPTER_DIR = "adapter"
"""Where a checkpoint keeps the adapter (``adapter_config.json``, ``adapter_model.safetensors``)."""


def import_peft() -> Any:
    """The ``peft`` module, or a :class:`ConfigError` naming the extra to install."""
    return import_extra(
        "peft", "train.lora.rank", "peft", ", or set train.lora.rank=0 to train every weight"
    )


def lora_with_ranks(rank: int) -> str:
    """Why adapters cannot be trained by trainer ranks, and the fix."""
    return (
        f"train.lora.rank={rank}: adapters are trained by one trainer in the job's process, not "
        "by trainer ranks; set train.world_size=1, train.parallel=ddp and backend=local, or "
        "train.lora.rank=0"
    )


def with_adapters(model: Any, config: LoraConfig) -> Any:
    """``model`` (modified in place) wrapped as a peft model: frozen, with trainable adapters on
    the linear layers ``config.target_modules`` names."""
    peft = import_peft()
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in config.target_modules if m not in present]
    if missing:
        linear = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if type(module).__name__ == "Linear"
            }
        )
        raise ConfigError(
            f"train.lora.target_modules={list(config.target_modules)}: the model has no layer "
            f"named {', '.join(missing)}; its linear layers are {', '.join(linear)}"
        )
    settings = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, settings)


def merged_state_dict(model: Any) -> dict[str, Tensor]:
    """The weights of the original model (names and shapes as before the adapters), each adapted
    weight merged with its adapter: detached copies; ``model`` is not changed."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state: dict[str, Tensor] = {}
    for name, value in base.state_dict().items():
        if ".lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = value.detach().clone()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layer: Any = (
                module  # a LoraLayer mixed into a torch layer, whose get_delta_weight it is
            )
            for adapter in layer.active_adapters:
                key = f"{name}.weight"
                delta = layer.get_delta_weight(adapter).detach()
                state[key] = state[key] + delta.to(state[key].dtype)
    return state


def save_adapter(model: Any, checkpoint: Path) -> None:
    """Write the adapter into ``checkpoint / ADAPTER_DIR``."""
    model.save_pretrained(checkpoint / ADAPTER_DIR)


def has_adapter(checkpoint: Path) -> bool:
    return (checkpoint / ADAPTER_DIR / "adapter_config.json").is_file()


def load_adapter(model: Any, checkpoint: Path) -> None:
    """Set the adapter of ``model`` to the one saved in ``checkpoint / ADAPTER_DIR``."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    weights = load_peft_weights(str(checkpoint / ADAPTER_DIR), device="cpu")
    result = set_peft_model_state_dict(model, weights)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise ConfigError(
            f"{checkpoint / ADAPTER_DIR}: the adapter does not fit this model (unexpected "
            f"{', '.join(unexpected[:3])}); resume with the train.lora settings it was written with"
        )

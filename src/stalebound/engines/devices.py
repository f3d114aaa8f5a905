"""Device and precision names of the trainer and the engines (``auto | cpu | cuda | cuda:N``,
``float32 | bfloat16 | float16``).

Checking a name needs no torch; checking that a CUDA device exists imports torch, and only when a
setting names one (``auto`` never fails: it picks CUDA when there is a GPU and the CPU otherwise).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from stalebound.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_NAMES", "DTYPE_NAMES", "device_problems", "resolve_device", "torch_dtype"]

DEVICE_NAMES: Final[str] = "auto, cpu, cuda or cuda:N"
DTYPE_NAMES: Final[tuple[str, ...]] = ("float32", "bfloat16", "float16")
_DEVICE: Final = re.compile(r"auto|cpu|cuda(:\d+)?")


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def resolve_device(name: str) -> str:
    """The device ``name`` means on this machine: ``auto`` becomes ``cuda`` when a GPU is there
    and ``cpu`` otherwise; every other name is returned as given."""
    if name == "auto":
        return "cuda" if _cuda_count() else "cpu"
    return name


def device_problems(section: str, device: str, dtype: str) -> list[str]:
    """What is wrong with ``SECTION.device`` / ``SECTION.dtype`` on this machine, each as
    ``name=value: why; the fix`` (empty when both are usable)."""
    problems: list[str] = []
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        problems.append(f"{section}.device={device}: not a device name; use {DEVICE_NAMES}")
        device = "cpu"
    if dtype not in DTYPE_NAMES:
        problems.append(
            f"{section}.dtype={dtype}: not a supported precision; use one of "
            f"{', '.join(DTYPE_NAMES)}"
        )
    if device.startswith("cuda") or dtype == "float16":
        count = _cuda_count()
        if device.startswith("cuda") and not count:
            problems.append(
                f"{section}.device={device}: no CUDA GPU is available here "
                f"(torch.cuda.is_available() is False); use {section}.device=cpu, or auto to "
                "take a GPU when there is one"
            )
        elif device.startswith("cuda:") and int(device[5:]) >= count:
            problems.append(
                f"{section}.device={device}: this machine has {count} CUDA device(s) "
                f"(cuda:0 … cuda:{count - 1}); pick one of them, or cuda / auto"
            )
        elif dtype == "float16" and (device == "cpu" or not count):
            problems.append(
                f"{section}.dtype=float16: float16 needs a CUDA device ({section}.device="
                f"{device!r} runs on the CPU here, where float16 is slow and overflows); use "
                f"{section}.dtype=bfloat16 or float32 on the CPU"
            )
    return problems


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a precision name (``float32``, ``bfloat16``, ``float16``)."""
    import torch

    if name not in DTYPE_NAMES:
        raise ConfigError(
            f"dtype={name!r}: not a supported precision; use one of {', '.join(DTYPE_NAMES)}"
        )
    dtype: torch.dtype = getattr(torch, name)
    return dtype

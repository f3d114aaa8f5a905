"""The trainer ranks' settings across sections, checked before a run writes anything (no torch).

Where the ranks run and what their batch is are decided by settings of several sections
(``train``, ``rollout``, ``engine``, ``backend``); :func:`parallel_problems` names every
combination that cannot run (``stalebound train`` checks them in its preflight), and
:func:`rank_device` says which device each rank trains on.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalebound.config import StaleboundConfig

__all__ = ["parallel_problems", "rank_device", "sharded"]


def sharded(cfg: StaleboundConfig) -> bool:
    """Whether the job's trainer runs as ranks of a process group (not in the job's process)."""
    t = cfg.train
    return cfg.backend == "ray" or t.world_size > 1 or t.parallel == "fsdp"


def _cuda_count() -> int:
    from stalebound.engines.devices import _cuda_count as count

    return count()


def rank_device(cfg: StaleboundConfig, rank: int) -> str:
    """The device rank ``rank`` of the local backend trains on: ``cuda:rank`` when the ranks are
    on GPUs (``train.device`` cuda, or auto with a GPU for every rank), else the CPU."""
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if _cuda_count() >= cfg.train.world_size else "cpu"
    if device.startswith("cuda"):
        base = int(device[5:]) if device.startswith("cuda:") else 0
        return f"cuda:{base + rank}"
    return "cpu"


def parallel_problems(cfg: StaleboundConfig) -> list[str]:
    """Every cross-section problem of the trainer ranks' settings, each as
    ``name=value: why; the fix``."""
    t, batch = cfg.train, cfg.rollout.consumer_batch_size
    n = t.world_size
    found: list[str] = []
    if not isinstance(n, int) or n < 1:
        return found  # the train section reports it
    if isinstance(batch, int) and batch % n:
        found.append(
            f"train.world_size={n}: rollout.consumer_batch_size={batch} groups per step do not "
            f"split evenly across {n} ranks; use a world size that divides {batch}, or a "
            f"consumer_batch_size that is a multiple of {n}"
        )
    if cfg.backend == "local" and n > 1 and t.device.startswith("cuda"):
        base = int(t.device[5:]) if t.device.startswith("cuda:") else 0
        count = _cuda_count()
        if count and base + n > count:
            found.append(
                f"train.world_size={n}: rank r trains on cuda:{base}+r, but this machine has "
                f"{count} CUDA device(s) (train.device={t.device}); use at most {count - base} "
                "ranks, or train.device=cpu"
            )
    if sharded(cfg) and cfg.engine.kind == "vllm" and cfg.engine.weight_transfer == "cuda_ipc":
        found.append(
            "engine.weight_transfer=cuda_ipc: it hands the trainer's own GPU tensors to the "
            "server, and trainer ranks publish the weights they gather on rank 0's CPU; use "
            "engine.weight_transfer=disk with trainer ranks"
        )
    gpus = cfg.ray.trainer_num_gpus
    if cfg.backend == "ray" and t.device.startswith("cuda") and not gpus:
        found.append(
            f"train.device={t.device}: with backend=ray a rank trains on the GPU Ray gives its "
            "actor, and ray.trainer_num_gpus=0 gives none; set ray.trainer_num_gpus=1 (a GPU per "
            "rank), or train.device=auto"
        )
    if cfg.backend == "ray" and t.device == "cpu" and gpus:
        found.append(
            f"ray.trainer_num_gpus={gpus}: each rank would hold a GPU and train on the CPU "
            "(train.device=cpu); set ray.trainer_num_gpus=0, or train.device=auto"
        )
    if sharded(cfg) and t.lora.rank:
        from stalebound.train.lora import lora_with_ranks

        found.append(lora_with_ranks(t.lora.rank))
    if t.lora.rank and importlib.util.find_spec("peft") is None:
        found.append(
            f"train.lora.rank={t.lora.rank}: the peft package is not installed; install the "
            "extra: pip install 'stalebound[peft]', or set train.lora.rank=0"
        )
    if sharded(cfg) and t.compile:
        found.append(
            "train.compile=true: the trainer ranks run their passes uncompiled; set "
            "train.compile=false, or train one rank in the job's process (train.parallel=ddp "
            "train.world_size=1)"
        )
    return found

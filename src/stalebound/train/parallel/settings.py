"""The trainer ranks' settings across sections, checked when the config is loaded (no torch).

Where the ranks run and what their batch is are decided by settings of three sections (``train``,
``rollout``, ``backend``/``ray``); :func:`parallel_problems` names every combination that cannot
run, and :func:`rank_device` says which device each rank trains on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from stalebound.typedconfig import Invalid

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


def parallel_problems(cfg: StaleboundConfig) -> Iterator[Invalid]:
    """Every cross-section problem of the trainer ranks' settings."""
    t, batch = cfg.train, cfg.rollout.consumer_batch_size
    n = t.world_size
    if not isinstance(n, int) or n < 1:
        return  # the train section reports it
    if isinstance(batch, int) and batch % n:
        yield Invalid(
            "train.world_size",
            f"rollout.consumer_batch_size={batch} groups per step do not split evenly across "
            f"{n} ranks",
            f"use a world size that divides {batch}, or a consumer_batch_size that is a "
            f"multiple of {n}",
        )
    if cfg.backend == "local" and n > 1 and t.device.startswith("cuda"):
        base = int(t.device[5:]) if t.device.startswith("cuda:") else 0
        count = _cuda_count()
        if count and base + n > count:
            yield Invalid(
                "train.world_size",
                f"rank r trains on cuda:{base}+r, but this machine has {count} CUDA device(s) "
                f"(train.device={t.device})",
                f"use at most {count - base} ranks, or train.device=cpu",
            )
    if sharded(cfg) and cfg.engine.kind == "vllm" and cfg.engine.weight_transfer == "cuda_ipc":
        yield Invalid(
            "engine.weight_transfer",
            "cuda_ipc hands the trainer's own GPU tensors to the server, and trainer ranks "
            "publish the weights they gather on rank 0's CPU",
            "use engine.weight_transfer=disk with trainer ranks",
        )
    if cfg.backend == "ray" and t.parallel == "fsdp":
        yield Invalid(
            "train.parallel",
            "fsdp with backend=ray: Ray's trainer ranks are full replicas combining their "
            "gradients in one all-reduce",
            "use train.parallel=ddp on Ray, or backend=local for FSDP",
        )
    if sharded(cfg) and t.compile:
        yield Invalid(
            "train.compile",
            "the trainer ranks run their passes uncompiled",
            "set train.compile=false, or train one rank in the job's process "
            "(train.parallel=ddp train.world_size=1)",
        )

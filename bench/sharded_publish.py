"""Publish time: full weights from the trainer into an engine's model, one trainer against ranks.

    PYTHONPATH=src python bench/sharded_publish.py [--layers 12] [--repeats 5] [--ray]

Builds the Llama of ``bench/sharded_memory.py`` locally (about 136M parameters at 12 layers;
nothing is downloaded) and times what a publication costs after a step, from "the step is done"
to "an engine's copy of the model holds the new weights":

* ``1 trainer``: the job's own trainer (``train.world_size=1``): a snapshot of its weights
  (``state_dict_for_engines``), loaded into the engine's model;
* ``ddp × 2`` and ``fsdp × 2``: two rank processes (gloo); rank 0 gathers the full weights onto
  its CPU parameter by parameter (FSDP: an all-gather per parameter), hands them to the job
  through shared memory, and the job loads them into the engine's model;
* with ``--ray``, ``fsdp × 2 (Ray)``: two rank actors; rank 0 puts the weights into the object
  store and the job fetches them (a Ray engine actor would fetch them the same way).

Every configuration is started once and publishes ``--repeats`` times (a training step between
publications, not timed); the table gives the median and range of the publish time and its ratio
to the one trainer's median, all measured in one invocation.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sharded_memory import batch, build
from stalebound.engines.models import load_model
from stalebound.train import TrainConfig, Trainer
from stalebound.train.parallel.driver import ShardedTrainer
from stalebound.train.parallel.launch import ProcessRanks
from stalebound.train.parallel.rank import RankSpec


def timed(publish: Callable[[], None], step: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        step()
        started = time.perf_counter()
        publish()
        times.append(time.perf_counter() - started)
    return times


def one_trainer(path: Path, engine: Any, repeats: int) -> list[float]:
    config = TrainConfig(num_threads=1)
    trainer = Trainer(load_model(path), None, config, pad_token_id=0)
    return timed(
        lambda: engine.load_state_dict(trainer.state_dict_for_engines()),
        lambda: trainer.step(batch(2), batch_version=trainer.version),
        repeats,
    )


def ranks(path: Path, engine: Any, repeats: int, parallel: str, on_ray: bool) -> list[float]:
    config = TrainConfig(num_threads=1, parallel=parallel, world_size=2)  # type: ignore[arg-type]
    group: ShardedTrainer
    if on_ray:
        from stalebound.distributed import RayTrainerGroup

        group = RayTrainerGroup(str(path), config, world_size=2, num_cpus=0.5)
    else:
        group = ShardedTrainer(
            ProcessRanks(RankSpec(str(path), config, 0, 0, 2), ["cpu"] * 2), config
        )

    def publish() -> None:
        payload = group.ranks.call("weights", [()] * 2)[0]
        engine.load_state_dict(dict(group.ranks.weights(payload)))

    try:
        return timed(publish, lambda: group.step(batch(4), batch_version=group.version), repeats)
    finally:
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ray", action="store_true", help="also two FSDP rank actors on Ray")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        n = build(path, args.layers)
        engine = load_model(path)  # the engine's copy of the model the weights are loaded into
        print(f"model: {n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB in float32)")
        rows: list[tuple[str, list[float]]] = [
            ("1 trainer", one_trainer(path, engine, args.repeats))
        ]
        for parallel in ("ddp", "fsdp"):
            rows.append((f"{parallel} × 2", ranks(path, engine, args.repeats, parallel, False)))
        if args.ray:
            from stalebound.distributed import init_ray
            from stalebound.distributed.config import RayConfig

            init_ray(RayConfig(num_cpus=2))
            rows.append(("fsdp × 2 (Ray)", ranks(path, engine, args.repeats, "fsdp", True)))
        base = statistics.median(rows[0][1])
        print(f"{'trainer':<16} {'publish s (median)':>18} {'range':>15} {'× 1 trainer':>11}")
        for name, times in rows:
            med = statistics.median(times)
            print(
                f"{name:<16} {med:>18.3f} {f'{min(times):.3f}–{max(times):.3f}':>15} "
                f"{med / base:>11.2f}"
            )


if __name__ == "__main__":
    main()

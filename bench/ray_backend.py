"""Trajectories/s through the Ray backend versus the local backend, and the weight-publication time.

    PYTHONPATH=src python bench/ray_backend.py [--replicas 2] [--steps 12] [--rounds 2]

The same workload runs on both backends in one process, alternating ``--rounds`` times so that
load from elsewhere on the machine hits both alike: the executor (buffer policy, η = 1) runs the
arithmetic task's episodes — real generations, 4 per group, 8 groups per step — on ``--replicas``
engine replicas: local worker processes behind a ``Router``, or Ray actors behind a ``RayRouter``
(each actor hosting the same embedded engine). After every consumed batch the driver publishes the
policy's weights as version + 1 and advances the executor: the per-step publication time is the
engine-facing half of a training step (no training here, so that the figure is the backends' own).

Publication on Ray is ``ray.put`` of the state dict once plus every replica's acknowledgement of
the reference (``put`` is reported separately); on the local backend it is every worker's
acknowledgement of the state dict sent down its pipe.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stalebound.config import RayConfig, RolloutConfig, load_config
from stalebound.engines import Router, SamplingParams
from stalebound.engines.local import LocalEngine
from stalebound.engines.models import build_default_model, load_model, load_tokenizer
from stalebound.runtime import WorkflowExecutor
from stalebound.tasks import TaskConfig, make_task
from stalebound.train.episode import EngineEpisode


def local_engine(model_dir: Path, replicas: int) -> tuple[Any, Any]:
    engines = [LocalEngine(model_dir, name=f"bench{i}") for i in range(replicas)]
    for e in engines:
        e.wait_ready(timeout=300)

    def close() -> None:
        for e in engines:
            e.close()

    return Router(engines), close


def ray_engine(model_dir: Path, replicas: int) -> tuple[Any, Any]:
    from stalebound.distributed import make_ray_engine

    cfg = load_config(overrides=[f"engine.replicas={replicas}", "ray.engine_num_cpus=0.5"])
    router = make_ray_engine(cfg, model_path=str(model_dir))
    return router, router.close


def run(engine: Any, model_dir: Path, steps: int, seed: int) -> dict[str, float]:
    tokenizer = load_tokenizer(model_dir)
    task = make_task(TaskConfig(name="arithmetic"))
    samples = list(task.generate_samples(2000, seed=seed))
    state = load_model(model_dir).state_dict()
    workflow = EngineEpisode(task, tokenizer, SamplingParams(temperature=1.0))
    config = RolloutConfig(consumer_batch_size=8, group_size=4, max_head_offpolicyness=1)
    publish: list[float] = []
    with WorkflowExecutor(config, engine).initialize() as ex:
        ex.prepare_batch(samples, workflow)  # warm-up: the first batch pays the model's start-up
        version = engine.get_version()
        trained = 0
        started = time.perf_counter()
        for _ in range(steps):
            trained += len(ex.prepare_batch(samples, workflow))
            version += 1
            t0 = time.perf_counter()
            ex.run_coroutine(engine.update_weights(state, version))
            publish.append(time.perf_counter() - t0)
            ex.set_version(version)
        elapsed = time.perf_counter() - started
    result = {
        "traj_s": trained / elapsed,
        "publish_ms": 1000 * statistics.median(publish),
        "publish_p90_ms": 1000 * sorted(publish)[int(0.9 * (len(publish) - 1))],
    }
    ray_stats = getattr(engine, "ray_statistics", None)
    if ray_stats is not None:
        result["put_ms"] = 1000 * statistics.median(ray_stats().put_s[-steps:])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = args.model_dir or build_default_model(Path(tempfile.mkdtemp()) / "model")
    from stalebound.distributed import init_ray

    init_ray(RayConfig(num_cpus=2, object_store_memory=256 * 1024**2))
    rows: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    for r in range(args.rounds):
        for name, make in (("local", local_engine), ("ray", ray_engine)):
            engine, close = make(model_dir, args.replicas)
            try:
                rows[name].append(run(engine, model_dir, args.steps, seed=r))
            finally:
                close()
            print(f"round {r + 1} {name}: {rows[name][-1]}", flush=True)

    def med(name: str, key: str) -> str:
        values = [row[key] for row in rows[name] if key in row]
        return f"{statistics.median(values):8.1f}" if values else "       -"

    params = sum(v.numel() for v in load_model(model_dir).state_dict().values())
    print(
        f"\n{args.replicas} replicas, {args.steps} steps × 32 trajectories, {args.rounds} rounds "
        f"(medians), weights {params * 4 / 1e6:.1f} MB"
    )
    print(f"{'backend':8} {'traj/s':>8} {'publish ms':>10} {'p90 ms':>8} {'put ms':>8}")
    for name in ("local", "ray"):
        print(
            f"{name:8} {med(name, 'traj_s')} {med(name, 'publish_ms'):>10} "
            f"{med(name, 'publish_p90_ms')} {med(name, 'put_ms')}"
        )
    ratio = statistics.median(r["traj_s"] for r in rows["ray"]) / statistics.median(
        r["traj_s"] for r in rows["local"]
    )
    print(f"ray / local throughput: {ratio:.2f}")


if __name__ == "__main__":
    main()

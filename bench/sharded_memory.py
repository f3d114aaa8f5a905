"""Memory per trainer rank, one rank against FSDP2 ranks, for a model of over 100M parameters.

    PYTHONPATH=src python bench/sharded_memory.py [--world-sizes 1 2] [--layers 12] [--device cpu]

Builds a Llama locally (hidden 768, 12 layers, vocabulary 32,000: about 136M parameters; nothing
is downloaded), then for each world size starts that many FSDP rank processes (gloo on the CPU,
NCCL with ``--device cuda``), trains one step on a small batch so that AdamW's state exists, and
asks every rank for its memory: the bytes its parameters, gradients and optimizer state take (its
shards), and its resident set now and at its peak (on a GPU, ``max_memory_allocated``). The
table's last column is each rank's parameter + optimizer bytes against one rank's: FSDP should
make it about 1/N.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from stalebound.tasks import Trajectory
from stalebound.train import TrainConfig
from stalebound.train.parallel.driver import ShardedTrainer
from stalebound.train.parallel.launch import ProcessRanks
from stalebound.train.parallel.rank import RankSpec

MiB = 1024**2


def build(path: Path, layers: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def batch(groups: int) -> list[list[Any]]:
    rng = random.Random(0)
    out = []
    for _ in range(groups):
        prompt = [1, *(rng.randrange(3, 32000) for _ in range(8))]
        members = []
        for m in range(2):
            tokens = [rng.randrange(3, 32000) for _ in range(8)]
            members.append(
                Trajectory(
                    prompt_ids=prompt,
                    output_ids=tokens,
                    behaviour_logprobs=[-10.0] * len(tokens),
                    versions=[0] * len(tokens),
                    reward=float(m),
                )
            )
        out.append(members)
    return out


def measure(path: Path, world_size: int, device: str) -> list[dict[str, float]]:
    config = TrainConfig(num_threads=1, parallel="fsdp", world_size=world_size)
    devices = [device if device == "cpu" else f"cuda:{r}" for r in range(world_size)]
    trainer = ShardedTrainer(
        ProcessRanks(RankSpec(str(path), config, 0, 0, world_size), devices), config
    )
    try:
        trainer.step(batch(2 * world_size), batch_version=0)
        memory: list[dict[str, float]] = trainer.ranks.call("memory", [()] * world_size)
        return memory
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        n = build(Path(tmp) / "model", args.layers)
        print(f"model: {n / 1e6:.1f}M parameters ({n * 4 / MiB:.0f} MiB in float32)")
        print(
            f"{'N':>2} {'rank':>4} {'params MiB':>10} {'grads MiB':>9} {'optim MiB':>9} "
            f"{'rss MiB':>8} {'peak MiB':>8} {'gpu peak':>8} {'p+o / one rank':>14}"
        )
        one = None
        for world_size in args.world_sizes:
            for r, m in enumerate(measure(Path(tmp) / "model", world_size, args.device)):
                held = m["parameters"] + m["optimizer"]
                one = held if one is None else one
                print(
                    f"{world_size:>2} {r:>4} {m['parameters'] / MiB:>10.1f} "
                    f"{m['gradients'] / MiB:>9.1f} {m['optimizer'] / MiB:>9.1f} "
                    f"{m['rss'] / MiB:>8.0f} {m['peak_rss'] / MiB:>8.0f} "
                    f"{m['cuda_peak'] / MiB:>8.0f} {held / one:>14.3f}"
                )


if __name__ == "__main__":
    main()

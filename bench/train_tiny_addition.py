"""How fast does a tiny Llama learn addition with warm start + GRPO on this machine?

A synchronous loop without the engine or executor (sampling with the in-process sampler), to pick
the defaults of ``stalebound train``: warm start, then RL steps of ``--batch`` prompts ×
``--group`` samples. ``--staleness K`` samples with the weights of K versions ago (a fixed-lag
stand-in for asynchronous rollouts) to exercise the off-policy corrections. Prints one line per
evaluation: elapsed seconds, step, greedy held-out score, mean sampled reward, ratio/KL stats.

    PYTHONPATH=src python bench/train_tiny_addition.py [--staleness 2] [--prox-mode recompute]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from stalebound.tasks import TaskConfig, make_task
from stalebound.train import TrainConfig, Trainer, evaluate, rollout_groups, warm_start
from train_helpers import CharTokenizer, tiny_llama


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warm-steps", type=int, default=40)
    ap.add_argument("--warm-lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--prox-mode", default="none")
    ap.add_argument("--tis-cap", type=float, default=2.0)
    ap.add_argument("--rejection", default="none")
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = CharTokenizer()
    cfg = TaskConfig(name=a.task, seed=a.seed)
    cfg.arithmetic.max_digits = a.digits
    task = make_task(cfg)
    train_samples = task.generate_samples(4000, seed=a.seed)
    held_out = task.generate_samples(300, seed=10_000 + a.seed)
    model = tiny_llama(vocab_size=tok.vocab_size, hidden=a.hidden, layers=a.layers, seed=a.seed)
    t0 = time.perf_counter()
    rows = []

    def report(step: int, extra: dict[str, float]) -> None:
        e = evaluate(model, tok, task, held_out)
        row = {"t": round(time.perf_counter() - t0, 1), "step": step, "eval": e["score"], **extra}
        rows.append(row)
        if not a.json:
            print(json.dumps(row), flush=True)

    ws = warm_start(
        model,
        tok,
        task,
        a.warm_steps,
        samples=train_samples,
        batch_size=64,
        lr=a.warm_lr,
        seed=a.seed,
    )
    report(0, {"warm_loss": round(ws.last_loss, 3)})
    tc = TrainConfig(
        lr=a.lr,
        prox_mode=a.prox_mode,
        tis_cap=None if a.prox_mode == "none" else a.tis_cap,
        rejection=a.rejection,
        minibatches=a.minibatches,
    )
    trainer = Trainer(model, tok, tc)
    lagged = copy.deepcopy(model)
    history: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=a.staleness + 1)
    history.append(trainer.state_dict_for_engines())
    trainer.publish(lambda sd, v: history.append(sd))
    rng = torch.Generator().manual_seed(a.seed)
    rewards: list[float] = []
    for step in range(1, a.steps + 1):
        idx = torch.randint(len(train_samples), (a.batch,), generator=rng).tolist()
        lagged.load_state_dict(history[0])
        behaviour_version = trainer.version - (len(history) - 1)
        groups = rollout_groups(
            lagged,
            tok,
            task,
            [train_samples[i] for i in idx],
            a.group,
            temperature=a.temperature,
            version=behaviour_version,
        )
        st = trainer.step(groups)
        rewards.append(st.reward_mean)
        if step % a.eval_every == 0 or step == a.steps:
            recent = rewards[-a.eval_every :]
            report(
                step,
                {
                    "reward": round(sum(recent) / len(recent), 3),
                    "ratio_max": round(st.ratio_max, 2),
                    "kl": round(st.kl_behaviour, 4),
                    "clip": round(st.clip_fraction, 3),
                    "stale_max": st.traj_staleness_max,
                    "len": round(st.response_length, 2),
                    "ent": round(st.entropy, 3),
                },
            )
    if a.json:
        print(json.dumps({"args": vars(a), "rows": rows}))


if __name__ == "__main__":
    main()

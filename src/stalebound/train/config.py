"""The ``train`` and ``run`` sections of the config tree: pure dataclasses (no torch), one
docstring per field.

:meth:`TrainConfig.problems` lists every invalid value at once (``name=value: why; the fix``);
:meth:`TrainConfig.validate` raises them as one :class:`~stalebound.core.errors.ConfigError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from stalebound.core.errors import ConfigError
from stalebound.engines.devices import device_problems
from stalebound.typedconfig import bounds

__all__ = ["RunConfig", "TrainConfig"]


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The attention projections of Llama, Qwen2 and Mistral checkpoints (and of the embedded model)."""


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, via the ``peft`` extra: ``pip install 'stalebound[peft]'``).

    With ``rank`` > 0 the trainer freezes the model and trains, for each linear layer that
    ``target_modules`` names, two matrices A (rank × in) and B (out × rank) whose product, scaled
    by ``alpha / rank``, is added to the frozen weight. Only the adapters are in the optimizer.
    The engines receive the merged weights (the frozen weight plus the product), so they serve
    the trained policy as a plain model; a checkpoint holds the merged policy (servable as it is)
    and the adapter itself (``adapter/``, peft's layout), from which a resumed run continues."""

    rank: int = field(default=0, metadata=bounds(ge=0, fix="e.g. 16, or 0 to train every weight"))
    """The adapters' rank r; 0 trains every weight (no adapters)."""
    alpha: float = field(default=32.0, metadata=bounds(gt=0, fix="e.g. 32 (twice a rank of 16)"))
    """The adapters' scale is ``alpha / rank``."""
    dropout: float = field(default=0.0, metadata=bounds(ge=0, le=0.9, fix="e.g. 0.05, or 0"))
    """Dropout on the adapters' input while training (the engines' merged weights have none)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Names (last component) of the linear layers that get adapters."""


@dataclass
class TrainConfig:
    """GRPO with PPO clipping and the off-policy corrections of bounded-staleness training.

    The objective per trained token t of a trajectory with group-normalised advantage A::

        r_t = π_θ(t) / π_prox(t)                          (the PPO ratio)
        w_t = min(π_prox(t) / π_behav(t), tis_cap)        (behaviour weight, detached)
        loss_t = w_t · max(−A·r_t, −A·clip(r_t, 1 − clip_eps, 1 + clip_eps_high))

    With ``prox_mode="none"`` the proximal policy is the behaviour policy (π_prox = π_behav,
    w_t = 1): plain PPO against the engine's log-probs.
    """

    lr: float = 1e-3
    """AdamW learning rate (1e-3 suits the tiny default model; 2e-3 collapsed its entropy).
    ``stalebound train`` with ``engine.model_path`` naming a user's checkpoint defaults to 1e-6,
    a usual rate for pretrained models (docs/training.md)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; ``None`` does not clip."""
    minibatches: int = 1
    """Optimizer steps per training step (the batch is split into this many parts); the version
    still advances by one per training step."""
    clip_eps: float = 0.2
    """PPO clip range below 1 (and above 1 unless ``clip_eps_high`` is set)."""
    clip_eps_high: float | None = None
    """PPO clip range above 1 (DAPO's clip-higher); ``None`` means ``clip_eps``."""
    prox_mode: Literal["recompute", "loglinear", "none"] = "none"
    """The proximal policy of decoupled PPO. ``recompute``: log-probs of the weights at the start
    of the training step (free when ``minibatches`` is 1: that is the first forward pass).
    ``loglinear``: approximated from behaviour and current log-probs and the versions, without a
    forward pass (see ``stalebound.train.losses.loglinear_proximal_logprobs``). ``none``: no
    proximal policy; the PPO ratio is taken against the behaviour policy, so clipping bounds the
    step away from the policy that sampled the data. With one minibatch the proximal policy is the
    current one and clipping never acts; ``none`` then learned faster under staleness (see
    ``bench/train_tiny_addition.py``)."""
    tis_cap: float | None = None
    """Truncated importance sampling: cap of the behaviour weight π_prox/π_behav (detached).
    ``None`` leaves it uncapped (2.0 is usual). Needs a proximal policy (``prox_mode`` not
    ``none``)."""
    rejection: Literal["none", "token", "sequence"] = "none"
    """Mask trained tokens whose behaviour importance ratio ρ is outside
    [``rejection_low``, ``rejection_high``]: per token, or per sequence by the geometric mean of ρ
    over its tokens. ρ = π_prox/π_behav, or π_θ/π_behav with ``prox_mode="none"``."""
    rejection_low: float = 0.5
    """Lower bound of ρ for ``rejection``."""
    rejection_high: float = 2.0
    """Upper bound of ρ for ``rejection``."""
    mask_truncated: bool = False
    """Exclude truncated trajectories (no end-of-turn token: length or turn limit, abort) from the
    loss. Off, they train with their reward (0 for the built-in tasks): a penalty for rambling."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """``token-mean``: every trained token of the batch weighs the same (DAPO).
    ``seq-mean-token-mean``: average per sequence, then over sequences (GRPO's original form)."""
    adv_eps: float = 1e-6
    """Added to the group standard deviation before dividing."""
    adv_scale_by_std: bool = True
    """Divide advantages by the group's standard deviation (off: Dr. GRPO's mean-centring only)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (the loss subtracts ``entropy_coef × mean entropy``)."""
    compute_entropy: bool = True
    """Compute the policy entropy of trained tokens for the statistics (one softmax pass)."""
    num_threads: int | None = None
    """``torch.set_num_threads`` for the trainer; ``None`` leaves torch's setting."""
    device: str = "auto"
    """Where the job trains: ``auto`` (a CUDA GPU when there is one, else the CPU), ``cpu``,
    ``cuda`` or ``cuda:N``. A :class:`~stalebound.train.trainer.Trainer` built by hand trains the
    model where it is (place it with ``load_model(path, device=...)``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute precision of the trainer's forward passes (mixed precision: the weights and the
    optimizer stay float32). ``float16`` needs a CUDA device (it adds a gradient scaler)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, about a
    third more compute per step)."""
    micro_batch_tokens: int | None = None
    """The most padded tokens (rows × longest row) one forward/backward pass takes; a larger
    minibatch is split into micro-batches whose gradients are accumulated before the optimizer
    step, so a step computes what one big batch would (up to float rounding). A row longer than
    the budget is a micro-batch of its own. ``None`` runs each minibatch in one pass;
    ``stalebound train`` with ``engine.model_path`` naming a user's checkpoint defaults to
    16384."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """How ``world_size`` trainer ranks share a step (see docs/scale-out.md). ``ddp``: each rank
    holds a full replica and torch's ``DistributedDataParallel`` averages the gradients (at world
    size 1 the trainer runs in the job's own process). ``fsdp``: ``fully_shard`` (FSDP2) shards
    the parameters, gradients and optimizer state across the ranks, per transformer block; with
    ``dtype`` bfloat16 the blocks compute in bfloat16 while reductions, master weights and AdamW
    state stay float32. Ranks on the CPU meet over gloo, on GPUs over NCCL."""
    world_size: int = 1
    """Trainer ranks, one process each (``backend: local``) or one Ray actor each (``backend:
    ray``); each step's groups are split across them. ``rollout.consumer_batch_size`` must be a
    multiple of it."""
    rank_timeout_s: float = 600.0
    """How long a rank waits for the others in a collective (the process group's timeout), and
    the driver for a rank's reply beyond it, before the group is stopped with an error."""
    compile: bool = False
    """Run the trainer's forward passes through ``torch.compile`` (off: compiling costs minutes at
    start and gains little on small models)."""
    seed: int = 0
    """Seed of warm start's shuffling and sampling."""
    warm_start_steps: int = 40
    """Supervised steps on the task's reference answers before RL (0 skips warm start).
    ``stalebound train`` with ``engine.model_path`` naming a user's checkpoint defaults to 0: a
    pretrained model gets warm start only when this is set."""
    warm_start_batch_size: int = 64
    """Samples per warm-start step."""
    warm_start_lr: float = 3e-3
    """AdamW learning rate of warm start."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of every weight (``rank`` > 0; the ``peft`` extra)."""

    def problems(self) -> list[str]:
        """Every invalid setting, each as ``name=value: why; the fix``."""
        p: list[str] = []
        if not 0 < self.lr < math.inf:
            p.append(f"train.lr={self.lr}: must be a finite number > 0 (1e-3 suits the tiny model)")
        if not 0 <= self.weight_decay < math.inf:
            p.append(f"train.weight_decay={self.weight_decay}: must be a finite number >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            p.append(
                f"train.betas={list(self.betas)}: must be two numbers in [0, 1), e.g. [0.9, 0.99]"
            )
        if self.grad_clip is not None and not 0 < self.grad_clip < math.inf:
            p.append(
                f"train.grad_clip={self.grad_clip}: must be a finite number > 0, or null to not clip"
            )
        if self.minibatches < 1:
            p.append(f"train.minibatches={self.minibatches}: must be >= 1")
        if not 0 < self.clip_eps < 1:
            p.append(f"train.clip_eps={self.clip_eps}: must be in (0, 1); 0.2 is usual")
        if self.clip_eps_high is not None and not 0 < self.clip_eps_high < math.inf:
            p.append(
                f"train.clip_eps_high={self.clip_eps_high}: must be a finite number > 0 (0.28 is "
                "DAPO's)"
            )
        if self.prox_mode not in ("recompute", "loglinear", "none"):
            p.append(f"train.prox_mode={self.prox_mode!r}: use recompute, loglinear or none")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            p.append(f"train.tis_cap={self.tis_cap}: must be >= 1 (2 is usual), or null")
        if self.tis_cap is not None and self.prox_mode == "none":
            p.append(
                f"train.tis_cap={self.tis_cap} with prox_mode='none': the behaviour weight is 1 "
                "without a proximal policy; set prox_mode to recompute or loglinear, or tis_cap "
                "to null"
            )
        if self.rejection not in ("none", "token", "sequence"):
            p.append(f"train.rejection={self.rejection!r}: use none, token or sequence")
        if not 0 <= self.rejection_low < 1 < self.rejection_high:
            p.append(
                f"train.rejection_low={self.rejection_low}, rejection_high="
                f"{self.rejection_high}: need 0 <= low < 1 < high"
            )
        if self.loss_agg not in ("token-mean", "seq-mean-token-mean"):
            p.append(f"train.loss_agg={self.loss_agg!r}: use token-mean or seq-mean-token-mean")
        if not 0 <= self.adv_eps < math.inf:
            p.append(f"train.adv_eps={self.adv_eps}: must be a finite number >= 0")
        if not math.isfinite(self.entropy_coef):
            p.append(f"train.entropy_coef={self.entropy_coef}: must be a finite number (0 is off)")
        if self.num_threads is not None and self.num_threads < 1:
            p.append(f"train.num_threads={self.num_threads}: must be >= 1, or null")
        p.extend(device_problems("train", self.device, self.dtype))
        if self.parallel not in ("ddp", "fsdp"):
            p.append(f"train.parallel={self.parallel!r}: use ddp or fsdp")
        if (
            isinstance(self.world_size, bool)
            or not isinstance(self.world_size, int)
            or (self.world_size < 1)
        ):
            p.append(f"train.world_size={self.world_size!r}: must be an integer >= 1 (1: one rank)")
        if not 0 < self.rank_timeout_s < math.inf:
            p.append(
                f"train.rank_timeout_s={self.rank_timeout_s}: must be a finite number of seconds "
                "> 0, e.g. 600"
            )
        if self.parallel == "fsdp" and self.dtype == "float16":
            p.append(
                "train.dtype='float16' with train.parallel=fsdp: FSDP keeps its reductions in "
                "float32 and has no gradient scaler for float16; use train.dtype=bfloat16"
            )

        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            p.append(
                f"train.micro_batch_tokens={self.micro_batch_tokens}: must be >= 1 (e.g. 16384), "
                "or null for one pass per minibatch"
            )
        if self.warm_start_steps < 0:
            p.append(f"train.warm_start_steps={self.warm_start_steps}: must be >= 0")
        if self.warm_start_batch_size < 1:
            p.append(f"train.warm_start_batch_size={self.warm_start_batch_size}: must be >= 1")
        if not 0 < self.warm_start_lr < math.inf:
            p.append(f"train.warm_start_lr={self.warm_start_lr}: must be a finite number > 0")
        if self.lora.rank and not self.lora.target_modules:
            p.append(
                "train.lora.target_modules=[]: adapters need at least one layer to attach to; "
                f"e.g. {list(DEFAULT_LORA_TARGETS)}"
            )
        return p

    def validate(self) -> TrainConfig:
        """Raise every problem at once as a :class:`ConfigError`; return ``self`` if none."""
        p = self.problems()
        if p:
            raise ConfigError(p)
        return self


@dataclass
class RunConfig:
    """The main job: how long it trains, where it writes, what it shows."""

    steps: int = field(default=60, metadata=bounds(ge=1, fix="train at least one step"))
    """Training steps (one consumed batch each)."""
    run_dir: str | None = None
    """The run directory; ``None`` makes ``runs/<date>-<time>``."""
    live: bool | None = None
    """The live terminal view: ``true`` always draws it, ``false`` prints a line per step, ``null``
    draws it on a terminal only."""
    eval_prompts: int = field(default=100, metadata=bounds(ge=1, fix="e.g. 100"))
    """Prompts of the greedy evaluation before and after RL."""
    target_reward: float = 0.6
    """The training reward (mean over the last 5 steps) that counts as reached for
    ``time_to_target_s``."""
    checkpoint: bool = True
    """Write checkpoints into ``RUN_DIR/checkpoints``: every ``checkpoint_every_steps`` steps and
    ``checkpoint_every_s`` seconds, at the end, and on SIGTERM/SIGINT (see docs/checkpoints.md)."""
    checkpoint_every_steps: int = field(
        default=20,
        metadata=bounds(ge=0, fix="e.g. 20; 0 writes one only at the end and on a signal"),
    )
    """Steps between periodic checkpoints (0: none)."""
    checkpoint_every_s: float = field(
        default=600.0, metadata=bounds(ge=0, fix="give seconds, e.g. 600; 0 turns the timer off")
    )
    """Seconds between periodic checkpoints, checked after each step (0: no timer)."""
    keep_checkpoints: int = field(
        default=2, metadata=bounds(ge=1, fix="keep at least one; 2 (the default) leaves a spare")
    )
    """How many of the newest checkpoints to keep; older ones are deleted once a new one is
    written, so a damaged newest one still leaves an intact one to resume from."""
    resume: str | None = None
    """Continue a run: its directory (the newest checkpoint in it) or one checkpoint directory
    (``RUN_DIR/checkpoints/step-000040``; later checkpoints move to ``RUN_DIR/abandoned/``).
    ``stalebound train resume=RUN_DIR`` reads the run's ``config.yaml`` first; overrides given
    with it (``run.steps=100``) still apply. A run with no checkpoint yet starts again."""
    plots: bool = True
    """Draw the PNG plots into the run directory at the end."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    trace: bool = True
    """Write ``trace.jsonl``: each episode's timing and tokens, for ``stalebound simulate
    --replay``."""
    gc_freeze: bool = True
    """Before the first step, move every object the set-up made (torch, the model, the prompts)
    into the garbage collector's permanent generation, so its full collections, which otherwise
    hold the trainer and the executor for a quarter of a second every few seconds on a CPU, visit
    only what the run makes; released when the run ends (``bench/gc_freeze.py`` measures both)."""

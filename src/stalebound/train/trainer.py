"""The built-in trainer: GRPO with off-policy corrections over any Hugging Face causal LM.

One :meth:`Trainer.step` trains on one consumed batch (groups of trajectories): it builds a padded
token batch, recomputes the current log-probs, computes the loss of
:mod:`stalebound.train.losses`, steps AdamW, increments the version and calls the publish hooks
with ``(state_dict, version)`` so engines can load the new weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from stalebound.core.errors import ConfigError
from stalebound.tasks.base import Trajectory
from stalebound.tasks.workflow import TokenizerLike
from stalebound.train.config import TrainConfig
from stalebound.train.losses import (
    FlatStats,
    PolicyLossStats,
    group_advantages,
    loglinear_proximal_logprobs,
    policy_loss,
    rejection_mask,
)

if TYPE_CHECKING:
    from stalebound.train.parallel.context import RankContext

__all__ = [
    "PublishHook",
    "RowSpan",
    "StepStats",
    "TokenBatch",
    "Trainer",
    "build_batch",
    "minibatch_parts",
    "token_logprobs",
]

log = logging.getLogger(__name__)

PublishHook = Callable[[dict[str, Tensor], int], None]
"""Called after every step with the new weights (CPU tensors) and the new version."""


@dataclass(frozen=True)
class StepStats(FlatStats):
    """What one training step did. Staleness is ``batch_version − version`` of each trained token
    (``staleness_*``) and of each trajectory's V_traj (``traj_staleness_*``)."""

    version: int
    """The trainer's version after the step."""
    batch_version: int
    """The version the batch was trained at (the consumed buffer's version)."""
    num_groups: int
    num_trajectories: int
    num_trained_tokens: int
    loss: float
    reward_mean: float
    reward_std: float
    accuracy: float
    """Mean ``acc`` metric of the trajectories (NaN if they carry none)."""
    response_length: float
    """Mean output tokens per trajectory."""
    truncated_fraction: float
    zero_advantage_fraction: float
    """Share of trajectories in groups whose rewards are all equal (no learning signal)."""
    entropy: float
    ratio_mean: float
    ratio_max: float
    ratio_min: float
    clip_fraction: float
    masked_fraction: float
    """Share of valid output tokens the loss dropped (truncation mask and rejection)."""
    behaviour_weight_mean: float
    kl_behaviour: float
    staleness_mean: float
    staleness_max: int
    traj_staleness_mean: float
    traj_staleness_max: int
    grad_norm: float
    step_time_s: float
    step_cpu_s: float = math.nan
    """The CPU seconds the training thread ran in ``step_time_s``: less than it when the thread
    was runnable and another process held its core. NaN where the thread's time does not measure
    the step (a GPU, more than one torch thread, or trainer ranks)."""


@dataclass
class TokenBatch:
    """Padded tensors of a batch. ``input_ids``/``attention_mask`` are ``[B, L]`` (right padded);
    the per-token tensors are ``[B, L − 1]``, position j describing token ``input_ids[:, j + 1]``
    (the one predicted by the logits at j)."""

    input_ids: Tensor
    attention_mask: Tensor
    targets: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    versions: Tensor
    truncated: Tensor
    """``[B]`` bool."""


def build_batch(trajectories: Sequence[Trajectory], pad_token_id: int) -> TokenBatch:
    """Pad ``prompt_ids + output_ids`` of each trajectory into one :class:`TokenBatch`; only
    output tokens with ``loss_mask`` 1 are marked for the loss."""
    if not trajectories:
        raise ConfigError("an empty batch: the trainer needs at least one trajectory")
    for t in trajectories:
        if not t.prompt_ids:
            raise ConfigError(
                f"trajectory {t.sample_id!r} has no prompt tokens; every prompt needs at least "
                "one token (prepend <bos>)"
            )
    length = max(len(t.prompt_ids) + len(t.output_ids) for t in trajectories)
    # Rows are padded as Python lists and turned into tensors once: per-row tensor writes cost
    # more than the model's forward pass at this size.
    ids_rows, attn_rows, mask_rows, behav_rows, vers_rows = [], [], [], [], []
    for t in trajectories:
        p, n = len(t.prompt_ids), len(t.output_ids)
        pad = length - p - n
        ids_rows.append(t.prompt_ids + t.output_ids + [pad_token_id] * pad)
        attn_rows.append([1] * (p + n) + [0] * pad)
        lm = t.loss_mask if t.loss_mask is not None else [1] * n
        head, tail = [0] * (p - 1), [0] * pad
        mask_rows.append(head + list(lm) + tail)
        behav_rows.append([0.0] * (p - 1) + list(t.behaviour_logprobs) + [0.0] * pad)
        vers_rows.append(head + list(t.versions) + tail)
    ids = torch.tensor(ids_rows, dtype=torch.long)
    attn = torch.tensor(attn_rows, dtype=torch.long)
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    behav = torch.tensor(behav_rows, dtype=torch.float32)
    vers = torch.tensor(vers_rows, dtype=torch.long)
    return TokenBatch(
        input_ids=ids,
        attention_mask=attn,
        targets=ids[:, 1:],
        loss_mask=mask,
        behaviour_logprobs=behav,
        versions=vers,
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
    )


@dataclass(frozen=True)
class RowSpan:
    """Where a rank's trajectories sit in the whole batch: rows ``start … start + n − 1`` of
    ``total`` (the batch's trajectories in order, every group's members together)."""

    start: int
    total: int


def minibatch_parts(n: int, minibatches: int, rows: RowSpan | None = None) -> list[Tensor]:
    """The local row indices of each minibatch: the whole batch's rows ``0 … total − 1`` in
    ``minibatches`` chunks (as :meth:`torch.Tensor.chunk` splits them; empty chunks dropped), each
    cut to this rank's ``n`` rows from ``rows.start``. A part may be empty on a rank."""
    span = rows or RowSpan(0, n)
    chunks = [c for c in torch.arange(span.total).chunk(minibatches) if c.numel()]
    return [c[(c >= span.start) & (c < span.start + n)] - span.start for c in chunks]


def _to(batch: TokenBatch, device: torch.device) -> TokenBatch:
    if device.type == "cpu":
        return batch
    return TokenBatch(**{k: v.to(device) for k, v in vars(batch).items()})


def token_logprobs(
    model: Any, input_ids: Tensor, attention_mask: Tensor, *, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities ``[B, L − 1]`` of ``input_ids[:, 1:]`` under ``model`` (temperature 1),
    and the entropy of each of those next-token distributions if asked."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logp.exp() * logp).sum(-1)
    return out, entropy


class Trainer:
    """GRPO with PPO clipping and the off-policy corrections of :class:`TrainConfig`.

    ``model`` is any Hugging Face causal LM (``model(input_ids, attention_mask).logits``); it
    trains on the device it is on (``load_model(path, device=...)`` places it; the job does so from
    ``train.device``), with the forward passes in ``config.dtype`` (mixed precision).
    ``tokenizer`` supplies the padding id (its ``pad_token_id``, else ``eos_token_id``). The trainer
    owns an AdamW optimizer over the model's parameters. ``version`` is the policy version of the
    model's current weights; each :meth:`step` makes it ``version + 1``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerLike | None = None,
        config: TrainConfig | None = None,
        *,
        version: int = 0,
        pad_token_id: int | None = None,
        rank: RankContext | None = None,
    ) -> None:
        self.config = (config or TrainConfig()).validate()
        self.rank = rank
        """The data-parallel group this trainer is one rank of (``None``: it trains alone)."""
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.lora = bool(self.config.lora.rank)
        """Whether only low-rank adapters are trained (``train.lora``; in this process only)."""
        if self.lora:
            from stalebound.train.lora import lora_with_ranks, with_adapters

            if rank is not None:
                raise ConfigError(lora_with_ranks(self.config.lora.rank))
            model = with_adapters(model, self.config.lora)
        self.model = model
        pad = pad_token_id
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id
            if pad is None:
                pad = tokenizer.eos_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        self._version = version
        self._hooks: list[PublishHook] = []
        c = self.config
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=c.lr,
            betas=c.betas,
            weight_decay=c.weight_decay,
        )
        self.device = next(model.parameters()).device
        if c.dtype == "float16" and self.device.type != "cuda":
            raise ConfigError(
                f"train.dtype='float16' with the model on {self.device}: float16 needs a CUDA "
                "device; use bfloat16 or float32 on the CPU"
            )
        autocast = rank is None or rank.autocast  # an FSDP policy casts the parameters itself
        self._autocast_dtype = (
            None if c.dtype == "float32" or not autocast else getattr(torch, c.dtype)
        )
        # float16 gradients underflow without loss scaling; bfloat16 has float32's range
        self._scaler = torch.amp.GradScaler("cuda") if c.dtype == "float16" else None
        if c.gradient_checkpointing:  # renamed in newer transformers
            enable = getattr(model, "activation_checkpointing_enable", None)
            # the non-reentrant form (transformers 5's default): the reentrant one does not run
            # FSDP's hooks when it recomputes
            (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
            if self.lora:  # the frozen embeddings give the recomputed blocks no gradient input
                model.enable_input_require_grads()
        forward = model if rank is None else rank.forward
        self._forward: Any = torch.compile(forward) if c.compile else forward

    @property
    def version(self) -> int:
        """The policy version of the model's current weights."""
        return self._version

    def publish(self, callback: PublishHook) -> None:
        """Call ``callback(state_dict, version)`` after every step (in registration order)."""
        self._hooks.append(callback)

    def state_dict_for_engines(self) -> dict[str, Tensor]:
        """A snapshot of the model's weights, detached and contiguous: CPU tensors for a model on
        the CPU; for a model on a GPU, copies on that GPU, so an engine on the same device takes
        them without a round trip through the CPU (others copy them over themselves)."""
        if self.lora:
            from stalebound.train.lora import merged_state_dict

            return merged_state_dict(self.model)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's whole state, for ``trainer_state.pt``."""
        state: dict[str, Any] = self.optimizer.state_dict()
        return state

    def save_optimizer(self, checkpoint: Path) -> None:
        """The adapter, when training one (``checkpoint/adapter``); nothing else beside
        :meth:`optimizer_state` (trainer ranks write their shards here)."""
        if self.lora:
            from stalebound.train.lora import save_adapter

            save_adapter(self.model, checkpoint)

    def load_optimizer(self, checkpoint: Path, state: Mapping[str, Any] | None) -> None:
        """Continue from ``checkpoint``'s optimizer state: ``state`` (a checkpoint of a trainer
        alone) or the shards trainer ranks wrote (any world size)."""
        from stalebound.train.parallel.checkpoint import load_optimizer

        if self.lora:
            from stalebound.train.lora import has_adapter, load_adapter

            if not has_adapter(checkpoint):
                raise ConfigError(
                    f"{checkpoint}: the checkpoint holds no adapter (it was written with "
                    "train.lora.rank=0); resume it with train.lora.rank=0"
                )
            load_adapter(self.model, checkpoint)
        load_optimizer(self.model, self.optimizer, checkpoint, state)

    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """:func:`token_logprobs` of the trained model as a step computes them (its device, its
        ``dtype``, compiled if ``compile`` is set)."""
        if self._autocast_dtype is None:  # float32: no autocast context at all
            return token_logprobs(
                self._forward, input_ids, attention_mask, with_entropy=with_entropy
            )
        with torch.autocast(self.device.type, dtype=self._autocast_dtype):
            return token_logprobs(
                self._forward, input_ids, attention_mask, with_entropy=with_entropy
            )

    def _micro_batches(self, rows: Tensor, lengths: list[int]) -> list[Tensor]:
        """Split ``rows`` into micro-batches whose padded size (rows × longest) fits
        ``micro_batch_tokens``, taking the rows shortest first so that rows of like length share
        a pass (a long-tailed batch then pads little); a row longer than the budget runs alone."""
        budget = self.config.micro_batch_tokens
        if budget is None:
            return [rows]
        out: list[list[int]] = [[]]
        longest = 0
        for r in sorted(rows.tolist(), key=lambda r: lengths[r]):
            longest_with = max(longest, lengths[r])
            if out[-1] and (len(out[-1]) + 1) * longest_with > budget:
                out.append([])
                longest_with = lengths[r]
            out[-1].append(r)
            longest = longest_with
        return [torch.tensor(m, dtype=torch.long) for m in out]

    # -- one training step ---------------------------------------------------------------------
    def step(
        self,
        groups: Sequence[Sequence[Trajectory]],
        *,
        batch_version: int | None = None,
        rows: RowSpan | None = None,
    ) -> StepStats:
        """Train on ``groups`` (the consumed batch), bump the version, publish, return stats.

        ``batch_version`` is the version the batch is trained at (staleness is measured against
        it); ``None`` means the trainer's current version.

        On a rank of a data-parallel group, ``groups`` are this rank's share of the batch and
        ``rows`` places them in it. The step then computes what one trainer would on the whole
        batch: each minibatch is the same chunk of the whole batch's rows, every loss is divided
        by the whole minibatch's normaliser (kept tokens or sequences, summed over the ranks), and
        the returned statistics are the whole batch's, the same on every rank.
        """
        t0, cpu0 = time.perf_counter(), time.thread_time()
        c = self.config
        v = self._version if batch_version is None else batch_version
        trajs = [t for g in groups for t in g]
        if not trajs:
            raise ConfigError("step() got no trajectories; pass at least one non-empty group")
        group_of = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        adv = group_advantages(rewards, group_of, eps=c.adv_eps, scale_by_std=c.adv_scale_by_std)
        batch = _to(build_batch(trajs, self.pad_token_id), self.device)
        adv = adv.to(self.device)
        valid = batch.loss_mask
        seq_keep = (~batch.truncated).float() if c.mask_truncated else torch.ones(len(trajs))
        train_mask = valid * seq_keep.to(self.device)[:, None]
        lengths = batch.attention_mask.sum(-1).tolist()
        with_entropy = c.compute_entropy or c.entropy_coef > 0

        self.model.train()
        prox_all: Tensor | None = None
        if c.prox_mode == "recompute" and c.minibatches > 1:
            with torch.no_grad():
                prox_all = self._recompute(batch, lengths)

        parts = minibatch_parts(len(trajs), c.minibatches, rows)
        weights = [float(train_mask[p].sum()) for p in parts]
        if self.rank is not None:
            weights = self.rank.all_sum(weights)
        total_w = sum(weights) or 1.0
        acc: dict[str, float] = {}
        grad_norms: list[float] = []
        ratio_max, ratio_min = -math.inf, math.inf
        for k, part in enumerate(parts):
            self.optimizer.zero_grad(set_to_none=True)
            micros: list[Tensor | None] = []
            if part.numel():  # a rank's part of a minibatch may be empty
                micros += self._micro_batches(part, lengths)
            if self.rank is not None:  # every rank enters as many passes as the busiest one
                passes = int(self.rank.all_max([len(micros)])[0])
                micros += [None] * (passes - len(micros))
            part_mask = train_mask[part]
            norms = self._part_norms(
                batch, lengths, micros, train_mask, part_mask, k, len(parts), v, prox_all
            )
            # Each micro-batch's loss is weighed by its share of the part's normaliser (trained
            # tokens, or sequences with one), so the accumulated gradient is the whole part's.
            if c.loss_agg == "token-mean":
                part_norm = float(part_mask.sum())
            else:
                part_norm = float((part_mask.sum(-1) > 0).sum())
            for j, idx in enumerate(micros):
                with self._accumulating(defer=j < len(micros) - 1):
                    if idx is None:
                        assert self.rank is not None
                        self.rank.stand_in_pass(self.pad_token_id, backward=True)
                        continue
                    width = max(lengths[i] for i in idx.tolist())
                    m = train_mask[idx, : width - 1]
                    ids = batch.input_ids[idx, :width]
                    lp, ent = self.logprobs(
                        ids, batch.attention_mask[idx, :width], with_entropy=with_entropy
                    )
                    behav = batch.behaviour_logprobs[idx, : width - 1]
                    prox = self._proximal(lp, batch, idx, width, k, len(parts), v, prox_all)
                    loss, st = self._policy_loss(lp, behav, adv[idx], m, prox, ent)
                    share = 1.0
                    if norms is not None:
                        mine = st.num_tokens if c.loss_agg == "token-mean" else st.num_sequences
                        share = mine / norms.policy if norms.policy else 0.0
                        loss = loss * share
                    elif len(micros) > 1:
                        if c.loss_agg == "token-mean":
                            share = (
                                float(m.sum()) / part_norm if part_norm else len(idx) / len(part)
                            )
                        else:
                            share = float((m.sum(-1) > 0).sum()) / part_norm if part_norm else 0.0
                        loss = loss * share
                    if c.entropy_coef > 0 and ent is not None:
                        ent_norm = part_mask.sum().clamp(min=1) if norms is None else norms.tokens
                        loss = loss - c.entropy_coef * (ent * m).sum() / max(float(ent_norm), 1.0)
                    if self.rank is not None:  # DDP and FSDP average the ranks' gradients
                        loss = loss * self.rank.world_size
                    if self._scaler is not None:
                        loss = self._scaler.scale(loss)
                    loss.backward()  # type: ignore[no-untyped-call]
                    w = float(m.sum()) / total_w
                    keep_w = (
                        w if norms is None else st.num_tokens / norms.kept * weights[k] / total_w
                    )
                    self._accumulate(acc, st, w, share * weights[k] / total_w, keep_w)
                    if st.num_tokens or float(m.sum()):
                        ratio_max = max(ratio_max, st.ratio_max)
                        ratio_min = min(ratio_min, st.ratio_min)
            if self._scaler is not None:
                self._scaler.unscale_(self.optimizer)
            clip = c.grad_clip if c.grad_clip is not None else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            grad_norms.append(self.rank.norm_value(norm) if self.rank is not None else float(norm))
            if self._scaler is not None:
                self._scaler.step(self.optimizer)
                self._scaler.update()
            else:
                self.optimizer.step()

        self._version += 1
        stats = self._stats(
            trajs, groups, batch, train_mask, acc, ratio_max, ratio_min, v, grad_norms, t0, cpu0
        )
        if self._hooks:
            weights_now = self.state_dict_for_engines()
            for hook in self._hooks:
                hook(weights_now, self._version)
        return stats

    def _accumulating(self, *, defer: bool) -> contextlib.AbstractContextManager[None]:
        if self.rank is None:
            return contextlib.nullcontext()
        return self.rank.accumulating(defer)

    def _proximal(
        self,
        lp: Tensor,
        batch: TokenBatch,
        idx: Tensor,
        width: int,
        k: int,
        parts: int,
        v: int,
        prox_all: Tensor | None,
    ) -> Tensor | None:
        """The proximal log-probs of micro-batch ``idx`` of part ``k`` (``None``: none)."""
        c = self.config
        if c.prox_mode == "none":
            return None
        if c.prox_mode == "recompute":
            return lp.detach() if prox_all is None else prox_all[idx, : width - 1]
        return loglinear_proximal_logprobs(
            batch.behaviour_logprobs[idx, : width - 1],
            lp,
            batch.versions[idx, : width - 1],
            proximal_version=v,
            current_version=v + k / parts,
        )

    def _policy_loss(
        self,
        lp: Tensor,
        behav: Tensor,
        adv: Tensor,
        mask: Tensor,
        prox: Tensor | None,
        entropy: Tensor | None,
    ) -> tuple[Tensor, PolicyLossStats]:
        c = self.config
        return policy_loss(
            lp,
            behav,
            adv,
            mask,
            proximal_logprobs=prox,
            clip_eps=c.clip_eps,
            clip_eps_high=c.clip_eps_high,
            tis_cap=c.tis_cap,
            rejection=c.rejection,
            rejection_low=c.rejection_low,
            rejection_high=c.rejection_high,
            entropy=entropy,
            loss_agg=c.loss_agg,
        )

    def _part_norms(
        self,
        batch: TokenBatch,
        lengths: list[int],
        micros: list[Tensor | None],
        train_mask: Tensor,
        part_mask: Tensor,
        k: int,
        parts: int,
        v: int,
        prox_all: Tensor | None,
    ) -> _PartNorms | None:
        """A data-parallel part's normalisers over all ranks (``None`` for a trainer alone).
        Which tokens rejection keeps depends on the current weights, so with rejection on it
        takes one pass without gradients over this rank's micro-batches first."""
        if self.rank is None:
            return None
        c = self.config
        kept = float(part_mask.sum())
        sequences = float((part_mask.sum(-1) > 0).sum())
        if c.rejection != "none":
            kept = sequences = 0.0
            with torch.no_grad():
                for idx in micros:
                    if idx is None:
                        self.rank.stand_in_pass(self.pad_token_id, backward=False)
                        continue
                    width = max(lengths[i] for i in idx.tolist())
                    m = train_mask[idx, : width - 1]
                    lp, _ = self.logprobs(
                        batch.input_ids[idx, :width],
                        batch.attention_mask[idx, :width],
                        with_entropy=False,
                    )
                    behav = batch.behaviour_logprobs[idx, : width - 1]
                    prox = self._proximal(lp, batch, idx, width, k, parts, v, prox_all)
                    log_rho = (lp if prox is None else prox) - behav
                    keep = rejection_mask(
                        log_rho, m, level=c.rejection, low=c.rejection_low, high=c.rejection_high
                    )
                    kept += float(keep.sum())
                    sequences += float((keep.sum(-1) > 0).sum())
        policy = kept if c.loss_agg == "token-mean" else sequences
        policy, tokens, kept = self.rank.all_sum([policy, float(part_mask.sum()), kept])
        return _PartNorms(policy=policy, tokens=tokens, kept=kept)

    def _recompute(self, batch: TokenBatch, lengths: list[int]) -> Tensor:
        """Log-probs of the whole batch under the current weights, micro-batch by micro-batch
        (on a rank, as many passes as the busiest rank's)."""
        out = torch.zeros_like(batch.behaviour_logprobs)
        micros = self._micro_batches(torch.arange(len(lengths)), lengths)
        for idx in micros:
            width = max(lengths[i] for i in idx.tolist())
            lp, _ = self.logprobs(
                batch.input_ids[idx, :width], batch.attention_mask[idx, :width], with_entropy=False
            )
            out[idx, : width - 1] = lp
        if self.rank is not None:
            for _ in range(int(self.rank.all_max([len(micros)])[0]) - len(micros)):
                self.rank.stand_in_pass(self.pad_token_id, backward=False)
        return out

    @staticmethod
    def _accumulate(
        acc: dict[str, float], st: PolicyLossStats, w: float, loss_w: float, keep_w: float
    ) -> None:
        """Add a micro-batch's statistics: its loss by its share of the step's loss ``loss_w``,
        means over its valid tokens by its share ``w`` of the step's trained tokens, means over
        its kept tokens by ``keep_w``."""
        if not math.isnan(st.loss):
            acc["loss"] = acc.get("loss", 0.0) + loss_w * st.loss
        for key, weight in (
            ("ratio_mean", w),
            ("clip_fraction", keep_w),
            ("behaviour_weight_mean", keep_w),
            ("kl_behaviour", w),
            ("entropy", w),
        ):
            value = getattr(st, key)
            if not math.isnan(value):
                acc[key] = acc.get(key, 0.0) + weight * value
        acc["num_tokens"] = acc.get("num_tokens", 0.0) + st.num_tokens

    def _stats(
        self,
        trajs: list[Trajectory],
        groups: Sequence[Sequence[Trajectory]],
        batch: TokenBatch,
        train_mask: Tensor,
        acc: dict[str, float],
        ratio_max: float,
        ratio_min: float,
        v: int,
        grad_norms: list[float],
        t0: float,
        cpu0: float,
    ) -> StepStats:
        """The step's statistics from sums over this trainer's trajectories (over all ranks'
        on a rank of a data-parallel group)."""
        trained = train_mask.bool()
        tok_stale = (v - batch.versions)[trained]
        traj_stale = [v - t.v_traj for t in trajs]
        accs = [t.metrics["acc"] for t in trajs if "acc" in t.metrics]
        rewards = [t.reward for t in trajs]
        sums = {
            "groups": float(len(groups)),
            "trajs": float(len(trajs)),
            "reward": sum(rewards),
            "reward_sq": sum(r * r for r in rewards),
            "acc_n": float(len(accs)),
            "acc": sum(accs),
            "out_len": float(sum(len(t.output_ids) for t in trajs)),
            "truncated": float(sum(t.truncated for t in trajs)),
            "zero_adv": float(sum(len(g) for g in groups if len({t.reward for t in g}) <= 1)),
            "valid": float(batch.loss_mask.sum()),
            "tok_stale": float(tok_stale.float().sum()),
            "tok_stale_n": float(tok_stale.numel()),
            "traj_stale": float(sum(traj_stale)),
            "num_tokens": acc.get("num_tokens", 0.0),
        }
        for key in _MEANS:  # a mean no micro-batch measured stays NaN
            sums[key] = acc.get(key, 0.0)
            sums[f"{key}?"] = float(key in acc)
        highs = {
            "ratio_max": ratio_max,
            "ratio_min": -ratio_min,
            "tok_stale_max": float(tok_stale.max()) if tok_stale.numel() else -math.inf,
            "traj_stale_max": float(max(traj_stale)),
        }
        if self.rank is not None:
            sums = dict(zip(sums, self.rank.all_sum(list(sums.values())), strict=True))
            highs = dict(zip(highs, self.rank.all_max(list(highs.values())), strict=True))
        nan = float("nan")
        n = sums["trajs"]
        mean_r = sums["reward"] / n
        mean = {key: sums[key] if sums[f"{key}?"] else nan for key in _MEANS}
        high, low = highs["ratio_max"], -highs["ratio_min"]
        n_valid = sums["valid"]
        return StepStats(
            version=self._version,
            batch_version=v,
            num_groups=int(sums["groups"]),
            num_trajectories=int(n),
            num_trained_tokens=int(sums["num_tokens"]),
            loss=sums["loss"] if sums["loss?"] else 0.0,
            reward_mean=mean_r,
            reward_std=math.sqrt(max(0.0, sums["reward_sq"] / n - mean_r**2)),
            accuracy=sums["acc"] / sums["acc_n"] if sums["acc_n"] else nan,
            response_length=sums["out_len"] / n,
            truncated_fraction=sums["truncated"] / n,
            zero_advantage_fraction=sums["zero_adv"] / n,
            entropy=mean["entropy"],
            ratio_mean=mean["ratio_mean"],
            ratio_max=high if math.isfinite(high) else nan,
            ratio_min=low if math.isfinite(low) else nan,
            clip_fraction=sums["clip_fraction"],
            masked_fraction=1.0 - sums["num_tokens"] / n_valid if n_valid else 0.0,
            behaviour_weight_mean=mean["behaviour_weight_mean"],
            kl_behaviour=mean["kl_behaviour"],
            staleness_mean=sums["tok_stale"] / sums["tok_stale_n"] if sums["tok_stale_n"] else 0.0,
            staleness_max=int(highs["tok_stale_max"]) if sums["tok_stale_n"] else 0,
            traj_staleness_mean=sums["traj_stale"] / n,
            traj_staleness_max=int(highs["traj_stale_max"]),
            grad_norm=sum(grad_norms) / len(grad_norms),
            step_time_s=time.perf_counter() - t0,
            step_cpu_s=(
                time.thread_time() - cpu0
                if self.device.type == "cpu" and torch.get_num_threads() == 1
                else math.nan
            ),
        )


_MEANS = ("loss", "ratio_mean", "clip_fraction", "behaviour_weight_mean", "kl_behaviour", "entropy")
"""The step's token means, accumulated micro-batch by micro-batch (see ``Trainer._accumulate``)."""


@dataclass(frozen=True)
class _PartNorms:
    """A minibatch's normalisers over all ranks of a data-parallel group."""

    policy: float
    """The policy loss's: kept tokens (``token-mean``) or sequences with one."""
    tokens: float
    """Trained tokens before rejection (the entropy bonus's)."""
    kept: float
    """Kept tokens after rejection (what the clip fraction and the weight mean average over)."""

"""The built-in trainer: GRPO with off-policy corrections over any Hugging Face causal LM.

One :meth:`Trainer.step` trains on one consumed batch (groups of trajectories): it builds a padded
token batch, recomputes the current log-probs, computes the loss of
:mod:`stalebound.train.losses`, steps AdamW, increments the version and calls the publish hooks
with ``(state_dict, version)`` so engines can load the new weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from stalebound.core.errors import ConfigError
from stalebound.tasks.base import Trajectory
from stalebound.tasks.workflow import TokenizerLike
from stalebound.train.config import TrainConfig
from stalebound.train.losses import (
    PolicyLossStats,
    group_advantages,
    loglinear_proximal_logprobs,
    policy_loss,
)

__all__ = ["PublishHook", "StepStats", "TokenBatch", "Trainer", "build_batch", "token_logprobs"]

log = logging.getLogger(__name__)

PublishHook = Callable[[dict[str, Tensor], int], None]
"""Called after every step with the new weights (CPU tensors) and the new version."""


@dataclass(frozen=True)
class StepStats:
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

    def as_dict(self) -> dict[str, float]:
        """The statistics as a flat mapping (for metrics files and TensorBoard)."""
        return {k: float(v) for k, v in asdict(self).items()}


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
    ) -> None:
        self.config = (config or TrainConfig()).validate()
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
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
        self._autocast_dtype = None if c.dtype == "float32" else getattr(torch, c.dtype)
        # float16 gradients underflow without loss scaling; bfloat16 has float32's range
        self._scaler = torch.amp.GradScaler("cuda") if c.dtype == "float16" else None
        if c.gradient_checkpointing:  # renamed in newer transformers
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
        self._forward: Any = torch.compile(model) if c.compile else model

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
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

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
        """Split ``rows`` (in order) into runs whose padded size (rows × longest) fits
        ``micro_batch_tokens``; a row longer than the budget runs alone."""
        budget = self.config.micro_batch_tokens
        if budget is None:
            return [rows]
        out: list[list[int]] = [[]]
        longest = 0
        for r in rows.tolist():
            longest_with = max(longest, lengths[r])
            if out[-1] and (len(out[-1]) + 1) * longest_with > budget:
                out.append([])
                longest_with = lengths[r]
            out[-1].append(r)
            longest = longest_with
        return [torch.tensor(m, dtype=torch.long) for m in out]

    # -- one training step ---------------------------------------------------------------------
    def step(
        self, groups: Sequence[Sequence[Trajectory]], *, batch_version: int | None = None
    ) -> StepStats:
        """Train on ``groups`` (the consumed batch), bump the version, publish, return stats.

        ``batch_version`` is the version the batch is trained at (staleness is measured against
        it); ``None`` means the trainer's current version.
        """
        t0 = time.perf_counter()
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

        parts = [p for p in torch.arange(len(trajs)).chunk(c.minibatches) if p.numel()]
        weights = [float(train_mask[p].sum()) for p in parts]
        total_w = sum(weights) or 1.0
        acc: dict[str, float] = {}
        grad_norms: list[float] = []
        ratio_max, ratio_min = -math.inf, math.inf
        for k, part in enumerate(parts):
            self.optimizer.zero_grad(set_to_none=True)
            micros = self._micro_batches(part, lengths)
            part_mask = train_mask[part]
            # Each micro-batch's loss is weighed by its share of the part's normaliser (trained
            # tokens, or sequences with one), so the accumulated gradient is the whole part's.
            if c.loss_agg == "token-mean":
                part_norm = float(part_mask.sum())
            else:
                part_norm = float((part_mask.sum(-1) > 0).sum())
            for idx in micros:
                width = max(lengths[i] for i in idx.tolist())
                m = train_mask[idx, : width - 1]
                ids = batch.input_ids[idx, :width]
                lp, ent = self.logprobs(
                    ids, batch.attention_mask[idx, :width], with_entropy=with_entropy
                )
                behav = batch.behaviour_logprobs[idx, : width - 1]
                prox: Tensor | None
                if c.prox_mode == "none":
                    prox = None
                elif c.prox_mode == "recompute":
                    prox = lp.detach() if prox_all is None else prox_all[idx, : width - 1]
                else:
                    prox = loglinear_proximal_logprobs(
                        behav,
                        lp,
                        batch.versions[idx, : width - 1],
                        proximal_version=v,
                        current_version=v + k / len(parts),
                    )
                loss, st = policy_loss(
                    lp,
                    behav,
                    adv[idx],
                    m,
                    proximal_logprobs=prox,
                    clip_eps=c.clip_eps,
                    clip_eps_high=c.clip_eps_high,
                    tis_cap=c.tis_cap,
                    rejection=c.rejection,
                    rejection_low=c.rejection_low,
                    rejection_high=c.rejection_high,
                    entropy=ent,
                    loss_agg=c.loss_agg,
                )
                share = 1.0
                if len(micros) > 1:
                    if c.loss_agg == "token-mean":
                        share = float(m.sum()) / part_norm if part_norm else len(idx) / len(part)
                    else:
                        share = float((m.sum(-1) > 0).sum()) / part_norm if part_norm else 0.0
                    loss = loss * share
                if c.entropy_coef > 0 and ent is not None:
                    loss = loss - c.entropy_coef * (ent * m).sum() / part_mask.sum().clamp(min=1)
                if self._scaler is not None:
                    loss = self._scaler.scale(loss)
                loss.backward()  # type: ignore[no-untyped-call]
                self._accumulate(acc, st, float(m.sum()) / total_w, share * weights[k] / total_w)
                if st.num_tokens or float(m.sum()):
                    ratio_max = max(ratio_max, st.ratio_max)
                    ratio_min = min(ratio_min, st.ratio_min)
            if self._scaler is not None:
                self._scaler.unscale_(self.optimizer)
            clip = c.grad_clip if c.grad_clip is not None else float("inf")
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)))
            if self._scaler is not None:
                self._scaler.step(self.optimizer)
                self._scaler.update()
            else:
                self.optimizer.step()

        self._version += 1
        stats = self._stats(
            trajs, groups, batch, train_mask, acc, ratio_max, ratio_min, v, grad_norms, t0
        )
        if self._hooks:
            weights_now = self.state_dict_for_engines()
            for hook in self._hooks:
                hook(weights_now, self._version)
        return stats

    def _recompute(self, batch: TokenBatch, lengths: list[int]) -> Tensor:
        """Log-probs of the whole batch under the current weights, micro-batch by micro-batch."""
        out = torch.zeros_like(batch.behaviour_logprobs)
        for idx in self._micro_batches(torch.arange(len(lengths)), lengths):
            width = max(lengths[i] for i in idx.tolist())
            lp, _ = self.logprobs(
                batch.input_ids[idx, :width], batch.attention_mask[idx, :width], with_entropy=False
            )
            out[idx, : width - 1] = lp
        return out

    @staticmethod
    def _accumulate(acc: dict[str, float], st: PolicyLossStats, w: float, loss_w: float) -> None:
        """Add a micro-batch's statistics: token means weighed by its share of the step's trained
        tokens ``w``, its loss by its share of the step's loss ``loss_w``."""
        if not math.isnan(st.loss):
            acc["loss"] = acc.get("loss", 0.0) + loss_w * st.loss
        for key in (
            "ratio_mean",
            "clip_fraction",
            "behaviour_weight_mean",
            "kl_behaviour",
            "entropy",
        ):
            value = getattr(st, key)
            if not math.isnan(value):
                acc[key] = acc.get(key, 0.0) + w * value
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
    ) -> StepStats:
        rewards = [t.reward for t in trajs]
        valid = batch.loss_mask
        trained = train_mask.bool()
        tok_stale = (v - batch.versions)[trained]
        traj_stale = [v - t.v_traj for t in trajs]
        accs = [t.metrics["acc"] for t in trajs if "acc" in t.metrics]
        n_valid = float(valid.sum())
        zero_adv = sum(len(g) for g in groups if len({t.reward for t in g}) <= 1)
        nan = float("nan")
        mean_r = sum(rewards) / len(rewards)
        return StepStats(
            version=self._version,
            batch_version=v,
            num_groups=len(groups),
            num_trajectories=len(trajs),
            num_trained_tokens=int(acc.get("num_tokens", 0)),
            loss=acc.get("loss", 0.0),
            reward_mean=mean_r,
            reward_std=math.sqrt(sum((r - mean_r) ** 2 for r in rewards) / len(rewards)),
            accuracy=sum(accs) / len(accs) if accs else nan,
            response_length=sum(len(t.output_ids) for t in trajs) / len(trajs),
            truncated_fraction=sum(t.truncated for t in trajs) / len(trajs),
            zero_advantage_fraction=zero_adv / len(trajs),
            entropy=acc.get("entropy", nan),
            ratio_mean=acc.get("ratio_mean", nan),
            ratio_max=ratio_max if math.isfinite(ratio_max) else nan,
            ratio_min=ratio_min if math.isfinite(ratio_min) else nan,
            clip_fraction=acc.get("clip_fraction", 0.0),
            masked_fraction=1.0 - acc.get("num_tokens", 0.0) / n_valid if n_valid else 0.0,
            behaviour_weight_mean=acc.get("behaviour_weight_mean", nan),
            kl_behaviour=acc.get("kl_behaviour", nan),
            staleness_mean=float(tok_stale.float().mean()) if tok_stale.numel() else 0.0,
            staleness_max=int(tok_stale.max()) if tok_stale.numel() else 0,
            traj_staleness_mean=sum(traj_stale) / len(traj_stale),
            traj_staleness_max=max(traj_stale),
            grad_norm=sum(grad_norms) / len(grad_norms),
            step_time_s=time.perf_counter() - t0,
        )

"""GRPO advantages and the PPO policy loss with off-policy corrections (pure torch, no model).

Shapes: per-token tensors are ``[B, T]`` (B sequences, T response positions, padded); ``mask`` is
1 where a token is trained (a generated token of a kept sequence), 0 at padding, prompt and tool
tokens. Advantages are ``[B]`` (one per sequence) or ``[B, T]``.

The corrections, all switchable (see :class:`~stalebound.train.config.TrainConfig`):

* **Behaviour log-probs** ``log π_behav`` come from the engine, per token (the weights of the
  version that sampled the token).
* **Decoupled PPO**: the PPO ratio is taken against a *proximal* policy π_prox (recent weights),
  and the off-policyness between π_prox and π_behav is corrected by the importance weight
  ``w = π_prox / π_behav`` (detached). π_prox is either recomputed or approximated with
  :func:`loglinear_proximal_logprobs`.
* **Truncated importance sampling** caps that weight: ``w = min(w, tis_cap)``.
* **Rejection** masks tokens (or whole sequences) whose behaviour ratio ρ falls outside bounds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from stalebound.core.errors import ConfigError

__all__ = [
    "PolicyLossStats",
    "group_advantages",
    "loglinear_proximal_logprobs",
    "policy_loss",
    "rejection_mask",
]


def group_advantages(
    rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """GRPO advantages: ``(r − mean_g) / (std_g + eps)`` within each group g.

    ``rewards`` ``[N]`` float, ``group_index`` ``[N]`` int (any labels). The standard deviation is
    the unbiased (Bessel-corrected) one, as in GRPO implementations; a group of one member has std
    0. A group whose members all have the same reward gets advantage exactly 0. With
    ``scale_by_std=False`` the advantage is ``r − mean_g`` (Dr. GRPO).
    """
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ConfigError(
            f"rewards shape {tuple(rewards.shape)} and group_index shape "
            f"{tuple(group_index.shape)}: both must be the same 1-D shape, one entry per trajectory"
        )
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_index, return_inverse=True)
    k = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, r) / count
    centred = r - mean[inverse]
    if not scale_by_std:
        return centred.to(rewards.dtype)
    sq = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, centred**2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return (centred / (std[inverse] + eps)).to(rewards.dtype)


def loglinear_proximal_logprobs(
    behaviour_logprobs: Tensor,
    current_logprobs: Tensor,
    behaviour_versions: Tensor,
    *,
    proximal_version: float,
    current_version: float,
) -> Tensor:
    """Approximate ``log π_prox`` without a forward pass, interpolating log-linearly in versions::

        α = (proximal_version − v_behav) / (current_version − v_behav), clamped to [0, 1]
        log π_prox ≈ log π_behav + α · (log π_θ − log π_behav)

    where ``v_behav`` is each token's behaviour version, π_θ the current weights (at
    ``current_version``, which may be fractional between optimizer steps of one training step)
    and π_prox the weights at ``proximal_version``. It assumes a token's log-probability moves
    linearly in the version between the behaviour and the current weights. A token with
    ``v_behav ≥ current_version`` gets α = 1 (π_prox = π_θ). The result is detached.
    """
    vb = behaviour_versions.to(torch.float64)
    span = current_version - vb
    alpha = torch.where(
        span > 0, (proximal_version - vb) / span.clamp(min=1e-12), torch.ones_like(vb)
    ).clamp(0.0, 1.0)
    b = behaviour_logprobs.detach()
    return (b + alpha.to(b.dtype) * (current_logprobs.detach() - b)).detach()


def rejection_mask(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    level: Literal["none", "token", "sequence"],
    low: float,
    high: float,
) -> Tensor:
    """Which tokens to keep (float 0/1, ``[B, T]``) given the behaviour log-ratio ``log ρ``.

    ``token``: keep a token iff ``low ≤ ρ ≤ high``. ``sequence``: keep all of a sequence's tokens
    iff the geometric mean of ρ over its masked tokens, ``exp(mean log ρ)``, is within bounds.
    ``none``: keep everything. Masked-out positions stay 0.
    """
    m = mask.to(log_ratio.dtype)
    if level == "none":
        return m
    lo = float("-inf") if low <= 0 else float(torch.log(torch.tensor(low)))
    hi = float(torch.log(torch.tensor(high)))
    lr = log_ratio.detach()
    if level == "token":
        return m * ((lr >= lo) & (lr <= hi)).to(m.dtype)
    if level == "sequence":
        n = m.sum(-1).clamp(min=1)
        seq = (lr * m).sum(-1) / n
        keep = ((seq >= lo) & (seq <= hi)).to(m.dtype)
        return m * keep[:, None]
    raise ConfigError(f"rejection={level!r}: use none, token or sequence")


class FlatStats:
    """Statistics of a dataclass as a flat mapping of floats (metrics files and TensorBoard)."""

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(cast(Any, self)).items()}


@dataclass(frozen=True)
class PolicyLossStats(FlatStats):
    """What one policy-loss evaluation measured (floats, detached).

    ``ratio_*`` describe ρ = π_θ / π_behav, current weights against the behaviour policy, over the
    tokens before rejection; ``behaviour_weight_mean`` is the mean applied weight w (1 without a
    proximal policy); ``clip_fraction`` the share of kept tokens whose PPO term was clipped;
    ``masked_fraction`` the share of valid tokens the loss dropped (rejection and any sequence mask
    the caller applied through ``mask``) — here, by rejection; ``kl_behaviour`` the k3 estimate of
    KL(π_behav ‖ π_θ) on the sampled tokens; ``entropy`` the mean given entropy (NaN if none).
    """

    loss: float
    num_tokens: int
    num_sequences: int
    """Sequences with at least one kept token (the normaliser of ``seq-mean-token-mean``)."""
    ratio_mean: float
    ratio_max: float
    ratio_min: float
    clip_fraction: float
    masked_fraction: float
    behaviour_weight_mean: float
    kl_behaviour: float
    entropy: float


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return (x * m).sum() / m.sum().clamp(min=1)


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    proximal_logprobs: Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    tis_cap: float | None = None,
    rejection: Literal["none", "token", "sequence"] = "none",
    rejection_low: float = 0.5,
    rejection_high: float = 2.0,
    entropy: Tensor | None = None,
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean",
) -> tuple[Tensor, PolicyLossStats]:
    """The clipped policy-gradient loss with off-policy corrections (see the module docstring).

    ``logprobs`` (with gradient) are the current policy's; ``behaviour_logprobs`` the engine's;
    ``proximal_logprobs`` (detached; ``None`` means π_prox = π_behav, plain PPO) the proximal
    policy's. Per kept token::

        r = exp(logprobs − log π_prox)
        w = min(exp(log π_prox − log π_behav), tis_cap)          (1 without a proximal policy)
        loss_t = w · max(−A·r, −A·clip(r, 1 − clip_eps, 1 + clip_eps_high))

    Rejection uses ρ = π_prox/π_behav (π_θ/π_behav without a proximal policy). ``token-mean``
    averages over all kept tokens; ``seq-mean-token-mean`` per sequence, then over sequences with
    a kept token. Returns ``(loss, stats)``; with no kept token the loss is 0 (still
    differentiable).
    """
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != mask.shape:
        raise ConfigError(
            f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs "
            f"{tuple(behaviour_logprobs.shape)} and mask {tuple(mask.shape)}: must be the same "
            "[B, T] shape"
        )
    hi_eps = clip_eps if clip_eps_high is None else clip_eps_high
    m = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logprobs)
    behav = behaviour_logprobs.to(logprobs.dtype).detach()
    if proximal_logprobs is None:
        old = behav
        log_rho = logprobs.detach() - behav
        weight = torch.ones_like(logprobs)
    else:
        old = proximal_logprobs.to(logprobs.dtype).detach()
        log_rho = old - behav
        weight = torch.exp(log_rho)
        if tis_cap is not None:
            weight = weight.clamp(max=tis_cap)
    keep = rejection_mask(log_rho, m, level=rejection, low=rejection_low, high=rejection_high)

    ratio = torch.exp(logprobs - old)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + hi_eps)
    per_token = torch.maximum(pg1, pg2) * weight * keep
    if loss_agg == "token-mean":
        loss = per_token.sum() / keep.sum().clamp(min=1)
    elif loss_agg == "seq-mean-token-mean":
        n = keep.sum(-1)
        per_seq = per_token.sum(-1) / n.clamp(min=1)
        loss = per_seq.sum() / (n > 0).sum().clamp(min=1)
    else:
        raise ConfigError(f"loss_agg={loss_agg!r}: use token-mean or seq-mean-token-mean")

    with torch.no_grad():
        valid = m.sum()
        lr_cur = (logprobs.detach() - behav) * m
        rho = torch.exp(lr_cur)
        has = bool(valid > 0)
        big, small = torch.finfo(rho.dtype).max, torch.finfo(rho.dtype).min
        stats = PolicyLossStats(
            loss=float(loss.detach()),
            num_tokens=int(keep.sum().item()),
            num_sequences=int((keep.sum(-1) > 0).sum().item()),
            ratio_mean=float(_masked_mean(rho, m)) if has else float("nan"),
            ratio_max=float(torch.where(m > 0, rho, small).max()) if has else float("nan"),
            ratio_min=float(torch.where(m > 0, rho, big).min()) if has else float("nan"),
            clip_fraction=float(_masked_mean((pg2 > pg1).to(m.dtype), keep)),
            masked_fraction=float(1.0 - keep.sum() / valid) if has else 0.0,
            behaviour_weight_mean=float(_masked_mean(weight, keep)),
            kl_behaviour=float(_masked_mean(rho - 1.0 - lr_cur, m)) if has else float("nan"),
            entropy=float(_masked_mean(entropy.detach(), m))
            if entropy is not None and has
            else float("nan"),
        )
    return loss, stats

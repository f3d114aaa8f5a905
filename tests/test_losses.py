"""Losses against hand-computed values."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from stalebound.core.errors import ConfigError  # noqa: E402
from stalebound.train.losses import (  # noqa: E402
    group_advantages,
    loglinear_proximal_logprobs,
    policy_loss,
    rejection_mask,
)

torch.set_num_threads(1)
T = torch.tensor
ln = math.log


def test_group_advantages_mean_std_per_group() -> None:
    r = T([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    g = T([7, 7, 7, 7, 3, 3])
    a = group_advantages(r, g, eps=0.0)
    # group 7: mean 0.25, unbiased std sqrt(0.75/3)=0.5
    assert a[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # group 3: mean 3, std sqrt(2)
    assert a[4:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    d = group_advantages(r, g, scale_by_std=False)
    assert d.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])


def test_group_advantages_zero_variance_and_singletons_are_zero() -> None:
    a = group_advantages(T([1.0, 1.0, 1.0, 0.0, 0.5]), T([0, 0, 0, 1, 2]))
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="same 1-D shape"):
        group_advantages(T([1.0, 2.0]), T([0]))


def test_plain_ppo_clipping_hand_computed() -> None:
    # ratios exp(lp - behav) = 1.5, 0.5, 1.1 ; advantages +1, +1, -1 ; eps 0.2
    behav = T([[0.0, 0.0, 0.0]]).log_softmax(-1) * 0 + T([[ln(0.2), ln(0.4), ln(0.5)]])
    lp = T([[ln(0.3), ln(0.2), ln(0.55)]], requires_grad=True)
    adv = T([[1.0, 1.0, -1.0]])
    loss, st = policy_loss(lp, behav, adv, torch.ones(1, 3), clip_eps=0.2)
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(-0.5, -0.8) = -0.5;
    # token 3: max(1.1, 1.1) = 1.1
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3)
    assert st.clip_fraction == pytest.approx(1 / 3)
    assert st.ratio_max == pytest.approx(1.5) and st.ratio_min == pytest.approx(0.5)
    assert st.ratio_mean == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert st.masked_fraction == 0.0 and st.behaviour_weight_mean == 1.0
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)) / 3
    assert st.kl_behaviour == pytest.approx(kl)
    loss.backward()
    # clipped token has no gradient; d/dlp of -A*r = -A*r
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, -0.5 / 3, 1.1 / 3])


def test_clip_higher_and_negative_advantage_clip() -> None:
    behav = torch.zeros(1, 2)
    lp = T([[ln(1.25), ln(0.7)]])
    adv = T([1.0, 1.0])[:1]  # per-sequence advantage, broadcast
    loss, st = policy_loss(lp, behav, adv, torch.ones(1, 2), clip_eps=0.2, clip_eps_high=0.28)
    # 1.25 < 1.28 unclipped → -1.25 ; 0.7: max(-0.7, -0.8) = -0.7
    assert loss.item() == pytest.approx((-1.25 - 0.7) / 2)
    assert st.clip_fraction == 0.0
    loss2, st2 = policy_loss(lp, behav, T([-1.0]), torch.ones(1, 2), clip_eps=0.2)
    # A<0: 1.25 → max(1.25, 1.2)=1.25 ; 0.7 → max(0.7, 0.8) = 0.8 (clipped)
    assert loss2.item() == pytest.approx((1.25 + 0.8) / 2)
    assert st2.clip_fraction == pytest.approx(0.5)


def test_decoupled_ratio_and_tis_cap() -> None:
    behav = T([[ln(0.1), ln(0.5)]])
    prox = T([[ln(0.4), ln(0.5)]])  # w = 4.0 and 1.0
    lp = T([[ln(0.44), ln(0.45)]], requires_grad=True)  # r = 1.1 and 0.9
    adv = T([2.0])
    loss, st = policy_loss(lp, behav, adv, torch.ones(1, 2), proximal_logprobs=prox, tis_cap=None)
    assert loss.item() == pytest.approx((4.0 * -2 * 1.1 + 1.0 * -2 * 0.9) / 2)
    assert st.behaviour_weight_mean == pytest.approx(2.5)
    capped, st_c = policy_loss(
        lp, behav, adv, torch.ones(1, 2), proximal_logprobs=prox, tis_cap=2.0
    )
    assert capped.item() == pytest.approx((2.0 * -2 * 1.1 + 1.0 * -2 * 0.9) / 2)
    assert st_c.behaviour_weight_mean == pytest.approx(1.5)
    capped.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([2.0 * -2 * 1.1 / 2, -2 * 0.9 / 2])
    # ratio stats are current vs behaviour: 4.4 and 0.9
    assert st_c.ratio_max == pytest.approx(4.4) and st_c.ratio_min == pytest.approx(0.9)


def test_decoupled_clip_is_against_the_proximal_policy() -> None:
    behav = T([[ln(0.1)]])
    prox = T([[ln(0.4)]])
    lp = T([[ln(0.6)]])  # r vs prox 1.5 → clipped to 1.2 ; vs behav it would be 6
    loss, st = policy_loss(
        lp, behav, T([1.0]), torch.ones(1, 1), proximal_logprobs=prox, tis_cap=2.0
    )
    assert loss.item() == pytest.approx(-2.0 * 1.2)
    assert st.clip_fraction == 1.0


def test_token_rejection_mask() -> None:
    lr = torch.log(T([[0.4, 1.0, 2.5, 1.9], [3.0, 1.0, 1.0, 1.0]]))
    m = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    keep = rejection_mask(lr, m, level="token", low=0.5, high=2.0)
    assert keep.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
    assert rejection_mask(lr, m, level="none", low=0.5, high=2.0).tolist() == m.tolist()


def test_sequence_rejection_uses_the_geometric_mean() -> None:
    # seq 0: geometric mean of 0.4, 1, 2.5 = 1 → kept ; seq 1: (3·1·1·1)^(1/4) ≈ 1.316 → kept
    # seq 2: (4·4)^(1/2) = 4 → rejected ; the 4th token of seq 0 is padding (ignored)
    lr = torch.log(T([[0.4, 1.0, 2.5, 100.0], [3.0, 1.0, 1.0, 1.0], [4.0, 4.0, 1.0, 1.0]]))
    m = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    keep = rejection_mask(lr, m, level="sequence", low=0.5, high=2.0)
    assert keep.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_rejection_in_the_loss_counts_masked_tokens() -> None:
    behav = torch.log(T([[0.5, 0.1, 0.5]]))
    lp = torch.log(T([[0.5, 0.5, 0.55]]))  # ρ = 1, 5, 1.1
    loss, st = policy_loss(
        lp,
        behav,
        T([1.0]),
        torch.ones(1, 3),
        rejection="token",
        rejection_low=0.5,
        rejection_high=2.0,
    )
    # token 2 rejected; tokens 1, 3: -1, -1.1 → mean over 2 kept tokens
    assert loss.item() == pytest.approx((-1.0 - 1.1) / 2)
    assert st.masked_fraction == pytest.approx(1 / 3) and st.num_tokens == 2


def test_loss_aggregation_modes_and_padding() -> None:
    behav = torch.zeros(2, 3)
    lp = torch.zeros(2, 3)  # ratio 1 everywhere → per-token loss = -A
    adv = T([1.0, 3.0])
    m = T([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    tok, _ = policy_loss(lp, behav, adv, m)
    assert tok.item() == pytest.approx(-(1 + 3 * 3) / 4)
    seq, _ = policy_loss(lp, behav, adv, m, loss_agg="seq-mean-token-mean")
    assert seq.item() == pytest.approx(-(1 + 3) / 2)
    empty, st = policy_loss(lp, behav, adv, torch.zeros(2, 3))
    assert empty.item() == 0.0 and st.num_tokens == 0 and math.isnan(st.ratio_mean)


def test_entropy_stat_and_shape_errors() -> None:
    _, st = policy_loss(
        torch.zeros(1, 2), torch.zeros(1, 2), T([1.0]), T([[1.0, 0.0]]), entropy=T([[0.7, 9.0]])
    )
    assert st.entropy == pytest.approx(0.7)
    with pytest.raises(ConfigError, match="same"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), T([1.0]), torch.ones(1, 2))


def test_loglinear_proximal_approximation() -> None:
    behav = T([[ln(0.2), ln(0.2), ln(0.2), ln(0.2)]])
    cur = T([[ln(0.6), ln(0.6), ln(0.6), ln(0.6)]])
    versions = T([[2, 4, 5, 6]])
    prox = loglinear_proximal_logprobs(behav, cur, versions, proximal_version=5, current_version=6)
    # α = (5-2)/(6-2) = 0.75 ; (5-4)/(6-4) = 0.5 ; (5-5)/1 = 0 ; v_b = current → α = 1
    d = ln(0.6) - ln(0.2)
    expected = [ln(0.2) + 0.75 * d, ln(0.2) + 0.5 * d, ln(0.2), ln(0.6)]
    assert prox[0].tolist() == pytest.approx(expected)
    # at the start of a step (current == proximal version) it is the current policy
    same = loglinear_proximal_logprobs(behav, cur, versions, proximal_version=6, current_version=6)
    assert same[0].tolist() == pytest.approx(cur[0].tolist())
    assert not same.requires_grad

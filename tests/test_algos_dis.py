"""DIS policy loss (spec §3, Eq. 8-9) and its clipped form for Li2SAO's bootstrap (spec §4)."""

import math

import torch
from torch.testing import assert_close

from async_rl.algos import dis_mask, dis_policy_loss


def test_hand_computed_loss_and_exact_zero_gradient_outside_interval():
    behaviour = torch.zeros(1, 5)
    # ratios 0.5, 1.0, 2.0, 7.0 on model tokens, last position is padding
    log_prob = torch.tensor([[math.log(0.5), 0.0, math.log(2.0), math.log(7.0), 0.0]], requires_grad=True)
    adv = torch.ones(1, 5)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, metrics = dis_policy_loss(log_prob, behaviour, adv, mask)
    # kept: ratios 1.0 and 2.0 -> loss = -(1 + 2) / 4 model tokens = -0.75
    assert_close(loss, torch.tensor(-0.75))
    loss.backward()
    # d(-ρA)/d log π = -ρA / 4 inside, exactly 0 outside
    assert log_prob.grad.tolist() == [[0.0, -0.25, -0.5, 0.0, 0.0]]
    assert metrics["actor/dis_masked_frac"] == 0.5
    # kept ratios 1 and 2: k3 = (0 + (2 - 1 - ln 2)) / 2; ppo_kl (k1) over all four: -(ln .5 + ln 2 + ln 7) / 4
    assert math.isclose(metrics["actor/dis_kept_kl"], (1 - math.log(2.0)) / 2, rel_tol=1e-6)
    assert math.isclose(metrics["actor/ppo_kl"], -math.log(7.0) / 4, rel_tol=1e-6)


def test_kept_kl_ignores_the_masked_tokens_that_dominate_ppo_kl():
    # one token whose probability collapsed (ratio e^-8, masked) among 19 unchanged ones
    behaviour = torch.zeros(1, 20)
    log_prob = torch.zeros(1, 20)
    log_prob[0, 0] = -8.0
    _, metrics = dis_policy_loss(log_prob, behaviour, torch.ones(1, 20), torch.ones(1, 20))
    assert math.isclose(metrics["actor/ppo_kl"], 8.0 / 20, rel_tol=1e-6)
    assert metrics["actor/dis_kept_kl"] == 0.0


def test_clipped_variant_is_pessimistic_and_still_masked():
    behaviour = torch.zeros(1, 3)
    log_prob = torch.log(torch.tensor([[1.5, 0.9, 0.6]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, _ = dis_policy_loss(log_prob, behaviour, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    # token 0: max(-1.5, -1.28) = -1.28 (clipped, no grad); token 1: A<0, max(0.9, 0.9) = 0.9;
    # token 2: ratio 0.6 < 0.7 -> DIS drops it.  loss = (-1.28 + 0.9) / 3
    assert_close(loss, torch.tensor((-1.28 + 0.9) / 3))
    loss.backward()
    assert_close(log_prob.grad, torch.tensor([[0.0, 0.9 / 3, 0.0]]))


def test_matches_verl_rollout_correction_icepop_token_mask():
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    g = torch.Generator().manual_seed(0)
    bs, T = 16, 32
    behaviour = -torch.rand(bs, T, generator=g) * 3
    log_prob = behaviour + torch.randn(bs, T, generator=g) * 1.2  # ratios spread across both bounds
    adv = torch.randn(bs, T, generator=g)
    mask = (torch.rand(bs, T, generator=g) > 0.2).float()
    weights, _ = compute_rollout_correction_weights(
        log_prob - behaviour, mask, rollout_is="token", rollout_is_threshold="0.7_6.0"
    )
    ours_keep = dis_mask(log_prob - behaviour) * mask
    assert torch.equal(ours_keep.bool(), weights > 0)
    assert 0.1 < 1 - ours_keep.sum() / mask.sum() < 0.9  # the inputs really exercise the mask
    # per-token DIS loss equals -A times verl's IcePop weight
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = dis_policy_loss(lp, behaviour, adv, mask, loss_agg_mode="token-mean")
    assert_close(loss, (-adv * weights * mask).sum() / mask.sum(), atol=1e-5, rtol=1e-5)
    # Eq. 1's default: the mean over trajectories of each trajectory's token mean
    loss, _ = dis_policy_loss(lp, behaviour, adv, mask)
    per_traj = (-adv * weights * mask).sum(1) / mask.sum(1)
    assert_close(loss, per_traj.mean(), atol=1e-5, rtol=1e-5)


def test_rejects_interval_without_one():
    try:
        dis_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), low=1.1)
    except ValueError as err:
        assert "(0.7, 6.0)" in str(err)
    else:
        raise AssertionError("expected ValueError")

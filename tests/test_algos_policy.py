"""Eq. 1's aggregation and clip, Eq. 5's critic loss, and how the learner picks them (spec §2-§4)."""

import math

import pytest
import torch
from torch.testing import assert_close

from async_rl.algos import (
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    dis_policy_loss,
    loss_normaliser_count,
    squared_value_loss,
)

# one 1-token trajectory with A = +1 and one 3-token trajectory with A = -1, all ratios 1
MASK = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([[1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])


def test_eq1_is_the_mean_over_trajectories_of_token_means():
    log_prob = torch.zeros(2, 3, requires_grad=True)
    loss, _ = clipped_policy_loss(log_prob, torch.zeros(2, 3), ADV, MASK)
    # trajectory means: -1 (row 0) and +1 (row 1) -> (−1 + 1) / 2 = 0
    assert_close(loss, torch.tensor(0.0))
    loss.backward()
    # d/dlogπ of -ρA / L_i / N at ρ = 1: row 0: -1/1/2 = -0.5; row 1: +1/3/2 = 0.1667 per token
    assert_close(log_prob.grad, torch.tensor([[-0.5, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]]))


def test_token_mean_is_the_named_ablation():
    log_prob = torch.zeros(2, 3, requires_grad=True)
    loss, _ = clipped_policy_loss(log_prob, torch.zeros(2, 3), ADV, MASK, loss_agg_mode="token-mean")
    # (-1 + 3) / 4 tokens = 0.5; every token's gradient is -A / 4
    assert_close(loss, torch.tensor(0.5))
    loss.backward()
    assert_close(log_prob.grad, torch.tensor([[-0.25, 0.0, 0.0], [0.25, 0.25, 0.25]]))


def test_dis_loss_uses_the_same_aggregation():
    log_prob = torch.zeros(2, 3, requires_grad=True)
    loss, _ = dis_policy_loss(log_prob, torch.zeros(2, 3), ADV, MASK)
    assert_close(loss, torch.tensor(0.0))
    # a DIS-masked token still counts in its trajectory's length: ratio 7 on row 1's first token
    lp = torch.tensor([[0.0, 0.0, 0.0], [math.log(7.0), 0.0, 0.0]])
    loss, _ = dis_policy_loss(lp, torch.zeros(2, 3), ADV, MASK)
    # row 0: -1; row 1: (0 + 1 + 1) / 3 -> (-1 + 2/3) / 2
    assert_close(loss, torch.tensor((-1 + 2 / 3) / 2))


def test_empty_trajectory_is_left_out_and_normaliser_counts():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss_mat = torch.tensor([[2.0, 4.0], [100.0, 100.0]])
    # only row 0 counts: its mean 3 over one trajectory
    assert_close(aggregate_loss(loss_mat, mask), torch.tensor(3.0))
    assert float(loss_normaliser_count(mask)) == 1.0
    assert float(loss_normaliser_count(mask, "token-mean")) == 2.0
    # a global normaliser (e.g. 4 trajectories on all ranks) replaces the local count
    assert_close(aggregate_loss(loss_mat, mask, loss_normaliser=4.0), torch.tensor(0.75))


def test_shards_with_global_normaliser_sum_to_the_full_batch():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.randn(6, 5, generator=g)
    behaviour = -torch.rand(6, 5, generator=g)
    lp = behaviour + 0.3 * torch.randn(6, 5, generator=g)
    full, _ = clipped_policy_loss(lp, behaviour, adv, mask)
    n = loss_normaliser_count(mask)
    parts = [clipped_policy_loss(lp[r], behaviour[r], adv[r], mask[r], loss_normaliser=n)[0]
             for r in (slice(0, 2), slice(2, 3), slice(3, 6))]
    assert_close(sum(parts), full)


def test_no_dual_clip_unlike_verl_vanilla():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import async_rl  # noqa: F401  (registers ppo_clip)

    # A = -1, ratio 5: Eq. 1 gives max(5, 1.28) = 5; dual clip (c = 3) caps it at 3
    lp = torch.tensor([[math.log(5.0)]])
    adv = -torch.ones(1, 1)
    ours, _ = clipped_policy_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1))
    assert_close(ours, torch.tensor(5.0))
    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                            "global_batch_info": {}})
    vanilla, _ = get_policy_loss_fn("vanilla")(torch.zeros(1, 1), lp, adv, torch.ones(1, 1), "token-mean", cfg)
    assert_close(vanilla, torch.tensor(3.0))
    registered, _ = get_policy_loss_fn("ppo_clip")(torch.zeros(1, 1), lp, adv, torch.ones(1, 1),
                                                   "seq-mean-token-mean", cfg)
    assert_close(registered, torch.tensor(5.0))


def test_registered_losses_follow_verl_global_batch_info():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import async_rl  # noqa: F401

    lp = torch.zeros(2, 3)
    # verl divides by the global count and multiplies by dp_size: 2 ranks, 4 trajectories in all -> sum / 2
    cfg = OmegaConf.create({"clip_ratio": 0.2, "global_batch_info": {"global_batch_size": 4, "dp_size": 2}})
    for name in ("ppo_clip", "dis", "dis_clip"):
        loss, _ = get_policy_loss_fn(name)(torch.zeros(2, 3), lp, ADV, MASK, "seq-mean-token-mean", cfg)
        assert_close(loss, torch.tensor((-1.0 + 1.0) / 2)), name
    cfg = OmegaConf.create({"clip_ratio": 0.2, "global_batch_info": {"batch_num_tokens": 8, "dp_size": 2}})
    loss, _ = get_policy_loss_fn("ppo_clip")(torch.zeros(2, 3), lp, ADV, MASK, "token-mean", cfg)
    assert_close(loss, torch.tensor(2.0 / 4))  # token sum 2 / (8 / 2)


def test_eq5_plain_squared_error_vs_eq10_clip():
    values = torch.tensor([[0.5, 1.5, 9.0]], requires_grad=True)
    targets = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = squared_value_loss(values, targets, mask)
    # ((0.5 - 1)^2 + (1.5 - 1)^2) / 2 = 0.25; the masked token adds nothing
    assert_close(loss, torch.tensor(0.25))
    loss.backward()
    assert_close(values.grad, torch.tensor([[-0.5, 0.5, 0.0]]))  # 2 (V - G) / 2
    assert metrics["critic/vf_clipfrac"] == 0.0
    # Eq. 10 around V_old = 0 with ε_v = 0.2: V̄ = [0.2, 0.2] -> max((−.5)², (−.8)²), max(.5², (−.8)²) = .64 each
    clipped, _ = clipped_value_loss(values.detach(), torch.zeros(1, 3), targets, mask, 0.2)
    assert_close(clipped, torch.tensor(0.64))


@pytest.mark.parametrize("normaliser", [0, 0.0, torch.tensor(0.0)])
def test_a_zero_global_count_gives_a_zero_loss_not_nan(normaliser):
    """An all-masked batch on every rank sums loss_normaliser_count to 0: the loss is 0 (0 / max(0, 1))."""
    from async_rl.algos import aggregate_loss, clipped_value_loss, dis_policy_loss, loss_normaliser_count
    from async_rl.algos.policy import clipped_policy_loss, squared_value_loss

    mask = torch.zeros(2, 3)
    x = torch.randn(2, 3, requires_grad=True)
    assert float(loss_normaliser_count(mask)) == 0.0
    losses = [
        aggregate_loss(x, mask, "seq-mean-token-mean", normaliser),
        aggregate_loss(x, mask, "token-mean", normaliser),
        dis_policy_loss(x, torch.zeros(2, 3), torch.ones(2, 3), mask, loss_normaliser=normaliser)[0],
        clipped_policy_loss(x, torch.zeros(2, 3), torch.ones(2, 3), mask, loss_normaliser=normaliser)[0],
        clipped_value_loss(x, torch.zeros(2, 3), torch.ones(2, 3), mask, loss_normaliser=normaliser)[0],
        squared_value_loss(x, torch.ones(2, 3), mask, loss_normaliser=normaliser)[0],
    ]
    for loss in losses:
        assert float(loss) == 0.0
        loss.backward()
        assert torch.isfinite(x.grad).all()

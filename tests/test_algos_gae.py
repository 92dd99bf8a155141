"""Skip-observation GAE with length-adaptive λ (spec §3)."""

import pytest
import torch
from torch.testing import assert_close

from async_rl.algos import (
    discounted_reverse_cumsum,
    length_adaptive_lambda,
    masked_whiten,
    sao_gae,
    skip_observation_gae,
)


def _loop_reference(rewards, values, mask, lam, gamma=1.0):
    """Plain per-sample loop over model tokens, written straight from Eq. 6-7."""
    bs, T = rewards.shape
    adv = torch.zeros(bs, T, dtype=torch.float64)
    for i in range(bs):
        pos = [t for t in range(T) if mask[i, t] > 0]
        running = 0.0
        for j in reversed(range(len(pos))):
            nxt = values[i, pos[j + 1]].item() if j + 1 < len(pos) else 0.0
            delta = rewards[i, pos[j]].item() + gamma * nxt - values[i, pos[j]].item()
            running = delta + gamma * float(lam[i]) * running
            adv[i, pos[j]] = running
    return adv


def test_multi_turn_hand_computed():
    # model tokens at 0, 1, 4; observation tokens at 2, 3 (their values must be ignored)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.8]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, ret = skip_observation_gae(rewards, values, mask, lam=0.5)
    # δ0 = 0.4-0.5 = -0.1, δ1 = 0.8-0.4 = 0.4, δ4 = 1-0.8 = 0.2
    # A4 = 0.2, A1 = 0.4 + 0.5*0.2 = 0.5, A0 = -0.1 + 0.5*0.5 = 0.15
    assert_close(adv, torch.tensor([[0.15, 0.5, 0.0, 0.0, 0.2]]), atol=1e-6, rtol=0)
    # critic returns use λ = 1: telescoping gives R = 1 on every model token
    assert_close(ret, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]), atol=1e-6, rtol=0)


def test_length_one_trajectory_and_empty_row():
    mask = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.3, 5.0, 5.0], [1.0, 1.0, 1.0]])
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lam = length_adaptive_lambda(mask)
    # L = 1: λ = 1 - 1/1.5 = 1/3; L = 0: clamped to 0
    assert_close(lam, torch.tensor([1 / 3, 0.0]))
    adv, ret = skip_observation_gae(rewards, values, mask, lam=lam)
    assert_close(adv, torch.tensor([[0.7, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(ret, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_length_adaptive_lambda_values():
    mask = torch.zeros(3, 10)
    mask[0, :3] = 1  # L = 3: 1 - 1/4.5
    mask[1, :10] = 1  # L = 10: 1 - 1/15
    mask[2, [0, 5]] = 1  # L = 2 with a gap: 1 - 1/3
    assert_close(length_adaptive_lambda(mask), torch.tensor([1 - 1 / 4.5, 1 - 1 / 15, 2 / 3]))


def test_random_batches_match_loop_with_per_trajectory_lambda_and_many_blocks():
    g = torch.Generator().manual_seed(0)
    bs, T = 6, 150
    mask = (torch.rand(bs, T, generator=g) > 0.35).double()
    values = torch.randn(bs, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(bs, T, generator=g, dtype=torch.float64) * mask
    lam = length_adaptive_lambda(mask).double()
    for block in (7, 64, 200):
        adv, _ = skip_observation_gae(rewards, values, mask, lam=lam, block=block)
        assert_close(adv, _loop_reference(rewards, values, mask, lam), atol=1e-9, rtol=0)


def test_observation_tokens_do_not_change_advantages():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(1, 6, generator=g)
    rewards = torch.zeros(1, 6)
    rewards[0, -1] = 1.0
    mask = torch.ones(1, 6)
    adv, _ = skip_observation_gae(rewards, values, mask, lam=0.9)
    # insert three observation tokens with arbitrary values after position 2
    v_obs = torch.cat([values[:, :3], torch.tensor([[7.0, -7.0, 3.0]]), values[:, 3:]], dim=1)
    r_obs = torch.cat([rewards[:, :3], torch.zeros(1, 3), rewards[:, 3:]], dim=1)
    m_obs = torch.cat([mask[:, :3], torch.zeros(1, 3), mask[:, 3:]], dim=1)
    adv_obs, _ = skip_observation_gae(r_obs, v_obs, m_obs, lam=0.9)
    assert_close(adv_obs[m_obs.bool()], adv[mask.bool()])
    assert (adv_obs[~m_obs.bool()] == 0).all()


def test_matches_verl_gae_with_whitening_on_observation_spans():
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    g = torch.Generator().manual_seed(5)
    bs, T = 8, 40
    mask = torch.ones(bs, T)
    mask[:, 10:15] = 0  # an observation span
    mask[:4, 30:] = 0  # shorter responses
    values = torch.randn(bs, T, generator=g)
    rewards = torch.zeros(bs, T)
    last = torch.tensor([29] * 4 + [39] * 4)
    rewards[torch.arange(bs), last] = torch.randint(0, 2, (bs,), generator=g).float()
    ref_adv, ref_ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
    adv, _ = skip_observation_gae(rewards, values, mask, lam=0.95, whiten=True)
    assert_close(adv * mask, ref_adv * mask, atol=1e-4, rtol=0)
    _, ret = skip_observation_gae(rewards, values, mask, lam=0.95, critic_lam=0.95)
    assert_close(ret * mask, ref_ret * mask, atol=1e-4, rtol=0)


def test_discounted_reverse_cumsum_zero_decay_and_whiten_statistics():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert_close(discounted_reverse_cumsum(x, 0.0), x)
    assert_close(discounted_reverse_cumsum(x, 1.0), torch.tensor([[6.0, 5.0, 3.0]]))
    w = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    # mean 2, unbiased var 1 -> [-1, 0, 1], masked entry 0
    assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


def test_sao_gae_whitens_and_returns_absolute_return():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.5, 2.0, 0.4, 0.6]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    adv, ret = sao_gae(rewards, values, mask)
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-6 and abs(valid.std().item() - 1.0) < 1e-3


def test_scan_levels_and_per_row_decays_match_the_recursion():
    """Several recursion levels (M = 1000, block 4: 250 -> 63 -> 16 -> 4 heads), one decay per row including
    0 and 1, against the step-by-step recursion in float64."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 1000, generator=g, dtype=torch.float64)
    decay = torch.tensor([0.0, 0.5, 0.97, 1.0], dtype=torch.float64)
    ref = torch.zeros_like(x)
    running = torch.zeros(4, dtype=torch.float64)
    for j in range(999, -1, -1):
        running = x[:, j] + decay * running
        ref[:, j] = running
    assert_close(discounted_reverse_cumsum(x, decay, block=4), ref, atol=1e-9, rtol=1e-12)
    # equal decays take the shared-matrix path: same answer as passing the float
    same = torch.full((4,), 0.9, dtype=torch.float64)
    assert_close(discounted_reverse_cumsum(x, same, block=16), discounted_reverse_cumsum(x, 0.9, block=16))


def test_scan_rejects_bad_block_and_decay_shape():
    x = torch.ones(3, 8)
    with pytest.raises(ValueError, match="block must be >= 2"):
        discounted_reverse_cumsum(x, 0.5, block=1)
    with pytest.raises(ValueError, match="one entry per row"):
        discounted_reverse_cumsum(x, torch.ones(2), block=4)

"""Diagnostics: explained variance, policy lag and off-policy ratio, unbiased pass@k."""

import math

import pytest
import numpy as np
import torch

from async_rl.algos import explained_variance, pass_at_k, policy_lag_stats


def test_explained_variance():
    g = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(g, g, mask) == 1.0
    assert explained_variance(torch.zeros_like(g), g, mask) == 0.0
    # V = G - [1, -1, 0]: Var(G - V) = 2/3, Var(G) = 2/3 -> 0
    v = g - torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    assert abs(explained_variance(v, g, mask)) < 1e-12
    assert math.isnan(explained_variance(g, torch.ones_like(g), mask))


def test_policy_lag_and_off_policy_ratio():
    versions = torch.tensor([[3, 3, 2], [1, 1, 0]])
    stats = policy_lag_stats(versions, 3, torch.ones(2, 3))
    # lags [0, 0, 1, 2, 2, 3]: mean 8/6; lag > 1 on 3 of 6 tokens
    assert abs(stats["async/policy_lag/mean"] - 8 / 6) < 1e-12
    assert stats["async/off_policy_token_ratio"] == 0.5
    assert stats["async/policy_lag/max"] == 3.0


def test_pass_at_k():
    # n = 4, c = 1, k = 2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert abs(pass_at_k(4, [1], 2)[0] - 0.5) < 1e-12
    out = pass_at_k(16, np.array([0, 16, 8]), 1)
    assert out.tolist()[:2] == [0.0, 1.0] and abs(out[2] - 0.5) < 1e-12
    # large n stays finite and exact: 1 - C(999, 1)/C(1000, 1) = 0.001
    assert abs(pass_at_k(1000, [1], 1)[0] - 0.001) < 1e-12
    assert abs(pass_at_k(2000, [3], 16)[0] - (1 - math.comb(1997, 16) / math.comb(2000, 16))) < 1e-10
    # no correct sample is exactly 0 for every n and k (lgamma's round-off gave 1.1e-16 at n = 4, k = 2, which an
    # eval table printed as pass@2 > 0 for a model that never answered right)
    for n in (2, 3, 4, 5, 8, 16, 64, 100):
        for k in range(1, n + 1):
            assert pass_at_k(n, [0], k)[0] == 0.0, (n, k)
    try:
        pass_at_k(4, [1], 8)
    except ValueError as err:
        assert "exceeds" in str(err)
    else:
        raise AssertionError("expected ValueError")


def test_mismatch_metrics_k3_abs_and_dis_band_share_by_hand():
    """log r = trainer - behaviour = [0, 0.5, -1]; only the first two tokens are at the current version:
    k3 = [0, e^0.5 - 1.5] -> mean 0.0743606, |log r| mean 0.25; the DIS band (0.7, 6) masks r = e^-1 only (1/3);
    the padded fourth position counts nowhere."""
    import math

    import torch

    from async_rl.algos.metrics import mismatch_metrics, mismatch_sums

    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    trainer = torch.tensor([[-1.0, -1.5, -1.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    current = torch.tensor([[True, True, False, True]])
    out = mismatch_metrics({k: float(v) for k, v in mismatch_sums(behaviour, trainer, mask, current, 0.7, 6.0).items()})
    assert out["rollout/mismatch_kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2, abs=1e-7)
    assert out["rollout/mismatch_abs_logprob_mean"] == pytest.approx(0.25, abs=1e-7)
    assert out["rollout/mismatch_tokens"] == 2.0 and out["rollout/dis_band_masked_frac"] == pytest.approx(1 / 3)
    empty = mismatch_sums(behaviour, trainer, mask, torch.zeros_like(current), 0.7, 6.0)
    assert mismatch_metrics({k: float(v) for k, v in empty.items()})["rollout/mismatch_kl"] == 0.0

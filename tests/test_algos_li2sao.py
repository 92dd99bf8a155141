"""Li2SAO (spec §4): residual targets, divergence mask, critic losses, readiness statistics and gate."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from async_rl.algos import (
    ReadinessGate,
    clipped_value_loss,
    divergence_mask,
    li2sao_advantage,
    li2sao_critic_loss,
    readiness_from_statistics,
    readiness_statistics,
    residual_critic_targets,
    terminal_ranking_loss,
    values_at_last_model_token,
)


def test_residual_targets_centre_by_group_and_drop_all_equal_groups():
    returns = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    ids = ["a", "a", "a", "a", "b", "b"]
    targets, keep = residual_critic_targets(returns, scores, ids, torch.ones(6, 2))
    # group a: mean 0.5 -> ±0.5; group b all zero -> dropped
    assert_close(targets[:4, 0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert keep.tolist() == [True, True, True, True, False, False]


def test_divergence_mask_shared_prefixes():
    ids = torch.tensor([
        [5, 6, 7, 8],  # R=1
        [5, 6, 9, 9],  # R=0: differs from r0 at 2
        [5, 1, 2, 3],  # R=0: differs from r0 at 1
    ])
    mask = torch.ones(3, 4)
    c = divergence_mask(ids, mask, torch.tensor([1.0, 0.0, 0.0]), [0, 0, 0])
    # d_0 = max(d(0,1)=2, d(0,2)=1) = 2; d_1 = d(1,0) = 2; d_2 = d(2,0) = 1
    assert c.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]]


def test_divergence_mask_observation_tokens_lengths_and_local_fallback():
    ids = torch.tensor([
        [5, 6, 7, 8, 0],  # g0, R=1, position 2 is an observation token
        [5, 6, 9, 9, 0],  # g0, R=0
        [5, 6, 0, 0, 0],  # g1, R=1, length 2 (a prefix of the next one)
        [5, 6, 7, 0, 0],  # g1, R=0, length 3
        [4, 4, 4, 0, 0],  # g2, R=1, nobody with another outcome in this partition
    ])
    rmask = torch.tensor([
        [1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
    ]).float()
    c = divergence_mask(ids, rmask, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), [0, 0, 1, 1, 2])
    assert c.tolist() == [
        [0, 0, 0, 1, 0],  # d = 2, the observation token gets no critic loss
        [0, 0, 1, 1, 0],
        [0, 1, 0, 0, 0],  # d = 2 is past its end: only the last action token
        [0, 0, 1, 0, 0],  # d = 2 (where the shorter one ended)
        [0, 0, 1, 0, 0],  # no opposite outcome locally: last action token only
    ]


def test_clipped_value_loss_hand_computed():
    # V = 0.5, V_old = 0, G = 1, ε = 0.2: V̄ = 0.2, max(0.25, 0.64) = 0.64
    # V = 0.1: V̄ = 0.1, both 0.81
    values = torch.tensor([[0.5, 0.1, 3.0]], requires_grad=True)
    loss, m = clipped_value_loss(values, torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    assert_close(loss, torch.tensor((0.64 + 0.81) / 2))
    loss.backward()
    # the clipped branch wins for token 0: no gradient; token 1: 2(V-G)/2 = -0.9
    assert_close(values.grad, torch.tensor([[0.0, -0.9, 0.0]]))
    assert m["critic/vf_clipfrac"] == 0.5


def test_terminal_ranking_loss_hand_computed():
    # group 0: R = [1, 0, 0], V_T = [0.3, 0.25, 0.5]; pairs (0,1): .1-.3+.25 = .05, (0,2): .1-.3+.5 = .3
    # group 1: all equal, no pair
    v = torch.tensor([0.3, 0.25, 0.5, 0.9, 0.9])
    loss, m = terminal_ranking_loss(v, torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]), [0, 0, 0, 1, 1], margin=0.1)
    assert_close(loss, torch.tensor(0.175))
    assert m["li2sao/rank_pairs"] == 2.0
    none, _ = terminal_ranking_loss(v[3:], torch.tensor([1.0, 1.0]), [1, 1])
    assert none.item() == 0.0


def test_li2sao_critic_loss_combines_residual_and_ranking():
    values = torch.tensor([[0.0, 0.3], [0.0, 0.25]], requires_grad=True)
    old = torch.zeros(2, 2)
    targets = torch.tensor([[0.5, 0.5], [-0.5, -0.5]])
    cmask = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    loss, m = li2sao_critic_loss(values, old, targets, cmask, torch.tensor([1.0, 0.0]), [0, 0], torch.ones(2, 2))
    # residual: V̄ = clip to ±0.2 -> token errs max((.3-.5)², (.2-.5)²) = .09, max((.25+.5)², (.2+.5)²) = .5625
    res = (0.09 + 0.5625) / 2
    rank = 0.1 - 0.3 + 0.25
    assert_close(loss, torch.tensor(res + 0.1 * rank))
    assert abs(m["li2sao/residual_loss"] - res) < 1e-6


def test_li2sao_advantage_group_phase_then_gae_phase():
    mask = torch.ones(4, 3)
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv, ret = li2sao_advantage(rewards, mask, ["a", "a", "b", "b"])
    assert_close(adv[:, 0], torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-4, rtol=0)
    assert_close(ret[:, 0], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    # singleton groups (after the switch): GAE, which needs values
    try:
        li2sao_advantage(rewards, mask, ["a", "b", "c", "d"])
    except ValueError as err:
        assert "values" in str(err)
    else:
        raise AssertionError("expected ValueError without values")
    adv_gae, _ = li2sao_advantage(rewards, mask, ["a", "b", "c", "d"], values=torch.full((4, 3), 0.5))
    assert not torch.allclose(adv_gae, adv)


def _naive_readiness(v, r, groups):
    z, d, pairs, correct = [], [], 0, 0
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        rg = np.array([r[i] for i in idx])
        if rg.std() == 0:
            continue
        for i in idx:
            z.append(r[i] - rg.mean())
            d.append(r[i] - rg.mean() - v[i])
        for i in idx:
            for j in idx:
                if r[i] > r[j]:
                    pairs += 1
                    correct += v[i] > v[j]
    return 1 - np.var(d) / np.var(z), correct / pairs


def test_readiness_statistics_reduce_exactly_across_shards():
    g = torch.Generator().manual_seed(0)
    groups = [i // 4 for i in range(32)]
    r = torch.randint(0, 2, (32,), generator=g).float()
    v = torch.randn(32, generator=g) * 0.3 + (r - 0.5) * 0.5
    full = readiness_statistics(v, r, groups)
    e_ref, a_ref = _naive_readiness(v.tolist(), r.tolist(), groups)
    e, a = readiness_from_statistics(full)
    assert abs(e - e_ref) < 1e-9 and abs(a - a_ref) < 1e-12
    # two data-parallel shards holding whole groups: summed statistics give the exact same numbers
    s1 = readiness_statistics(v[:12], r[:12], groups[:12])
    s2 = readiness_statistics(v[12:], r[12:], groups[12:])
    assert_close(s1 + s2, full)
    # ... whereas averaging the per-shard ratios would not
    e1, _ = readiness_from_statistics(s1)
    e2, _ = readiness_from_statistics(s2)
    assert abs((e1 + e2) / 2 - e) > 1e-3


def test_readiness_undefined_without_mixed_groups():
    stats = readiness_statistics(torch.zeros(4), torch.tensor([1.0, 1.0, 0.0, 0.0]), [0, 0, 1, 1])
    assert readiness_from_statistics(stats) == (None, None)


def test_gate_switches_at_exact_step_with_paper_defaults():
    # constant e = a = 1: EMA_k = 1 - 0.9^k; ā > 0.65 from k = 10 (0.9^10 = .3487), ē > .2 from k = 3.
    # the paper's pseudocode counts steps k >= T_min = 60: c = 1 at k = 60, ..., c = M = 10 at k = 69
    gate = ReadinessGate()
    opened = [k for k in range(1, 200) if gate.update(1.0, 1.0)]
    assert opened == [69] and gate.switch_step == 69 and not gate.forced
    assert gate.update(1.0, 1.0) is False  # one way


def test_gate_counter_resets_and_state_round_trips():
    # β = 0 makes the EMA the raw value: ready 60..65, fail at 66 (c = 0), ready again from 67 -> 67 + 9 = 76
    def script(k):
        return (1.0, 0.0) if k == 66 else (1.0, 1.0)

    gate = ReadinessGate(beta=0.0)
    for k in range(1, 66):
        assert not gate.update(*script(k))
    restored = ReadinessGate.from_state_dict(gate.state_dict())  # checkpoint at step 65
    steps = [k for k in range(66, 120) if restored.update(*script(k))]
    assert steps == [76]
    # an undefined step (no mixed group) leaves the EMAs as they are and the pseudocode reads the condition on
    # them: with ready EMAs it keeps counting (60..69), with unready EMAs it resets
    gate2 = ReadinessGate(beta=0.0)
    opened = [k for k in range(1, 120) if gate2.update(*((None, None) if k == 62 else (1.0, 1.0)))]
    assert opened == [69]
    gate3 = ReadinessGate(beta=0.0)
    script3 = {61: (1.0, 0.0), 62: (None, None)}  # 61 not ready, 62 undefined -> still not ready
    opened = [k for k in range(1, 120) if gate3.update(*script3.get(k, (1.0, 1.0)))]
    assert opened == [63 + 9]


def test_gate_window_first_counted_step_is_t_min():
    # T_min = 3, M = 2, β = 0: steps 1-2 never count even when ready; 3 and 4 count -> opens at 4
    gate = ReadinessGate(beta=0.0, t_min=3, patience=2, t_max=50)
    counters = []
    for k in range(1, 10):
        if gate.update(1.0, 1.0):
            break
        counters.append(gate.consecutive)
    assert counters == [0, 0, 1] and gate.switch_step == 4 and not gate.forced
    assert gate.metrics()["li2sao/eta_e"] == 0.2 and gate.metrics()["li2sao/eta_a"] == 0.65


def test_gate_forced_at_t_max():
    gate = ReadinessGate()
    opened = [k for k in range(1, 200) if gate.update(-3.0, 0.5)]
    assert opened == [150] and gate.forced


def test_values_at_last_model_token():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert values_at_last_model_token(values, mask).tolist() == [2.0, 6.0]


def test_equal_fractional_rewards_are_an_all_equal_group():
    # a float32 mean of eight 0.998 rounds: the group must still count as all-equal (zero advantage, dropped)
    scores = torch.full((8,), 0.998)
    ids = [0] * 8
    from async_rl.algos import grpo_group_advantage

    assert torch.equal(grpo_group_advantage(scores, ids), torch.zeros(8))
    _, keep = residual_critic_targets(torch.ones(8, 2) * 0.998, scores, ids, torch.ones(8, 2))
    assert not keep.any()
    assert readiness_statistics(torch.zeros(8), scores, ids)[0] == 0


def test_li2sao_advantage_passes_alpha_to_gae():
    mask = torch.ones(2, 4)
    rewards = torch.zeros(2, 4)
    rewards[:, -1] = torch.tensor([1.0, 0.0])
    values = torch.tensor([[0.1, 0.3, 0.2, 0.6], [0.5, 0.2, 0.4, 0.1]])
    a, _ = li2sao_advantage(rewards, mask, ["a", "b"], values=values, alpha=1.5)
    b, _ = li2sao_advantage(rewards, mask, ["a", "b"], values=values, alpha=100.0)
    assert not torch.allclose(a, b)


def test_critic_returns_do_not_depend_on_group_completeness_at_any_gamma():
    """γ^k R in both branches (λ = 1 return, spec §4), also when γ ≠ 1."""
    from async_rl.algos.li2sao import bootstrap_returns, li2sao_advantage

    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, 3)
    values = torch.zeros(2, 3)
    _, all_complete = li2sao_advantage(rewards, mask, [0, 0], values=values, gamma=0.9)
    _, one_incomplete = li2sao_advantage(rewards, mask, [0, 0], values=values, gamma=0.9,
                                         complete_group=torch.tensor([True, False]))
    expected = torch.tensor([[0.81, 0.9, 1.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(all_complete, expected) and torch.allclose(one_incomplete, expected)
    assert torch.allclose(bootstrap_returns(rewards.sum(-1), mask, 0.9), expected)


def test_a_gate_with_t_min_equal_to_t_max_switches_there():
    """algorithm.gate validation accepts t_min == t_max (a fixed switch step); the gate must too."""
    from async_rl.algos.li2sao import ReadinessGate
    from async_rl.config import AlgorithmConfig, GateConfig

    cfg = AlgorithmConfig(name="li2sao", group_size=8, use_critic=True, policy_loss="dis_clip",
                          gate=GateConfig(t_min=5, t_max=5))
    cfg.validate()
    gate = ReadinessGate(**vars(cfg.gate))
    opened = [gate.update(1.0, 1.0) for _ in range(6)]
    assert opened == [False] * 4 + [True, False] and gate.switch_step == 5 and gate.forced
    with pytest.raises(ValueError, match="t_min <= t_max"):
        ReadinessGate(t_min=6, t_max=5)


def test_divergence_mask_of_an_empty_batch_or_response_is_empty():
    assert divergence_mask(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5), torch.zeros(0), []).shape == (0, 5)
    out = divergence_mask(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0), torch.tensor([0.0, 1.0, 0.0]),
                          [0, 0, 1])
    assert out.shape == (3, 0)

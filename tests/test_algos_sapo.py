"""SAPO math (spec §5): readout, restricted softmax, turn targets, normalisation, turn-averaged losses."""

import torch
from torch.testing import assert_close

from async_rl.algos import (
    broadcast_turns_to_tokens,
    normalise_turn_advantages,
    normalised_readout,
    restricted_entropy,
    restricted_log_softmax,
    restricted_token_logprobs,
    sapo_targets,
    turn_boundaries,
    turn_gae,
    turn_value_loss,
    two_logit_value,
)


def test_two_logit_readout_on_hand_built_logits():
    logits = torch.zeros(3, 6)
    plus, minus = 4, 5  # reserved ids
    logits[:, plus] = torch.tensor([2.0, 0.0, 5.0])
    logits[:, minus] = torch.tensor([1.0, 1.0, -5.0])
    # (z+ - z-)/τ with τ = 2: 0.5, -0.5, 5 -> clipped to 1
    assert_close(normalised_readout(logits[:, plus], logits[:, minus], 2.0), torch.tensor([0.5, -0.5, 1.0]))
    assert_close(two_logit_value(logits[:, plus], logits[:, minus], 2.0, 10.0), torch.tensor([5.0, -5.0, 10.0]))


def test_restricted_softmax_zero_probability_and_zero_gradient_on_reserved_ids():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0]], requires_grad=True)
    logp = restricted_log_softmax(logits, [3, 4])
    assert torch.isinf(logp[0, 3]) and torch.isinf(logp[0, 4])
    ref = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), dim=-1)
    assert_close(logp[0, :3], ref)
    assert_close(logp.exp().sum(), torch.tensor(1.0))
    lp = restricted_token_logprobs(logits, torch.tensor([0]), [3, 4])
    ent = restricted_entropy(logits, [3, 4])
    p = ref.exp()
    assert_close(ent, -(p * ref).sum().unsqueeze(0))
    (lp.sum() + ent.sum()).backward()
    assert logits.grad[0, 3] == 0.0 and logits.grad[0, 4] == 0.0
    assert torch.isfinite(logits.grad).all() and logits.grad[0, :3].abs().sum() > 0


def test_three_turn_targets_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v_old = torch.tensor([[0.2, 0.4, 0.6]])
    q_old = torch.tensor([[0.3, 0.5, 0.7]])
    done = torch.tensor([[0.0, 0.0, 1.0]])
    valid = torch.ones(1, 3)
    adv, y_v, y_q = sapo_targets(r, v_old, q_old, done, valid, gamma=1.0, lam=0.9)
    # δ3 = 1 - .6 = .4, δ2 = .6 - .4 = .2, δ1 = .4 - .2 = .2
    # A3 = .4, A2 = .2 + .9*.4 = .56, A1 = .2 + .9*.56 = .704
    assert_close(adv, torch.tensor([[0.704, 0.56, 0.4]]))
    assert_close(y_v, torch.tensor([[0.904, 0.96, 1.0]]))
    # SARSA: y^Q_t = r_t + (1-d_t) Q_old(t+1) = [.5, .7, 1]
    assert_close(y_q, torch.tensor([[0.5, 0.7, 1.0]]))


def test_truncation_is_terminal_and_done_stops_propagation():
    # 2 valid turns of K = 3, no done flag: horizon truncation bootstraps 0
    r = torch.tensor([[0.0, 0.0, 0.0]])
    v_old = torch.tensor([[0.2, 0.4, 99.0]])
    adv = turn_gae(r, v_old, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), gamma=1.0, lam=0.9)
    # δ2 = 0 - .4, δ1 = .4 - .2 -> A2 = -.4, A1 = .2 + .9*(-.4) = -.16
    assert_close(adv, torch.tensor([[-0.16, -0.4, 0.0]]))
    # a done flag at turn 1 (a sub-episode ended) cuts both bootstrap and accumulation
    adv2 = turn_gae(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.3]]), torch.tensor([[1.0, 0.0]]),
                    torch.ones(1, 2), gamma=1.0, lam=0.9)
    assert_close(adv2, torch.tensor([[0.5, -0.3]]))


def test_batch_normalised_advantages_with_invalid_action_penalty():
    adv = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    valid = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    invalid = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    out = normalise_turn_advantages(adv, valid, invalid, invalid_penalty=1.0, eps=0.0)
    # Ã = [1, 1, 3]: mean 5/3, population std sqrt(24/27) = .9428 -> [-.7071, -.7071, 1.4142]
    assert_close(out, torch.tensor([[-0.70711, -0.70711, 1.41421, 0.0]]), atol=1e-4, rtol=0)


def test_broadcast_and_turn_boundaries():
    tti = torch.tensor([[0, 0, -1, -1, 1, 1, 1, -1]])
    assert broadcast_turns_to_tokens(torch.tensor([[2.0, 3.0]]), tti).tolist() == [[2, 2, 0, 0, 3, 3, 3, 0]]
    first, last = turn_boundaries(tti, 3)
    assert first.tolist() == [[0, 4, -1]] and last.tolist() == [[1, 6, -1]]


def test_value_loss_is_averaged_over_turns_not_tokens():
    # p = [.5, 0], targets [1, -1] (R_max = 1): errors .25 and 1 -> ½ mean = .3125,
    # however many tokens each turn has (the loss never sees token counts)
    p = torch.tensor([[0.5, 0.0]], requires_grad=True)
    loss, _ = turn_value_loss(p, p.detach(), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 1.0)
    assert_close(loss, torch.tensor(0.3125))
    # targets are clipped to the readout range after dividing by R_max
    loss10, _ = turn_value_loss(p, p.detach(), torch.tensor([[20.0, -10.0]]), torch.ones(1, 2), 0.2, 10.0)
    assert_close(loss10, torch.tensor(0.3125))


def test_turn_targets_with_no_turns_are_empty():
    from async_rl.algos.sapo import sapo_targets, turn_gae

    none = torch.zeros(2, 0)
    assert turn_gae(none, none, none, none).shape == (2, 0)
    assert all(t.shape == (2, 0) for t in sapo_targets(none, none, none, none, none))

"""SapoRole: readout positions, restricted policy, turn targets, turn-averaged value loss, one update."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algos.sapo import ppo_clip_token_loss, restricted_entropy, turn_value_loss
from async_rl.driver.batch import collate, turn_tensors
from async_rl.config import AlgorithmConfig
from async_rl.driver.learner import shared_backbone_targets
from async_rl.driver.trajectory import Segment, Trajectory
from async_rl.engine.base import OptimizerConfig
from async_rl.models.loading import load_tokenizer
from async_rl.models.tiny import make_tiny_model
from async_rl.workers.sapo import (
    SAPO_DEFAULTS,
    SapoRole,
    default_reserved_ids,
    resolve_reserved_ids,
)

TAU_V = 5.0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sapo") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def reserved(tokenizer):
    return resolve_reserved_ids(tokenizer)


def sapo_targets_of(role, batch, turns, **settings):
    """The learner's path: the role's frozen readouts -> the registered sapo_turn estimator -> the update's
    targets (settings: gamma, sapo_lambda, sapo_invalid_penalty; the AlgorithmConfig defaults otherwise)."""
    return shared_backbone_targets(role, batch, turns, {**vars(AlgorithmConfig(name="sapo")), **settings})[1]


def make_role(tiny_dir, reserved, lr=0.0, kl_coef=0.0, **kwargs):
    optim = OptimizerConfig(lr=lr, weight_decay=0.0, max_grad_norm=1.0)
    return SapoRole(tiny_dir, optim, reserved, tau_v=TAU_V, r_max=1.0, kl_coef=kl_coef, **kwargs)


def trajectory(uid, prompt, turns, rewards=None, dones=None, invalid=None, truncated=False):
    """``turns``: list of (action_ids, observation_ids or None)."""
    segments = []
    for k, (action, obs) in enumerate(turns):
        segments.append(Segment("model", list(action), [0.0] * len(action), [0] * len(action), turn=k))
        if obs:
            segments.append(Segment("env", list(obs), turn=k))
    n = len(turns)
    return Trajectory(uid=uid, group_id=uid, prompt_index=0, prompt_ids=list(prompt), segments=segments,
                      num_turns=n, turn_rewards=list(rewards or [0.0] * n),
                      turn_dones=list(dones or [False] * (n - 1) + [True]),
                      turn_invalid=list(invalid or [False] * n), truncated=truncated,
                      reward=float(sum(rewards or [0.0])))


def two_trajectories():
    a = trajectory("a", [11, 12, 13, 14], [([40, 41, 42], [90, 91]), ([43, 44], [92, 93, 94]), ([45, 46, 47], None)],
                   rewards=[0.0, 0.0, 1.0])
    b = trajectory("b", [21, 22], [([50, 51], [95]), ([52, 53, 54, 55], None)], rewards=[0.0, 0.5],
                   dones=[False, False], truncated=True)
    return [a, b]


def on_policy(role, trajs, pad_id):
    """Collate and replace the behaviour log-probs by the current policy's (ratio 1)."""
    batch = collate(trajs, pad_id)
    batch["behaviour_log_probs"] = role.evaluate(batch)["log_probs"]
    return batch


# ----------------------------------------------------------------------------------------------------
# reserved ids
# ----------------------------------------------------------------------------------------------------
class _FakeTokenizer:
    """A vocabulary without the value tokens: ids 0..9, 0 = eos/pad, 9 an added chat marker."""

    eos_token_id = 0
    pad_token_id = 0
    all_special_ids = [0]
    added_tokens_decoder = {0: "<eos>", 9: "<tool>"}

    def get_vocab(self):
        return {"<eos>": 0, **{f"t{i}": i for i in range(1, 9)}, "<tool>": 9}

    def __len__(self):
        return 10

    def convert_ids_to_tokens(self, ids):
        names = {v: k for k, v in self.get_vocab().items()}
        return [names[i] for i in ids] if isinstance(ids, list) else names[ids]


def test_resolve_reserved_ids(tokenizer):
    plus, minus = resolve_reserved_ids(tokenizer)
    assert tokenizer.convert_ids_to_tokens([plus, minus]) == ["<|value_plus|>", "<|value_minus|>"]
    assert resolve_reserved_ids(tokenizer, [plus, "<|value_minus|>"]) == (plus, minus)
    assert resolve_reserved_ids(tokenizer, (100, 101)) == (100, 101)
    with pytest.raises(ValueError, match="not in the tokenizer"):
        resolve_reserved_ids(tokenizer, ("<|nope|>", "<|value_minus|>"))
    with pytest.raises(ValueError, match="different"):
        resolve_reserved_ids(tokenizer, (plus, plus))
    with pytest.raises(ValueError, match="eos_token_id|pad_token_id"):
        resolve_reserved_ids(tokenizer, ("<|endoftext|>", minus))
    with pytest.raises(ValueError, match="outside"):
        resolve_reserved_ids(tokenizer, (plus, len(tokenizer)))
    with pytest.raises(ValueError, match="exactly two"):
        resolve_reserved_ids(tokenizer, (plus,))

    # default picker, rule 1: the two highest unused special tokens (not eos/pad/bos/unk, not in the chat
    # template): on the tiny tokenizer its value tokens; <|im_start|> / <|im_end|> are in the template
    auto = resolve_reserved_ids(tokenizer, "auto")
    assert auto == default_reserved_ids(tokenizer) == (plus, minus)
    # rule 2 (fewer than two unused specials): the last two ordinary ids, never special / added / eos / pad
    fake = _FakeTokenizer()
    assert default_reserved_ids(fake) == (8, 7)  # 9 is an added token, 0 is eos/pad
    assert resolve_reserved_ids(fake) == (8, 7)  # default names missing -> picker
    assert resolve_reserved_ids(fake, None) == (8, 7)


# ----------------------------------------------------------------------------------------------------
# forward: log-probs as the rollout records them, readout positions, causality
# ----------------------------------------------------------------------------------------------------
def test_log_probs_equal_rollout_behaviour_log_probs(tiny_dir, tokenizer, reserved):
    from async_rl.rollout import GenerationRequest, HFRolloutEngine, SamplingParams

    temperature = 0.7
    engine = HFRolloutEngine(tiny_dir, device="cpu")
    sampling = SamplingParams(temperature=temperature, max_new_tokens=5, ignore_eos=True,
                              banned_token_ids=list(reserved))
    prompts = [tokenizer.encode("Hello world", add_special_tokens=False),
               tokenizer.encode("<think> search the room </think> action:", add_special_tokens=False)]
    observations = [[60, 61, 62], [70]]
    trajs = []
    for i, prompt in enumerate(prompts):
        t = Trajectory(uid=str(i), group_id=str(i), prompt_index=i, prompt_ids=prompt)
        for k in range(2):
            request = GenerationRequest(f"{i}/{k}", prompt + t.response_ids,
                                        SamplingParams(**{**vars(sampling), "seed": 10 * i + k}))
            out = engine.generate([request])[0]
            t.segments.append(Segment("model", out.token_ids, out.logprobs, out.versions, turn=k))
            if k == 0:
                t.segments.append(Segment("env", observations[i], turn=k))
            t.turn_rewards.append(0.0)
            t.turn_dones.append(k == 1)
        trajs.append(t)
    batch = collate(trajs, tokenizer.pad_token_id)
    mask = batch["response_mask"] > 0
    assert not torch.isin(batch["responses"][mask], torch.tensor(reserved)).any()

    role = make_role(tiny_dir, reserved, temperature=temperature)
    out = role.evaluate(batch)
    torch.testing.assert_close(out["log_probs"][mask], batch["behaviour_log_probs"][mask], atol=1e-4, rtol=0)
    assert (out["log_probs"][~mask] == 0).all() and (out["entropy"][~mask] == 0).all()
    assert out["turn_mask"].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def _full_logits(role, batch):
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["response_attention"]], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return role.engine.module(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()


def test_readouts_sit_at_the_turn_boundaries(tiny_dir, tokenizer, reserved):
    role = make_role(tiny_dir, reserved)
    batch = collate(two_trajectories(), tokenizer.pad_token_id)
    out = role.evaluate(batch)
    logits = _full_logits(role, batch)
    P = batch["prompts"].shape[1]
    plus, minus = reserved
    first = {0: [0, 5, 10], 1: [0, 3]}
    last = {0: [2, 6, 12], 1: [1, 6]}
    for i in (0, 1):
        for k, (f, l) in enumerate(zip(first[i], last[i])):
            zv = logits[i, P + f - 1]  # last column of the state context
            zq = logits[i, P + l]  # last action token
            assert out["p_v"][i, k] == pytest.approx(float(((zv[plus] - zv[minus]) / TAU_V).clamp(-1, 1)), abs=1e-5)
            assert out["p_q"][i, k] == pytest.approx(float(((zq[plus] - zq[minus]) / TAU_V).clamp(-1, 1)), abs=1e-5)
            # the policy is the restricted softmax at the column before each token
            lp = torch.log_softmax(logits[i, P + f - 1].index_fill(0, torch.tensor(reserved), -math.inf), -1)
            assert out["log_probs"][i, f] == pytest.approx(float(lp[batch["responses"][i, f]]), abs=1e-5)
            assert out["entropy"][i, f] == pytest.approx(
                float(restricted_entropy(logits[i, P + f - 1], reserved)), abs=1e-5)
    assert out["turn_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["p_v"][1, 2] == 0 and out["p_q"][1, 2] == 0
    torch.testing.assert_close(out["values"], role.r_max * out["p_v"])


def test_v_is_causal_and_q_sees_the_action_but_not_the_observation(tiny_dir, tokenizer, reserved):
    role = make_role(tiny_dir, reserved)
    base = [([40, 41, 42], [90, 91, 92]), ([43, 44], [93]), ([45, 46], None)]

    def readouts(turns):
        batch = collate([trajectory("x", [11, 12, 13], turns)], tokenizer.pad_token_id)
        out = role.evaluate(batch)
        return out["p_v"][0], out["p_q"][0]

    v0, q0 = readouts(base)
    assert not torch.allclose(v0[:2], q0[:2], atol=1e-4)

    def changed(a, b):
        return not torch.allclose(a, b, atol=1e-6)

    # change turn 0's action (same length): V_0 unchanged, Q_0 changes
    v, q = readouts([([40, 77, 200], base[0][1]), *base[1:]])
    assert torch.allclose(v[0], v0[0], atol=1e-6) and changed(q[0], q0[0])
    # change the observation after turn 0: V_0 and Q_0 unchanged, V_1 (a later state) changes
    v, q = readouts([(base[0][0], [300, 301, 302]), *base[1:]])
    assert torch.allclose(v[0], v0[0], atol=1e-6) and torch.allclose(q[0], q0[0], atol=1e-6)
    assert changed(v[1], v0[1])
    # change turn 2's action: nothing before its Q changes
    v, q = readouts([*base[:2], ([250, 251], None)])
    assert torch.allclose(v, v0, atol=1e-6) and torch.allclose(q[:2], q0[:2], atol=1e-6)
    assert changed(q[2], q0[2])


def test_reserved_ids_get_no_gradient_through_the_policy_terms(tiny_dir, tokenizer, reserved):
    role = make_role(tiny_dir, reserved, temperature=0.9)
    batch = collate(two_trajectories(), tokenizer.pad_token_id)
    K = 3
    role.engine.train_mode()
    tail = role._tail_logits(role.engine.module, batch)
    tail.retain_grad()
    out = role._outputs(tail, batch, K)
    mask = batch["response_mask"]
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    pol, _ = ppo_clip_token_loss(out["log_probs"], batch["behaviour_log_probs"] - 0.3, adv, mask)
    entropy = (out["entropy"] * mask).sum() / mask.sum()
    (pol - 0.1 * entropy).backward()

    grad = tail.grad
    assert (grad[..., list(reserved)] == 0).all()
    assert grad.abs().sum() > 0
    head = role.engine.module.get_output_embeddings().weight
    assert not role.engine.module.config.tie_word_embeddings
    assert (head.grad[list(reserved)] == 0).all() and head.grad.abs().sum() > 0
    role.engine.zero_grad()

    # positive control: the V loss does reach the reserved logits, and only at the V columns
    tail = role._tail_logits(role.engine.module, batch)
    tail.retain_grad()
    out = role._outputs(tail, batch, K)
    tmask = out["turn_mask"]
    v_loss, _ = turn_value_loss(out["p_v"], out["p_v"].detach(), torch.full((2, K), 0.9), tmask, 0.2, 1.0)
    v_loss.backward()
    g = tail.grad[..., list(reserved)].abs().sum(-1)
    v_cols = (g > 0).nonzero().tolist()
    assert v_cols == [[0, 0], [0, 5], [0, 10], [1, 0], [1, 3]]
    role.engine.zero_grad()


# ----------------------------------------------------------------------------------------------------
# turn tensors and targets
# ----------------------------------------------------------------------------------------------------
def test_turn_tensors_from_trajectories_and_batch(tokenizer):
    trajs = two_trajectories()
    trajs[0].turn_invalid = [False, True, False]
    turns = turn_tensors(trajs)
    assert turns["turn_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert turns["turn_rewards"].tolist() == [[0, 0, 1], [0, 0.5, 0]]
    assert turns["turn_dones"].tolist() == [[0, 0, 1], [0, 0, 0]]
    assert turns["turn_invalid"].tolist() == [[0, 1, 0], [0, 0, 0]]
    assert turn_tensors(trajs, num_turns=5)["turn_mask"].shape == (2, 5)
    # from a collated batch alone: outcome reward on the last turn
    derived = turn_tensors(collate(trajs, tokenizer.pad_token_id))
    assert derived["turn_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert derived["turn_rewards"].tolist() == [[0, 0, 1], [0, 0.5, 0]]
    assert derived["turn_dones"].tolist() == [[0, 0, 1], [0, 1, 0]]
    # single-turn trajectory without per-turn lists
    single = Trajectory(uid="s", group_id="s", prompt_index=0, prompt_ids=[1, 2],
                        segments=[Segment("model", [5, 6], [0, 0], [0, 0], turn=0)], reward=0.7)
    assert turn_tensors([single])["turn_rewards"].tolist() == [[pytest.approx(0.7)]]


def test_targets_match_hand_computation(tiny_dir, tokenizer, reserved, monkeypatch):
    role = make_role(tiny_dir, reserved)
    trajs = two_trajectories()
    trajs[0].turn_invalid = [False, True, False]
    batch = collate(trajs, tokenizer.pad_token_id)
    turns = turn_tensors(trajs)
    v_old = torch.tensor([[0.2, 0.5, -0.1], [0.1, 0.3, 0.0]])
    q_old = torch.tensor([[0.3, 0.4, 0.6], [0.2, 0.1, 0.0]])
    readout_mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])

    def fake_evaluate(b, num_turns=None):
        assert num_turns == 3
        return {"values": v_old, "q_values": q_old, "p_v": v_old, "p_q": q_old, "turn_mask": readout_mask,
                "log_probs": torch.zeros(b["responses"].shape)}

    monkeypatch.setattr(role, "evaluate", fake_evaluate)
    gamma, lam, c_inv = 0.9, 0.8, 0.1
    tg = sapo_targets_of(role, batch, turns, gamma=gamma, sapo_lambda=lam, sapo_invalid_penalty=c_inv)

    # trajectory a (terminal after turn 2):
    #   δ2 = 1 - (-0.1) = 1.1                 A2 = 1.1
    #   δ1 = 0.9·(-0.1) - 0.5 = -0.59         A1 = -0.59 + 0.72·1.1 = 0.202
    #   δ0 = 0.9·0.5 - 0.2 = 0.25             A0 = 0.25 + 0.72·0.202 = 0.39544
    # trajectory b (truncated at the horizon: last turn bootstraps 0):
    #   δ1 = 0.5 - 0.3 = 0.2                  A1 = 0.2
    #   δ0 = 0.9·0.3 - 0.1 = 0.17             A0 = 0.17 + 0.72·0.2 = 0.314
    adv = torch.tensor([[0.39544, 0.202, 1.1], [0.314, 0.2, 0.0]])
    y_v = torch.tensor([[0.59544, 0.702, 1.0], [0.414, 0.5, 0.0]])
    y_q = torch.tensor([[0.36, 0.54, 1.0], [0.09, 0.5, 0.0]])  # r + γ(1-d) Q_old(t+1)
    torch.testing.assert_close(tg["advantages"], adv, atol=1e-6, rtol=0)
    torch.testing.assert_close(tg["y_v"], y_v, atol=1e-6, rtol=0)
    torch.testing.assert_close(tg["y_q"], y_q, atol=1e-6, rtol=0)

    # Ã = A - c_inv·invalid over the 5 valid turns, then (Ã - μ)/(σ + 1e-6), σ the population std
    tilde = [0.39544, 0.202 - c_inv, 1.1, 0.314, 0.2]
    mu = sum(tilde) / 5
    sigma = math.sqrt(sum((x - mu) ** 2 for x in tilde) / 5)
    norm = [(x - mu) / (sigma + 1e-6) for x in tilde]
    expected = torch.tensor([[norm[0], norm[1], norm[2]], [norm[3], norm[4], 0.0]])
    torch.testing.assert_close(tg["norm_advantages"], expected, atol=1e-5, rtol=0)
    # broadcast to every model token of the turn, 0 on observation tokens and padding
    tok = tg["token_advantages"]
    assert tok[0, :3].tolist() == pytest.approx([norm[0]] * 3, abs=1e-5)
    assert tok[0, 3:5].tolist() == [0.0, 0.0]
    assert tok[0, 5:7].tolist() == pytest.approx([norm[1]] * 2, abs=1e-5)
    assert tok[1, 3:7].tolist() == pytest.approx([norm[4]] * 4, abs=1e-5)
    assert tok[1, 2] == 0 and (tok[1, 7:] == 0).all()
    torch.testing.assert_close(tg["p_v_old"], v_old * readout_mask)
    assert tg["turn_mask"].tolist() == readout_mask.tolist()


# ----------------------------------------------------------------------------------------------------
# losses and the update
# ----------------------------------------------------------------------------------------------------
def test_value_loss_is_a_mean_over_turns_not_tokens(tiny_dir, tokenizer, reserved):
    role = make_role(tiny_dir, reserved, lr=0.0)  # lr 0: update() only measures
    short = trajectory("s", [11, 12, 13], [([40, 41], [90, 91]), ([43, 44], None)])
    # the last turn's action repeated four times: V_0, V_1 (read before turn 1) are unchanged
    long = trajectory("l", [11, 12, 13], [([40, 41], [90, 91]), ([43, 44] * 4, None)])
    y_v = torch.tensor([[0.8, -0.6]])

    def v_loss(traj, micro_batch_size=None, rows=1):
        role.micro_batch_size = micro_batch_size
        batch = on_policy(role, [traj] * rows, tokenizer.pad_token_id)
        turns = turn_tensors([traj] * rows)
        tg = sapo_targets_of(role, batch, turns)
        tg["y_v"] = y_v.expand(rows, 2).clone()
        metrics = role.update(batch, turns, tg, kl_coef=0.0)
        return metrics["sapo/v_loss"], tg["p_v_old"][0]

    loss_short, p_short = v_loss(short)
    loss_long, p_long = v_loss(long)
    torch.testing.assert_close(p_short, p_long, atol=1e-6, rtol=0)
    # current p == p_old (nothing moved): L_V = ½ mean_turns (p - ȳ)²
    errors = ((p_short - y_v[0]) ** 2).tolist()
    assert loss_short == pytest.approx(0.5 * sum(errors) / 2, abs=1e-6)
    assert loss_long == pytest.approx(loss_short, abs=1e-6)
    # a token-weighted mean would have weighted turn 1 by its 8 tokens instead of 2
    token_weighted = 0.5 * (2 * errors[0] + 8 * errors[1]) / 10
    assert abs(token_weighted - loss_short) > 1e-3
    # micro-batching keeps the global turn mean
    assert v_loss(long, micro_batch_size=1, rows=3)[0] == pytest.approx(loss_short, abs=1e-6)


def test_update_changes_weights_and_lowers_the_joint_loss(tiny_dir, tokenizer, reserved):
    role = make_role(tiny_dir, reserved, lr=1e-3, kl_coef=SAPO_DEFAULTS["kl_coef"], micro_batch_size=1)
    assert role.ref_model is not None
    trajs = two_trajectories()
    batch = on_policy(role, trajs, tokenizer.pad_token_id)
    turns = turn_tensors(trajs)
    tg = sapo_targets_of(role, batch, turns)
    assert "ref_log_probs" in tg
    before = role.export_weights()
    kwargs = {k: SAPO_DEFAULTS[k] for k in ("clip_eps", "clip_v", "clip_q", "c_v", "c_q")}
    first = role.update(batch, turns, tg, c_h=0.01, **kwargs)
    after = role.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    expected_keys = {"sapo/loss", "sapo/v_loss", "sapo/q_loss", "sapo/kl", "sapo/entropy", "sapo/explained_var",
                     "sapo/v_mean", "sapo/q_mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm"}
    assert expected_keys <= set(first)
    assert all(math.isfinite(v) for v in first.values())
    assert first["sapo/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the initial model
    second = role.update(batch, turns, tg, c_h=0.01, **kwargs)
    assert second["sapo/loss"] < first["sapo/loss"]
    assert second["sapo/kl"] > 0
    # the reference policy stays frozen
    assert all(not p.requires_grad for p in role.ref_model.parameters())
    # turn tensors of another batch: refused before the readouts are read
    with pytest.raises(ValueError, match="turn tensors have 1 rows, the batch 2"):
        sapo_targets_of(role, batch, turn_tensors(trajs[:1]))
    # turn tensors of another (bs, K) than the targets': refused before any forward or step
    weights = role.export_weights()
    with pytest.raises(ValueError, match="disagree on"):
        role.update(batch, {"turn_mask": torch.ones(len(trajs), tg["turn_mask"].shape[1] + 1)}, tg)
    assert all(torch.equal(weights[k], v) for k, v in role.export_weights().items())


def test_model_token_equal_to_a_reserved_id_is_rejected(tiny_dir, tokenizer, reserved):
    role = make_role(tiny_dir, reserved)
    bad = trajectory("x", [11, 12], [([40, reserved[0]], None)])
    batch = collate([bad], tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="must ban"):
        sapo_targets_of(role, batch, turn_tensors([bad]))


# ----------------------------------------------------------------------------------------------------
# data parallelism: two gloo ranks on half batches == one process on the whole batch
# ----------------------------------------------------------------------------------------------------
def four_trajectories():
    a, b = two_trajectories()
    c = trajectory("c", [31, 32, 33], [([60, 61, 62, 63, 64], [96]), ([65], None)], rewards=[0.0, -1.0],
                   invalid=[True, False])
    d = trajectory("d", [41], [([70, 71], [97, 98]), ([72, 73, 74], [99]), ([75], None)], rewards=[0.0, 0.0, 1.0])
    return [a, b, c, d]


def _dp_worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import os

    from async_rl.engine import dist

    torch.set_num_threads(1)
    dist.init_distributed(rank, world_size, "127.0.0.1", port, device="cpu")
    try:
        tokenizer = load_tokenizer(model_dir)
        reserved = resolve_reserved_ids(tokenizer)
        role = make_role(model_dir, reserved, lr=1e-3, kl_coef=0.01, micro_batch_size=1)
        trajs = four_trajectories()
        batch = on_policy(role, trajs, tokenizer.pad_token_id)
        turns = turn_tensors(trajs)
        # the driver's job, on the whole batch (its readouts gathered from the ranks): Â's μ_B and σ_B are global
        targets = sapo_targets_of(role, batch, turns)
        n = 4 // world_size
        rows = slice(rank * n, (rank + 1) * n)

        def mine(tensors):
            return {key: value[rows] for key, value in tensors.items()}
        metrics = role.update(mine(batch), mine(turns), mine(targets), c_h=0.01)
        weights = role.export_weights()
        torch.save({"targets": targets, "metrics": metrics, "weights": weights},
                   os.path.join(out_dir, f"w{world_size}_r{rank}.pt"))
    finally:
        dist.destroy_distributed()


@pytest.mark.slow
def test_data_parallel_update_equals_single_process(tiny_dir, tmp_path):
    import torch.multiprocessing as mp

    from async_rl.engine import dist

    results = {}
    for world_size in (1, 2):
        mp.spawn(_dp_worker, args=(world_size, dist.find_free_port(), str(tiny_dir), str(tmp_path)),
                 nprocs=world_size, join=True)
        results[world_size] = [torch.load(tmp_path / f"w{world_size}_r{r}.pt", weights_only=False)
                               for r in range(world_size)]
    (single,) = results[1]
    for rank, part in enumerate(results[2]):
        # every rank read the same readouts with its FSDP shard of the weights: the same frozen targets
        for key, value in single["targets"].items():
            torch.testing.assert_close(part["targets"][key], value, atol=1e-5, rtol=0)
        for key, value in single["metrics"].items():
            assert part["metrics"][key] == pytest.approx(value, abs=1e-5), key
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(part["weights"][name], tensor, atol=1e-5, rtol=0)


def test_default_reserved_ids_prefers_unused_special_tokens():
    """Rule 1 of default_reserved_ids on a hand-made vocabulary: specials 5..9, of which 9 is written by the chat
    template, 8 is bos and 5 is not flagged special -> the two highest unused specials are 6 and 7."""
    from types import SimpleNamespace

    class Specials(_FakeTokenizer):
        bos_token_id = 8
        chat_template = "{% for m in messages %}<turn>{{ m.content }}{% endfor %}"
        added_tokens_decoder = {0: SimpleNamespace(content="<eos>", special=True),
                                5: SimpleNamespace(content="<plain>", special=False),
                                6: SimpleNamespace(content="<a>", special=True),
                                7: SimpleNamespace(content="<b>", special=True),
                                8: SimpleNamespace(content="<bos>", special=True),
                                9: SimpleNamespace(content="<turn>", special=True)}

    assert default_reserved_ids(Specials()) == (6, 7)
    Specials.added_tokens_decoder = {k: v for k, v in Specials.added_tokens_decoder.items() if k != 6}
    # one unused special left (7): rule 2, the last two ordinary ids (6 is now an ordinary id; 7, 8, 9 are added)
    assert default_reserved_ids(Specials()) == (6, 4)

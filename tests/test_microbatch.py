"""Memory-bounded updates: token-budget packing, gradient accumulation over micro-batches, activation
checkpointing and chunked log-probs / entropy (docs/engine.md §7).

Every equality here is against the one-batch, full-logits computation in float32 (1e-5)."""

from __future__ import annotations

import pytest
import torch

from async_rl.engine import FSDPEngine, OptimizerConfig
from async_rl.engine.microbatch import MicroBatchPlan, pack_rows, padded_tokens, row_widths, split_to_count, trim_bounds
from async_rl.models.critic import CriticModel
from async_rl.models.logprobs import (
    chunked_head_logprobs,
    entropy_from_logits,
    response_token_logprobs,
    token_logprobs_from_logits,
)

VOCAB, P, T = 96, 5, 7
TOL = 1e-5


def tiny_lm(seed: int = 0, tie: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def make_batch(prompt_lens, response_lens, seed: int = 0) -> dict[str, torch.Tensor]:
    """Collated layout: prompts left-padded to P, responses right-padded to T."""
    g = torch.Generator().manual_seed(seed)
    bs = len(prompt_lens)
    prompt_mask = (torch.arange(P)[None, :] >= P - torch.tensor(prompt_lens)[:, None]).float()
    response_attention = (torch.arange(T)[None, :] < torch.tensor(response_lens)[:, None]).float()
    return {
        "prompts": torch.randint(0, VOCAB, (bs, P), generator=g),
        "responses": torch.randint(0, VOCAB, (bs, T), generator=g),
        "prompt_mask": prompt_mask,
        "response_attention": response_attention,
        "response_mask": response_attention.clone(),
        "advantages": torch.randn(bs, T, generator=g),
        "returns": torch.randn(bs, T, generator=g),
    }


def rows_of(batch, index):
    return {k: v[index] for k, v in batch.items()}


def inputs(batch):
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_attention"]], dim=1).long()
    return ids, mask


# ---------------------------------------------------------------------------------------------------- packing
def test_row_widths_and_trim_bounds_by_hand():
    # P = 5: row 0 has 3 real prompt tokens (columns 2..4), row 1 has 5, row 2 none (width clamps to 1)
    # T = 7: responses of 2, 7 and 0 real tokens (width clamps to 1)
    batch = make_batch([3, 5, 0], [2, 7, 0])
    prompt_w, response_w = row_widths(batch["prompt_mask"], batch["response_attention"])
    assert prompt_w.tolist() == [3, 5, 1] and response_w.tolist() == [2, 7, 1]
    # rows 0 and 2: widest prompt 3 -> start column 5 - 3 = 2, widest response 2 -> stop 5 + 2 = 7
    _, mask = inputs(rows_of(batch, [0, 2]))
    assert trim_bounds(mask, T) == (2, 7)
    assert padded_tokens(prompt_w[[0, 2]], response_w[[0, 2]]) == 2 * (3 + 2)
    # an all-padding batch still keeps the last prompt column and one response column
    assert trim_bounds(torch.zeros(2, P + T), T) == (P - 1, P + 1)


def test_pack_rows_by_hand():
    # widths (prompt + response): row0 2+3, row1 2+1, row2 4+6 (10 alone), row3 1+1, row4 1+2
    prompt_w = torch.tensor([2, 2, 4, 1, 1])
    response_w = torch.tensor([3, 1, 6, 1, 2])
    # budget 10: [0, 1] costs 2 x (2 + 3) = 10 ok; + row2 -> 3 x (4 + 6) = 30 > 10, so row2 starts a group
    # and fills it alone (10); row3 -> 2 x 10 > 10, new group; [3, 4] costs 2 x (1 + 2) = 6
    groups = pack_rows(prompt_w, response_w, max_tokens=10)
    assert [g.tolist() for g in groups] == [[0, 1], [2], [3, 4]]
    # budget 8: row2 (10 tokens) is over budget on its own: a micro-batch by itself, not dropped
    groups = pack_rows(prompt_w, response_w, max_tokens=8)
    assert [g.tolist() for g in groups] == [[0], [1], [2], [3, 4]]
    # row cap only
    assert [g.tolist() for g in pack_rows(prompt_w, response_w, max_rows=2)] == [[0, 1], [2, 3], [4]]
    # nothing set: one micro-batch
    assert [g.tolist() for g in pack_rows(prompt_w, response_w)] == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        pack_rows(prompt_w, response_w, max_tokens=0)


@pytest.mark.parametrize("seed", range(6))
def test_pack_rows_invariants(seed):
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 40, (1,), generator=g))
    prompt_w = torch.randint(1, 30, (bs,), generator=g)
    response_w = torch.randint(1, 60, (bs,), generator=g)
    budget = int(torch.randint(20, 400, (1,), generator=g))
    max_rows = [None, 3][seed % 2]
    groups = pack_rows(prompt_w, response_w, max_tokens=budget, max_rows=max_rows)
    # every row exactly once, in order: concatenation is arange(bs) (outputs cat back in batch order)
    assert torch.equal(torch.cat(groups), torch.arange(bs))
    for i, group in enumerate(groups):
        cost = padded_tokens(prompt_w[group], response_w[group])
        assert cost <= budget or group.numel() == 1  # budget respected, or one over-long row alone
        assert max_rows is None or group.numel() <= max_rows
        if i + 1 < len(groups):  # greedy: the next row did not fit
            grown = torch.cat([group, groups[i + 1][:1]])
            assert padded_tokens(prompt_w[grown], response_w[grown]) > budget or (
                max_rows is not None and grown.numel() > max_rows)


def test_split_to_count_keeps_order_and_refuses_too_few_rows():
    groups = [torch.tensor([0, 1, 2, 3]), torch.tensor([4])]
    split = split_to_count(groups, 4)
    assert len(split) == 4 and torch.equal(torch.cat(split), torch.arange(5))
    assert all(s.numel() > 0 for s in split)
    with pytest.raises(ValueError, match="micro-batches but this rank has only 5 rows"):
        split_to_count(groups, 6)


def test_plan_rejects_bad_settings():
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch"):
        MicroBatchPlan(max_tokens=0)
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        MicroBatchPlan(max_rows=-2)


# ---------------------------------------------------------------------------------------------- chunked log-probs
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_logprobs_and_entropy_equal_the_direct_computation(chunk):
    model = tiny_lm(1)
    batch = make_batch([5, 3, 1], [7, 4, 2], seed=1)
    ids, mask = inputs(batch)
    banned = [3, 17, VOCAB - 1]
    labels = batch["responses"].clone()
    labels[labels == 3] = 4  # a banned label would be -inf on both sides; keep the comparison finite
    ids[:, P:] = labels

    def direct():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, P - 1:-1]
        return token_logprobs_from_logits(logits, labels, 0.7, banned), entropy_from_logits(logits, banned, 0.7)

    lp_ref, ent_ref = direct()
    valid = batch["response_attention"] > 0
    (lp_ref[valid].sum() + 0.3 * ent_ref[valid].sum()).backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    lp, ent = response_token_logprobs(model, ids, mask, T, 0.7, banned, with_entropy=True, chunk_tokens=chunk)
    torch.testing.assert_close(lp[valid], lp_ref[valid], atol=TOL, rtol=0)
    torch.testing.assert_close(ent[valid], ent_ref[valid], atol=TOL, rtol=0)
    (lp[valid].sum() + 0.3 * ent[valid].sum()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads_ref[name], atol=TOL, rtol=0, msg=name)
    # banned rows of the LM head get exactly no gradient: they are outside the restricted softmax
    assert (model.lm_head.weight.grad[banned] == 0).all()


def test_chunked_head_equals_full_logits_on_raw_hidden_states():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=True)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    labels = torch.randint(0, 20, (3, 5))
    lp, ent = chunked_head_logprobs(hidden, head, labels, 1.3, [2], True, chunk_tokens=4)
    logits = head(hidden)
    lp_ref = token_logprobs_from_logits(logits, labels, 1.3, [2])
    ent_ref = entropy_from_logits(logits, [2], 1.3)
    finite = torch.isfinite(lp_ref)
    torch.testing.assert_close(lp[finite], lp_ref[finite], atol=TOL, rtol=0)
    assert torch.equal(torch.isneginf(lp), torch.isneginf(lp_ref))  # label 2 is banned: -inf on both sides
    torch.testing.assert_close(ent, ent_ref, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_head_logprobs(hidden, head, labels, chunk_tokens=0)


def test_trailing_padding_columns_change_nothing():
    """Extra all-padding columns are dropped before the forward: valid outputs are unchanged, padding gets 0."""
    model = tiny_lm(2)
    critic = CriticModel(tiny_lm(2))
    batch = make_batch([5, 2], [3, 1], seed=2)
    ids, mask = inputs(batch)
    with torch.no_grad():
        lp, _ = response_token_logprobs(model, ids, mask, T)
        direct = model(input_ids=ids, attention_mask=mask).logits[:, P - 1:-1]
        lp_ref = token_logprobs_from_logits(direct, batch["responses"])
        values = critic(ids, mask)
        h = critic.backbone(input_ids=ids, attention_mask=mask,
                            position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        values_ref = critic.value_head(h).squeeze(-1)
    valid = batch["response_attention"] > 0
    torch.testing.assert_close(lp[valid], lp_ref[valid], atol=TOL, rtol=0)
    assert (lp[~valid] == 0).all()  # padding reads 0 (columns after the longest response are not computed)
    real = mask > 0
    torch.testing.assert_close(values[real], values_ref[real], atol=TOL, rtol=0)
    assert (values[~real] == 0).all() and values.dtype == torch.float32


# ------------------------------------------------------------------------------- gradient accumulation
def _token_mean_loss(engine, mb, denominator):
    ids, mask = inputs(mb)
    lp, _ = response_token_logprobs(engine.module, ids, mask, T)
    m = mb["response_mask"]
    return engine.backward(-(mb["advantages"] * lp * m).sum(), denominator)


def _trajectory_mean_loss(engine, mb, denominator):
    """Eq. 1's aggregation: each trajectory's token mean counts once; denominator = trajectories."""
    ids, mask = inputs(mb)
    lp, _ = response_token_logprobs(engine.module, ids, mask, T)
    m = mb["response_mask"]
    per_row = -(mb["advantages"] * lp * m).sum(-1) / m.sum(-1).clamp(min=1)
    return engine.backward(per_row.sum(), denominator)


@pytest.mark.parametrize("loss, count", [(_token_mean_loss, "tokens"), (_trajectory_mean_loss, "rows")])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_micro_batched_gradients_equal_the_one_batch_gradients(loss, count, checkpointing):
    batch = make_batch([5, 3, 1, 4, 2], [7, 4, 2, 6, 1], seed=3)
    whole = FSDPEngine(tiny_lm(3), OptimizerConfig(lr=1e-3))
    chunked = FSDPEngine(tiny_lm(3), OptimizerConfig(lr=1e-3), activation_checkpointing=checkpointing)
    whole.train_mode(), chunked.train_mode()

    def local_count(b):
        return b["response_mask"].sum() if count == "tokens" else torch.tensor(float(b["response_mask"].shape[0]))

    # one batch
    loss(whole, batch, whole.global_denominator(local_count(batch)))
    expected = whole.full_gradients()
    # widths 5+7, 3+4, 1+2, 4+6, 2+1; budget 24 -> [0, 1] = 2 x 12, [2, 3] = 2 x 10, [4] = 3 tokens
    groups = MicroBatchPlan(max_tokens=24).split(batch)
    assert [g.tolist() for g in groups] == [[0, 1], [2, 3], [4]]
    denominator = chunked.global_denominator(local_count(batch))  # once per step, before the loop
    for rows in groups:
        loss(chunked, rows_of(batch, rows), denominator)
    actual = chunked.full_gradients()
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=TOL, rtol=0, msg=name)


def test_activation_checkpointing_recomputes_each_decoder_layer():
    engine = FSDPEngine(tiny_lm(4), OptimizerConfig(), activation_checkpointing=True)
    assert engine.activation_checkpointing == "hf"
    calls = []
    for layer in engine.module.model.layers:
        # a pre-hook: the recompute stops early once backward has what it needs, before post-hooks run
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = make_batch([5, 5], [7, 7], seed=4)
    engine.train_mode()
    assert _token_mean_loss(engine, batch, engine.global_denominator(batch["response_mask"].sum())) is not None
    # 2 layers: forward once each, then once more each when backward recomputes them
    assert len(calls) == 4


def test_activation_checkpointing_on_a_model_without_hf_support():
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = torch.tanh(block(x))
            return x

    torch.manual_seed(0)
    plain, checkpointed = Blocks(), Blocks()
    checkpointed.load_state_dict(plain.state_dict())
    engine = FSDPEngine(checkpointed, OptimizerConfig(), activation_checkpointing=True)
    assert engine.activation_checkpointing == "blocks"
    x = torch.randn(5, 4)
    plain(x).square().sum().backward()
    engine.train_mode()
    engine.module(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), engine.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=TOL, rtol=0, msg=name)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        FSDPEngine(torch.nn.Linear(3, 3), OptimizerConfig(), activation_checkpointing=True)


@pytest.mark.parametrize("max_rows", [1, 3])
def test_critic_ranking_loss_across_micro_batches_equals_the_one_batch_gradient(max_rows):
    """Li2SAO's bootstrap critic (Eq. 10 + α Eq. 11) split into micro-batches that cut groups apart gives
    the one-batch gradient: the ranking term goes through its exact gradient at the terminal values."""
    from async_rl.workers.roles import CriticRole

    batch = make_batch([5, 3, 4, 5, 2, 4], [7, 5, 6, 3, 7, 4], seed=3)
    mask = batch["response_mask"]
    targets = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)) * mask
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    ranking = {"scores": scores, "group_ids": ["a", "a", "a", "b", "b", "b"], "margin": 0.1, "coef": 0.1}
    grads, losses = [], []
    for rows in (None, max_rows):
        role = CriticRole(tiny_lm(seed=1), OptimizerConfig(lr=0.0, max_grad_norm=None), micro_batch_size=rows)
        old = role.values(batch)
        step = role.engine.step  # gradients are zeroed by the step: read them just before it

        def recording_step(engine=role.engine, step=step):
            grads.append({k: v.detach().clone() for k, v in engine.full_gradients().items()})
            return step()

        role.engine.step = recording_step
        metrics = role.update(batch, targets, mask, old, clip_eps=0.2, ranking=ranking)
        losses.append(metrics["li2sao/rank_loss"])
    assert len(grads[0]) > 0
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=TOL, rtol=1e-4)
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)

"""trainer.precision: bf16 compute with float32 master weights and AdamW state (docs/engine.md §7), for the
actor engine, the critic and the SAPO backbone; plus SAPO's chunked readouts and micro-batched update, and a
2-rank gloo run of the sharded (FSDP2 MixedPrecisionPolicy) path and of token-budget micro-batches."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from async_rl.driver.learner import shared_backbone_targets
from async_rl.driver.batch import collate, turn_tensors
from async_rl.driver.trajectory import Segment, Trajectory
from async_rl.engine import FSDPEngine, MicroBatchPlan, OptimizerConfig, TrainingSettings, dist
from async_rl.engine.precision import bf16_supported
from async_rl.models.critic import CriticModel
from async_rl.models.loading import load_tokenizer
from async_rl.models.logprobs import response_token_logprobs
from async_rl.models.tiny import make_tiny_model
from async_rl.workers.sapo import SapoRole, resolve_reserved_ids

VOCAB, P, T = 96, 4, 6
CPU = torch.device("cpu")
needs_cpu_bf16 = pytest.mark.skipif(not bf16_supported(CPU), reason="this torch build has no CPU bf16 autocast")


def tiny_lm(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def make_batch(seed: int = 0, response_lens=(6, 5, 2, 1)):
    g = torch.Generator().manual_seed(seed)
    bs = len(response_lens)
    ids = torch.randint(0, VOCAB, (bs, P + T), generator=g)
    response_mask = (torch.arange(T)[None, :] < torch.tensor(response_lens)[:, None]).float()
    prompt_mask = torch.ones(bs, P)
    prompt_mask[1, :2] = 0
    return {"prompts": ids[:, :P], "responses": ids[:, P:], "prompt_mask": prompt_mask,
            "response_attention": response_mask, "response_mask": response_mask,
            "advantages": torch.randn(bs, T, generator=g)}


def policy_loss_step(engine: FSDPEngine, batch, plan: MicroBatchPlan | None = None):
    """Token-mean -A * log-prob over micro-batches with the step's global denominator; returns (loss, grads)."""
    engine.train_mode()
    denominator = engine.global_denominator(batch["response_mask"].sum())
    loss = 0.0
    for rows in (plan or MicroBatchPlan()).split(batch):
        mb = {k: v[rows] for k, v in batch.items()}
        ids = torch.cat([mb["prompts"], mb["responses"]], 1)
        mask = torch.cat([mb["prompt_mask"], mb["response_attention"]], 1).long()
        lp, _ = response_token_logprobs(engine.module, ids, mask, T)
        loss += float(engine.backward(-(mb["advantages"] * lp * mb["response_mask"]).sum(), denominator))
    return loss, engine.full_gradients()


# ------------------------------------------------------------------------------------------------ master weights
def test_invalid_precision_is_rejected_with_the_key_name():
    with pytest.raises(ValueError, match=r"trainer.precision='fp16'; valid choices: bf16, fp32"):
        FSDPEngine(tiny_lm(), OptimizerConfig(), precision="fp16")
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch"):
        TrainingSettings(max_tokens_per_micro_batch=0).validate()


def test_an_engine_model_is_not_copied_or_wrapped_twice():
    import copy

    model = tiny_lm()
    FSDPEngine(model, OptimizerConfig())
    # the engine's forward (precision, chunked heads) is bound to this module: a copy would call the original
    with pytest.raises(TypeError, match="cannot be deep-copied; copy the model before building the engine"):
        copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="already has an engine root forward"):
        FSDPEngine(model, OptimizerConfig())


@needs_cpu_bf16
def test_bf16_with_fp32_master_moves_weights_where_pure_bf16_does_not():
    batch = make_batch(1)
    optim = OptimizerConfig(lr=1e-6, weight_decay=0.0, max_grad_norm=None)

    # pure bf16: the parameters themselves are bf16 and AdamW steps them in place
    pure = tiny_lm(0).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in pure.named_parameters()}
    adam = torch.optim.AdamW(pure.parameters(), lr=optim.lr, weight_decay=0.0)
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_attention"]], 1).long()
    lp, _ = response_token_logprobs(pure, ids, mask, T)
    (-(batch["advantages"] * lp * batch["response_mask"]).sum() / batch["response_mask"].sum()).backward()
    pushed = {n: p.grad != 0 for n, p in pure.named_parameters()}  # weights with a gradient to follow
    adam.step()
    # AdamW's first step moves each weight by ~lr = 1e-6; bf16 spacing at |w| ~ 0.02 is 1.2e-4, so
    # the update rounds away except on the few weights below ~2.6e-4 in magnitude
    changed = sum(int((p.detach() != before[n])[pushed[n]].sum()) for n, p in pure.named_parameters())
    total = sum(int(m.sum()) for m in pushed.values())
    assert total > 10_000 and changed / total < 0.05

    # the engine: a bf16 checkpoint is upcast to fp32 masters; compute is bf16 under autocast
    engine = FSDPEngine(tiny_lm(0).to(torch.bfloat16), optim, precision="bf16")
    assert engine.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _, grads = policy_loss_step(engine, batch)
    assert all(g.dtype == torch.float32 for g in grads.values())
    pushed = {n: g != 0 for n, g in grads.items()}
    engine.step()
    moved = sum(int((p.detach() != start[n])[pushed[n]].sum()) for n, p in engine.module.named_parameters())
    assert moved / sum(int(m.sum()) for m in pushed.values()) > 0.99
    for state in engine.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # the largest change is ~lr (Adam's normalised step), far below bf16 resolution and kept by fp32
    delta = max(float((p.detach() - start[n]).abs().max()) for n, p in engine.module.named_parameters())
    assert 5e-7 < delta < 2e-6


@needs_cpu_bf16
def test_bf16_computes_in_bf16_and_loading_bf16_weights_keeps_fp32_masters():
    engine = FSDPEngine(tiny_lm(0), OptimizerConfig(), precision="bf16")
    ids = torch.randint(0, VOCAB, (2, 5))
    logits = engine.module(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16  # the LM head ran under autocast
    # a bf16 state dict (e.g. a bf16 checkpoint or a rollout's weights) is copied into fp32 parameters
    bf16_state = {k: v.to(torch.bfloat16) for k, v in tiny_lm(5).state_dict().items()}
    engine.load_full_state_dict(bf16_state)
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(engine.module.get_parameter(name).detach(), bf16_state[name].float())
    # fp32 precision: no autocast at all
    fp32 = FSDPEngine(tiny_lm(0), OptimizerConfig(), precision="fp32")
    assert fp32.module(input_ids=ids).logits.dtype == torch.float32


@needs_cpu_bf16
def test_bf16_critic_keeps_an_fp32_value_head_and_close_values():
    critic32 = CriticModel(tiny_lm(2))
    critic16 = CriticModel(tiny_lm(2))
    critic16.load_state_dict(critic32.state_dict())
    e32 = FSDPEngine(critic32, OptimizerConfig(), precision="fp32")
    e16 = FSDPEngine(critic16, OptimizerConfig(), precision="bf16")
    ids = torch.randint(0, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    v32, v16 = e32.module(ids, mask), e16.module(ids, mask)
    assert v16.dtype == torch.float32 and e16.module.value_head.weight.dtype == torch.float32
    # bf16 backbone: values differ from fp32 by bf16 rounding only (|v| ~ 0.02 here)
    assert float((v16 - v32).detach().abs().max()) < 5e-3
    v16.sum().backward()
    assert e16.module.value_head.weight.grad.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------- SAPO
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("precision") / "tiny", seed=0)


def sapo_batch(tiny_dir):
    def trajectory(uid, prompt, turns, rewards):
        segments = []
        for k, (action, obs) in enumerate(turns):
            segments.append(Segment("model", list(action), [0.0] * len(action), [0] * len(action), turn=k))
            if obs:
                segments.append(Segment("env", list(obs), turn=k))
        n = len(turns)
        return Trajectory(uid=uid, group_id=uid, prompt_index=0, prompt_ids=list(prompt), segments=segments,
                          num_turns=n, turn_rewards=list(rewards), turn_dones=[False] * (n - 1) + [True],
                          turn_invalid=[False] * n, truncated=False, reward=float(sum(rewards)))

    trajs = [
        trajectory("a", [11, 12, 13, 14], [([40, 41, 42], [90, 91]), ([43, 44], None)], [0.0, 1.0]),
        trajectory("b", [21, 22], [([50, 51], [95]), ([52, 53, 54, 55], None)], [0.0, 0.5]),
        trajectory("c", [31], [([60], None)], [1.0]),
    ]
    pad = load_tokenizer(tiny_dir).pad_token_id
    return trajs, collate(trajs, pad)


def sapo_role(tiny_dir, **kwargs):
    reserved = resolve_reserved_ids(load_tokenizer(tiny_dir))
    optim = OptimizerConfig(lr=1e-3, weight_decay=0.0, max_grad_norm=None)
    return SapoRole(tiny_dir, optim, reserved, kl_coef=0.01, **kwargs)


def test_sapo_chunked_readouts_equal_the_full_logits_path(tiny_dir):
    _, batch = sapo_batch(tiny_dir)
    chunked = sapo_role(tiny_dir, logits_chunk_tokens=3)
    full = sapo_role(tiny_dir, logits_chunk_tokens=None)
    a, b = chunked.evaluate(batch), full.evaluate(batch)
    for key in ("log_probs", "entropy", "p_v", "p_q", "turn_mask"):
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=key)


def _captured_update(role, batch, trajs):
    """SapoRole.update with the gradients read just before the optimizer step."""
    turns = turn_tensors(trajs)
    _, targets = shared_backbone_targets(role, batch, turns, {})
    batch = {**batch, "behaviour_log_probs": targets["old_log_probs"] - 0.05 * batch["response_mask"]}
    captured = {}
    step = role.engine.step

    def step_and_capture():
        captured.update(role.engine.full_gradients())
        return step()

    role.engine.step = step_and_capture
    metrics = role.update(batch, turns, targets)
    return metrics, captured


def test_sapo_micro_batched_update_equals_the_one_batch_update(tiny_dir):
    trajs, batch = sapo_batch(tiny_dir)
    whole_metrics, whole = _captured_update(sapo_role(tiny_dir), batch, trajs)
    # rows (prompt + response widths): 4 + 7, 2 + 7, 1 + 1. Budget 15: [0, 1] = 2 x (4 + 7) = 22 > 15 and
    # [1, 2] = 2 x (2 + 7) = 18 > 15, so every row runs alone
    split_role = sapo_role(tiny_dir, max_tokens_per_micro_batch=15)
    assert [g.tolist() for g in split_role.micro_batching.split(batch)] == [[0], [1], [2]]
    split_metrics, split = _captured_update(split_role, batch, trajs)
    assert whole.keys() == split.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-5, rtol=0, msg=name)
    for key in ("sapo/loss", "sapo/v_loss", "sapo/q_loss", "actor/pg_loss", "sapo/kl"):
        assert abs(split_metrics[key] - whole_metrics[key]) < 1e-5, key


@needs_cpu_bf16
def test_sapo_bf16_keeps_fp32_masters_and_reserved_ids_get_no_policy_gradient(tiny_dir):
    trajs, batch = sapo_batch(tiny_dir)
    role = sapo_role(tiny_dir, precision="bf16", activation_checkpointing=True)
    assert role.engine.compute_dtype == torch.bfloat16
    assert next(role.ref_model.parameters()).dtype == torch.bfloat16  # frozen: stored in the compute dtype
    assert all(p.dtype == torch.float32 for p in role.engine.module.parameters())
    out = role.forward(batch)
    mask = batch["response_mask"]
    (-(out["log_probs"] * mask).sum() - 0.1 * (out["entropy"] * mask).sum()).backward()
    head = role.engine.module.get_output_embeddings().weight
    assert head.grad.dtype == torch.float32
    assert (head.grad[list(role.reserved_ids)] == 0).all() and head.grad.abs().sum() > 0
    role.engine.zero_grad()
    metrics, grads = _captured_update(role, batch, trajs)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert abs(metrics["sapo/kl"]) < 1e-3  # reference = the same weights rounded the same way


# ------------------------------------------------------------------------------------------------- 2 gloo ranks
def _dp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, world_size, "127.0.0.1", port, device="cpu")
    try:
        batch = make_batch(3, response_lens=(6, 6, 1, 1))
        share = 4 // world_size
        mine = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
        # rank 0 holds the two long rows (4 + 6 = 10 tokens each), rank 1 two short ones (4 + 1): with a
        # 12-token budget rank 0 needs 2 micro-batches and rank 1 only 1 -> the plan splits rank 1's in two
        plan = MicroBatchPlan(max_tokens=12)
        result = {"groups": [g.tolist() for g in plan.split(mine)]}
        fp32 = FSDPEngine(tiny_lm(0), OptimizerConfig(lr=1e-3))
        result["fp32_loss"], result["fp32_grads"] = policy_loss_step(fp32, mine, plan)
        if bf16_supported(CPU):
            bf16 = FSDPEngine(tiny_lm(0), OptimizerConfig(lr=1e-3), precision="bf16", activation_checkpointing=True)
            loss = torch.tensor(policy_loss_step(bf16, mine, plan)[0], dtype=torch.float64)
            result["bf16_loss"] = float(dist.all_reduce_sum(loss))
            result["bf16_param_dtypes"] = sorted({str(p.to_local().dtype if hasattr(p, "to_local") else p.dtype)
                                                 for p in bf16.module.parameters()})
            before = bf16.full_state_dict()
            bf16.step()
            after = bf16.full_state_dict()
            result["bf16_moved"] = max(float((after[n] - before[n]).abs().max()) for n in before)
        torch.save(result, os.path.join(out_dir, f"w{world_size}_r{rank}.pt"))
    finally:
        dist.destroy_distributed()


def _spawn(world_size: int, out_dir: str) -> list[dict]:
    mp.spawn(_dp_worker, args=(world_size, dist.find_free_port(), out_dir), nprocs=world_size, join=True)
    return [torch.load(os.path.join(out_dir, f"w{world_size}_r{r}.pt"), weights_only=False) for r in range(world_size)]


@pytest.mark.slow
def test_two_ranks_token_budget_and_bf16_mixed_precision(tmp_path):
    (single,) = _spawn(1, str(tmp_path))
    ranks = _spawn(2, str(tmp_path))
    # micro-batch counts agree across ranks (2 each) though rank 1 alone would need one
    assert ranks[0]["groups"] == [[0], [1]] and ranks[1]["groups"] == [[0], [1]]
    # fp32: sharded, micro-batched gradients equal the single-process gradients
    for result in ranks:
        for name, grad in single["fp32_grads"].items():
            torch.testing.assert_close(result["fp32_grads"][name], grad, atol=1e-5, rtol=0, msg=name)
    if "bf16_loss" in single:
        # bf16 sharded (FSDP2 MixedPrecisionPolicy) vs unsharded autocast: same loss up to bf16 rounding
        full_loss = ranks[0]["fp32_loss"] + ranks[1]["fp32_loss"]
        assert abs(ranks[0]["bf16_loss"] - full_loss) < 2e-2
        assert abs(single["bf16_loss"] - full_loss) < 2e-2
        assert ranks[0]["bf16_param_dtypes"] == ["torch.float32"]  # fp32 master shards
        assert ranks[0]["bf16_moved"] > 1e-4

"""Li2SAO's ranking loss (Eq. 11) under data parallelism: ``1/|P|`` over the pairs of the *global* batch.

Two gloo ranks on CPU against one process on the same 7 trajectories: a group whose aborted member was
dropped (3 left) and a group of 4 that the contiguous dispatch cuts across the two ranks, plus the
zero-weight padding row that makes the shards equal. Loss and gradients agree to 1e-6 (the weights after
AdamW's first step are not compared: it divides by |g|, so entries near 0 amplify float noise).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from async_rl.engine import OptimizerConfig, dist

VOCAB, P, T = 96, 5, 7
# two gloo ranks in spawned processes: tens of seconds of start-up
pytestmark = pytest.mark.slow


OPTIM = OptimizerConfig(lr=1e-2, max_grad_norm=None)
# group "a" lost its 4th member to an abort; group "b" is split 1 | 3 between rank 0 and rank 1
GROUPS = ["a", "a", "a", "b", "b", "b", "b"]
SCORES = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
RANKING = {"margin": 0.1, "coef": 0.1}


def tiny_lm(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def make_batch() -> dict:
    g = torch.Generator().manual_seed(5)
    response_lens = torch.tensor([7, 5, 6, 3, 7, 4, 2])
    prompt_lens = torch.tensor([5, 3, 4, 5, 2, 4, 5])
    bs = len(response_lens)
    response_attention = (torch.arange(T)[None, :] < response_lens[:, None]).float()
    return {
        "prompts": torch.randint(0, VOCAB, (bs, P), generator=g),
        "responses": torch.randint(0, VOCAB, (bs, T), generator=g),
        "prompt_mask": (torch.arange(P)[None, :] >= P - prompt_lens[:, None]).float(),
        "response_attention": response_attention,
        "response_mask": response_attention.clone(),
        "targets": torch.randn(bs, T, generator=g) * response_attention,
        "scores": torch.tensor(SCORES),
    }


def padded_shard(batch: dict, group_ids: list, rank: int, world_size: int) -> tuple[dict, list]:
    """What verl's dispatch hands rank ``rank``: pad to a multiple of the world size with zero-weight rows
    (a unique group id each, as :func:`pad_proto_for_dp` does), then a contiguous equal shard."""
    n = len(group_ids)
    pad = (-n) % world_size
    full = {k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) for k, v in batch.items()}
    full["response_mask"][n:] = 0.0
    full["targets"][n:] = 0.0
    ids = list(group_ids) + [f"__pad_{i}__" for i in range(pad)]
    per = (n + pad) // world_size
    rows = slice(rank * per, (rank + 1) * per)
    return {k: v[rows] for k, v in full.items()}, ids[rows]


def _worker(rank: int, world_size: int, port: int, out_dir: str, coef: float) -> None:
    from async_rl.workers.roles import CriticRole

    torch.set_num_threads(1)
    dist.init_distributed(rank, world_size, "127.0.0.1", port, device="cpu")
    try:
        role = CriticRole(tiny_lm(seed=1), OPTIM)
        shard, ids = padded_shard(make_batch(), GROUPS, rank, world_size)
        old = role.values(shard)
        grads = {}
        step = role.engine.step

        def recording_step():
            grads.update({k: v.detach().clone() for k, v in role.engine.full_gradients().items()})
            return step()

        role.engine.step = recording_step
        metrics = role.update(shard, shard["targets"], shard["response_mask"], old, clip_eps=0.2,
                              ranking={"scores": shard["scores"], "group_ids": ids, **RANKING, "coef": coef})
        result = {"metrics": metrics, "grads": grads}
        torch.save(result, os.path.join(out_dir, f"w{world_size}_c{coef}_r{rank}.pt"))
    finally:
        dist.destroy_distributed()


def spawn(world_size: int, out_dir: str, coef: float) -> list[dict]:
    mp.spawn(_worker, args=(world_size, dist.find_free_port(), out_dir, coef), nprocs=world_size, join=True)
    return [torch.load(os.path.join(out_dir, f"w{world_size}_c{coef}_r{r}.pt"), weights_only=False)
            for r in range(world_size)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rank_dp"))
    return {"one": spawn(1, out, RANKING["coef"])[0], "two": spawn(2, out, RANKING["coef"]),
            "one_no_rank": spawn(1, out, 0.0)[0]}


@pytest.mark.slow
def test_two_ranks_rank_loss_equals_one_rank_over_all_pairs(runs):
    """|P| = 2 (group a: 1 x 2) + 4 (group b: 2 x 2) = 6 pairs; the loss is their mean on every rank,
    not the mean of the two ranks' own pair means (rank 0 holds 2 pairs, rank 1 holds 2, 2 cross)."""
    one = runs["one"]["metrics"]["li2sao/rank_loss"]
    assert one > 0.0
    for rank in runs["two"]:
        assert rank["metrics"]["li2sao/rank_loss"] == pytest.approx(one, abs=1e-6)


def test_two_ranks_ranking_gradient_equals_one_rank(runs):
    one = runs["one"]
    # the ranking term moves the gradient (so the comparison below tests it, not just the value loss)
    assert max(float((one["grads"][k] - runs["one_no_rank"]["grads"][k]).abs().max()) for k in one["grads"]) > 1e-4
    for rank in runs["two"]:
        assert rank["grads"].keys() == one["grads"].keys()
        for name, g in one["grads"].items():
            torch.testing.assert_close(rank["grads"][name], g, atol=1e-6, rtol=0, msg=name)

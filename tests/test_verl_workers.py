"""The roles as verl single_controller workers on Ray (CPU, gloo).

One module-scoped Ray instance with more logical CPUs than the machine has cores (a scheduling label
only), two placements started once (starting worker processes is the slow part):

* ``disagg``: actor + critic on 2 train processes (FSDP over gloo), no rollout engine;
* ``coloc``: 2 processes, each with actor + critic + rollout engine (its own copy of the weights), served as
  rollout.mode=hybrid replicas.

Checks: DP through verl's dispatch equals one in-process role; the hybrid replicas' behaviour log-probs equal the
actor's log-probs after a publication; a failing or slow worker call surfaces at the driver with a named error
within a bounded time.
"""

from __future__ import annotations

import time

import pytest
import torch

import ray  # noqa: E402  (a hard dependency: a broken Ray must fail, not skip)

from async_rl.algos.metrics import MISMATCH_METRIC_KEYS  # noqa: E402
from async_rl.driver.batch import collate, mark_current_version  # noqa: E402
from async_rl.driver.trajectory import Segment, Trajectory  # noqa: E402
from async_rl.engine.base import OptimizerConfig  # noqa: E402
from async_rl.models.loading import load_causal_lm  # noqa: E402
from async_rl.models.tiny import make_tiny_model  # noqa: E402
from async_rl.workers.placement import make_worker_groups, shutdown_worker_groups  # noqa: E402
from async_rl.workers.roles import ActorRole, CriticRole  # noqa: E402
from async_rl.workers.calls import WorkerCallError, WorkerTimeoutError, wait_for_workers  # noqa: E402
from async_rl.workers.proto import pad_proto_for_dp  # noqa: E402
from async_rl.workers.role_calls import pack_call, unpack_call  # noqa: E402

OPTIM = OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, max_grad_norm=1.0)
CALL_TIMEOUT_S = 240.0
PAD_ID = 0
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("verl_workers") / "tiny", seed=0))


@pytest.fixture(scope="module")
def ray_cluster():
    # 2 physical cores: 8 logical CPUs so that 3 + 2 one-CPU bundles fit; no dashboard.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _groups(placement, n_train, n_rollout, tiny_dir):
    return make_worker_groups(placement, n_train, n_rollout, tiny_dir, actor_kwargs={"optim": OPTIM},
                              critic_kwargs={"optim": OPTIM}, call_timeout_s=CALL_TIMEOUT_S)


@pytest.fixture(scope="module")
def disagg(ray_cluster, tiny_dir):
    groups = _groups("disaggregated", 2, 0, tiny_dir)
    yield groups
    shutdown_worker_groups(groups)


@pytest.fixture(scope="module")
def coloc(ray_cluster, tiny_dir, disagg):
    groups = _groups("colocated", 2, None, tiny_dir)
    yield groups
    shutdown_worker_groups(groups)


def training_batch(seed: int = 0, n: int = 5) -> tuple[dict, torch.Tensor]:
    """``n`` trajectories (5 is not a multiple of 2: one zero-weight padding row) with mixed prompt and
    response lengths and an env segment (mask 0) in the middle of some responses."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(5, VOCAB, (k,), generator=g).tolist()

    def model_seg(k, turn):
        return Segment("model", ids(k), (-torch.rand(k, generator=g) * 3).tolist(), [0] * k, turn)

    trajectories = []
    for i in range(n):
        segments = [model_seg(2 + (3 * i) % 5, 0)]
        if i % 2 == 0:
            segments += [Segment("env", ids(2), turn=0), model_seg(1 + i, 1)]
        trajectories.append(Trajectory(uid=f"u{i}", group_id=f"g{i // 2}", prompt_index=i,
                                       prompt_ids=ids(3 + i % 3), segments=segments, reward=float(i % 2)))
    batch = collate(trajectories, PAD_ID)
    advantages = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    return batch, advantages


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --------------------------------------------------------------------------------------------- no Ray


def test_call_round_trip_and_zero_weight_padding():
    """A role call packed for the workers (workers/role_calls.py) comes back as the same arguments; padding rows
    copy real tokens but carry no loss weight, and their group ids pair with nobody."""
    batch, advantages = training_batch()
    ranking = {"scores": batch["scores"], "group_ids": ["a", "a", "b", "b", "c"], "margin": 0.1, "coef": 0.5}
    proto = pack_call("update", {"batch": batch, "advantages": advantages, "loss_mode": "vanilla",
                                 "ranking": ranking, "clip_low": None})
    assert proto.meta_info["method"] == "update" and proto.meta_info["kwargs"] == {"loss_mode": "vanilla",
                                                                                   "clip_low": None}
    back = unpack_call(proto)
    assert set(back) == {"batch", "advantages", "loss_mode", "ranking", "clip_low"}
    assert torch.equal(back["advantages"], advantages) and back["ranking"]["group_ids"] == ranking["group_ids"]
    assert (back["ranking"]["margin"], back["ranking"]["coef"]) == (0.1, 0.5)
    assert torch.equal(back["ranking"]["scores"], ranking["scores"])
    for key, value in batch.items():
        assert torch.equal(back["batch"][key], value), key
    with pytest.raises(ValueError, match="one entry per row"):
        pack_call("update", {"batch": {**batch, "group_ids": ["a"]}})

    padded, added = pad_proto_for_dp(proto, 4, zero_keys=("response_mask", "arg__advantages"))
    assert (len(padded), added) == (8, 3)
    rows = unpack_call(padded)
    assert torch.equal(rows["batch"]["responses"][5:], batch["responses"][-1:].expand(3, -1))  # real tokens, ...
    assert float(rows["batch"]["response_mask"][5:].abs().sum()) == 0.0  # ... but no loss weight
    assert float(rows["advantages"][5:].abs().sum()) == 0.0
    assert len(set(rows["ranking"]["group_ids"][5:]) | set(ranking["group_ids"])) == 6  # pads pair with nobody
    assert pad_proto_for_dp(proto, 5)[1] == 0


# --------------------------------------------------------------------------------------------- Ray


@pytest.mark.slow
def test_two_actor_ranks_match_single_process_update(disagg, tiny_dir):
    """world size 2 (gloo) through DP_COMPUTE_PROTO == one in-process ActorRole on the full batch."""
    batch, advantages = training_batch(seed=1)
    remote = disagg.remote_actor()
    local = ActorRole(load_causal_lm(tiny_dir), OPTIM)
    before = local.export_weights()

    assert torch.allclose(remote.log_probs(batch), local.log_probs(batch), atol=1e-5)

    mark_current_version(batch, 0)  # every token at the trainer's version: the engine-vs-trainer metrics are logged
    remote_metrics = remote.update(batch, advantages, "vanilla")
    local_metrics = local.update(batch, advantages, "vanilla")
    after_remote, after_local = remote.export_weights(), local.export_weights()
    assert max_diff(after_local, before) > 5e-4  # the step moved the weights: the comparison has teeth
    assert max_diff(after_remote, after_local) < 1e-5
    # the mismatch metrics are built from all-reduced sums: summing them over the ranks again would double them
    assert local_metrics["rollout/mismatch_tokens"] == float(batch["response_mask"].sum()) > 0
    for key in ("actor/pg_loss", "actor/grad_norm", *MISMATCH_METRIC_KEYS):
        assert remote_metrics[key] == pytest.approx(local_metrics[key], abs=1e-5), key


def test_two_critic_ranks_match_single_process_update(disagg, tiny_dir):
    """Critic values and one clipped-value-loss step through the critic worker group (world size 2) ==
    one in-process CriticRole; the workers' (random) value head reaches it through state_dict."""
    batch, _ = training_batch(seed=3)
    remote = disagg.remote_critic()
    local = CriticRole(load_causal_lm(tiny_dir), OPTIM)
    local.engine.load_full_state_dict(remote.state_dict()["model"])

    old_values = local.values(batch)
    assert torch.allclose(remote.values(batch), old_values, atol=1e-5)
    targets = torch.randn(old_values.shape, generator=torch.Generator().manual_seed(4)) * 0.1
    mask = batch["response_mask"]
    remote_metrics = remote.update(batch, targets, mask, old_values, clip_eps=0.2)
    local_metrics = local.update(batch, targets, mask, old_values, clip_eps=0.2)
    assert remote_metrics["critic/value_loss"] == pytest.approx(local_metrics["critic/value_loss"], abs=1e-6)
    assert max_diff(remote.state_dict()["model"], local.engine.full_state_dict()) < 1e-5


def test_two_critic_ranks_rank_loss_is_eq11_over_the_global_batch(disagg, tiny_dir):
    """The ranking term through the worker group: 5 rows pad to 6 and split 3 | 3, so group g1 straddles the
    two ranks (rows 2 and 3). Eq. 11's 1/|P| over all pairs == one in-process CriticRole on the full batch."""
    batch, _ = training_batch(seed=5)
    remote = disagg.remote_critic()
    local = CriticRole(load_causal_lm(tiny_dir), OPTIM)
    local.engine.load_full_state_dict(remote.state_dict()["model"])
    old_values = local.values(batch)
    targets = torch.randn(old_values.shape, generator=torch.Generator().manual_seed(6)) * 0.1
    mask = batch["response_mask"]
    ranking = {"scores": batch["scores"], "group_ids": ["g0", "g0", "g1", "g1", "g2"], "margin": 0.1, "coef": 0.1}
    remote_metrics = remote.update(batch, targets, mask, old_values, clip_eps=0.2, ranking=ranking)
    local_metrics = local.update(batch, targets, mask, old_values, clip_eps=0.2, ranking=ranking)
    assert local_metrics["li2sao/rank_loss"] > 0.0
    for key in ("li2sao/rank_loss", "critic/value_loss"):
        assert remote_metrics[key] == pytest.approx(local_metrics[key], abs=1e-6), key
    # the gradients themselves are compared at 1e-6 in tests/test_ranking_dp.py; the weights after AdamW's first
    # step are not (it divides by |g|, so float noise in near-zero entries flips their update: 1.7e-3 measured)


@pytest.mark.slow
def test_hybrid_replicas_on_two_fsdp_ranks_sample_under_the_actors_published_weights(coloc, tiny_dir):
    """The product's colocated path (rollout.mode=hybrid): one replica per FSDP rank, each engine holding its own
    copy of the weights. After an actor update, nothing reaches the engines until the publication; then each rank
    all-gathers the sharded actor in memory and the rollout's behaviour log-probs equal the actor worker's
    log_probs on the same tokens, on both replicas. The log-probs before the publication are those of the
    checkpoint, and differ from the updated actor's."""
    from async_rl.rollout.base import GenerationRequest, SamplingParams
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool, episode_key

    def generate(pool, tag):
        out = pool.generate([GenerationRequest(f"{tag}{i}/r0/turn0", list(range(10 + i, 14 + 2 * i)),
                                               SamplingParams(max_new_tokens=10, seed=100 + i, ignore_eos=True))
                             for i in range(4)])
        trajectories = [Trajectory(uid=str(o.request_id), group_id="g", prompt_index=i, prompt_ids=o.prompt_ids,
                                   segments=[Segment("model", o.token_ids, o.logprobs, o.versions)])
                        for i, o in enumerate(out)]
        return out, collate(trajectories, PAD_ID)

    assert [info["device"] for info in coloc.init_info["rollout"]] == ["cpu", "cpu"]
    pool = coloc.rollout_pool = ReplicaPool(launch_replicas("hf", 2, tiny_dir, mode="hybrid",
                                                            worker_group=coloc.process_groups[0]), "hf")
    assert len(set(pool.pids)) == 2 and pool.takes_version_only
    actor = coloc.remote_actor()
    actor.update(*training_batch(seed=5), "vanilla")  # the actor's weights now differ from the checkpoint
    stale, stale_batch = generate(pool, "a")
    assert all(v == 0 for o in stale for v in o.versions)
    mask = stale_batch["response_mask"].bool()
    assert mask.sum() == 40
    gap = (actor.log_probs(stale_batch)[mask] - stale_batch["behaviour_log_probs"][mask]).abs().max()
    assert gap > 1e-2  # version 0 is the checkpoint, not the updated actor

    pool.update_weights(None, 7)  # hybrid: only the version travels; each rank copies its actor's weights in
    fresh, batch = generate(pool, "b")
    assert all(v == 7 for o in fresh for v in o.versions)
    served_by = {pool._affinity[episode_key(o.request_id)] for o in fresh}  # least outstanding: 2 | 2
    assert served_by == {0, 1}, "both ranks' engines should have served requests"
    assert torch.allclose(actor.log_probs(batch)[mask], batch["behaviour_log_probs"][mask], atol=1e-4)


@pytest.mark.slow
def test_worker_errors_surface_with_names_and_never_hang(disagg):
    batch, _ = training_batch()  # no "advantages": a malformed update, sent past the adapter's own binding
    start = time.monotonic()
    with pytest.raises(WorkerCallError) as info:
        disagg.actor.call_role(pad_proto_for_dp(pack_call("update", {"batch": batch, "loss_mode": "vanilla"}), 2)[0],
                               timeout_s=120)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert "ActorRole.update" in message and "argument advantages" in message and "KeyError" in message
    assert info.value.worker and info.value.worker in message and "rank" in message
    with pytest.raises(TypeError, match="advantages"):  # the adapter binds the role's signature before sending
        disagg.remote_actor().update(batch, loss_mode="vanilla")

    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        disagg.critic.ping(sleep_s=3, timeout_s=1)
    assert time.monotonic() - start < 3
    assert "ping" in str(info.value) and info.value.worker in str(info.value)

    # a rank that fails while its peer is blocked (e.g. in a collective) ends the wait at once
    @ray.remote(num_cpus=0)
    def blocked_rank():
        time.sleep(120)

    @ray.remote(num_cpus=0)
    def failing_rank():
        raise ValueError("boom")

    refs = [blocked_rank.remote(), failing_rank.remote()]
    start = time.monotonic()
    with pytest.raises(WorkerCallError, match=r"step failed on w1 \(rank 1 of 2\): ValueError: boom"):
        wait_for_workers(refs, method="step", worker_names=["w0", "w1"], timeout_s=100)
    assert time.monotonic() - start < 30
    ray.cancel(refs[0], force=True)

    # both groups are still usable (the failure happened before any collective)
    assert [p["rank"] for p in disagg.actor.ping(timeout_s=60)] == [0, 1]
    assert disagg.critic.ping(timeout_s=60)[0]["class"] == "CriticWorker"


@pytest.mark.slow
def test_two_sapo_ranks_match_single_process_update(ray_cluster, tiny_dir):
    """SapoWorker (verl Worker, same engine interface as the actor): 2 gloo ranks == one SapoRole."""
    from verl.single_controller.ray import RayClassWithInitArgs

    from async_rl.models.loading import load_tokenizer
    from async_rl.workers.placement import _group, _pool
    from async_rl.driver.batch import turn_tensors
    from async_rl.driver.learner import shared_backbone_targets
    from async_rl.workers.remote import RemoteSapo
    from async_rl.workers.sapo import SapoRole, resolve_reserved_ids
    from async_rl.workers.sapo_worker import SapoWorker

    batch, _ = training_batch(seed=3, n=4)
    turns = turn_tensors(batch)
    pool = _pool(2, False, "sapo_test_")
    group = _group(pool, {"actor": RayClassWithInitArgs(ray.remote(SapoWorker), tiny_dir, optim=OPTIM)},
                   name="sapo_test_", call_timeout_s=CALL_TIMEOUT_S, device_name="cpu", cpus_per_worker=None,
                   worker_env={"TOKENIZERS_PARALLELISM": "false"}).spawn(prefix_set=["actor"])["actor"]
    try:
        group.init_model()
        # the driver's path: readouts from the ranks, the registered estimator on the whole batch, the update
        remote = RemoteSapo(group, reserved_ids=resolve_reserved_ids(load_tokenizer(tiny_dir)))
        _, targets = shared_backbone_targets(remote, batch, turns, {})
        out = remote.update(batch, turns, targets)
        remote_weights = group.export_weights()[0]
    finally:
        ray.util.remove_placement_group(pool.pgs[0]) if pool.pgs else None
        for worker in group.workers:
            ray.kill(worker, no_restart=True)

    local = SapoRole(load_causal_lm(tiny_dir), OPTIM,
                     reserved_ids=resolve_reserved_ids(load_tokenizer(tiny_dir)))
    before = local.export_weights()
    _, local_targets = shared_backbone_targets(local, batch, turns, {})
    local_metrics = local.update(batch, turns, local_targets)
    after = local.export_weights()
    assert max_diff(after, before) > 5e-4
    assert max_diff(remote_weights, after) < 1e-5
    assert out["sapo/v_loss"] == pytest.approx(local_metrics["sapo/v_loss"], abs=1e-5)

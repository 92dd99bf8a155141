"""SAPO on Ray worker groups (``algorithm=sapo trainer.workers=ray``): SapoWorker ranks behind RemoteSapo,
rollout on hf replicas that ban the two reserved value ids.

One module-scoped Ray instance (8 logical CPUs on 2 cores: a scheduling label only, no dashboard). Checks:
the first step of a 2-rank run equals a local SapoRole step on the same trajectories (an odd batch, so a
zero-weight DP padding row is in play); both schedulers train a few steps with finite V/Q losses; with a
checkpoint whose reserved ids would win almost every unbanned draw, no sampled token is a reserved id.
"""

from __future__ import annotations

import math

import pytest
import torch

import ray  # noqa: E402  (a hard dependency: a broken Ray must fail, not skip)

from async_rl.config import AlgorithmConfig  # noqa: E402
from async_rl.driver.driver import DriverConfig  # noqa: E402
from async_rl.driver.episode import EpisodeLimits  # noqa: E402
from async_rl.engine.settings import TrainingSettings  # noqa: E402
from async_rl.models.tiny import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.ray]


# SapoRole.update metrics a 2-rank step must reproduce to fp32 rounding (the V/Q terms read the same frozen
# targets; the gradient norm sums every term's gradient)
EXACT_METRICS = ("sapo/v_loss", "sapo/q_loss", "sapo/kl", "sapo/entropy", "sapo/v_mean", "sapo/q_mean",
                 "sapo/explained_var", "actor/ppo_kl", "actor/grad_norm")
# L_pol on the first step is -mean(Â) over model tokens, a near-cancellation (|value| ~ 1e-5 against Â ~ 1): a
# shift of μ_B by one float32 rounding (the per-rank sums differ from the one-process sum) moves it by ~1e-5
CANCELLING_METRICS = ("actor/pg_loss", "sapo/loss")


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def ray_session():
    # 2 SapoWorker ranks + 1 hf replica; the builder's ensure_ray leaves a running instance alone
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _sapo_algo(batch: int) -> AlgorithmConfig:
    # lr 1e-3 so that each step visibly moves the tiny model (and the next rollout runs on new weights)
    return AlgorithmConfig(name="sapo", train_batch_trajectories=batch, group_size=1, actor_lr=1e-3)


def _spec(model_dir, *, seed: int = 0, training: TrainingSettings | None = None, **kwargs):
    import async_rl.envs.toy  # noqa: F401  (registers the toy envs)
    from async_rl.assemble import RunSpec
    from async_rl.envs.toy import make_toy_tasks

    return RunSpec(model_path=str(model_dir), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 32, seed),
                   seed=seed, max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40),
                   workers="ray", train_workers=2, ray_num_cpus=8, training=training or TrainingSettings(),
                   **kwargs)


def _record_batches(learner) -> list:
    """Wrap ``learner.train_step`` to keep every batch of trajectories it trains on."""
    seen: list = []
    train_step = learner.train_step

    def recording(trajectories):
        seen.append(list(trajectories))
        return train_step(trajectories)

    learner.train_step = recording
    return seen


def _model_tokens(batches) -> list[int]:
    return [int(t) for batch in batches for traj in batch for seg in traj.segments if seg.kind == "model"
            for t in seg.token_ids]


class _RecordingSapoGroup:
    """Stands in for a 2-rank SapoWorker group: keeps the DataProtos RemoteSapo dispatches to ``call_role``."""

    world_size = 2

    def __init__(self):
        self.sent = {}

    def call_role(self, proto, **kwargs):
        from verl.protocol import DataProto

        method = proto.meta_info["method"]
        self.sent[method] = proto
        if method == "readouts":
            # one readout column per row (its row index), so the returned order and un-padding are visible
            return DataProto.from_dict(tensors={"out__turn_mask": torch.ones(len(proto), 2),
                                                "out__row": torch.arange(len(proto), dtype=torch.float32)})
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": [{"sapo/v_loss": 0.25}] * 2})


def test_remote_sapo_pads_odd_batches_with_zero_weight_rows():
    from async_rl.workers.remote import RemoteSapo
    from async_rl.workers.role_calls import unpack_call

    bs, T, K = 3, 4, 2
    batch = {"prompts": torch.ones(bs, 2, dtype=torch.long), "prompt_mask": torch.ones(bs, 2),
             "responses": torch.ones(bs, T, dtype=torch.long), "response_attention": torch.ones(bs, T),
             "response_mask": torch.ones(bs, T), "token_turn_index": torch.zeros(bs, T, dtype=torch.long),
             "behaviour_log_probs": torch.zeros(bs, T)}
    turns = {"turn_rewards": torch.ones(bs, K), "turn_dones": torch.ones(bs, K), "turn_mask": torch.ones(bs, K),
             "turn_invalid": torch.zeros(bs, K)}
    group = _RecordingSapoGroup()
    remote = RemoteSapo(group, reserved_ids=(7, 8))
    assert remote.banned_token_ids == (7, 8)

    readouts = remote.readouts(batch, num_turns=K)
    sent = group.sent["readouts"]
    # 3 rows on 2 ranks: one added row that holds no model token
    assert len(sent) == 4
    assert sent.batch["response_mask"][3].sum() == 0 and sent.batch["responses"][3].sum() == T  # copied, weightless
    assert unpack_call(sent)["num_turns"] == K
    assert readouts["row"].tolist() == [0.0, 1.0, 2.0] and set(readouts) == {"turn_mask", "row"}
    # without num_turns, K comes from the whole batch (a rank's shard may hold fewer turns)
    last_turn = {**batch, "token_turn_index": torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]])}
    remote.readouts(last_turn)
    assert unpack_call(group.sent["readouts"])["num_turns"] == 2

    targets = {"turn_mask": torch.ones(bs, K), "token_advantages": torch.full((bs, T), 2.0)}
    metrics = remote.update(batch, turns, targets, clip_eps=0.1, c_v=0.7, kl_coef=0.0)
    sent = group.sent["update"]
    assert len(sent) == 4
    assert sent.batch["arg__targets__token_advantages"][3].abs().sum() == 0
    assert sent.batch["arg__targets__turn_mask"][3].sum() == 0 and sent.batch["arg__turns__turn_mask"][3].sum() == 0
    assert sent.batch["arg__targets__token_advantages"][:3].eq(2.0).all()
    # what the role receives on a rank: its own signature's arguments, the left-out ones not sent (its defaults)
    received = unpack_call(sent)
    assert set(received) == {"batch", "turns", "targets", "clip_eps", "c_v", "kl_coef"}
    assert (received["clip_eps"], received["c_v"], received["kl_coef"]) == (0.1, 0.7, 0.0)
    assert set(received["turns"]) == set(turns) and set(received["targets"]) == set(targets)
    assert metrics == {"sapo/v_loss": 0.25}
    with pytest.raises(TypeError, match="clip_wrong"):  # bound to SapoRole.update's signature on the driver
        remote.update(batch, turns, targets, clip_wrong=0.1)

    with pytest.raises(ValueError, match="two reserved value ids"):
        RemoteSapo(group, reserved_ids=(7,))


def test_unknown_actor_worker_is_refused_before_any_process_starts(tmp_path):
    from async_rl.workers.placement import make_worker_groups

    with pytest.raises(ValueError, match="actor_worker='critic'; valid choices: actor, sapo"):
        make_worker_groups("disaggregated", 2, 0, str(tmp_path), actor_worker="critic")


def test_two_rank_sapo_run_matches_a_local_step_and_trains(tmp_path, ray_session):
    from async_rl.assemble import build_deterministic_driver
    from async_rl.driver.learner import Learner
    from async_rl.engine.base import OptimizerConfig
    from async_rl.models.loading import load_causal_lm, load_tokenizer
    from async_rl.workers.sapo import SapoRole, resolve_reserved_ids
    from async_rl.workers.remote import RemoteSapo

    model = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1)
    # 5 trajectories over 2 ranks: one zero-weight padding row; a token budget that splits every shard in two
    algo = _sapo_algo(batch=5)
    training = TrainingSettings(max_tokens_per_micro_batch=64, activation_checkpointing=True)
    spec = _spec(model, training=training)
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=3, chunk_tokens=4, update_ticks=1), spec)
    actor = driver.learner.actor
    tokenizer = load_tokenizer(str(model))
    reserved = resolve_reserved_ids(tokenizer, list(algo.sapo_reserved_tokens))
    assert isinstance(actor, RemoteSapo) and driver.learner.critic is None
    assert actor.banned_token_ids == tuple(reserved)
    assert tuple(driver.rollout.sampling.banned_token_ids) == tuple(reserved)  # what every request carries
    batches = _record_batches(driver.learner)
    try:
        history = driver.run()
        # a checkpoint of the worker group: rank 0's full model and AdamW state after the 3 steps
        state = actor.state_dict()
        exported = actor.export_weights()
    finally:
        actor.worker_groups.shutdown()

    assert state["update_count"] == 3 and state["optim"] is not None
    assert set(state["model"]) == set(exported)
    assert all(torch.equal(state["model"][name], exported[name]) for name in exported)
    assert len(history) == 3 and driver.learner.policy_version == 3
    for metrics in history:
        for key in ("sapo/v_loss", "sapo/q_loss", "sapo/loss", "actor/grad_norm"):
            assert key in metrics and math.isfinite(metrics[key]), (key, metrics.get(key))
        assert metrics["actor/updated"] == 1.0
    assert not set(_model_tokens(batches)) & set(reserved)

    # the same first batch through one in-process SapoRole, built as build.py builds the local path
    role = SapoRole(load_causal_lm(str(model)), OptimizerConfig(lr=algo.actor_lr, max_grad_norm=spec.max_grad_norm,
                                                                weight_decay=0.0),
                    reserved_ids=reserved, tau_v=algo.sapo_tau_v, r_max=algo.sapo_r_max,
                    temperature=spec.temperature, micro_batch_size=spec.micro_batch_size, kl_coef=algo.sapo_kl_coef,
                    **training.role_kwargs())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    local = Learner(algo, role, None, pad_token_id=pad).train_step(batches[0]).metrics
    assert len(batches[0]) == 5
    for key in EXACT_METRICS:
        assert history[0][key] == pytest.approx(local[key], rel=1e-4, abs=1e-7), key
    for key in CANCELLING_METRICS:
        assert history[0][key] == pytest.approx(local[key], abs=1e-4), key


def test_concurrent_sapo_on_ray_never_samples_the_reserved_ids(tmp_path, ray_session):
    """A checkpoint whose lm_head makes w+ or w- the top logit at almost every step: the replicas still never
    sample them (they are banned per request), while the same replicas without the ban sample them often."""
    from async_rl.assemble import build_concurrent_driver
    from async_rl.models.loading import load_causal_lm, load_tokenizer
    from async_rl.rollout.base import GenerationRequest, SamplingParams
    from async_rl.workers.sapo import resolve_reserved_ids

    model_dir = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1)
    algo = _sapo_algo(batch=4)
    plus, minus = resolve_reserved_ids(load_tokenizer(str(model_dir)), list(algo.sapo_reserved_tokens))
    model = load_causal_lm(str(model_dir))
    with torch.no_grad():
        # only hidden dimension 0 leaves the final norm; w+ reads it with +50 and w- with -50, every other id
        # with a weight below 0.05: one of the two reserved logits is about 1000x any other logit
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.mul_(0.05 / model.lm_head.weight.abs().max())
        model.lm_head.weight[plus, 0] = 50.0
        model.lm_head.weight[minus, 0] = -50.0
    model.save_pretrained(str(model_dir))

    spec = _spec(model_dir, seed=1)
    driver = build_concurrent_driver(algo, DriverConfig(total_steps=2, chunk_tokens=4, max_inflight_trajectories=8),
                                     spec)
    batches = _record_batches(driver.learner)
    try:
        history = driver.run()
        # control on the same replicas: the identical prompts without the ban draw the reserved ids
        prompts = [traj.prompt_ids for traj in batches[0]]
        free = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3)
        unbanned = driver.rollout.engine.generate([GenerationRequest(f"control-{i}", list(p), free)
                                                   for i, p in enumerate(prompts)])
    finally:
        driver.learner.actor.worker_groups.shutdown()

    assert len(history) == 2
    assert all(math.isfinite(m["sapo/v_loss"]) and math.isfinite(m["sapo/q_loss"]) for m in history)
    sampled = _model_tokens(batches)
    assert sampled and not {plus, minus} & set(sampled)
    control = [t for out in unbanned for t in out.token_ids]
    assert sum(t in (plus, minus) for t in control) > len(control) // 2

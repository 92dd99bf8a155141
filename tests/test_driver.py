"""The async driver (issue: in-flight streaming, staleness cap, Li2SAO switch, resume).

Buffer rules are tested on crafted trajectories; the switch protocol and resume run the real deterministic
driver on a random tiny model (fast: every action is invalid, so rewards are 0 and the gate opens at T_max).
"""

import dataclasses

import pytest
import torch

from async_rl.config import AlgorithmConfig, GateConfig
from async_rl.driver.buffer import TrajectoryBuffer
from async_rl.driver.driver import DriverConfig
from async_rl.driver.trajectory import Segment, Trajectory


def _traj(uid, group, versions, group_size=1, aborted=False, reward=0.0):
    seg = Segment("model", list(range(len(versions))), [0.0] * len(versions), list(versions))
    return Trajectory(uid=uid, group_id=group, prompt_index=0, prompt_ids=[1], segments=[seg], reward=reward,
                      group_size=group_size, aborted=aborted)


def test_per_token_staleness_cap_drops_exactly_the_stale_trajectories():
    buf = TrajectoryBuffer(capacity=16)
    # trainer at version 5, cap k = 2: a token sampled at version v has lag 5 - v
    buf.add(_traj("fresh", "g1", [5, 5, 5]))  # lags 0
    buf.add(_traj("edge", "g2", [3, 4, 5]))  # max lag 2 = k: kept
    buf.add(_traj("one_old_token", "g3", [2, 5, 5]))  # one token with lag 3 > k: dropped
    buf.add(_traj("old", "g4", [1, 1]))  # dropped
    batch = buf.take_batch(2, trainer_version=5, staleness_cap=2)
    assert [t.uid for t in batch] == ["fresh", "edge"]
    assert buf.counters.dropped_stale == 2


def test_group_barrier_releases_only_complete_groups_and_never_mixes_sizes():
    buf = TrajectoryBuffer(capacity=32)
    for i in range(3):
        buf.add(_traj(f"a{i}", "A", [0], group_size=4))
    assert buf.num_ready == 0 and buf.take_batch(1, 0, 10) is None  # 3 of 4 members: held back
    buf.add(_traj("a3", "A", [0], group_size=4, aborted=True))  # last member aborted: group complete
    assert buf.num_ready == 3 and buf.counters.aborted == 1
    buf.add(_traj("s0", "S", [0], group_size=1))
    batch = buf.take_batch(3, 0, 10)
    assert {t.group_id for t in batch} == {"A"}  # the singleton waits for a batch of its own size
    assert buf.take_batch(1, 0, 10)[0].uid == "s0"


def test_buffer_state_round_trip_and_overflow_message():
    buf = TrajectoryBuffer(capacity=2)
    buf.add(_traj("x", "G", [0], group_size=2))
    buf.add(_traj("y", "H", [0]))
    other = TrajectoryBuffer(capacity=1)
    other.load_state_dict(buf.state_dict())
    assert len(other) == 2 and other.num_ready == 1 and other.num_partial_groups == 1
    with pytest.raises(OverflowError, match="has_room"):
        buf.add(_traj("z", "I", [0]))


# ------------------------------------------------------------------------------------------------------
# the real driver on a random tiny model
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from async_rl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1))


def _build(model_path, algo, steps, checkpoint_dir=None, **driver_kw):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    spec = RunSpec(model_path=model_path, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40))
    cfg = DriverConfig(total_steps=steps, chunk_tokens=4, update_ticks=2, **driver_kw)
    return build_deterministic_driver(algo, cfg, spec, checkpoint_dir=checkpoint_dir)


def _li2sao(t_max=3):
    return AlgorithmConfig(name="li2sao", train_batch_trajectories=8, group_size=4, use_critic=True,
                           actor_lr=1e-3, critic_lr=1e-3, policy_loss="dis_clip",
                           gate=GateConfig(t_min=1, patience=1, t_max=t_max))


def test_li2sao_switch_protocol_in_deterministic_mode(tiny_model):
    driver = _build(tiny_model, _li2sao(t_max=3), steps=7, max_inflight_trajectories=24)
    sizes = []
    original = driver.learner.train_step

    def spy(batch):
        sizes.append(sorted({t.group_size for t in batch}))
        return original(batch)

    driver.learner.train_step = spy
    losses = []
    original_update = driver.learner.actor.update
    driver.learner.actor.update = lambda batch, adv, loss_mode, *a, **kw: (losses.append(loss_mode),
                                                                      original_update(batch, adv, loss_mode, *a, **kw))[1]
    driver.run()
    # the kept job (step 4) still trains with the bootstrap loss; single-rollout batches with DIS
    assert losses == ["dis_clip"] * 4 + ["dis"] * 3
    # the gate opens at T_max = 3 (no mixed group on a random model); step 4 is the kept prefetched job
    assert driver.learner.gate.switch_step == 3 == driver.stats.switch_step
    assert all(len(s) == 1 for s in sizes), "a batch mixed group sizes"
    assert sizes[:4] == [[4]] * 4 and sizes[4:] == [[1]] * 3
    assert driver.stats.discarded_at_switch > 0, "leftover bootstrap groups must be discarded"
    assert driver.learner.phase == "single"


def test_resume_is_bit_for_bit(tiny_model, tmp_path):
    algo = _li2sao(t_max=3)
    full = _build(tiny_model, dataclasses.replace(algo), steps=6, max_inflight_trajectories=16)
    full.run()

    first = _build(tiny_model, dataclasses.replace(algo), steps=6, checkpoint_dir=tmp_path,
                   max_inflight_trajectories=16, checkpoint_every=2)
    first.run(until_step=2)  # then the process "dies"
    resumed = _build(tiny_model, dataclasses.replace(algo), steps=6, checkpoint_dir=tmp_path,
                     max_inflight_trajectories=16, checkpoint_every=2)
    assert resumed.resume()
    assert resumed.learner.step == 2
    resumed.run()

    w_full = full.learner.actor.export_weights()
    w_resumed = resumed.learner.actor.export_weights()
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)
    # wall-clock perf/ metrics aside, every metric is identical (NaN compared as a string)
    strip = [{k: repr(v) for k, v in m.items() if not k.startswith("perf/")} for m in full.history]
    strip_resumed = [{k: repr(v) for k, v in m.items() if not k.startswith("perf/")} for m in resumed.history]
    assert len(strip) == 6 and strip == strip_resumed
    # no prompt lost or repeated: the trained prompt indices are the same sequence
    assert full.rollout.prompts.cursor == resumed.rollout.prompts.cursor


def test_a_critic_only_step_is_checkpointed_and_resumes_bit_for_bit(tiny_model, tmp_path):
    """LiSAO's warm-up steps train the critic and publish nothing; a checkpoint there keeps that training."""
    algo = AlgorithmConfig(name="lisao", train_batch_trajectories=8, group_size=1, use_critic=True,
                           policy_loss="dis", critic_warmup_steps=3, actor_lr=1e-3, critic_lr=1e-3)
    full = _build(tiny_model, dataclasses.replace(algo), steps=5, max_inflight_trajectories=16)
    full.run()
    first = _build(tiny_model, dataclasses.replace(algo), steps=5, checkpoint_dir=tmp_path,
                   max_inflight_trajectories=16, checkpoint_every=2)
    first.run(until_step=2)
    assert (tmp_path / "step_000002.pt").exists()  # step 2 is a warm-up step: no actor update
    assert first.learner.policy_version == 0
    resumed = _build(tiny_model, dataclasses.replace(algo), steps=5, checkpoint_dir=tmp_path,
                     max_inflight_trajectories=16, checkpoint_every=2)
    assert resumed.resume() and resumed.learner.step == 2
    resumed.run()
    for role in ("actor", "critic"):
        w_full = getattr(full.learner, role).engine.full_state_dict()
        w_resumed = getattr(resumed.learner, role).engine.full_state_dict()
        assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)
    strip = [{k: repr(v) for k, v in m.items() if not k.startswith("perf/")} for m in full.history]
    assert strip == [{k: repr(v) for k, v in m.items() if not k.startswith("perf/")} for m in resumed.history]


def test_the_concurrent_scheduler_also_checkpoints_a_critic_only_step(tiny_model, tmp_path):
    algo = AlgorithmConfig(name="lisao", train_batch_trajectories=8, group_size=1, use_critic=True,
                           policy_loss="dis", critic_warmup_steps=3, actor_lr=1e-3, critic_lr=1e-3)
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_concurrent_driver
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    spec = RunSpec(model_path=tiny_model, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40))
    driver = build_concurrent_driver(algo, DriverConfig(total_steps=2, chunk_tokens=4, checkpoint_every=2), spec,
                                     checkpoint_dir=tmp_path)
    driver.run()
    assert driver.learner.policy_version == 0  # both steps were warm-up steps
    assert (tmp_path / "step_000002.pt").exists()


def test_synchronous_baseline_trains_a_round_that_aborts_left_short(tiny_model):
    """One failed env step leaves the synchronous round B - 1 trajectories: it trains on those, never stalls."""
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.base import register_env
    from async_rl.envs.toy import ToyKeysEnv, make_toy_tasks

    calls = {"n": 0}

    @register_env("toy_keys_fails_once")
    class FailsOnce(ToyKeysEnv):
        def step(self, action):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("env failed once")
            return super().step(action)

    torch.set_num_threads(1)
    spec = RunSpec(model_path=tiny_model, env_name="toy_keys_fails_once", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40))
    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=3, chunk_tokens=4, synchronous=True), spec)
    history = driver.run()
    assert len(history) == 3 and driver.buffer.counters.aborted == 1
    sizes = [m["train/batch_trajectories"] for m in history]
    assert sizes == [7.0, 8.0, 8.0]  # the short round, then full ones
    assert all(m["async/policy_lag/max"] == 0.0 for m in history)  # still on-policy


def test_a_bootstrap_batch_of_single_survivors_uses_gae_not_zero_group_advantages(tiny_model, monkeypatch):
    """Spec App. F.3: the group advantage only when the batch's largest prompt group has > 1 response."""
    import async_rl.driver.learner as learner_module

    driver = _build(tiny_model, _li2sao(t_max=100), steps=1, max_inflight_trajectories=8)
    used, advantages = [], []
    real_get = learner_module.get_adv_estimator_fn
    monkeypatch.setattr(learner_module, "get_adv_estimator_fn", lambda name: (used.append(name), real_get(name))[1])
    real_update = driver.learner.actor.update

    def update(batch, adv, *args, **kwargs):
        advantages.append(adv.clone())
        return real_update(batch, adv, *args, **kwargs)

    monkeypatch.setattr(driver.learner.actor, "update", update)

    def batch(members_per_group):
        out = []
        for g, members in enumerate(members_per_group):
            for m in range(members):
                seg = Segment("model", [11, 12, 13], [-1.0] * 3, [0] * 3)
                out.append(Trajectory(uid=f"p{g}/r{m}", group_id=f"p{g}", prompt_index=g, prompt_ids=[1, 2, 3],
                                      segments=[seg], reward=float((g + m) % 2), group_size=4))
        return out

    driver.learner.train_step(batch([1] * 8))  # aborts left one member of each group of 4
    assert used[-1] == "sao_gae" and float(advantages[-1].abs().max()) > 0
    driver.learner.train_step(batch([2] + [1] * 6))  # one group still has two members
    assert used[-1] == "li2sao_group"


def test_driver_config_errors():
    with pytest.raises(ValueError, match="staleness_cap"):
        DriverConfig(staleness_cap=-1).validate(8)
    with pytest.raises(ValueError, match="buffer_capacity"):
        DriverConfig(buffer_capacity=4).validate(8)
    with pytest.raises(ValueError, match=r"buffer_capacity=10: .*group size 4\): set it to 11 or more"):
        DriverConfig(buffer_capacity=10).validate(8, 4)
    DriverConfig(buffer_capacity=11).validate(8, 4)


# ------------------------------------------------------------------------------------------------------
# the concurrent scheduler (real time, rollout thread)
# ------------------------------------------------------------------------------------------------------
def _build_concurrent(model_path, algo, steps, **driver_kw):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_concurrent_driver
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    spec = RunSpec(model_path=model_path, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40))
    return build_concurrent_driver(algo, DriverConfig(total_steps=steps, chunk_tokens=4, **driver_kw), spec)


def test_concurrent_switch_never_mixes_group_sizes(tiny_model):
    driver = _build_concurrent(tiny_model, _li2sao(t_max=3), steps=6, max_inflight_trajectories=24)
    sizes = []
    original = driver.learner.train_step
    driver.learner.train_step = lambda batch: (sizes.append(sorted({t.group_size for t in batch})),
                                               original(batch))[1]
    history = driver.run()
    assert len(history) == 6 and driver.stats.switch_step == 3
    assert sizes[:4] == [[4]] * 4 and sizes[4:] == [[1]] * 2
    # in-flight updates: the rollout engine runs the trainer's latest published version
    assert driver.rollout.engine.policy_version == driver.learner.policy_version


def test_concurrent_rollout_failure_surfaces_instead_of_hanging(tiny_model):
    from async_rl.driver.concurrent import RolloutThreadError

    driver = _build_concurrent(tiny_model, _li2sao(t_max=3), steps=3)

    def broken(chunk_tokens):
        raise RuntimeError("engine exploded")

    driver.rollout.advance = broken
    with pytest.raises(RolloutThreadError, match="engine exploded"):
        driver.run()


def test_a_full_model_context_truncates_episodes_instead_of_failing(tmp_path):
    from async_rl.models.tiny import make_tiny_model

    # 96 positions: the prompt (~30 tokens) plus a few turns fill the context long before the response budget
    model = str(make_tiny_model(tmp_path / "short", hidden_size=32, num_layers=1, max_position_embeddings=96))
    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    spec = RunSpec(model_path=model, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 16, 0), max_new_tokens=32,
                   limits=EpisodeLimits(max_turns=4, max_response_tokens=400))
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=2, chunk_tokens=8), spec)
    driver.run()
    assert driver.buffer.counters.added >= 16
    assert all(len(t.prompt_ids) + len(t.response_ids) <= 96 for t in
               [t for g in driver.buffer._ready for t in g])


def test_env_crashes_abort_the_episode_and_never_reach_training():
    """An env that raises (in step or close) aborts its trajectory: excluded, counted, never scored."""
    from async_rl.driver.episode import Episode, EpisodeLimits
    from async_rl.envs.base import Env, StepResult
    from async_rl.rollout.base import GenerationOutput, SamplingParams

    class Broken(Env):
        max_turns = 3

        def reset(self, task):
            return "hi"

        def step(self, action):
            raise RuntimeError("env exploded")

        def close(self):
            raise OSError("close failed too")

    class Formatter:
        end_token_id = None

        def prompt_ids(self, text):
            return [1, 2]

    ep = Episode(Broken(), {"id": 0}, Formatter(), SamplingParams(max_new_tokens=4), EpisodeLimits(), "u", "g", 1, 0)
    ep.begin()
    request = ep.next_request()
    ep.on_output(GenerationOutput(request.request_id, request.prompt_ids, [5], [-0.1], [0], "stop", "look"))
    assert ep.finished and ep.trajectory.aborted and "env exploded" in ep.trajectory.abort_reason
    buf = TrajectoryBuffer(capacity=4)
    buf.add(ep.trajectory)
    assert buf.num_ready == 0 and buf.counters.aborted == 1


def test_overlong_penalty_is_applied_at_episode_end():
    """DAPO's soft penalty (spec §2) on responses entering the final quarter of their context window
    (max_response_tokens, capped by what the model's context leaves after the prompt)."""
    from async_rl.driver.episode import Episode, EpisodeLimits
    from async_rl.envs.base import Env, StepResult
    from async_rl.rollout.base import GenerationOutput, SamplingParams

    class Solved(Env):
        def reset(self, task):
            return "q"

        def step(self, action):
            return StepResult("", 1.0, True, {"success": True})

    class Formatter:
        end_token_id = None

        def prompt_ids(self, text):
            return [1] * 8  # an 8-token prompt

    def play(n_tokens, penalty, max_context_tokens=None):
        limits = EpisodeLimits(max_turns=1, max_response_tokens=32, overlong_penalty=penalty,
                               max_context_tokens=max_context_tokens)
        ep = Episode(Solved(), {}, Formatter(), SamplingParams(max_new_tokens=32), limits, "u", "g", 1, 0)
        ep.begin()
        req = ep.next_request()
        ep.on_output(GenerationOutput(req.request_id, req.prompt_ids, [7] * n_tokens, [-0.1] * n_tokens,
                                      [0] * n_tokens, "stop", "ok"))
        return ep.trajectory

    # window 32, final quarter 8: 24 tokens are free; 28 are halfway in -> 1 - 0.5
    assert play(24, True).reward == 1.0
    assert play(28, True).reward == 0.5 and play(28, True).success
    assert play(28, False).reward == 1.0
    # the model's context caps the window: 20 - 8 prompt tokens = 12, free 9; 10 tokens -> -(10 - 9) / 3
    # (the rule before counted against max_response_tokens only: 10 of 32 was free)
    assert play(10, True, max_context_tokens=20).reward == pytest.approx(1.0 - 1.0 / 3.0)


def test_the_algorithm_decides_the_overlong_penalty_unless_the_limits_say(tiny_model):
    """One default (AlgorithmConfig.overlong_penalty): a run built with the limits' None gets the algorithm's
    setting; an explicit EpisodeLimits value wins; anything but a bool or None is refused."""
    from async_rl.driver.episode import EpisodeLimits

    for penalty in (True, False):
        algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, overlong_penalty=penalty)
        assert _build(tiny_model, algo, steps=1).rollout.limits.overlong_penalty is penalty
    assert EpisodeLimits().overlong_penalty is None
    with pytest.raises(ValueError, match="overlong_penalty='yes'"):
        EpisodeLimits(overlong_penalty="yes")


def test_synchronous_baseline_is_on_policy(tiny_model):
    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    driver = _build(tiny_model, algo, steps=3, synchronous=True)
    history = driver.run()
    # generate a batch under the current weights, train, publish, repeat: no token is ever stale
    assert [m["async/policy_lag/max"] for m in history] == [0.0, 0.0, 0.0]
    async_driver = _build(tiny_model, algo, steps=3)
    assert max(m["async/policy_lag/max"] for m in async_driver.run()) > 0


def test_idle_fractions_mean_the_same_in_both_schedulers(tiny_model):
    """``perf/*_idle_frac`` are fractions of real time in both schedulers; the simulated clock's own fractions
    are ``sim/*_idle_frac``, logged by the deterministic scheduler only.

    Counted by hand for the synchronous baseline with ``update_ticks=2`` (``_build``): an update holds the
    trainer for exactly 2 ticks, during which the rollout is blocked, and every other tick generates (the round
    launches in the tick after the publication, and the batch is taken in the tick after its last trajectory
    ends). Step k's metrics are recorded when its batch is taken, before that tick's work: the trainer has been
    busy for the (k - 1) earlier updates, 2 (k - 1) ticks, and the rollout for all the other ticks so far."""
    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    deterministic = _build(tiny_model, algo, steps=3, synchronous=True)
    history = deterministic.run()
    for k, metrics in enumerate(history, start=1):
        ticks = metrics["async/clock_ticks"]
        trainer_busy = 2 * (k - 1)
        assert ticks > trainer_busy  # each round generates for at least one tick
        assert metrics["sim/trainer_idle_frac"] == pytest.approx(1.0 - trainer_busy / ticks, abs=1e-12)
        assert metrics["sim/rollout_idle_frac"] == pytest.approx(trainer_busy / ticks, abs=1e-12)
    last = history[-1]
    # one process, training and generating in turn: the two real-time busy shares cannot exceed the wall time
    assert (1 - last["perf/trainer_idle_frac"]) + (1 - last["perf/rollout_idle_frac"]) <= 1.0 + 1e-6
    concurrent = _build_concurrent(tiny_model, algo, steps=3, max_inflight_trajectories=8)
    for row in (last, concurrent.run()[-1]):
        assert 0.0 <= row["perf/trainer_idle_frac"] < 1.0 and 0.0 <= row["perf/rollout_idle_frac"] <= 1.0
    assert not any(key.startswith("sim/") for row in concurrent.history for key in row)


def test_stop_at_cut_keeps_the_newest_checkpoint_and_says_why_when_the_final_one_fails(tmp_path):
    """Issue 38, item 1: a stop at a cut writes the final checkpoint; when it cannot (a worker the same Ctrl-C
    ended), RunStopped names the newest checkpoint on disk and the reason instead of raising something else."""
    from types import SimpleNamespace

    from async_rl.driver.core import RunCore, RunStopped

    def failing_save():
        raise OSError("disk full\nsecond line")

    older = tmp_path / "step_000004.pt"
    core = SimpleNamespace(learner=SimpleNamespace(step=6), checkpoint_dir=tmp_path, last_checkpoint=(4, older),
                           stop_reason="SIGINT", save_checkpoint=failing_save)
    with pytest.raises(RunStopped) as caught:
        RunCore.stop_at_cut(core)
    assert (caught.value.step, caught.value.checkpoint, caught.value.save_error) == (6, older, "OSError: disk full")
    core.save_checkpoint = lambda: tmp_path / "step_000006.pt"
    with pytest.raises(RunStopped) as caught:
        RunCore.stop_at_cut(core)
    assert caught.value.checkpoint == tmp_path / "step_000006.pt" and caught.value.save_error is None
    core.learner.step = 0  # nothing trained: nothing to keep, no save attempted
    core.save_checkpoint = failing_save
    with pytest.raises(RunStopped) as caught:
        RunCore.stop_at_cut(core)
    assert caught.value.checkpoint is None and caught.value.save_error is None

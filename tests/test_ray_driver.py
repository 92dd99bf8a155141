"""The concurrent scheduler with the actor and critic as verl worker groups on Ray (2 data-parallel ranks)."""

import pytest
import torch

from async_rl.config import AlgorithmConfig, GateConfig


pytestmark = [pytest.mark.e2e, pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_session():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


def test_li2sao_on_ray_worker_groups_with_in_flight_rollout(tmp_path, ray_session):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_concurrent_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks
    from async_rl.models.tiny import make_tiny_model
    from async_rl.workers.remote import RemoteActor, RemoteCritic

    torch.set_num_threads(1)
    model = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1)
    algo = AlgorithmConfig(name="li2sao", train_batch_trajectories=8, group_size=4, use_critic=True,
                           actor_lr=1e-3, critic_lr=1e-3, policy_loss="dis_clip",
                           gate=GateConfig(t_min=1, patience=1, t_max=2))
    spec = RunSpec(model_path=str(model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 32, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40),
                   workers="ray", train_workers=2, ray_num_cpus=4)
    driver = build_concurrent_driver(algo, DriverConfig(total_steps=4, chunk_tokens=4, max_inflight_trajectories=16),
                                     spec)
    try:
        assert isinstance(driver.learner.actor, RemoteActor) and isinstance(driver.learner.critic, RemoteCritic)
        history = driver.run()
    finally:
        driver.learner.actor.worker_groups.shutdown()
    assert len(history) == 4 and driver.stats.switch_step == 2
    # weights went from the Ray actor group to the in-process rollout engine, version by version
    assert driver.rollout.engine.policy_version == driver.learner.policy_version == 4
    assert all(m["critic/grad_norm"] >= 0 for m in history)

"""The rollout contract (issue 35, item 5): one Protocol, ``RolloutService``, is everything the driver calls on its
rollout. The in-process engine and the replica pool both implement all of it, and a concurrent run with a
checkpoint and a resume, driven through a guard that refuses every other attribute, trains on each."""

from __future__ import annotations

import inspect

import pytest

from async_rl.rollout.base import ROLLOUT_CONTRACT, ROLLOUT_OPTIONAL, RolloutService


def test_the_contract_lists_exactly_the_protocols_members():
    members = {name for name in vars(RolloutService) if not name.startswith("_")}
    assert members == set(ROLLOUT_CONTRACT)


@pytest.mark.parametrize("where", ["async_rl.rollout.hf_engine:HFRolloutEngine", "async_rl.rollout.pool:ReplicaPool"])
def test_both_rollouts_implement_every_member_with_its_signature(where):
    import importlib

    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    for member in ROLLOUT_CONTRACT:
        assert hasattr(cls, member), f"{name} lacks {member}"
        wanted = getattr(RolloutService, member)
        if isinstance(wanted, property):
            assert isinstance(getattr(cls, member), property), f"{name}.{member} must be a property"
        else:  # the contract's parameters first (names may differ), then only parameters with defaults
            got = list(inspect.signature(getattr(cls, member)).parameters.values())[1:]
            expected = list(inspect.signature(wanted).parameters)[1:]
            assert len(got) >= len(expected), (name, member, got, expected)
            assert all(p.default is not inspect.Parameter.empty for p in got[len(expected):]), (name, member, got)


class ContractBreach(BaseException):
    """Not an Exception: no ``except Exception`` on the driver's way (its stop path has one) can swallow it."""


class Guard:
    """The rollout, through the contract only: any other attribute read or set is recorded and raised. (Special
    methods skip ``__getattr__``; the driver uses none on its rollout. The builder, ``assemble.py``, knows the
    concrete class it built and reads more, e.g. ``max_positions`` and the pool's ``pids``; it runs before the
    guard is put in.)"""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "used", set())
        object.__setattr__(self, "breaches", [])

    def __getattr__(self, name):
        if name not in ROLLOUT_CONTRACT and name not in ROLLOUT_OPTIONAL:
            self.breaches.append(f"read rollout.{name}")
            raise ContractBreach(f"the driver read rollout.{name}, which is not in the rollout contract")
        self.used.add(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        self.breaches.append(f"set rollout.{name}")
        raise ContractBreach(f"the driver set rollout.{name}")


def _run(tiny_model, tmp_path, workers: str, resume: bool):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_concurrent_driver
    from async_rl.config import AlgorithmConfig
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks
    from async_rl.rollout.settings import ReplicaSettings

    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    spec = RunSpec(model_path=str(tiny_model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40), workers=workers,
                   rollout=ReplicaSettings(replicas=1, cpus_per_replica=1))
    driver = build_concurrent_driver(algo, DriverConfig(total_steps=4 if resume else 2, chunk_tokens=4,
                                                        max_inflight_trajectories=16, checkpoint_every=1),
                                     spec, checkpoint_dir=tmp_path / "ckpt")
    guard = Guard(driver.rollout.engine)
    driver.rollout.engine = guard
    # RunCore chose its weight sync from the engine when it was built: the same choice through the guard
    from async_rl.rollout.publication import choose_publication_form

    assert choose_publication_form(driver.learner.actor, guard) is driver.publication_form
    try:
        if resume:
            assert driver.resume()
        history = driver.run()
    finally:
        groups = getattr(driver.learner.actor, "worker_groups", None)
        if groups is not None:
            groups.shutdown()
    assert not guard.breaches, guard.breaches  # also those a thread may have met
    return history, guard.used


@pytest.mark.parametrize("workers", ["local", pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])])
def test_the_driver_trains_checkpoints_and_resumes_through_the_contract_alone(tiny_model, tmp_path, workers, request):
    """``workers=local``: the in-process hf engine; ``workers=ray``: a ReplicaPool of one hf replica server (on the
    module's Ray instance, shut down with the module: later modules start their own)."""
    if workers == "ray":
        request.getfixturevalue("ray_cluster")
    history, used = _run(tiny_model, tmp_path, workers, resume=False)
    assert len(history) == 2
    resumed, used_again = _run(tiny_model, tmp_path, workers, resume=True)
    assert [row["trainer/step"] for row in resumed] == [1, 2, 3, 4]  # the checkpoint's history, then 3 and 4
    used |= used_again
    # the streaming calls, the weight publication, and both halves of the checkpoint went through the contract
    assert {"add_requests", "step", "has_unfinished", "update_weights", "export_inflight", "import_inflight"} <= used

"""One weight-sync strategy per run (rollout/publication.py): picked from what the actor and engine support."""

import pytest

from async_rl.rollout.publication import PublicationForm, choose_publication_form, weights_to_publish


class Actor:
    def __init__(self):
        self.calls = []

    def export_weights(self):
        self.calls.append("export")
        return {"w": 1}

    def publish_weights(self, version):
        self.calls.append(("publish", version))
        return {"version": version, "ref": ["handle"]}


class InDriverEngine:  # HFRolloutEngine: takes a state dict
    pass


class PublishingPool:  # ReplicaPool whose replicas load what they are sent
    accepts_published_weights = True
    takes_version_only = False


class PullingPool(PublishingPool):  # hybrid replicas, or verl's checkpoint manager
    takes_version_only = True


class InProcessActor:  # an in-process role: no publish_weights
    def export_weights(self):
        return {"w": 2}


@pytest.mark.parametrize("actor,engine,expected", [
    (Actor(), InDriverEngine(), PublicationForm.STATE_DICT),
    (Actor(), PublishingPool(), PublicationForm.OBJECT_STORE),
    (InProcessActor(), PublishingPool(), PublicationForm.STATE_DICT),
    (Actor(), PullingPool(), PublicationForm.VERSION_ONLY),
    (InProcessActor(), PullingPool(), PublicationForm.VERSION_ONLY),
])
def test_the_strategy_moves_the_weights_least(actor, engine, expected):
    assert choose_publication_form(actor, engine) is expected


def test_each_strategy_sends_one_form():
    actor = Actor()
    assert weights_to_publish(PublicationForm.STATE_DICT, actor, 3) == {"w": 1}
    assert weights_to_publish(PublicationForm.OBJECT_STORE, actor, 3) == {"version": 3, "ref": ["handle"]}
    assert weights_to_publish(PublicationForm.VERSION_ONLY, actor, 3) == {"version": 3, "in_process": True}
    assert actor.calls == ["export", ("publish", 3)]  # version-only moves nothing off the actor


def test_the_run_core_picks_the_strategy_once_when_built():
    from async_rl.config import AlgorithmConfig
    from async_rl.driver.driver import DeterministicDriver, DriverConfig
    from async_rl.driver.learner import Learner

    class Rollout:
        engine = PublishingPool()
        group_size = 1

    learner = Learner(AlgorithmConfig(name="grpo", group_size=2, train_batch_trajectories=2), Actor(), None, 0)
    core = DeterministicDriver(DriverConfig(total_steps=1), learner, Rollout())
    assert core.publication_form is PublicationForm.OBJECT_STORE
    assert core.weights_for(5) == {"version": 5, "ref": ["handle"]}

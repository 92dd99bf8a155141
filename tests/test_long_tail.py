"""toy_keys' long-tailed variant: a forced thinking turn whose length is lognormal per episode (issue 22)."""

from __future__ import annotations

import math
import statistics

import pytest

from async_rl.driver.episode import Episode, EpisodeLimits, forced_turn_tokens
from async_rl.envs.toy import LONG_TAIL_DEFAULT, ToyKeysEnv, make_toy_tasks
from async_rl.rollout.base import GenerationOutput, SamplingParams


def test_lengths_are_lognormal_with_p99_ten_times_the_median():
    spec = {"median": 24, "sigma": 1.0, "min": 1, "max": 100000}
    draws = sorted(forced_turn_tokens(spec, f"p{i}/r0") for i in range(20000))
    median, p99 = draws[10000], draws[19800]
    assert 22 <= median <= 26  # the median of a lognormal is exp(mu) = 24
    # p99 / median = exp(2.326 sigma) = 10.2 for sigma = 1
    assert 8.5 <= p99 / median <= 12.0
    logs = [math.log(x) for x in draws]
    assert abs(statistics.stdev(logs) - 1.0) < 0.05


def test_draws_are_reproducible_per_episode_and_differ_within_a_group():
    spec = {**LONG_TAIL_DEFAULT, "seed": 3}
    group = [forced_turn_tokens(spec, f"p7/r{m}") for m in range(8)]
    assert group == [forced_turn_tokens(spec, f"p7/r{m}") for m in range(8)]
    assert len(set(group)) > 1  # each member draws its own length
    assert all(LONG_TAIL_DEFAULT["min"] <= n <= LONG_TAIL_DEFAULT["max"] for n in group)
    assert forced_turn_tokens({**spec, "seed": 4}, "p7/r0") != forced_turn_tokens(spec, "p7/r0") or \
        forced_turn_tokens({**spec, "seed": 4}, "p7/r1") != forced_turn_tokens(spec, "p7/r1")


@pytest.mark.parametrize("spec", [{"sigma": 1.0, "max": 10}, {"median": 0, "max": 10},
                                  {"median": 5, "min": 20, "max": 10}, {"median": 5, "sigma": -1, "max": 10}])
def test_bad_spec_is_one_clear_error(spec):
    with pytest.raises(ValueError, match="forced_first_turn"):
        forced_turn_tokens(spec, "p0/r0")


def test_the_first_request_is_forced_and_the_env_answers_it_with_a_free_turn():
    task = make_toy_tasks("toy_keys", 1, seed=0, long_tail=LONG_TAIL_DEFAULT)[0]
    assert task["forced_first_turn"] == {**LONG_TAIL_DEFAULT, "seed": 0}
    env = ToyKeysEnv()
    env.reset(task)
    assert env.max_turns == 5  # the thinking turn is not one of the 4

    class _Formatter:
        end_token_id = None

        def prompt_ids(self, text):
            return [1, 2]

        def observation_ids(self, obs, closed):
            return [9]

    sampling = SamplingParams(max_new_tokens=24, stop_strings=("</s>",))
    ep = Episode(env, task, _Formatter(), sampling, EpisodeLimits(max_turns=5, max_response_tokens=1000),
                 uid="p0/r0", group_id="p0", group_size=1, prompt_index=0)
    ep.apply_reset(type("R", (), {"aborted": False, "observation": "prompt"})())
    n = forced_turn_tokens(task["forced_first_turn"], "p0/r0")
    first = ep.next_request()
    assert first.sampling.max_new_tokens == n and first.sampling.ignore_eos and first.sampling.stop_strings == ()
    assert ep.trajectory.info["forced_first_turn_tokens"] == n
    ep.on_output(GenerationOutput(request_id=first.request_id, prompt_ids=first.prompt_ids, token_ids=[5] * n,
                                  logprobs=[0.0] * n, versions=[0] * n, text="blah", finish_reason="length"))
    assert not ep.finished and ep.trajectory.turn_rewards == [0.0]
    second = ep.next_request()
    assert second.sampling == sampling  # later turns sample as configured
    step = env.step("look")
    assert step.observation == "The key is %d." % task["key"]


def test_long_tail_is_a_toy_keys_option_only():
    with pytest.raises(ValueError, match="long_tail"):
        make_toy_tasks("toy_echo", 2, long_tail=LONG_TAIL_DEFAULT)
    assert "forced_first_turn" not in make_toy_tasks("toy_keys", 1)[0]

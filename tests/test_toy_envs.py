"""toy_keys / toy_echo: rewards, action parsing, turn limit, observation wrapping, task determinism."""

from __future__ import annotations

import random

import pytest

from async_rl.envs.base import make_env, registered_env_names
from async_rl.envs.calls import run_env_step
from async_rl.envs.toy import (
    TOY_KEYS_PROMPT,
    ToyEchoEnv,
    ToyKeysEnv,
    echo_prompt,
    make_toy_tasks,
    observation_text,
    optimal_action,
    parse_boxed,
    parse_keys_action,
    play_episode,
)


@pytest.fixture(scope="module")
def tokenizer():
    from async_rl.models.tiny import build_tokenizer

    return build_tokenizer()


def test_both_envs_are_registered():
    assert {"toy_keys", "toy_echo"} <= set(registered_env_names())
    assert isinstance(make_env("toy_keys"), ToyKeysEnv)
    assert isinstance(make_env("toy_echo"), ToyEchoEnv)


@pytest.mark.parametrize("name", ["toy_keys", "toy_echo"])
def test_optimal_policy_always_succeeds(name):
    for task in make_toy_tasks(name, 200, seed=3):
        episode = play_episode(task)
        assert episode["reward"] == 1.0 and episode["success"], task
        assert episode["num_turns"] == (2 if name == "toy_keys" else 1)
        final = episode["turns"][-1][1]
        assert final.done and final.info["success"] is True and final.info["invalid_action"] is False


def test_optimal_keys_play_is_look_then_open_the_key():
    task = {"id": "k", "key": 7}
    env = ToyKeysEnv()
    assert env.reset(task) == TOY_KEYS_PROMPT
    assert optimal_action(task, [], env_name="toy_keys") == "look"
    first = env.step("look")
    assert (first.observation, first.reward, first.done) == ("The key is 7.", 0.0, False)
    assert first.info == {"invalid_action": False, "success": False, "turn": 1}
    action = optimal_action(task, [("look", first.observation)], env_name="toy_keys")
    assert action == "open 7"
    second = env.step(action)
    assert (second.observation, second.reward, second.done, second.info["success"]) == ("", 1.0, True, True)
    with pytest.raises(RuntimeError):
        env.step("look")


def test_blind_guessing_succeeds_about_ten_percent():
    rng = random.Random(0)
    tasks = make_toy_tasks("toy_keys", 3000, seed=11)
    wins = sum(play_episode(t, lambda task, history: f"open {rng.randrange(10)}")["success"] for t in tasks)
    assert 0.08 <= wins / len(tasks) <= 0.12


def test_wrong_door_ends_with_zero_reward():
    env = ToyKeysEnv()
    env.reset({"id": "k", "key": 2})
    result = env.step("open 5")
    assert (result.reward, result.done, result.info["success"], result.info["invalid_action"]) == (0.0, True, False, False)


@pytest.mark.parametrize("action", ["", "dance", "open", "open 12", "open x", "look around", "\\boxed{3}"])
def test_invalid_keys_action_is_flagged(action):
    env = ToyKeysEnv()
    env.reset({"id": "k", "key": 4})
    result = env.step(action)
    assert result.observation == "Invalid action."
    assert (result.reward, result.done) == (0.0, False)
    assert result.info["invalid_action"] is True and result.info["success"] is False


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("look", ("look", None)),
        ("open 7", ("open", 7)),
        ("  Open   3. ", ("open", 3)),
        ("<think> so the key is </think>\nlook", ("look", None)),
        ("<think> open 1 </think>\nopen 2", ("open", 2)),
        ("I will look first\nopen 9", ("open", 9)),  # the last non-empty line is the action
        ("open 1\n\n", ("open", 1)),
        ("<action>open 4</action> then <action>look</action>", ("look", None)),  # last tag wins
        ("<think> x </think>\n<action> open 6 </action>", ("open", 6)),
        ("open 7 now", None),
        ("<think> unfinished", None),
    ],
)
def test_keys_action_format(text, parsed):
    assert parse_keys_action(text) == parsed


def test_max_turns_is_enforced():
    env = ToyKeysEnv()
    assert env.max_turns == 4
    env.reset({"id": "k", "key": 1})
    for turn in range(1, 4):
        result = env.step("look" if turn % 2 else "hello")
        assert not result.done and result.reward == 0.0
    last = env.step("look")
    assert last.done and last.reward == 0.0 and last.info["success"] is False and last.info["out_of_turns"]
    with pytest.raises(RuntimeError):
        env.step("open 1")
    # The 4th turn can still win.
    env.reset({"id": "k", "key": 1})
    for _ in range(3):
        env.step("look")
    assert env.step("open 1").reward == 1.0


def test_reset_starts_a_fresh_episode_and_validates_the_task():
    env = ToyKeysEnv()
    env.reset({"id": "a", "key": 3})
    env.step("open 3")
    env.reset({"id": "b", "key": 8})
    assert env.step("look").observation == "The key is 8."
    with pytest.raises(KeyError):
        env.reset({"id": "c"})
    with pytest.raises(ValueError):
        env.reset({"id": "c", "key": 10})
    with pytest.raises(RuntimeError):
        ToyEchoEnv().step("\\boxed{1}")


@pytest.mark.parametrize(
    "answer, reward, invalid",
    [
        ("\\boxed{7}", 1.0, False),
        ("<think> so </think>\n\\boxed{ 7 }", 1.0, False),
        ("\\boxed{3} no wait \\boxed{7}", 1.0, False),
        ("\\boxed{7} no wait \\boxed{3}", 0.0, False),
        ("\\boxed{77}", 0.0, False),
        ("7", 0.0, True),
        ("", 0.0, True),
    ],
)
def test_echo_reward_uses_the_last_box(answer, reward, invalid):
    env = ToyEchoEnv()
    assert env.reset({"id": "e", "code": 7}) == "Repeat the code 7 inside \\boxed{}."
    result = env.step(answer)
    assert (result.reward, result.done, result.observation) == (reward, True, "")
    assert result.info["invalid_action"] is invalid and result.info["success"] is (reward == 1.0)
    with pytest.raises(RuntimeError):
        env.step("\\boxed{7}")


def test_parse_boxed():
    assert parse_boxed("a \\boxed{1} b \\boxed{ 2 }") == "2"
    assert parse_boxed("no box") is None


def test_envs_work_through_the_safe_step_runner():
    env = make_env("toy_keys")
    env.reset(make_toy_tasks("toy_keys", 1, seed=0)[0])
    outcome = run_env_step(env, "look", timeout_s=5)
    assert not outcome.aborted and outcome.result.observation.startswith("The key is ")


def test_observation_text_is_exact():
    assert observation_text("The key is 7.") == (
        "\n<|im_start|>user\nThe key is 7.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_observation_text_matches_the_chat_template(tokenizer):
    prompt, action, obs = TOY_KEYS_PROMPT, "<think> so </think>\nlook", "The key is 7."
    user = {"role": "user", "content": prompt}
    rollout_text = (
        tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        + action
        + "<|im_end|>"
        + observation_text(obs)
    )
    chat = [user, {"role": "assistant", "content": action}, {"role": "user", "content": obs}]
    assert rollout_text == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # Token level too: the rollout concatenates separately encoded pieces.
    pieces = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    rollout_ids = (
        tokenizer.encode(pieces, add_special_tokens=False)
        + tokenizer.encode(action + "<|im_end|>", add_special_tokens=False)
        + tokenizer.encode(observation_text(obs), add_special_tokens=False)
    )
    assert rollout_ids == tokenizer.encode(rollout_text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["toy_keys", "toy_echo"])
def test_make_toy_tasks_is_deterministic(name):
    tasks = make_toy_tasks(name, 500, seed=5)
    assert tasks == make_toy_tasks(name, 500, seed=5)
    assert make_toy_tasks(name, 20, seed=5) == tasks[:20]
    assert len({t["id"] for t in tasks}) == 500
    other = make_toy_tasks(name, 500, seed=6)
    assert not {t["id"] for t in tasks} & {t["id"] for t in other}
    field = "key" if name == "toy_keys" else "code"
    assert [t[field] for t in tasks] != [t[field] for t in other]
    assert {t[field] for t in tasks} == set(range(10))
    assert all(t["env"] == name for t in tasks)
    if name == "toy_echo":
        assert all(t["prompt"] == echo_prompt(t["code"]) for t in tasks)
    with pytest.raises(ValueError):
        make_toy_tasks("nope", 3)

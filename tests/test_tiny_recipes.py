"""Scripted demonstrations of the real tasks (the SIZE=tiny recipes' SFT warm start, async_rl.models.sft)."""

import pytest

from async_rl.envs.base import make_env
from async_rl.models.sft import (
    DEFAULTS,
    TASK_DEFAULTS,
    make_task_demonstrations,
    sft_warm_start_on_tasks,
)
from async_rl.models.tiny import make_tiny_model


pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from async_rl.models.loading import load_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path, hidden_size=16, num_layers=1)
    return load_tokenizer(path)


def _assistant_texts(demo):
    return [m["content"] for m in demo["messages"] if m["role"] == "assistant"]


def test_math_clean_demos_box_the_training_answer_and_noisy_ones_a_wrong_number(tokenizer):
    tasks = [{"id": "a", "prompt": "What is 2+3?", "answer": "5"}, {"id": "b", "prompt": "What is 6*7?", "answer": "42"}]
    env = make_env("math")
    clean = make_task_demonstrations("math", env, tasks, tokenizer, 4, noise=0.0)
    assert [_assistant_texts(d) for d in clean] == [["\\boxed{5}"], ["\\boxed{42}"]] * 2
    assert all(d["success"] and d["reward"] == 1.0 for d in clean)
    noisy = make_task_demonstrations("math", env, tasks, tokenizer, 6, noise=1.0)
    assert not any(d["success"] for d in noisy)  # one digit changed: never the right number
    # the loss covers exactly the action and <|im_end|>
    demo = clean[0]
    trained = [t for t, m in zip(demo["input_ids"], demo["loss_mask"]) if m]
    assert tokenizer.decode(trained) == "\\boxed{5}<|im_end|>"


def test_retool_demos_run_code_in_the_sandbox_then_box_its_output(tokenizer):
    from async_rl.envs.retool import make_retool_toy_tasks

    tasks = make_retool_toy_tasks(3, seed=0)
    env = make_env("retool", max_turns=2)
    clean = make_task_demonstrations("retool", env, tasks, tokenizer, 3, noise=0.0)
    for demo, task in zip(clean, tasks):
        code, answer = _assistant_texts(demo)
        assert code == f"<code>\nprint({task['expression']})\n</code>"
        assert f"\\boxed{{{task['answer']}}}" in answer
        assert demo["num_code_turns"] == 1 and demo["success"]
        assert "<interpreter>" in demo["messages"][2]["content"] and task["answer"] in demo["messages"][2]["content"]
    noisy = make_task_demonstrations("retool", env, tasks, tokenizer, 12, noise=1.0, seed=3)
    assert not any(d["success"] for d in noisy)
    assert any(d["num_code_turns"] == 1 for d in noisy)  # a wrong digit in the code still runs the tool


def test_alfworld_expert_plan_wins_the_fixture_game(tokenizer):
    from async_rl.envs.alfworld_env import make_alfworld_tasks

    tasks = make_alfworld_tasks("tests/fixtures/alfworld", split="train")
    env = make_env("alfworld", max_turns=7, history_length=0, data_dir="tests/fixtures/alfworld", expert=True)
    try:
        env.reset(tasks[0])
        assert env.expert_plan[0] in env.admissible_actions
        (clean,) = make_task_demonstrations("alfworld", env, tasks, tokenizer, 1, noise=0.0)
        # the planner's five steps: go to the cabinet, open it, take the mug, go to the shelf, put it there
        assert len(_assistant_texts(clean)) == 5 and clean["success"] and clean["reward"] == 1.0
        assert _assistant_texts(clean)[-1].endswith("<action>move mug 1 to shelf 1</action>")
    finally:
        env.close()


def test_alfworld_expert_plan_needs_the_expert_flag():
    env = make_env("alfworld", data_dir="tests/fixtures/alfworld")
    with pytest.raises(RuntimeError, match="expert=True"):
        env.expert_plan


def test_webshop_clean_demos_buy_the_target_with_its_options(tokenizer):
    from async_rl.envs.webshop import make_webshop_tasks

    tasks = make_webshop_tasks(6, seed=0)
    env = make_env("webshop", max_turns=5, history_length=0, page_size=3)
    clean = make_task_demonstrations("webshop", env, tasks, tokenizer, 6, noise=0.0)
    for demo, task in zip(clean, tasks):
        actions = _assistant_texts(demo)
        assert actions[0] == f"<action>search[{env.simulator_goal(task['goal_index'])['query']}]</action>"
        assert actions[-1].endswith("<action>click[buy now]</action>")
        assert demo["reward"] > 0
    # when the query's first page lists the target it is bought with the options the instruction names
    assert any(d["success"] for d in clean)
    noisy = make_task_demonstrations("webshop", env, tasks, tokenizer, 12, noise=1.0, seed=1)
    # a random product or skipped options lowers the score
    assert sum(d["reward"] for d in noisy) / len(noisy) < sum(d["reward"] for d in clean) / len(clean)


def test_an_option_is_named_only_as_whole_words():
    from async_rl.envs.demonstrations import names_phrase as _names_phrase

    # "large" is not named by "x-large" (the demo used to click "large" first, wasting one of its 5 turns)
    assert _names_phrase("in size x-large", "x-large") and not _names_phrase("in size x-large", "large")
    assert not _names_phrase("in size 33.8 fl oz", "8 fl oz") and _names_phrase("in size 8 fl oz, and", "8 fl oz")


def test_task_demonstrations_reject_bad_input(tokenizer):
    with pytest.raises(ValueError, match="no scripted demonstrations for env 'toy_keys'"):
        make_task_demonstrations("toy_keys", None, [{}], tokenizer, 1, 0.5)
    with pytest.raises(ValueError, match="no training tasks"):
        make_task_demonstrations("math", make_env("math"), [], tokenizer, 1, 0.5)
    with pytest.raises(ValueError, match="noise must be in"):
        make_task_demonstrations("math", make_env("math"), [{"prompt": "q", "answer": "1"}], tokenizer, 1, 1.5)


def test_warm_start_on_tasks_names_the_envs_it_supports(tmp_path):
    with pytest.raises(ValueError, match="model.sft: no demonstrations for env 'nope'.*model.sft.enabled=false"):
        sft_warm_start_on_tasks(tmp_path, tmp_path / "out", "nope", [{}])


def test_toy_defaults_are_untouched_and_every_task_has_its_own():
    assert DEFAULTS["toy_keys"] == {"noise": 0.7, "steps": 450, "clean_fraction": 2 / 3, "blind_fraction": 1.0}
    assert set(TASK_DEFAULTS) == {"math", "retool", "alfworld", "webshop", "reasoning_gym"}
    assert all(0 < d["noise"] < 1 and d["steps"] > 0 for d in TASK_DEFAULTS.values())


def test_webshop_page_size_shortens_the_results_page_and_the_goal_names_its_query():
    from async_rl.envs.webshop import make_webshop_tasks

    task = make_webshop_tasks(1, seed=0)[0]
    clicks = {}
    for size in (3, 10):
        env = make_env("webshop", page_size=size)
        env.reset(task)
        env.step(f"<action>search[{task['instruction']}]</action>")
        clicks[size] = [a for a in env.admissible_actions if a.startswith("click[b0")]
    assert len(clicks[3]) == 3 and len(clicks[10]) == 10 and clicks[3] == clicks[10][:3]
    goal = env.simulator_goal(task["goal_index"])
    assert goal["asin"] == task["target_asin"] and goal["query"] in task["instruction"]


def test_a_new_env_gets_a_warm_start_from_its_registered_demonstrations_alone(tokenizer):
    """models/sft.py reads the script, the defaults and the fillers from the env's facts, not from its name."""
    import random

    from async_rl.envs import facts as facts_module
    from async_rl.envs.base import Env, StepResult
    from async_rl.envs.facts import Demonstrations, EnvFacts, register_env_facts

    class Countdown(Env):
        max_turns = 3

        def reset(self, task):
            self.left = int(task["n"])
            return f"count down from {self.left}"

        def step(self, action_text):
            self.left -= 1
            solved = action_text.strip() == str(self.left) and self.left == 0
            done = self.left == 0 or action_text.strip() != str(self.left)
            return StepResult(observation=str(self.left), reward=float(solved), done=done, info={"success": solved})

    def policy(env, task, noisy, rng: random.Random, **_):
        wrong_turn = rng.randrange(int(task["n"])) if noisy else -1
        turns = iter(range(int(task["n"])))

        def act(observation):
            turn = next(turns)
            value = int(task["n"]) - 1 - turn
            return str(value + 5 if turn == wrong_turn else value)

        return act

    register_env_facts("countdown_test", EnvFacts(
        make_tasks=lambda cfg, seed: [], demonstrations=Demonstrations(
            policy=policy, think_fillers=False, sft_defaults={"noise": 0.5, "steps": 1})))
    try:
        from async_rl.envs.facts import demonstration_env_names

        assert "countdown_test" in demonstration_env_names(toy=False)
        tasks = [{"id": "c3", "n": 3}]
        clean = make_task_demonstrations("countdown_test", Countdown(), tasks, tokenizer, 2, 0.0)
        # "count down from 3" -> 2, 1, 0: three assistant turns, the last one ends the episode with reward 1
        assert [_assistant_texts(d) for d in clean] == [["2", "1", "0"], ["2", "1", "0"]]
        assert all(d["success"] and d["reward"] == 1.0 for d in clean)
        noisy = make_task_demonstrations("countdown_test", Countdown(), tasks, tokenizer, 6, 1.0, seed=3)
        assert not any(d["success"] for d in noisy)  # one wrong number ends every noisy episode unsolved
    finally:
        facts_module._FACTS.pop("countdown_test")
    with pytest.raises(ValueError, match="no scripted demonstrations for env 'countdown_test'"):
        make_task_demonstrations("countdown_test", Countdown(), [{"n": 1}], tokenizer, 1, 0.0)

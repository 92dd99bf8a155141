"""env=reasoning_gym: any reasoning-gym dataset by name, seeded, disjoint train/eval items, scored by the dataset's
own scorer after the documented answer extraction. Hand-worked cases use questions written here, scored by the
dataset's scorer rules (reasoning-gym 0.1.25: exact match 1.0, else len(oracle)/len(answer) when the oracle occurs in
the answer, else 0; gsm_symbolic: 1.0 for the right number, 0.01 for another number, 0 for none)."""

from __future__ import annotations

import pytest

from async_rl.envs import make_env
from async_rl.envs.reasoning_gym_env import (ANSWER_FORMATS, REASONING_GYM_DEMONSTRATIONS, create_dataset,
                                             extract_answer, format_answer, make_reasoning_gym_tasks)

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # few distinct questions: collisions


def _task(question: str, answer: str, prompt: str = "q") -> dict:
    return {"id": "hand", "prompt": prompt, "answer": answer,
            "entry": {"question": question, "answer": answer, "metadata": {}}}


@pytest.mark.parametrize("text, fmt, expected", [
    ("<answer>3</answer> no, <answer> 42 </answer>", "answer_tag", "42"),  # the last tag, stripped
    ("<answer>\n7\n</answer>", "answer_tag", "7"),
    ("The answer is 42.", "answer_tag", None),
    ("<answer>42", "answer_tag", None),  # never closed
    ("2 + 3 = 5\n#### 5\n", "hashes", "5"),
    ("#### 4\nwait\n#### 6", "hashes", "6"),
    ("#### \n", "hashes", None),  # nothing after the marker
    ("so \\boxed{12} and then \\boxed{13}", "boxed", "13"),
    ("\\boxed{12", "boxed", None),
])
def test_answer_extraction(text, fmt, expected):
    assert extract_answer(text, fmt) == expected


def test_format_answer_round_trips_every_format():
    for fmt in ANSWER_FORMATS:
        assert extract_answer("some work\n" + format_answer("-17", fmt), fmt) == "-17"


def test_step_is_scored_by_the_datasets_own_scorer():
    env = make_env("reasoning_gym", dataset="basic_arithmetic", dataset_config=SMALL)
    task = _task("Calculate 17 + 25.", "42")
    cases = [("<answer>42</answer>", 1.0, True, False),
             ("<answer>41</answer>", 0.0, False, False),
             ("<answer>x = 42</answer>", 2 / 6, False, False),  # default scorer's partial credit: 2 of 6 chars
             ("42", 0.0, False, True)]  # no tag: nothing extracted
    for text, reward, success, invalid in cases:
        assert env.reset(task) == "q"
        result = env.step(text)
        assert result.done and result.reward == pytest.approx(reward)
        assert result.info["success"] is success and result.info["invalid_action"] is invalid
    with pytest.raises(RuntimeError, match="over"):
        env.step("<answer>42</answer>")


def test_gsm_symbolic_scorer_reads_the_number_in_hashes_format():
    env = make_env("reasoning_gym", dataset="gsm_symbolic", answer_format="hashes")
    task = _task("Tom has 3 apples and buys 5 more. How many apples does he have?", "8")
    for text, reward in [("3 + 5 = 8\n#### 8", 1.0), ("#### 8 apples", 1.0), ("#### 9", 0.01), ("#### none", 0.0),
                         ("8", 0.0)]:
        env.reset(task)
        assert env.step(text).reward == pytest.approx(reward), text


def test_items_are_seeded_and_the_run_seed_only_orders_them():
    from async_rl.envs.facts import env_facts

    first = make_reasoning_gym_tasks("gsm_symbolic", {}, data_seed=3, num_train=20, num_eval=5)
    again = make_reasoning_gym_tasks("gsm_symbolic", {}, data_seed=3, num_train=20, num_eval=5)
    other = make_reasoning_gym_tasks("gsm_symbolic", {}, data_seed=4, num_train=20, num_eval=5)
    assert first == again
    assert [t["question"] for t in first] != [t["question"] for t in other]
    cfg = {"name": "reasoning_gym", "dataset": "gsm_symbolic", "dataset_config": {}, "data_seed": 3, "num_train": 20,
           "num_eval": 5, "split": "train", "answer_format": "answer_tag"}
    make = env_facts("reasoning_gym").make_tasks
    seed0, seed1 = make(cfg, 0), make(cfg, 1)
    assert seed0 == make(cfg, 0) and [t["id"] for t in seed0] != [t["id"] for t in seed1]
    assert sorted(t["id"] for t in seed0) == sorted(t["id"] for t in seed1) == sorted(t["id"] for t in first)


@pytest.mark.parametrize("data_seed", [0, 1, 2])
def test_train_and_eval_never_share_a_question(data_seed):
    # 1-digit a op b: ~ 4 * 19 * 19 questions at most, so 300 items repeat many of them
    train = make_reasoning_gym_tasks("basic_arithmetic", SMALL, data_seed, num_train=300, num_eval=100, split="train")
    held = make_reasoning_gym_tasks("basic_arithmetic", SMALL, data_seed, num_train=300, num_eval=100, split="eval")
    assert len(train) == 300 and 0 < len(held) < 100  # collisions were dropped from eval, not from train
    assert not {t["question"] for t in train} & {t["question"] for t in held}
    assert not {t["id"] for t in train} & {t["id"] for t in held}


def test_bad_names_and_configs_list_what_is_valid():
    with pytest.raises(ValueError) as info:
        create_dataset("gsm8k", {}, 0, 1)
    assert "not a reasoning-gym dataset" in str(info.value)
    assert "gsm_symbolic" in str(info.value) and "basic_arithmetic" in str(info.value)
    with pytest.raises(ValueError, match="does not take; valid: .*max_terms"):
        create_dataset("basic_arithmetic", {"max_term": 3}, 0, 1)
    with pytest.raises(ValueError, match="data_seed"):
        create_dataset("basic_arithmetic", {"seed": 3}, 0, 1)
    with pytest.raises(ValueError, match="not valid for basic_arithmetic"):
        create_dataset("basic_arithmetic", {"min_terms": 3, "max_terms": 2}, 0, 1)
    with pytest.raises(ValueError, match="answer_format"):
        make_env("reasoning_gym", dataset="gsm_symbolic", answer_format="json")
    with pytest.raises(KeyError, match="index"):
        make_env("reasoning_gym", dataset="gsm_symbolic").reset({"id": 1, "prompt": "q", "answer": "3"})


@pytest.mark.slow  # ~5 s: arc_agi loads its puzzle files three times
def test_items_are_scored_as_generated_and_a_foreign_config_is_refused():
    """The env regenerates a record's item: arc_agi compares tuple grids, which a JSON round trip of the item would
    turn into lists (its own right answer then scored 0.05, measured); and a record made with another config is
    refused instead of being scored against a different item."""
    from async_rl.envs.facts import env_facts

    cfg = {"name": "reasoning_gym", "dataset": "arc_agi", "dataset_config": {}, "data_seed": 5, "num_train": 3,
           "num_eval": 0, "split": "train", "answer_format": "answer_tag"}
    facts = env_facts("reasoning_gym")
    tasks = facts.make_tasks(cfg, 0)
    env = make_env("reasoning_gym", **facts.env_kwargs(cfg))
    for task in tasks:
        env.reset(task)
        assert env.step(format_answer(task["answer"], "answer_tag")).reward == 1.0
    other = make_env("reasoning_gym", **facts.env_kwargs({**cfg, "data_seed": 6}))
    with pytest.raises(ValueError, match="another dataset config or seed"):
        other.reset(tasks[0])
    with pytest.raises(ValueError, match="not an item"):
        env.reset({**tasks[0], "index": 3})


@pytest.mark.slow
def test_cli_refuses_an_unknown_dataset_in_one_line(tmp_path, capsys):
    from async_rl.train import main

    with pytest.raises(SystemExit) as info:
        main(["env=reasoning_gym", "env.dataset=gsm8k", f"trainer.output_dir={tmp_path}", "trainer.device=cpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "env.dataset='gsm8k'" in err[0] and "gsm_symbolic" in err[0]


@pytest.mark.parametrize("fmt", ["hashes", "answer_tag"])
def test_worked_solution_demonstrations_score_full_marks_and_noisy_ones_do_not(fmt):
    import random

    env = make_env("reasoning_gym", dataset="gsm_symbolic", answer_format=fmt, num_train=8, num_eval=0)
    tasks = make_reasoning_gym_tasks("gsm_symbolic", {}, 0, num_train=8, num_eval=0, answer_format=fmt)
    rng = random.Random(0)
    for task in tasks:
        clean = REASONING_GYM_DEMONSTRATIONS.policy(env, task, False, rng)(task["prompt"])
        assert clean.count("####") == (1 if fmt == "hashes" else 0)  # the worked solution's own #### line is gone
        env.reset(task)
        assert env.step(clean).reward == 1.0
        noisy = REASONING_GYM_DEMONSTRATIONS.policy(env, task, True, rng)(task["prompt"])
        env.reset(task)
        assert env.step(noisy).reward < 1.0


def test_eval_plays_the_held_out_split():
    from omegaconf import OmegaConf

    from async_rl.eval import load_sets

    env_cfg = OmegaConf.create({"name": "reasoning_gym", "dataset": "gsm_symbolic", "dataset_config": {},
                                "data_seed": 0, "num_train": 30, "num_eval": 6, "split": "train",
                                "eval_split": "eval", "num_tasks": None, "answer_format": "hashes",
                                "prompt_template": None})
    cfg = OmegaConf.create({"eval_sets": [], "limit": 4, "fallback_to_mini_sets": False, "seed": 0})
    [(name, tasks)] = load_sets(cfg, env_cfg)
    train = make_reasoning_gym_tasks("gsm_symbolic", {}, 0, 30, 6, answer_format="hashes")
    assert name == "reasoning_gym_eval" and len(tasks) == 4
    assert not {t["question"] for t in tasks} & {t["question"] for t in train}


@pytest.mark.parametrize("dataset, config", [("basic_arithmetic", {}), ("chain_sum", {})])
def test_two_data_seeds_give_different_items(dataset, config):
    # reasoning-gym seeds item i of its seed s with s + i: handed over as such, data seed 1 would repeat 49 of data
    # seed 0's 50 items one place later (measured on basic_arithmetic); the stride leaves chance repeats only
    first = make_reasoning_gym_tasks(dataset, config, data_seed=0, num_train=50, num_eval=0)
    second = make_reasoning_gym_tasks(dataset, config, data_seed=1, num_train=50, num_eval=0)
    assert len({t["question"] for t in first} & {t["question"] for t in second}) <= 2


def ReasoningGymYaml() -> dict:
    from pathlib import Path

    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf" / "env" / "reasoning_gym.yaml"
    return OmegaConf.to_container(OmegaConf.load(conf))


def test_data_seeds_stay_within_numpys_seeds():
    # pool_matrix hands seed + index to numpy (seeds below 2**32): the largest data seed still generates
    assert len(make_reasoning_gym_tasks("pool_matrix", {}, data_seed=4095, num_train=2, num_eval=1)) == 2
    with pytest.raises(ValueError, match=r"env.data_seed=4096: must be in \[0, 4095\]"):
        create_dataset("pool_matrix", {}, 4096, 2)
    from async_rl.envs.settings import check_env
    from async_rl.validation import ConfigError

    with pytest.raises(ConfigError, match="data_seed=4096"):
        check_env({**ReasoningGymYaml(), "data_seed": 4096})


@pytest.mark.parametrize("written, reference, passed_on", [
    ("28,080", "28080", "28080"), ("28,080.", "28080", "28080"), ("-1,234,567", "-1234567", "-1234567"),
    ("42.", "42", "42"), ("3.5", "3.5", "3.5"), (" 7 ", "7", "7"),
    ("2,80", "280", "2,80"),  # not thousands groups: as written
    ("1,234", "1, 2", "1,234"),  # the reference is not a plain number: as written
    ("12 apples", "12", "12 apples"), (None, "5", None),
])
def test_numbers_with_thousands_separators_reach_the_scorer_plain(written, reference, passed_on):
    from async_rl.envs.reasoning_gym_env import plain_number

    assert plain_number(written, reference) == passed_on


def test_a_grouped_number_scores_full_marks_on_gsm_symbolic():
    env = make_env("reasoning_gym", dataset="gsm_symbolic", answer_format="hashes")
    task = _task("Ann earns $2340 a month. How much does she earn in a year?", "28080")
    for text, reward in [("12 * 2340 = 28080\n#### 28,080", 1.0), ("#### 28,080.", 1.0), ("#### 28,081", 0.01)]:
        env.reset(task)
        assert env.step(text).reward == pytest.approx(reward), text


def test_prompt_template_places_the_question_and_keeps_other_braces():
    tasks = make_reasoning_gym_tasks("basic_arithmetic", SMALL, 0, num_train=2, num_eval=0, answer_format="boxed",
                                     prompt_template="Solve: {question}\nAnswer in \\boxed{}. {instruction}")
    for task in tasks:
        assert task["prompt"].startswith("Solve: " + task["question"] + "\nAnswer in \\boxed{}. Think step by step")
    for bad in ["no placeholder", "{problem}", 3]:
        with pytest.raises(ValueError, match=r"must contain \{question\}"):
            make_reasoning_gym_tasks("basic_arithmetic", SMALL, 0, num_train=2, num_eval=0, prompt_template=bad)


def test_a_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    from async_rl.envs import reasoning_gym_env

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    for call in (reasoning_gym_env.dataset_names, lambda: create_dataset("gsm_symbolic", {}, 0, 1)):
        with pytest.raises(ImportError, match="pip install reasoning-gym==0.1.25"):
            call()


def _recipe(*overrides):
    from async_rl.cli_config import compose_command_line
    from async_rl.train import check_config

    cfg = compose_command_line(["--config-dir", "recipes", "--config-name", "smollm2", *overrides])
    check_config(cfg)
    return cfg


def test_the_recipe_takes_another_dataset_with_its_own_config():
    from async_rl.validation import ConfigError

    # a whole mapping replaces the recipe's basic_arithmetic one; null gives the dataset's defaults
    assert dict(_recipe("env.dataset=gsm_symbolic", "env.dataset_config={difficulty: 1.0}").env.dataset_config) == {
        "difficulty": 1.0}
    assert _recipe("env.dataset=gsm_symbolic", "env.dataset_config=null").env.dataset_config is None
    # one entry changes, or joins, the recipe's mapping
    assert _recipe("env.dataset_config.max_digits=1").env.dataset_config.max_digits == 1
    assert _recipe("env.dataset_config.whitespace=single").env.dataset_config.min_terms == 2
    # the recipe's keys are not gsm_symbolic's: the error lists the valid ones and says how to replace the mapping
    with pytest.raises(ConfigError, match=r"does not take; valid: difficulty.*env.dataset_config=\{\.\.\.\} replaces"):
        _recipe("env.dataset=gsm_symbolic")
    with pytest.raises(ConfigError, match="does not take"):
        _recipe("env.dataset_config.max_digit=1")
    # whatever the mapping is when replaced: null, deleted, or given twice
    for first in ("env.dataset_config=null", "~env.dataset_config", "env.dataset_config={a: 1}"):
        cfg = _recipe(first, "env.dataset=gsm_symbolic", "env.dataset_config={difficulty: 1.0}")
        assert dict(cfg.env.dataset_config) == {"difficulty": 1.0}, first
    assert dict(_recipe("env.dataset_config=null", "env.dataset_config.max_digits=1").env.dataset_config) == {
        "max_digits": 1}
    assert "max_terms" not in _recipe("~env.dataset_config.max_terms", "~env.dataset_config.min_terms").env.dataset_config
    with pytest.raises(ConfigError, match="no such key"):  # only a free-form mapping takes new entries
        _recipe("env.dataset_confg={a: 1}")


def test_hydra_gets_the_replacement_spelled_in_its_own_overrides():
    from async_rl.cli_config import hydra_arguments

    assert hydra_arguments(["--config-dir", "recipes", "env.dataset_config={difficulty: 1.0}",
                            "env.dataset_config.max_digits=1", "+env.dataset_config.x=2", "~env.dataset_config",
                            "env.dataset=gsm_symbolic"]) == [
        "--config-dir", "recipes", "++env.dataset_config=null", "++env.dataset_config={difficulty: 1.0}",
        "++env.dataset_config.max_digits=1", "++env.dataset_config.x=2", "~env.dataset_config",
        "env.dataset=gsm_symbolic"]


@pytest.mark.slow
def test_cli_composes_a_replaced_dataset_config_through_hydra(tmp_path, capsys):
    """Hydra itself composes the rewritten overrides: the run gets as far as the machine check (no model there)."""
    from async_rl.train import main

    with pytest.raises(SystemExit) as info:
        main(["--config-dir", "recipes", "--config-name", "smollm2", "model=local", f"model.dir={tmp_path}/none",
              "env.dataset=gsm_symbolic", "env.dataset_config={difficulty: 1.0}", f"trainer.output_dir={tmp_path}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no Hugging Face checkpoint" in err[0]


def test_eval_without_the_package_says_how_to_install_it(monkeypatch, tiny_model, tmp_path, capsys):
    import importlib.util
    import sys

    from async_rl.eval import _cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    monkeypatch.setattr(sys, "argv", ["eval", f"model_dir={tiny_model}", "env=reasoning_gym", f"output_dir={tmp_path}"])
    with pytest.raises(SystemExit) as info:
        _cli()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install reasoning-gym==0.1.25" in err[0], err


def test_eval_replaces_a_dataset_config_as_training_does():
    from async_rl.eval import parse_args

    _, env_cfg = parse_args(["model_dir=/m", "env=reasoning_gym", "env.dataset=basic_arithmetic",
                             "env.dataset_config={min_terms: 2, max_terms: 2}", "env.dataset_config={max_digits: 1}",
                             "env.dataset_config.min_digits=1"])
    assert dict(env_cfg.dataset_config) == {"max_digits": 1, "min_digits": 1}
    _, env_cfg = parse_args(["model_dir=/m", "env=reasoning_gym", "env.dataset_config={a: 1}",
                             "env.dataset_config=null"])
    assert env_cfg.dataset_config is None

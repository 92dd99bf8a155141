"""Math data loading: DAPO-Math-17K (verl layout, parquet) and AIME (jsonl) fixtures, errors, config entry points.

Fixtures (tests/fixtures/, written by hand / by make_fixtures.py; never downloaded):
  dapo_math_mini.parquet  6 rows in verl format, row 5 repeats row 0 (the real file repeats every prompt)
  aime_2024_mini.jsonl    5 problems, HuggingFaceH4 layout (id, problem, solution, answer, url, year)
  aime_2025_mini.jsonl    3 problems, capitalised layout (ID, Problem, Answer as integers), no year column
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from async_rl.data.math_data import (
    MathDataError,
    load_eval_set,
    load_math_records,
    make_math_tasks,
    strip_dapo_instruction,
)

FIXTURES = Path(__file__).parent / "fixtures"
DAPO = FIXTURES / "dapo_math_mini.parquet"
AIME_2024 = FIXTURES / "aime_2024_mini.jsonl"
AIME_2025 = FIXTURES / "aime_2025_mini.jsonl"


@pytest.fixture
def cache(tmp_path):
    """A private datasets cache, so tests leave nothing in ~/.cache."""
    return str(tmp_path / "hf_cache")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------------------------------------
# DAPO-Math-17K, verl layout
# ------------------------------------------------------------------------------------------------


def test_dapo_verl_layout_reads_chat_prompt_and_ground_truth(cache):
    records = load_math_records(DAPO, cache_dir=cache)
    # 6 rows, the last repeats the first -> 5 distinct problems
    assert [r["id"] for r in records] == ["fx-0001", "fx-0002", "fx-0003", "fx-0004", "fx-0005"]
    assert [r["answer"] for r in records] == ["2", "9", "100", "54", "20"]
    first = records[0]
    # the prompt is the user message verbatim (DAPO's instruction wrapper included)
    assert first["prompt"].startswith("Solve the following math problem step by step.")
    assert "What is the remainder when $2^{10}$ is divided by $7$?" in first["prompt"]
    assert first["source"] == "dapo_math_mini"
    assert "year" not in first  # no year column, none in the name


def test_dapo_strip_instruction_and_template(cache):
    template = "{question}\n\nPut the answer in \\boxed{}."
    records = load_math_records(DAPO, cache_dir=cache, strip_instruction=True, prompt_template=template)
    assert records[0]["question"] == "What is the remainder when $2^{10}$ is divided by $7$?"
    # str.replace, not str.format: the literal \boxed{} survives
    question = "What is the remainder when $2^{10}$ is divided by $7$?"
    assert records[0]["prompt"] == question + "\n\nPut the answer in \\boxed{}."


def test_dapo_without_dedupe_keeps_repeats_with_unique_ids(cache):
    records = load_math_records(DAPO, cache_dir=cache, dedupe=False)
    assert len(records) == 6
    # row 5 repeats row 0's extra_info.index -> "#row" appended so ids stay unique
    assert records[5]["id"] == "fx-0001#5"
    assert len({r["id"] for r in records}) == 6


def test_limit_counts_distinct_records(cache):
    assert [r["id"] for r in load_math_records(DAPO, limit=2, cache_dir=cache)] == ["fx-0001", "fx-0002"]


def test_dataset_directory_as_downloaded_from_the_hub(tmp_path, cache):
    # `hf download --repo-type dataset ... --local-dir DIR` gives DIR/data/train-00000-of-00001.parquet
    (tmp_path / "dapo" / "data").mkdir(parents=True)
    shutil.copy(DAPO, tmp_path / "dapo" / "data" / "train-00000-of-00001.parquet")
    records = load_math_records(tmp_path / "dapo", cache_dir=cache)
    assert len(records) == 5 and records[0]["source"] == "dapo"
    with pytest.raises(MathDataError, match="Unknown split"):
        load_math_records(tmp_path / "dapo", split="test", cache_dir=cache)


def test_strip_dapo_instruction_leaves_other_text_alone():
    wrapped = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
               "What is $1+1$?\n\nRemember to put your answer on its own line after \"Answer:\".")
    assert strip_dapo_instruction(wrapped) == "What is $1+1$?"
    assert strip_dapo_instruction("What is $1+1$?") == "What is $1+1$?"


# ------------------------------------------------------------------------------------------------
# AIME layouts
# ------------------------------------------------------------------------------------------------


def test_aime_h4_layout(cache):
    records = load_math_records(AIME_2024, cache_dir=cache)
    assert len(records) == 5
    assert records[1] == {
        "id": "61",
        "prompt": "What is $17 \\times 23$?",
        "question": "What is $17 \\times 23$?",
        "answer": "391",  # the `answer` column wins over the boxed `solution`
        "source": "aime_2024_mini",
        "year": 2024,  # from the year column ("2024" as text)
    }


def test_aime_capitalised_layout_with_integer_answers(cache):
    records = load_math_records(AIME_2025, cache_dir=cache)
    assert [r["id"] for r in records] == ["2025-I-1", "2025-I-2", "2025-II-1"]
    assert [r["answer"] for r in records] == ["210", "42", "32"]  # ints become text
    assert all(r["year"] == 2025 for r in records)  # no year column: parsed from "aime_2025_mini"


def test_question_column_boxed_solution_and_explicit_keys(tmp_path, cache):
    path = write_jsonl(tmp_path / "aime25.jsonl", [
        {"question": "Q1", "solution": "so it is $\\boxed{\\frac{1}{2}}$", "n": 7},
        {"question": "Q2", "solution": "thus \\boxed{12}", "n": 8},
    ])
    records = load_math_records(path, cache_dir=cache)
    assert [r["answer"] for r in records] == ["\\frac{1}{2}", "12"]  # last \boxed{} of the solution
    assert [r["id"] for r in records] == ["aime25-0", "aime25-1"]  # no id column: f"{source}-{row}"
    assert records[0]["year"] == 2025  # "aime25" -> 2025
    # explicit keys, case-insensitive
    records = load_math_records(path, prompt_key="QUESTION", answer_key="n", id_key="n", year=1999, cache_dir=cache)
    assert [(r["id"], r["answer"], r["year"]) for r in records] == [("7", "7", 1999), ("8", "8", 1999)]


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_missing_file_says_where_and_how(tmp_path):
    with pytest.raises(MathDataError, match="not found") as info:
        load_math_records(tmp_path / "nope.parquet")
    assert "allow_hub" in str(info.value) and "docs/evaluation.md" in str(info.value)
    # a Hub-looking name is not fetched unless allowed
    with pytest.raises(MathDataError, match="allow_hub=true"):
        load_math_records("BytedTsinghua-SIA/DAPO-Math-17k")


def test_missing_columns_lists_the_columns_found(tmp_path, cache):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "What is 1+1?", "label": "2"}])
    with pytest.raises(MathDataError, match="no prompt column") as info:
        load_math_records(path, cache_dir=cache)
    assert "['text', 'label']" in str(info.value)
    with pytest.raises(MathDataError, match="no answer column") as info:
        load_math_records(path, prompt_key="text", cache_dir=cache)
    assert "['text', 'label']" in str(info.value)
    assert load_math_records(path, prompt_key="text", answer_key="label", cache_dir=cache)[0]["answer"] == "2"


def test_explicit_key_not_found_lists_nested_fields(cache):
    with pytest.raises(MathDataError, match="column 'problem' \\(prompt_key\\) not found") as info:
        load_math_records(DAPO, prompt_key="problem", cache_dir=cache)
    assert "reward_model.ground_truth" in str(info.value)  # struct fields are listed too


def test_bad_rows_and_files(tmp_path, cache):
    rows = [{"problem": "ok", "answer": "1"}, {"problem": "no answer", "answer": ""}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(MathDataError, match="row 1.*empty answer"):
        load_math_records(path, cache_dir=cache)
    text = tmp_path / "data.txt"
    text.write_text("hello")
    with pytest.raises(MathDataError, match="unsupported file type"):
        load_math_records(text)
    with pytest.raises(ValueError, match="\\{question\\}"):
        load_math_records(AIME_2024, prompt_template="no placeholder")


# ------------------------------------------------------------------------------------------------
# Config entry points
# ------------------------------------------------------------------------------------------------


def test_make_math_tasks_from_env_config(cache):
    env_cfg = {"name": "math", "train_data": str(DAPO), "num_tasks": 3, "strip_dapo_instruction": True,
               "prompt_template": "{question} Box it.", "cache_dir": cache}
    tasks = make_math_tasks(env_cfg, seed=0)
    assert [t["id"] for t in tasks] == ["fx-0001", "fx-0002", "fx-0003"]
    assert all(t["env"] == "math" and t["prompt"].endswith(" Box it.") for t in tasks)
    with pytest.raises(MathDataError, match="train_data"):
        make_math_tasks({"name": "math"}, seed=0)


def test_load_eval_set_mapping_overrides(cache):
    name, records = load_eval_set({"path": str(AIME_2025), "name": "aime_2025", "year": 2031},
                                  {"prompt_template": "{question}!", "cache_dir": cache}, limit=2)
    assert name == "aime_2025" and len(records) == 2
    assert records[0]["source"] == "aime_2025" and records[0]["year"] == 2031
    assert records[0]["prompt"] == "Compute $1 + 2 + \\cdots + 20$.!"
    with pytest.raises(MathDataError, match="unknown keys \\['colour'\\]"):
        load_eval_set({"path": str(AIME_2025), "colour": "red"})


@pytest.mark.slow  # ~5 s: the package's 7 MB json and the grader's worker process
def test_champ_integer_problems_are_an_eval_set_graded_by_the_math_reward():
    """CHAMP (champ-dataset 1.0.0) as eval_sets=[champ]: its 79 integer-answer problems of 270, graded exactly."""
    from omegaconf import OmegaConf

    from async_rl.eval import load_sets
    from async_rl.rewards.math_reward import grade_answer

    env_cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "env" / "math.yaml")
    cfg = OmegaConf.create({"eval_sets": ["champ"], "limit": None, "fallback_to_mini_sets": True, "seed": 0})
    [(name, records)] = load_sets(cfg, env_cfg)
    assert name == "champ" and len(records) == 79
    assert all(re.fullmatch(r"-?\d+", r["answer"]) for r in records)
    assert len({r["id"] for r in records}) == 79
    first = next(r for r in records if r["id"] == "champ-P_Combinatorics_1")
    # "strings of length 6 over {1,2,3}, adjacent digits differing by <= 1": 239 (by hand: a transfer matrix)
    assert first["answer"] == "239" and first["prompt"].endswith("within \\boxed{}.")
    assert first["question"] in first["prompt"]
    assert grade_answer("so the count is \\boxed{239}", first["answer"])[1]
    assert not grade_answer("\\boxed{238}", first["answer"])[1]
    cfg.limit = 5
    assert len(load_sets(cfg, env_cfg)[0][1]) == 5

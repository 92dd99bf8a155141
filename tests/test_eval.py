"""async_rl.eval: pass@k arithmetic, argument parsing, the multi-turn episode loop with a scripted engine,
and end-to-end runs on a random tiny model (pass@k ~ 0 there: the point is the plumbing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_rl.eval import evaluate_pass_at_k, format_table, main, make_env_factory, parse_args, run_episodes

FIXTURES = Path(__file__).parent / "fixtures"
AIME_2024 = FIXTURES / "aime_2024_mini.jsonl"
AIME_2025 = FIXTURES / "aime_2025_mini.jsonl"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from async_rl.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


# ------------------------------------------------------------------------------------------------
# pass@k (pure)
# ------------------------------------------------------------------------------------------------


def test_evaluate_pass_at_k_by_hand():
    samples = {
        "a": [True, False, True, False],  # n=4, c=2
        "b": [False] * 4,  # n=4, c=0
        "c": [False, False, False, True],  # n=4, c=1
    }
    result = evaluate_pass_at_k(samples, ks=[1, 2, 4, 8])
    # a: pass@1 = 2/4 = 0.5; pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6 = 0.8333; pass@4 = 1
    # b: 0, 0, 0
    # c: pass@1 = 0.25;      pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5;    pass@4 = 1
    # mean: pass@1 = 0.75/3 = 0.25; pass@2 = 1.3333/3 = 0.4444; pass@4 = 2/3
    assert result["k"] == [1, 2, 4]
    assert result["skipped_k"] == [8]  # k > n
    assert result["pass"] == pytest.approx([0.25, 4 / 9, 2 / 3], abs=1e-9)
    assert result["num_problems"] == 3
    assert result["per_problem"]["a"] == {"n": 4, "c": 2, "pass": pytest.approx([0.5, 5 / 6, 1.0])}
    assert result["per_problem"]["b"]["pass"] == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)  # lgamma: ~1e-16


def test_evaluate_pass_at_k_uneven_n_and_errors():
    # n = [2, 3]: k=2 fits both, k=4 fits neither. a: c=2 -> 1; b: c=0 -> 0; pass@1 = (1 + 0)/2
    result = evaluate_pass_at_k({"a": [True, True], "b": [False, False, False]}, ks=(4, 1, 2, 2))
    assert result["k"] == [1, 2] and result["pass"] == [0.5, 0.5] and result["skipped_k"] == [4]
    with pytest.raises(ValueError, match="at least one problem"):
        evaluate_pass_at_k({}, ks=[1])
    with pytest.raises(ValueError, match="must be >= 1"):
        evaluate_pass_at_k({"a": [True]}, ks=[0])
    with pytest.raises(ValueError, match="without samples"):
        evaluate_pass_at_k({"a": []}, ks=[1])


def test_format_table_has_a_row_per_set_and_the_mean():
    sets = {"aime_2024": {"k": [1, 2], "pass": [0.25, 0.5], "num_problems": 30, "year": 2024},
            "aime_2025": {"k": [1, 2], "pass": [0.75, 1.0], "num_problems": 30, "year": 2025}}
    table = format_table(sets, {"k": [1, 2], "pass": [0.5, 0.75]})
    lines = table.splitlines()
    assert lines[0].split() == ["set", "year", "problems", "pass@1", "pass@2"]
    assert lines[2].split() == ["aime_2024", "2024", "30", "25.0%", "50.0%"]
    assert lines[-1].split() == ["mean", "50.0%", "75.0%"]


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------


def test_parse_args_loads_the_env_yaml_and_overrides():
    cfg, env_cfg = parse_args(["model_dir=/m", "env=retool", "env.max_turns=3", "env.sandbox.kind=fusion",
                               f"eval_sets=[{AIME_2024},{AIME_2025}]", "n_samples=4", "ks=[1,4]"])
    assert cfg.model_dir == "/m" and cfg.n_samples == 4 and list(cfg.ks) == [1, 4]
    assert list(cfg.eval_sets) == [str(AIME_2024), str(AIME_2025)]
    assert env_cfg.name == "retool" and env_cfg.max_turns == 3 and env_cfg.sandbox.kind == "fusion"
    assert env_cfg.stop_strings == ["</code>"]  # from conf/env/retool.yaml
    cfg, env_cfg = parse_args(["model_dir=/m"])
    assert cfg.env == "math" and env_cfg.max_turns == 1 and cfg.n_samples == 16 and list(cfg.ks) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("argv, message", [
    (["model_dir=/m", "colour=red"], "Valid keys"),
    (["model_dir=/m", "n_samples=many"], "bad eval argument 'n_samples=many'"),
    (["model_dir"], "key=value"),
    (["env=no_such_env"], "unknown env 'no_such_env'"),
    (["model_dir=/m", "n_samples="], r"n_samples= has no value: give one \(n_samples=...\) or leave n_samples out"),
    (["model_dir=/m", "env.max_turns="], "env.max_turns= has no value"),
])
def test_parse_args_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_bad_values_fail_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="model_dir is not set and no trained model was found.*MODEL=<dir>"):
        main(["env=math", f"eval_sets=[{AIME_2024}]", f"runs_dir={tmp_path / 'no_runs'}"])
    with pytest.raises(ValueError, match="exceeds n_samples"):
        main(["model_dir=/nowhere", "n_samples=2", "ks=[4]"])
    with pytest.raises(ValueError, match="must exceed env.code_timeout_s"):
        main(["model_dir=/nowhere", "env=retool", "env.code_timeout_s=100", f"eval_sets=[{AIME_2024}]"])
    with pytest.raises(ValueError, match="not found"):  # data errors also come before the model
        main(["model_dir=/nowhere", f"eval_sets=[{tmp_path / 'missing.jsonl'}]"])


# ------------------------------------------------------------------------------------------------
# Multi-turn episode loop (ReTool + the real sandbox) with a scripted engine
# ------------------------------------------------------------------------------------------------


class ScriptedEngine:
    """Stands in for HFRolloutEngine: answers each request with the toy-optimal ReTool action."""

    def __init__(self, tokenizer, tasks):
        from async_rl.driver.episode import ChatFormatter

        self.tokenizer = tokenizer
        self.tasks = {t["id"]: t for t in tasks}
        self.end_id = ChatFormatter(tokenizer).end_token_id
        self.seeds: list[int] = []

    def generate(self, requests):
        from async_rl.envs.retool import optimal_toy_action
        from async_rl.rollout.base import GenerationOutput

        outputs = []
        for request in requests:
            self.seeds.append(request.sampling.seed)
            task_id = str(request.request_id).split("/")[1]  # "{set}/{task id}/s{sample}/turn{t}"
            context = self.tokenizer.decode(request.prompt_ids)
            text = optimal_toy_action(self.tasks[task_id], [("", context)])
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end_id]
            outputs.append(GenerationOutput(request.request_id, list(request.prompt_ids), ids, [0.0] * len(ids),
                                            [0] * len(ids), "stop", text))
        return outputs


def test_run_episodes_drives_multi_turn_retool(tiny_model):
    from omegaconf import OmegaConf

    from async_rl.driver.episode import ChatFormatter, EpisodeLimits
    from async_rl.envs.retool import make_retool_toy_tasks
    from async_rl.models.loading import load_tokenizer
    from async_rl.rollout.base import SamplingParams

    tokenizer = load_tokenizer(tiny_model)
    tasks = make_retool_toy_tasks(3, seed=0)
    engine = ScriptedEngine(tokenizer, tasks)
    env_factory = make_env_factory(OmegaConf.create({"name": "retool"}), max_turns=4)
    trajectories = run_episodes(engine, ChatFormatter(tokenizer), env_factory, "retool_toy", tasks, n_samples=2,
                                sampling=SamplingParams(max_new_tokens=64), limits=EpisodeLimits(4, 2048, 30.0),
                                seed=0, batch_size=4)  # 6 episodes in batches of 4 and 2
    assert len(trajectories) == 6
    # turn 1 runs the expression, turn 2 boxes the interpreter's output
    assert all(t.success and t.reward == 1.0 and t.num_turns == 2 and not t.aborted for t in trajectories)
    assert [t.uid for t in trajectories[:2]] == ["retool_toy/retool_toy-s0-0/s0", "retool_toy/retool_toy-s0-0/s1"]
    assert len(set(engine.seeds)) == len(engine.seeds) == 12  # one fixed seed per (problem, sample, turn)
    result = evaluate_pass_at_k({t["id"]: [True, True] for t in tasks}, [1, 2])
    assert result["pass"] == [1.0, 1.0]


# ------------------------------------------------------------------------------------------------
# End to end on a random tiny model
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_end_to_end_math_on_aime_fixtures(tiny_model, tmp_path, capsys):
    out = tmp_path / "eval"
    report = main([f"model_dir={tiny_model}", "env=math", f"eval_sets=[{AIME_2024},{AIME_2025}]", "n_samples=2",
                   "temperature=1.0", "max_new_tokens=8", "batch_size=4", f"output_dir={out}"])
    saved = json.loads((out / "pass_at_k.json").read_text())
    assert saved["sets"].keys() == {"aime_2024_mini", "aime_2025_mini"}
    aime = saved["sets"]["aime_2024_mini"]
    assert aime["k"] == [1, 2] and aime["skipped_k"] == [4, 8, 16] and len(aime["pass"]) == 2
    assert aime["year"] == 2024 and aime["num_problems"] == 5
    assert set(aime["per_problem"]) == {"60", "61", "62", "63", "64"}
    assert all(p["n"] == 2 and 0 <= p["c"] <= 2 and p["aborted"] == 0 for p in aime["per_problem"].values())
    assert saved["mean"]["k"] == [1, 2] and saved["mean"]["num_sets"] == 2
    assert "eval/mean/pass@1" in saved["metrics"] and report["sets"]["aime_2025_mini"]["year"] == 2025
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5 * 2 + 3 * 2
    assert {s["set"] for s in samples} == {"aime_2024_mini", "aime_2025_mini"}
    printed = capsys.readouterr().out
    assert "aime_2024_mini  2024" in printed and "pass@2" in printed and "mean" in printed

    # fixed seeds: the same command gives the same samples
    main([f"model_dir={tiny_model}", "env=math", f"eval_sets=[{AIME_2024}]", "n_samples=2", "max_new_tokens=8",
          "batch_size=3", f"output_dir={tmp_path / 'again'}", "save_samples=true"])
    again = [json.loads(line) for line in (tmp_path / "again" / "samples.jsonl").read_text().splitlines()]
    assert [s["response"] for s in again] == [s["response"] for s in samples[:10]]


def test_end_to_end_toy_keys_multi_turn(tiny_model, tmp_path):
    report = main([f"model_dir={tiny_model}", "env=toy_keys", "n_samples=2", "limit=3", "max_new_tokens=6",
                   f"output_dir={tmp_path}", "save_samples=false"])
    result = report["sets"]["toy_keys"]
    assert result["k"] == [1, 2] and result["num_problems"] == 3
    assert not (tmp_path / "samples.jsonl").exists() and (tmp_path / "pass_at_k.json").exists()


def test_success_and_score_per_category():
    from types import SimpleNamespace

    from async_rl.eval import success_and_score

    tasks = [{"category": "Pick"}, {"category": "Cool"}]
    t = lambda success, reward, aborted=False: SimpleNamespace(success=success, reward=reward, aborted=aborted)  # noqa: E731
    # 2 samples per task: Pick 1/2, Cool 0/2 (one aborted: scored 0, never its reward)
    out = success_and_score(tasks, [t(True, 1.0), t(False, 0.5), t(False, 0.25), t(False, 0.9, aborted=True)], 2)
    assert out["success_rate"] == 0.25
    assert abs(out["score_mean"] - (1.0 + 0.5 + 0.25 + 0.0) / 4) < 1e-12
    assert out["success_by_category"] == {"Cool": 0.0, "Pick": 0.5, "All": 0.25}


def test_end_to_end_webshop_reports_score_and_success(tiny_model, tmp_path):
    report = main([f"model_dir={tiny_model}", "env=webshop", "n_samples=1", "ks=[1]", "limit=2", "max_turns=1",
                   "max_new_tokens=4", f"output_dir={tmp_path}"])
    result = report["sets"]["webshop_test"]
    # the reported means are those of the saved samples: score = reward (0 for an aborted sample), success = correct
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert result["num_problems"] == 2 and len(samples) == 2 and {s["set"] for s in samples} == {"webshop_test"}
    scores = [0.0 if s["aborted"] else float(s["reward"]) for s in samples]
    assert abs(result["score_mean"] - sum(scores) / 2) < 1e-12
    assert result["success_rate"] == sum(bool(s["correct"]) for s in samples) / 2


# ------------------------------------------------------------------------------------------------
# Evaluation without guessing: defaults, data fallbacks, messages
# ------------------------------------------------------------------------------------------------


def test_pass_at_k_never_negative_zero():
    from async_rl.eval import percent

    # c = 0 of n = 8: lgamma round-off made 1 - exp(+2e-16) = -2.2e-16, printed as "-0.0%"
    result = evaluate_pass_at_k({"a": [False] * 8, "b": [False] * 8}, ks=[1, 8])
    for value in result["pass"] + [v for p in result["per_problem"].values() for v in p["pass"]]:
        assert value == 0.0 and str(value) == "0.0"  # not -0.0, not -2e-16
    table = format_table({"alfworld": result}, None)
    assert "-0.0" not in table and table.splitlines()[-1].split()[-2:] == ["0.0%", "0.0%"]
    assert f"{percent(-0.0):.1f}" == "0.0" and f"{percent(-2e-16):.1f}" == "0.0" and percent(0.25) == 25.0


def test_empty_model_and_env_mean_unset(tmp_path):
    # `make eval` with MODEL and ENV unset used to pass model_dir= env=, failing with "Incompatible value 'None'"
    cfg, env_cfg = parse_args(["model_dir=", "env=", f"runs_dir={tmp_path}"])
    assert cfg.model_dir is None and cfg.env == "math" and env_cfg.name == "math"
    with pytest.raises(ValueError, match=f"{tmp_path / 'last_run.json'} does not exist.*make aime"):
        main(["model_dir=", f"runs_dir={tmp_path}"])


def test_stale_last_run_pointer_is_reported(tmp_path):
    from async_rl.models.export import write_last_run

    write_last_run(tmp_path, tmp_path / "gone", tmp_path / "gone" / "model")
    cfg, _ = parse_args([f"runs_dir={tmp_path}"])
    assert cfg.model_dir is None
    with pytest.raises(ValueError, match="holds no model any more"):
        main([f"runs_dir={tmp_path}"])


def test_run_directory_stands_for_its_model_and_sets_env_and_output(tiny_model, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "outputs" / "my-run"
    shutil.copytree(tiny_model, run_dir / "model")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.json").write_text(json.dumps({"env": {"name": "toy_keys", "max_turns": 2, "num_tasks": 8}}))
    cfg, env_cfg = parse_args([f"model_dir={run_dir}", f"runs_dir={tmp_path / 'none'}"])
    assert cfg.model_dir == str(run_dir / "model")
    assert cfg.output_dir == str(run_dir / "eval")
    # an untagged model gives no env: math, the documented default; with env=toy_keys the run's env config
    assert cfg.env == "math" and env_cfg.name == "math"
    cfg, env_cfg = parse_args([f"model_dir={run_dir}", "env=toy_keys", "env.max_new_tokens=3"])
    assert env_cfg.max_turns == 2 and env_cfg.num_tasks == 8 and env_cfg.max_new_tokens == 3  # run's, then override
    assert "env config: the one run" in capsys.readouterr().err


def test_missing_math_data_falls_back_to_the_shipped_mini_sets(tmp_path, monkeypatch, capsys):
    from async_rl.eval import load_sets

    monkeypatch.chdir(tmp_path)  # conf/env/math.yaml's data/aime/... do not exist here
    cfg, env_cfg = parse_args(["model_dir=/m", "env=math", f"runs_dir={tmp_path}"])
    assert cfg.fallback_to_mini_sets
    sets = load_sets(cfg, env_cfg)
    # the AIME mini set, and CHAMP's 79 integer-answer problems from its package (a pyproject dependency)
    assert [name for name, _ in sets] == ["aime_2024_mini", "champ"] and len(sets[0][1]) == 5
    assert len(sets[1][1]) == 79 and all(str(int(task["answer"])) == task["answer"] for task in sets[1][1])
    err = capsys.readouterr().err
    assert "CHAMP's 79 integer-answer competition problems" in err
    assert "none of env.eval_sets exists" in err and "data/aime/aime_2024.jsonl" in err
    assert "Evaluating the mini sets shipped in recipes/data/" in err
    assert "env.allow_hub=true" in err and "load_dataset('HuggingFaceH4/aime_2024'" in err


def test_named_data_is_never_replaced(tmp_path, monkeypatch):
    from async_rl.eval import load_sets

    monkeypatch.chdir(tmp_path)
    cfg, env_cfg = parse_args(["model_dir=/m", "env=math", "env.eval_sets=[data/mine.jsonl]"])
    assert not cfg.fallback_to_mini_sets
    with pytest.raises(ValueError, match=r"not found .*data/mine.jsonl.*from env.eval_sets.*env.allow_hub=true"):
        load_sets(cfg, env_cfg)
    cfg, env_cfg = parse_args(["model_dir=/m", "env=math", "eval_sets=[data/mine.jsonl]"])
    with pytest.raises(ValueError, match=r"from eval_sets\)"):
        load_sets(cfg, env_cfg)
    cfg, env_cfg = parse_args(["model_dir=/m", "env=math", "fallback_to_mini_sets=false"])
    with pytest.raises(ValueError, match="HuggingFaceH4/aime_2024"):
        load_sets(cfg, env_cfg)


def test_part_of_the_data_missing_skips_only_that_part(tmp_path, monkeypatch, capsys):
    import shutil

    from async_rl.eval import load_sets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "aime").mkdir(parents=True)
    shutil.copy(AIME_2024, tmp_path / "data" / "aime" / "aime_2024.jsonl")
    cfg, env_cfg = parse_args(["model_dir=/m", "env=math"])
    assert [name for name, _ in load_sets(cfg, env_cfg)] == ["aime_2024"]
    err = capsys.readouterr().err
    assert "skipping eval sets that do not exist" in err and "aime_2025.jsonl" in err and "aime_2026.jsonl" in err


def test_alfworld_data_check_looks_for_game_files_not_the_folder(tmp_path, capsys):
    from async_rl.eval import load_sets

    empty = tmp_path / "alfworld"  # what `import alfworld` leaves behind: the folder, no games
    empty.mkdir()
    cfg, env_cfg = parse_args(["model_dir=/m", "env=alfworld", f"runs_dir={tmp_path}"])
    env_cfg.data_dir = str(empty)  # as if it came from $ALFWORLD_DATA: not named on the command line
    ((name, tasks),) = load_sets(cfg, env_cfg)
    assert name == "alfworld_valid_seen" and [t["category"] for t in tasks] == ["Cool"]  # the fixture game
    err = capsys.readouterr().err
    assert "no ALFWorld games for env.eval_split=eval_out_of_distribution" in err and str(empty) in err
    assert "tests/fixtures/alfworld, split valid_seen (1 game" in err and "alfworld-download" in err

    cfg, env_cfg = parse_args(["model_dir=/m", "env=alfworld", f"env.data_dir={empty}"])
    with pytest.raises(ValueError, match="alfworld-download.*env.data_dir="):
        load_sets(cfg, env_cfg)
    fixtures = FIXTURES / "alfworld"
    cfg, env_cfg = parse_args(["model_dir=/m", "env=alfworld", f"env.data_dir={fixtures}"])
    with pytest.raises(ValueError, match=r"splits with games there: \['train', 'valid_seen'\].*env.eval_split="):
        load_sets(cfg, env_cfg)
    cfg, env_cfg = parse_args(["model_dir=/m", "env=alfworld", f"env.data_dir={fixtures}",
                               "env.eval_split=valid_seen"])
    assert [name for name, _ in load_sets(cfg, env_cfg)] == ["alfworld_valid_seen"]
    cfg, env_cfg = parse_args(["model_dir=/m", "env=alfworld", "env.eval_split=test"])
    with pytest.raises(ValueError, match="env.eval_split='test' is not an ALFWorld split"):
        load_sets(cfg, env_cfg)


@pytest.mark.slow
def test_cli_prints_one_line_fixes(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "async_rl.eval", f"runs_dir={tmp_path}"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: model_dir is not set") and "Traceback" not in proc.stderr
    assert "Incompatible value" not in proc.stderr

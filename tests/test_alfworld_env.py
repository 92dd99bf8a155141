"""ALFWorld adapter (async_rl.envs.alfworld_env) on the real alfworld / textworld packages.

The games are the project's own fixtures (tests/fixtures/alfworld/, built by build_games.py from the
problems in sources/): a Pick game in train and a Cool game in valid_seen. Tests that play a game need
the alfworld package; without it they fail (never skip) with the install command.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from async_rl.envs.alfworld_env import (
    ALFWORLD_CATEGORIES,
    INVALID_ACTION_FEEDBACK,
    AlfWorldEnv,
    AlfWorldNotInstalled,
    alfworld_env_kwargs,
    build_prompt,
    category_of,
    make_alfworld_tasks,
    make_alfworld_tasks_from_config,
    parse_action,
    resolve_data_dir,
    success_by_category,
)
from async_rl.envs.base import StepResult, make_env, registered_env_names
from async_rl.envs.calls import run_env_reset, run_env_step

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "alfworld"
PICK_ID = "train/pick_and_place_simple-Mug-None-Shelf-901/trial_T20260101_000001_000001"
COOL_ID = "valid_seen/pick_cool_then_place_in_recep-Apple-None-DiningTable-902/trial_T20260101_000002_000001"
PICK_SOLUTION = ["go to cabinet 1", "open cabinet 1", "take mug 1 from cabinet 1", "go to shelf 1",
                 "move mug 1 to shelf 1"]
COOL_SOLUTION = ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1",
                 "cool apple 1 with fridge 1", "go to diningtable 1", "move apple 1 to diningtable 1"]


def _require_alfworld() -> None:
    """Fail (not skip) with the install command when the package is missing."""
    for name in ("alfworld", "textworld", "fast_downward"):
        if importlib.util.find_spec(name) is None:
            pytest.fail(f"the {name!r} package is not installed; these tests play real ALFWorld games. "
                        "Install: pip install alfworld==0.4.2", pytrace=False)


@pytest.fixture(scope="module")
def pick_task() -> dict:
    (task,) = make_alfworld_tasks(FIXTURES, "train")
    return task


@pytest.fixture(scope="module")
def cool_task() -> dict:
    (task,) = make_alfworld_tasks(FIXTURES, "valid_seen")
    return task


@pytest.fixture
def env():
    _require_alfworld()
    environment = AlfWorldEnv()
    yield environment
    environment.close()


def act(action: str) -> str:
    return f"<think>I should {action}.</think>\n<action>{action}</action>"


# --------------------------------------------------------------------------------------------------
# Pure parts: parser, prompt, categories, task scanning, aggregation (no alfworld needed)
# --------------------------------------------------------------------------------------------------


def test_parse_action_takes_the_last_tag_and_normalises():
    assert parse_action("<think>maybe <action>look</action></think> <action>Go to  Desk 1.</action>") == "go to desk 1"
    assert parse_action("<ACTION>\n 'take mug 1 from cabinet 1' \n</ACTION>") == "take mug 1 from cabinet 1"
    assert parse_action("<think>x</think> go to desk 1") is None
    assert parse_action("<action>  </action>") is None
    assert parse_action("<action>look") is None
    assert parse_action("") is None


def test_build_prompt_first_step_has_task_observation_actions_and_format():
    prompt = build_prompt("put a mug in shelf", "You are in the middle of a room.", ["go to shelf 1", "look"])
    assert "Your task is to: put a mug in shelf" in prompt
    assert "Your current observation is: You are in the middle of a room." in prompt
    assert "['go to shelf 1',\n'look']" in prompt
    assert "<think> </think>" in prompt and "<action> </action>" in prompt
    assert "Prior to this step" not in prompt


def test_build_prompt_shows_the_last_history_length_turns():
    history = [("obs A", "look"), ("obs B", "go to shelf 1"), ("obs C", "inventory")]
    prompt = build_prompt("t", "obs D", ["look"], history, history_length=2)
    assert "you have already taken 3 step(s)" in prompt
    assert "obs A" not in prompt
    assert "[Observation 2: 'obs B', Action 2: 'go to shelf 1']" in prompt
    assert "[Observation 3: 'obs C', Action 3: 'inventory']" in prompt
    assert "You are now at step 4 and your current observation is: obs D" in prompt
    bare = build_prompt("t", "obs D", ["look"], history, history_length=0)
    assert "Observation" not in bare.replace("current observation", "")
    assert "You are now at step 4" in bare


def test_categories_map_alfworld_task_types():
    task_types = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                  "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
    assert [category_of(t) for t in task_types] == list(ALFWORLD_CATEGORIES)
    assert category_of("pick_two_obj_and_place-Pen-None-Desk-304") == "Pick2"
    with pytest.raises(ValueError, match="pick_and_place_with_movable_recep"):
        category_of("pick_and_place_with_movable_recep")


def test_make_alfworld_tasks_scans_the_fixture_tree(pick_task, cool_task):
    assert pick_task["id"] == PICK_ID and pick_task["category"] == "Pick" and pick_task["split"] == "train"
    assert cool_task["id"] == COOL_ID and cool_task["category"] == "Cool"
    for task in (pick_task, cool_task):
        assert task["env"] == "alfworld" and Path(task["game_file"]).is_absolute() and Path(task["game_file"]).is_file()
    assert make_alfworld_tasks(FIXTURES, "eval_in_distribution") == [cool_task]
    assert make_alfworld_tasks(FIXTURES / "json_2.1.1", "train") == [pick_task]  # json_2.1.1 itself as data_dir
    with pytest.raises(FileNotFoundError, match="found: \\['train', 'valid_seen'\\]"):
        make_alfworld_tasks(FIXTURES, "valid_unseen")  # the fixtures ship no valid_unseen folder


def test_make_alfworld_tasks_uses_alfworld_data_env_and_reports_bad_paths(monkeypatch, tmp_path, pick_task):
    monkeypatch.setenv("ALFWORLD_DATA", str(FIXTURES))
    assert resolve_data_dir() == FIXTURES
    assert make_alfworld_tasks(split="train") == [pick_task]
    with pytest.raises(ValueError, match="valid: train"):
        make_alfworld_tasks(FIXTURES, "test")
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        make_alfworld_tasks(tmp_path / "missing", "train")
    with pytest.raises(FileNotFoundError, match="no split folder"):
        make_alfworld_tasks(tmp_path, "train")


def _copy_trial(src_id: str, dst_root: Path, task_dir: str, trial: str = "trial_T1") -> Path:
    source = FIXTURES / "json_2.1.1" / src_id
    target = dst_root / "json_2.1.1" / "train" / task_dir / trial
    shutil.copytree(source, target)
    return target


def test_make_alfworld_tasks_filters_like_alfredtwenv_and_is_seeded(tmp_path):
    for i in range(6):  # six good Pick games
        _copy_trial(PICK_ID, tmp_path, f"pick_and_place_simple-Mug-None-Shelf-{i}")
    cool = _copy_trial(COOL_ID, tmp_path, "pick_cool_then_place_in_recep-Apple-None-DiningTable-7")
    bad = _copy_trial(PICK_ID, tmp_path, "pick_and_place_simple-Mug-None-Shelf-unsolvable")
    data = json.loads((bad / "game.tw-pddl").read_text())
    data["solvable"] = False
    (bad / "game.tw-pddl").write_text(json.dumps(data))
    _copy_trial(PICK_ID, tmp_path, "pick_and_place_with_movable_recep-Mug-Bowl-Shelf-8")
    _copy_trial(PICK_ID, tmp_path, "pick_and_place_simple-AppleSliced-None-Shelf-9")
    gone = _copy_trial(PICK_ID, tmp_path, "pick_and_place_simple-Mug-None-Shelf-nogame")
    (gone / "game.tw-pddl").unlink()
    odd = _copy_trial(PICK_ID, tmp_path, "place_all_obj_type_into_recep-Mug-None-Shelf-10")
    (odd / "traj_data.json").write_text(json.dumps({"task_type": "place_all_obj_type_into_recep"}))

    everything = make_alfworld_tasks(tmp_path, "train", seed=None)
    assert [t["id"] for t in everything] == sorted(t["id"] for t in everything)
    assert len(everything) == 7 and {t["category"] for t in everything} == {"Pick", "Cool"}
    assert str(cool / "game.tw-pddl") in {t["game_file"] for t in everything}
    first = make_alfworld_tasks(tmp_path, "train", limit=3, seed=5)
    assert first == make_alfworld_tasks(tmp_path, "train", limit=3, seed=5) and len(first) == 3
    assert make_alfworld_tasks(tmp_path, "train", seed=5)[:3] == first
    assert sorted(t["id"] for t in make_alfworld_tasks(tmp_path, "train", seed=5)) == [t["id"] for t in everything]
    only_cool = make_alfworld_tasks(tmp_path, "train", categories=["Cool"])
    assert [t["category"] for t in only_cool] == ["Cool"]
    with pytest.raises(ValueError, match="unknown categories"):
        make_alfworld_tasks(tmp_path, "train", categories=["Slice"])


def test_config_helpers_read_conf_env_alfworld(monkeypatch, pick_task):
    from omegaconf import OmegaConf

    monkeypatch.setenv("ALFWORLD_DATA", str(FIXTURES))
    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "env" / "alfworld.yaml")
    assert cfg.name == "alfworld" and cfg.max_turns == 50 and cfg.data_dir == str(FIXTURES)
    assert make_alfworld_tasks_from_config(cfg, seed=0) == [pick_task]
    assert alfworld_env_kwargs(cfg) == {"max_turns": 50, "history_length": 2, "data_dir": str(FIXTURES)}
    built = make_env("alfworld", **alfworld_env_kwargs({"max_turns": 7, "history_length": 0}))
    assert (built.max_turns, built.history_length, built.data_dir) == (7, 0, FIXTURES)
    with pytest.raises(ValueError, match="no playable ALFWorld games"):
        make_alfworld_tasks_from_config({"data_dir": str(FIXTURES), "categories": ["Heat"]}, seed=0)


def test_success_by_category_aggregates_infos_and_step_results():
    results = [
        {"category": "Pick", "success": True},
        {"category": "Pick", "success": False},
        StepResult("", 1.0, True, {"category": "Cool", "success": True}),
        {"category": "Look", "success": False},
        {"success": True},
    ]
    table = success_by_category(results)
    assert list(table) == ["Pick", "Look", "Cool", "unknown", "all"]
    assert table["Pick"] == {"episodes": 2, "successes": 1, "success_rate": 0.5}
    assert table["Cool"]["success_rate"] == 1.0 and table["Look"]["success_rate"] == 0.0
    assert table["all"] == {"episodes": 5, "successes": 3, "success_rate": 0.6}
    assert success_by_category([]) == {"all": {"episodes": 0, "successes": 0, "success_rate": 0.0}}
    with pytest.raises(TypeError):
        success_by_category([("Pick", True)])


def test_registered_and_importable_without_playing():
    assert "alfworld" in registered_env_names()
    built = make_env("alfworld")
    assert isinstance(built, AlfWorldEnv) and built.max_turns == 50 and built.history_length == 2
    built.close()
    with pytest.raises(ValueError):
        AlfWorldEnv(max_turns=0)


def test_missing_package_fails_with_the_install_command(monkeypatch, pick_task):
    monkeypatch.setitem(sys.modules, "alfworld.agents.environment.alfred_tw_env", None)
    with pytest.raises(AlfWorldNotInstalled, match=r"pip install alfworld==0\.4\.2"):
        AlfWorldEnv().reset(pick_task)


# --------------------------------------------------------------------------------------------------
# The fixture games against the real package
# --------------------------------------------------------------------------------------------------


def test_fixture_games_carry_the_installed_packages_domain_and_grammar():
    _require_alfworld()
    data = Path(list(importlib.util.find_spec("alfworld").submodule_search_locations)[0]) / "data"
    domain, grammar = (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()
    games = sorted((FIXTURES / "json_2.1.1").rglob("game.tw-pddl"))
    assert len(games) == 2
    for game in games:
        payload = json.loads(game.read_text())
        assert set(payload) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
        assert payload["pddl_domain"] == domain, f"{game}: rebuild with tests/fixtures/alfworld/build_games.py"
        assert payload["solvable"] is True and "UNKNOWN GOAL" not in payload["grammar"]
        goal = json.loads((game.parent / "traj_data.json").read_text())
        assert goal["task_type"] in game.parent.parent.name
        assert payload["grammar"].replace(_goal_line(payload["grammar"]), "UNKNOWN GOAL") == grammar


def _goal_line(grammar: str) -> str:
    start = grammar.index("Your task is to: ") + len("Your task is to: ")
    return grammar[start:grammar.index('."', start)]


def test_alfworlds_own_loader_collects_the_fixture_games():
    _require_alfworld()
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    config = {
        "env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {"data_path": str(FIXTURES / "json_2.1.1" / "train"),
                    "eval_id_data_path": str(FIXTURES / "json_2.1.1" / "valid_seen"), "num_train_games": -1,
                    "num_eval_games": -1},
    }
    assert [Path(p).parent.name for p in AlfredTWEnv(config, "train").game_files] == [PICK_ID.rsplit("/", 1)[1]]
    assert len(AlfredTWEnv(config, "eval_in_distribution").game_files) == 1


def test_reset_shows_task_observation_and_admissible_actions(env, pick_task):
    prompt = env.reset(pick_task)
    assert "Your task is to: put a mug in shelf" in prompt
    assert "you see a cabinet 1, a countertop 1, and a shelf 1" in prompt
    assert "Welcome to TextWorld" not in prompt
    assert env.admissible_actions == ["go to cabinet 1", "go to countertop 1", "go to shelf 1", "inventory", "look"]
    assert "'go to cabinet 1'" in prompt and "'help'" not in prompt
    assert "<think>" in prompt and "<action>" in prompt
    assert env.category == "Pick" and env.task_description == "put a mug in shelf"


@pytest.mark.parametrize(
    "which, solution, category", [("pick", PICK_SOLUTION, "Pick"), ("cool", COOL_SOLUTION, "Cool")]
)
def test_scripted_solution_wins(env, pick_task, cool_task, which, solution, category):
    env.reset(pick_task if which == "pick" else cool_task)
    for i, action in enumerate(solution):
        assert action in env.admissible_actions, (action, env.admissible_actions)
        result = env.step(act(action))
        assert result.info["invalid_action"] is False and result.info["category"] == category
        assert result.info["action"] == action and result.info["turn"] == i + 1
        if i < len(solution) - 1:
            assert (result.reward, result.done, result.info["success"]) == (0.0, False, False)
            assert result.info["feedback"] in result.observation
    assert (result.reward, result.done, result.observation) == (1.0, True, "")
    assert result.info["success"] is True and result.info["won"] is True
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(act("look"))


@pytest.mark.slow
def test_games_stepping_at_once_on_threads_all_finish(pick_task, cool_task):
    """The rollout steps several episodes on env worker threads at once. textworld derives every step's text with
    one module-global (not thread-safe) parser; unguarded, concurrent steps broke it ("IndexError: pop from empty
    list") and the failed steps aborted their episodes. Six games play their solutions in lock step here."""
    import threading

    _require_alfworld()
    plays = [(pick_task, PICK_SOLUTION), (cool_task, COOL_SOLUTION)] * 3
    envs = [AlfWorldEnv() for _ in plays]
    errors: list[str] = []
    wins: list[bool] = []
    barrier = threading.Barrier(len(plays))
    shortest = min(len(solution) for _, solution in plays)

    def play(env, task, solution):
        try:
            env.reset(task)
            for i, action in enumerate(solution):
                if i < shortest:
                    barrier.wait(timeout=120)  # every game steps at the same moment
                result = env.step(act(action))
            wins.append(bool(result.info["won"]))
        except Exception as error:  # collected, the test fails below with the message
            errors.append(f"{type(error).__name__}: {error}")
            barrier.abort()

    threads = [threading.Thread(target=play, args=(env, task, solution))
               for env, (task, solution) in zip(envs, plays)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        for env in envs:
            env.close()
    assert not errors, errors
    assert wins == [True] * len(plays)


def test_invalid_actions_are_flagged_and_leave_the_game_unchanged(env, pick_task):
    env.reset(pick_task)
    before = env.admissible_actions
    for text in ("<think>hmm</think><action>dance</action>",       # not a command
                 "<think>hmm</think> go to cabinet 1",              # no <action> tag
                 act("take mug 1 from cabinet 1"),                  # a real command, not admissible here
                 act("help")):                                      # hidden from the list
        result = env.step(text)
        assert result.info["invalid_action"] is True and result.info["feedback"] == INVALID_ACTION_FEEDBACK
        assert (result.reward, result.done) == (0.0, False)
        assert env.admissible_actions == before
    assert result.info["turn"] == 4
    assert "you have already taken 4 step(s)" in result.observation and "Action 4: 'help'" in result.observation
    follow = env.step(act("Go to cabinet 1."))  # normalised, then valid
    assert follow.info["invalid_action"] is False
    assert follow.info["feedback"] == "You arrive at cabinet 1. The cabinet 1 is closed."


def test_max_turns_ends_the_episode(pick_task):
    _require_alfworld()
    with AlfWorldEnv(max_turns=3) as short:
        short.reset(pick_task)
        results = [short.step(act("look")) for _ in range(3)]
        assert [r.done for r in results] == [False, False, True]
        assert results[-1].reward == 0.0 and results[-1].info["out_of_turns"] is True
        assert results[-1].info["success"] is False and results[-1].observation == ""


def test_default_budget_is_50_turns(env, cool_task):
    env.reset(cool_task)
    results = [env.step(act("inventory")) for _ in range(50)]
    assert not any(r.done for r in results[:-1]) and results[-1].done and results[-1].info["out_of_turns"]
    assert results[0].info["feedback"] == "You are not carrying anything."


def test_one_env_plays_several_games_and_leaves_process_state_alone(env, pick_task, cool_task, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pytest", "--marker"])
    stdout = sys.stdout
    env.reset(pick_task)
    assert sys.argv == ["pytest", "--marker"] and sys.stdout is stdout  # fast_downward rewrites sys.argv
    no_category = {k: v for k, v in cool_task.items() if k not in ("category", "task_type")}
    env.reset(no_category)  # category read from traj_data.json
    assert env.category == "Cool" and "put a cool apple in diningtable" in env.task_description
    for action in COOL_SOLUTION:
        result = env.step(act(action))
    assert result.info["success"] is True
    env.reset(pick_task)
    assert env.category == "Pick" and env.admissible_actions[0] == "go to cabinet 1"


def test_relative_game_file_and_goal_filled_from_traj_data(tmp_path):
    _require_alfworld()
    trial = _copy_trial(PICK_ID, tmp_path, "pick_and_place_simple-Mug-None-Shelf-5")
    game = json.loads((trial / "game.tw-pddl").read_text())
    game["grammar"] = game["grammar"].replace("put a mug in shelf", "UNKNOWN GOAL")
    (trial / "game.tw-pddl").write_text(json.dumps(game))
    with AlfWorldEnv(data_dir=tmp_path) as fresh:
        fresh.reset({"id": "x", "game_file": str((trial / "game.tw-pddl").relative_to(tmp_path))})
        assert fresh.task_description == "put a mug in shelf" and fresh.category == "Pick"
        with pytest.raises(FileNotFoundError):
            fresh.reset({"id": "y", "game_file": "json_2.1.1/train/nothing/game.tw-pddl"})


def test_through_the_threaded_step_helpers_and_concurrent_resets(pick_task, cool_task):
    _require_alfworld()
    envs = [AlfWorldEnv() for _ in range(3)]
    outcomes: list = [None] * 3
    stdout = sys.stdout

    def start(i: int) -> None:
        outcomes[i] = run_env_reset(envs[i], pick_task if i % 2 == 0 else cool_task, timeout_s=120)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sys.stdout is stdout
    assert all(not o.aborted for o in outcomes), [o.error for o in outcomes]
    assert "put a mug in shelf" in outcomes[0].unwrap() and "put a cool apple" in outcomes[1].unwrap()
    for action in PICK_SOLUTION:
        step = run_env_step(envs[2], act(action), timeout_s=60).unwrap()
    assert step.reward == 1.0 and step.info["success"] is True
    for e in envs:
        e.close()
        e.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        envs[0].reset(pick_task)


@pytest.mark.slow
def test_closed_envs_let_the_interpreter_exit_cleanly(pick_task):
    """Unloading fast-downward's library copy (dlclose) crashes Python at exit; close() must not do it."""
    _require_alfworld()
    script = (
        "from async_rl.envs.alfworld_env import AlfWorldEnv\n"
        "for _ in range(2):\n"
        "    env = AlfWorldEnv()\n"
        f"    env.reset({{'id': 'p', 'game_file': {pick_task['game_file']!r}}})\n"
        "    env.step('<action>look</action>')\n"
        "    env.close()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])

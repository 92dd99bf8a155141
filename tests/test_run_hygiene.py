"""Run hygiene: one output folder per run (no Hydra date folders, whatever config is the primary one),
progress lines in logs, and one shape for ``admissible_actions`` across the agent envs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import async_rl.train as train

REPO = Path(__file__).resolve().parents[1]


def _launch(monkeypatch, tmp_path, argv):
    """``python -m async_rl.train ARGV`` in ``tmp_path``, with ``run`` replaced by a recorder (no training)."""
    seen = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["async_rl.train"])
    monkeypatch.setattr(train, "run", lambda cfg, checked=None: seen.append(cfg))
    train.main(argv)
    assert len(seen) == 1
    return seen[0]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("argv, run_name", [
    (["--config-dir", str(REPO / "recipes"), "--config-name", "aime_tiny"], "aime-tiny-li2sao"),
    (["--config-dir", str(REPO / "recipes"), "--config-name", "alfworld_tiny", "algorithm=sapo"], "alfworld-tiny-sapo"),
    (["--config-name", "demo"], "demo-li2sao-toy_keys"),
    (["algorithm=grpo", "env=toy_echo"], "grpo-toy_echo"),
])
def test_one_output_folder_per_run_and_no_hydra_date_folders(monkeypatch, tmp_path, argv, run_name):
    cfg = _launch(monkeypatch, tmp_path, argv)
    assert cfg.trainer.run_name == run_name
    # Hydra's own files (train.log) land in the run directory; nothing else appears: no outputs/<date>/<time>/
    # and no .hydra/ folder
    assert _tree(tmp_path) <= {"outputs", f"outputs/{run_name}", f"outputs/{run_name}/train.log"}
    assert (tmp_path / "outputs" / run_name).is_dir()


def test_the_users_own_hydra_run_dir_wins(monkeypatch, tmp_path):
    _launch(monkeypatch, tmp_path, ["algorithm=grpo", "hydra.run.dir=elsewhere"])
    assert (tmp_path / "elsewhere").is_dir() and not (tmp_path / "outputs").exists()
    assert train.with_run_dir_overrides(["hydra.run.dir=x", "seed=1"]) == [
        "hydra.run.dir=x", "seed=1", "hydra.sweep.dir=${trainer.output_dir}", "hydra.sweep.subdir=${trainer.run_name}",
        "hydra.output_subdir=null"]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _printed_steps(seconds_per_step: float, total: int, first_step: int = 1) -> list[int]:
    clock = FakeClock()
    progress = train.ProgressLines(total, clock=clock)
    printed = []
    for step in range(first_step, total + 1):
        clock.now += seconds_per_step
        if progress.due(step):
            printed.append(step)
    return printed


def test_progress_lines_every_10_steps_or_10_seconds():
    # fast steps (0.1 s): the first step, every 10th, the last
    assert _printed_steps(0.1, 25) == [1, 10, 20, 25]
    # slow steps (ALFWorld, ~15 s each): every step
    assert _printed_steps(15.0, 5) == [1, 2, 3, 4, 5]
    # 4 s a step: a line once 10 s have passed since the previous one (steps 1, 4 at 16 s, 7 at 28 s, ...)
    assert _printed_steps(4.0, 12) == [1, 4, 7, 10, 12]
    # a resumed run starts at its checkpoint's step
    assert _printed_steps(0.1, 25, first_step=13) == [13, 20, 25]


def test_progress_line_reads_well():
    from async_rl.progress import Phase

    clock = FakeClock()
    with Phase("training", total=40, terminal=False, clock=clock, log_only=None) as phase:
        clock.now = 30.0
        # 3 steps in 30 s: 10 s a step, 37 steps left
        assert phase.line(3, "acc 0.25 reward 0.50 lag 1.50") == \
            "training: 3/40 steps acc 0.25 reward 0.50 lag 1.50 | 10.0 s/step, elapsed 30 s, eta 370 s"
        # fast phases read as a rate: 3 steps in 0.03 s
        clock.now = 0.03
        assert phase.lines.timing(3).startswith("100 steps/s, elapsed 0 s, eta 0 s")


def test_admissible_actions_is_a_list_property_in_every_agent_env():
    from async_rl.envs.alfworld_env import AlfWorldEnv
    from async_rl.envs.webshop.env import WebShopEnv

    for env_class in (AlfWorldEnv, WebShopEnv):
        assert isinstance(env_class.__dict__["admissible_actions"], property), env_class.__name__
    from async_rl.envs.webshop import make_webshop_tasks

    env = WebShopEnv(num_products=20, num_goals=10, num_test_goals=2)
    task = make_webshop_tasks(1, seed=0, num_products=20, num_goals=10, num_test_goals=2)[0]
    env.reset(task)
    actions = env.admissible_actions
    assert isinstance(actions, list) and actions == ["search[<your query>]"]
    env.close()


def test_train_log_gets_stdout_warnings_and_module_logger_names(tmp_path):
    """Issue 38, item 5: under a root file handler (Hydra's train.log), printed lines and Python warnings land in
    the file, and path-shaped logger names (verl's getLogger(__file__)) become module names."""
    import logging
    import warnings

    from async_rl.run_log import module_name_of, run_log

    assert module_name_of("/x/.venv/lib/python3.11/site-packages/verl/workers/actor/dp_actor.py") == \
        "verl.workers.actor.dp_actor"
    assert module_name_of("/repo/src/async_rl/envs/__init__.py") == "async_rl.envs"
    assert module_name_of("async_rl.train") == "async_rl.train"
    root = logging.getLogger()
    handler = logging.FileHandler(tmp_path / "train.log")
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(), run_log() as path:  # catch_warnings: pytest's own recorder set aside
            warnings.simplefilter("always")
            assert path == tmp_path / "train.log"
            print("step 3/10 acc 0.50", flush=True)
            logging.getLogger("/x/site-packages/verl/utils/device.py").warning("no accelerator")
            warnings.warn("a deprecation", UserWarning)
        print("after the run: not copied")
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(old_level)
        logging.captureWarnings(False)
    text = (tmp_path / "train.log").read_text()
    assert "[stdout] step 3/10 acc 0.50" in text and "not copied" not in text
    assert "[verl.utils.device] no accelerator" in text
    assert "[py.warnings]" in text and "a deprecation" in text


def test_ray_address_joins_a_cluster_instead_of_starting_one(monkeypatch):
    """Issue 38, item 8: with RAY_ADDRESS set, ensure_ray joins that cluster (no num_cpus: Ray refuses it there)."""
    import ray

    from async_rl.workers import placement

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6380")
    placement.ensure_ray(num_cpus=8, log_to_driver=False)
    monkeypatch.delenv("RAY_ADDRESS")
    placement.ensure_ray(num_cpus=8, log_to_driver=False)
    assert calls == [{"address": "10.0.0.5:6380", "log_to_driver": False},
                     {"num_cpus": 8, "log_to_driver": False, "include_dashboard": False}]


def test_a_cluster_that_cannot_be_joined_names_the_address_and_token_authentication(monkeypatch):
    """A head started with `ray start --head` refuses a joiner without its token; Ray's own error is a retry loop
    then "Failed to connect": ensure_ray says where it tried and which two settings a token-auth head needs."""
    import ray

    from async_rl.workers import placement

    def refuse(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6380")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6380")
    with pytest.raises(ConnectionError, match=r"RAY_ADDRESS=10.0.0.5:6380 \(Failed to connect.*RAY_AUTH_MODE=token"
                                              r".*RAY_AUTH_TOKEN"):
        placement.ensure_ray(num_cpus=8)
    monkeypatch.setattr(ray, "init", lambda **kwargs: (_ for _ in ()).throw(ConnectionError("")))
    with pytest.raises(ConnectionError, match=r"\(ConnectionError\)"):  # an empty message still reads
        placement.ensure_ray(num_cpus=8)

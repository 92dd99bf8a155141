"""Bring your own env (issue 38, item 8): the two files of docs/own_env.md, outside the package, train through
the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _blocks(language: str) -> list[str]:
    text = (REPO / "docs" / "own_env.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _write_user_files(root: Path) -> None:
    (root / "my_envs").mkdir(parents=True)
    (root / "my_envs" / "__init__.py").write_text("")
    (root / "my_envs" / "parity.py").write_text(_blocks("python")[0])
    (root / "my_conf" / "env").mkdir(parents=True)
    (root / "my_conf" / "env" / "parity.yaml").write_text(_blocks("yaml")[0])


@pytest.mark.e2e
def test_an_env_from_an_outside_module_trains_through_the_cli(tmp_path):
    _write_user_files(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "src")]), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline"}
    args = [sys.executable, "-m", "async_rl.train", "--config-dir", "my_conf", "env=parity", "model.sft.enabled=false",
            "algorithm=grpo", "algorithm.train_batch_trajectories=8", "algorithm.group_size=4", "model.hidden_size=32",
            "model.num_layers=1", f"model.dir={tmp_path}/model", "trainer.driver.total_steps=2", "trainer.wandb=false",
            "env.reward_right=0.5", "trainer.run_name=parity", "algorithm.overlong_penalty=false"]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "parity"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((run_dir / "config.json").read_text())["env"]["module"] == "my_envs.parity"
    # env.reward_right reached the env (no overlong shaping here: the reward is the env's own)
    assert all(0.0 <= r["train/reward_mean"] <= 0.5 for r in rows)


def test_an_outside_env_is_checked_like_a_built_in_one(tmp_path):
    from async_rl.cli_config import compose_command_line
    from async_rl.train import check_config
    from async_rl.validation import ConfigError

    _write_user_files(tmp_path)
    argv = ["--config-dir", str(tmp_path / "my_conf"), "env=parity", "model.sft.enabled=false"]
    check_config(compose_command_line(argv))  # any name is fine with a module; nothing imported yet
    with pytest.raises(ConfigError, match=r"^env.max_turns=0: must be an integer >= 1$"):
        check_config(compose_command_line([*argv, "env.max_turns=0"]))
    with pytest.raises(ConfigError, match="must be an importable module name"):
        check_config(compose_command_line([*argv, "env.module=my envs"]))
    with pytest.raises(ConfigError, match=r"^\+env.colour=1: env has no key colour and \+ cannot add one"):
        compose_command_line([*argv, "+env.colour=1"])
    with pytest.raises(ConfigError, match="env.name='parity': must be one of"):  # without a module: built-ins only
        check_config(compose_command_line([*argv, "env.module=null"]))


def test_the_yaml_reaches_the_outside_env(tmp_path, monkeypatch):
    from async_rl.cli_config import compose_command_line
    from async_rl.envs import make_env
    from async_rl.train import env_kwargs, make_tasks

    import async_rl.envs.base as base
    import async_rl.envs.facts as facts

    _write_user_files(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # "parity" is registered into copies of the registries, and its module forgotten, once this test ends: other
    # tests see exactly the built-in envs
    monkeypatch.setattr(base, "_ENV_REGISTRY", dict(base._ENV_REGISTRY))
    monkeypatch.setattr(facts, "_FACTS", dict(facts._FACTS))
    for name in ("my_envs", "my_envs.parity"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    cfg = compose_command_line(["--config-dir", str(tmp_path / "my_conf"), "env=parity", "env.reward_right=0.5"])
    tasks = make_tasks(cfg.env, seed=3)  # imports env.module, which registers "parity"
    assert len(tasks) == 256 and tasks == make_tasks(cfg.env, seed=3)
    env = make_env("parity", **env_kwargs(cfg.env))
    env.reset(tasks[0])
    right = "even" if tasks[0]["number"] % 2 == 0 else "odd"
    result = env.step(f" {right}.")
    assert result.reward == 0.5 and result.done and result.info["success"]
    for name in ("my_envs", "my_envs.parity"):
        sys.modules.pop(name, None)

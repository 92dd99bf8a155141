"""Config errors on the command line (issue 38, item 3): a mistyped group, key or value ends
``python -m async_rl.train`` in one line with the valid choices and a "did you mean", exit status 2, before
torch, Ray, verl or transformers are imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from async_rl.cli_config import compose_command_line, did_you_mean
from async_rl.validation import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _error(*argv: str) -> str:
    with pytest.raises(ConfigError) as caught:
        compose_command_line(list(argv))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_mistyped_group_option_names_the_choices_without_internal_files():
    message = _error("algorithm=lisoa")
    assert message == ("algorithm=lisoa: no such option of algorithm; valid choices: grpo, li2sao, lisao, ppo, sapo "
                       "(did you mean lisao?)")
    # the internal file is neither offered nor accepted
    assert _error("algorithm=_base") == ("algorithm=_base: no such option of algorithm; valid choices: grpo, li2sao, "
                                         "lisao, ppo, sapo")
    assert _error("env=chess").startswith("env=chess: no such option of env; valid choices: alfworld, math,")
    # every choice of a -m sweep is checked
    assert _error("-m", "algorithm=grpo,lisoa").startswith("algorithm=grpo,lisoa: no such option of algorithm")


def test_a_key_at_the_wrong_level_or_misspelt_gets_its_full_path():
    assert _error("trainer.checkpoint_every=10").startswith(
        "trainer.checkpoint_every=10: no such key (did you mean trainer.driver.checkpoint_every?); keys of trainer: ")
    assert _error("trainer.driver.totl_steps=3").startswith(
        "trainer.driver.totl_steps=3: no such key (did you mean trainer.driver.total_steps?); keys of trainer.driver:")
    assert _error("algorthm=lisao").startswith("algorthm=lisao: no such key (did you mean algorithm?)")
    assert "did you mean" not in _error("trainer.zzzzzz=1")  # nothing close: no guess


def test_plus_cannot_add_a_key_and_plus_on_an_existing_key_says_to_drop_it():
    message = _error("+trainer.foo=1")
    assert message.startswith("+trainer.foo=1: trainer has no key foo and + cannot add one")
    assert "did you mean" not in message  # trainer.top_p is no answer to foo
    assert _error("++algorithm.gate.t_mni=3").startswith("++algorithm.gate.t_mni=3: algorithm.gate has no key t_mni "
                                                         "and + cannot add one")
    assert "(did you mean algorithm.gate.t_min?)" in _error("++algorithm.gate.t_mni=3")
    assert _error("+trainer.resume=true") == ("+trainer.resume=true: trainer.resume exists already; set it without "
                                              "the +: trainer.resume=true")


def test_a_mistyped_config_name_and_a_good_command_line():
    assert _error("--config-name", "democ").startswith("--config-name democ: no such config; valid choices: config, "
                                                       "demo (did you mean demo?)")
    cfg = compose_command_line(["--config-dir", str(REPO / "recipes"), "--config-name", "retool_tiny",
                                "algorithm=grpo", "algorithm.group_size=4", "trainer.cpu_variant=null"])
    assert cfg.algorithm.name == "grpo" and cfg.trainer.run_name == "retool-tiny-grpo"
    assert cfg.trainer.cpu_variant is None
    assert compose_command_line(["--help"]) is None  # Hydra answers itself


def test_did_you_mean():
    keys = ["trainer.driver.checkpoint_every", "trainer.driver.total_steps", "trainer.top_p", "seed", "algorithm"]
    assert did_you_mean("trainer.checkpoint_every", keys) == "trainer.driver.checkpoint_every"
    assert did_you_mean("sede", keys) == "seed"
    assert did_you_mean("trainer.foo", keys + ["trainer"]) is None


CASES = [
    ("algorithm=lisoa", "error: algorithm=lisoa: no such option of algorithm; valid choices: grpo, li2sao, lisao, ppo, "
                        "sapo (did you mean lisao?)"),
    ("trainer.checkpoint_every=10", "error: trainer.checkpoint_every=10: no such key (did you mean "
                                    "trainer.driver.checkpoint_every?)"),
    ("trainer.driver.total_steps=abc", "error: trainer.driver.total_steps='abc': must be an integer >= 1"),
]


@pytest.mark.parametrize("override,message", CASES, ids=["group", "key", "value"])
def test_the_cli_fails_in_one_line_with_status_2_within_3_seconds(override, message, tmp_path):
    # measured: medians 0.36-0.85 s, the slowest of 20 tries 1.8 s, with the 2-core machine at load 6
    # (benchmarks/results/config_error_time.json); the best of two tries must be under 3 s, so one load spike
    # of another process does not fail the test, while a CLI that imports torch first (15 s here) always does
    walls = []
    for _ in range(2):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "async_rl.train", override, f"trainer.output_dir={tmp_path}/out"],
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True,
                              text=True, timeout=120)
        walls.append(time.perf_counter() - started)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), done.stderr
        assert done.stdout == ""
        if walls[-1] < 3.0:
            break
    assert min(walls) < 3.0, f"{walls} s to a config error"
    assert not (tmp_path / "out").exists()


def test_composing_and_checking_imports_no_heavy_library():
    code = textwrap.dedent("""
        import sys
        sys.orig_argv = [sys.executable, "-m", "async_rl.train"]  # as the CLI is launched
        import async_rl.train as train
        cfg = train.compose_command_line(train.with_run_dir_overrides(
            ["--config-dir", "recipes", "--config-name", "webshop_tiny", "trainer.workers=ray"]))
        train.check_config(cfg)
        print(sorted(m for m in ("torch", "ray", "verl", "transformers", "vllm") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"

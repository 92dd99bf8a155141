"""benchmarks/lisao_demo_seeds.py reads a CLI run's files the way docs/algorithms.md quotes them.

A hand-made run directory: the collapse step and the lowest success after 0.9 come from the per-step success,
the peaks skip steps without the metric and NaN, and the warning steps are the rows with ``actor/kl_warning`` 1.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def seeds_module(load_benchmark):
    return load_benchmark("lisao_demo_seeds")


def test_read_run_takes_collapse_peaks_and_warning_steps_from_the_metrics(seeds_module, tmp_path):
    success = [0.2, 0.5, 0.95, 0.4, 0.1, 0.1, 0.1, 0.1, 0.3]
    rows = []
    for step, value in enumerate(success, start=1):
        row = {"step": step, "train/success_rate": value}
        if step >= 2:  # step 1 is a critic warm-up step: no actor metrics
            row.update({"actor/ppo_kl": 0.01 * step, "actor/dis_kept_kl": 0.001 * step,
                        "actor/kl_warning": 1.0 if step in (4, 6) else 0.0})
        rows.append(row)
    rows[6]["actor/ppo_kl"] = float("nan")  # a NaN must not become the peak or hide it
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"train_accuracy_first_10pct": 0.2,
                                                       "train_accuracy_last_10pct": 0.3, "warnings": []}))
    run = seeds_module.read_run(tmp_path)
    assert run["collapse_step"] == 4  # reached 0.9 at step 3, then 5 steps below 0.5 from step 4
    assert run["first_reached_step"] == 3 and run["min_success_after_reach"] == pytest.approx(0.1)
    assert run["peak_ppo_kl"] == pytest.approx(0.09) and run["peak_dis_kept_kl"] == pytest.approx(0.009)
    assert run["kl_warning_steps"] == [4, 6]
    assert [r["actor/ppo_kl"] for r in run["kl_warning_rows"]] == pytest.approx([0.04, 0.06])
    assert run["train_accuracy_first_10pct"] == 0.2 and run["success"] == success


def test_the_runs_are_the_demo_command_with_lisao_single_rollout(seeds_module):
    extra = seeds_module.overrides(1, 1e-3, 40)
    assert extra == ["algorithm=lisao", "algorithm.group_size=1", "seed=1", "trainer.driver.total_steps=40",
                     "algorithm.actor_lr=0.001"]
    assert seeds_module._fmt(None) == "n/a" and seeds_module._fmt(0.12345, 3) == "0.123"


def test_the_runs_are_three_seeds_at_the_demos_actor_lr_and_one_at_issue_19s(seeds_module):
    """docs/algorithms.md reads the first three runs as "the demo at its own lr": if conf/demo.yaml's actor lr
    moves, the benchmark must move with it (and be rerun)."""
    import yaml

    demo = yaml.safe_load((seeds_module.C.REPO / "conf" / "demo.yaml").read_text())
    demo_lr = float(demo["algorithm"]["actor_lr"])
    assert sorted(seed for seed, lr in seeds_module.RUNS if lr == demo_lr) == [0, 1, 2]
    assert [(seed, lr) for seed, lr in seeds_module.RUNS if lr != demo_lr] == [(0, 1e-3)]

"""benchmarks/gate_statistics.py: Li2SAO's readiness statistics read from a run's metrics.jsonl. The bootstrap is
the steps logged with switched = 0: the switch step logs 1 and later steps no li2sao/* keys at all, so a maximum
taken over "not switched" would wrongly include the single-rollout steps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module():
    spec = importlib.util.spec_from_file_location("gate_statistics", BENCH / "gate_statistics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(ev, acc, counter, switched):
    row = {"train/success_rate": 0.5}
    if switched is not None:
        row.update({"li2sao/ema_explained_var": ev, "li2sao/ema_rank_acc": acc, "li2sao/gate_counter": counter,
                    "li2sao/switched": switched, "li2sao/eta_e": 0.2, "li2sao/eta_a": 0.65})
    return row


def test_maxima_are_over_the_bootstrap_steps_only(tmp_path):
    rows = [_row(0.01, 0.4, 0, 0.0), _row(0.05, 0.7, 1, 0.0), _row(0.02, 0.6, 0, 0.0),
            _row(0.9, 0.9, 0, 1.0),  # the switch step: not part of the bootstrap's maxima
            _row(None, None, None, None), _row(None, None, None, None)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gate = _module()
    stats = gate.gate_statistics(gate.read_rows(tmp_path))  # a run folder is read as its metrics.jsonl
    assert stats["steps"] == 6 and stats["bootstrap_steps"] == 3 and stats["switch_step"] == 4
    assert stats["max_ema_explained_var_in_bootstrap"] == 0.05 and stats["max_ema_rank_acc_in_bootstrap"] == 0.7
    assert stats["eta_e"] == 0.2 and stats["eta_a"] == 0.65
    assert stats["per_step"]["switched"] == [0.0, 0.0, 0.0, 1.0, None, None]


def test_a_run_that_never_switched_is_all_bootstrap(tmp_path):
    rows = [_row(0.1 * i, 0.5, 0, 0.0) for i in range(4)]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gate = _module()
    stats = gate.gate_statistics(gate.read_rows(path))
    assert stats["bootstrap_steps"] == 4 and stats["switch_step"] is None
    assert abs(stats["max_ema_explained_var_in_bootstrap"] - 0.3) < 1e-12

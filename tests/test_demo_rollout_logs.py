"""benchmarks/demo_rollout_logs.py: the metrics read-out the docs quote, and its refusal of unknown variants."""

from __future__ import annotations

import json

import pytest


@pytest.fixture()
def logs(load_benchmark):
    return load_benchmark("demo_rollout_logs")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_readout_counts_only_steps_with_tokens_at_the_trainers_version(logs, tmp_path):
    rows = [
        {"rollout/mismatch_kl": 2e-13, "rollout/mismatch_tokens": 30, "rollout/mismatch_abs_logprob_mean": 4e-7,
         "rollout/dis_band_masked_frac": 0.0, "rollout/update_latency_s": 0.02},
        # no token at the current version: the metric is 0 by definition and must not enter the median
        {"rollout/mismatch_kl": 0.0, "rollout/mismatch_tokens": 0, "rollout/mismatch_abs_logprob_mean": 0.0,
         "rollout/dis_band_masked_frac": 0.1, "rollout/update_latency_s": 0.04},
        {"rollout/mismatch_kl": 6e-13, "rollout/mismatch_tokens": 10, "rollout/mismatch_abs_logprob_mean": 8e-7,
         "rollout/dis_band_masked_frac": 0.2},
    ]
    text = "\n".join(logs.metrics_readout(_write(tmp_path / "metrics.jsonl", rows)))
    assert "3 rows, 3 with rollout/mismatch_kl" in text
    assert "own version: 2 (40 tokens)" in text
    assert "rollout/mismatch_kl median 4e-13, max 6e-13" in text
    assert "mismatch_abs_logprob_mean median 6e-07, max 8e-07" in text
    assert "dis_band_masked_frac median 0.1" in text
    assert "update_latency_s median 0.03" in text


def test_readout_without_any_own_version_tokens_or_updates(logs, tmp_path):
    rows = [{"rollout/mismatch_kl": 0.0, "rollout/mismatch_tokens": 0}]
    text = "\n".join(logs.metrics_readout(_write(tmp_path / "metrics.jsonl", rows)))
    assert "own version: 0 (0 tokens)" in text
    assert "rollout/mismatch_kl None" in text
    assert "update_latency_s median None" in text


def test_unknown_variant_is_refused_with_the_choices(logs, monkeypatch):
    monkeypatch.setattr("sys.argv", ["demo_rollout_logs.py", "sglang"])
    with pytest.raises(SystemExit, match="choose from hybrid, replicas, vllm"):
        logs.main()

"""Diagnostics on hand-made batches and the plot command on a tiny recorded run (no model, a few seconds)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from async_rl.algos.metrics import explained_variance, policy_lag_stats
from async_rl.driver.batch import collate
from async_rl.driver.trajectory import Segment, Trajectory
from async_rl.plots import (
    PANELS,
    PASS_AT_K_TITLE,
    RUN_FACTS_TITLE,
    build_eval_figure,
    build_run_figure,
    compare_runs,
    infer_algorithm,
    load_pass_at_k,
    main,
    plot_comparison,
    plot_eval,
    plot_run,
    switch_step,
    two_sided_ema,
)

ALPHA = 2.0 / 11.0  # span 10


# ------------------------------------------------------------------------------------- policy lag
def test_policy_lag_on_crafted_tensors():
    # trainer at version 5; -1 marks env tokens (mask 0), the last column is padding (mask 0)
    versions = torch.tensor([[5, 4, 4, -1, 3, 0],
                             [1, 1, -1, 5, 5, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 0],
                         [1, 1, 0, 1, 1, 0]], dtype=torch.float32)
    out = policy_lag_stats(versions, 5, mask)
    lags = [0, 1, 1, 2, 4, 4, 0, 0]  # model tokens only
    assert out["async/policy_lag/mean"] == pytest.approx(sum(lags) / len(lags))
    assert out["async/policy_lag/max"] == 4.0
    # a one-version lag counts as on-policy: only lags 2, 4, 4 are off-policy
    assert out["async/off_policy_token_ratio"] == pytest.approx(3 / 8)


def test_policy_lag_all_fresh_and_empty():
    versions = torch.full((2, 3), 7)
    mask = torch.ones(2, 3)
    assert policy_lag_stats(versions, 7, mask) == {
        "async/policy_lag/mean": 0.0, "async/policy_lag/max": 0.0, "async/off_policy_token_ratio": 0.0}
    assert policy_lag_stats(versions, 7, torch.zeros(2, 3))["async/policy_lag/mean"] == 0.0


def _traj(uid, segments):
    return Trajectory(uid=uid, group_id=uid, prompt_index=0, prompt_ids=[1, 2], segments=segments, reward=1.0)


def test_policy_lag_through_collate_ignores_env_tokens():
    # a two-turn trajectory whose second turn was sampled after a weight update (in-flight publication)
    a = _traj("a", [
        Segment("model", [10, 11, 12], [-0.1] * 3, [2, 2, 3]),
        Segment("env", [20, 21]),
        Segment("model", [13, 14], [-0.1] * 2, [4, 4], turn=1),
    ])
    b = _traj("b", [Segment("model", [15], [-0.2], [1])])
    batch = collate([a, b], pad_token_id=0)
    out = policy_lag_stats(batch["token_versions"], 4, batch["response_mask"])
    lags = [2, 2, 1, 0, 0, 3]
    assert out["async/policy_lag/mean"] == pytest.approx(sum(lags) / 6)
    assert out["async/policy_lag/max"] == 3.0
    assert out["async/off_policy_token_ratio"] == pytest.approx(3 / 6)
    # the buffer's staleness check sees the same per-token lags
    assert a.max_lag(4) == 2 and b.max_lag(4) == 3


def test_explained_variance_crafted():
    returns = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    assert explained_variance(returns + 0.5, returns, mask) == pytest.approx(1.0)  # a constant offset is free
    assert explained_variance(torch.full_like(returns, 0.5), returns, mask) == pytest.approx(0.0)  # constant V
    # V = 0.5 G: residual variance 0.25 Var(G) -> 0.75
    assert explained_variance(0.5 * returns, returns, mask) == pytest.approx(0.75)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask))  # Var(G) = 0


# ------------------------------------------------------------------------------------- two-sided EMA
def test_two_sided_ema_constant_and_identity():
    np.testing.assert_allclose(two_sided_ema([0.3] * 17), 0.3)
    x = [0.0, 1.0, 0.5, 2.0]
    np.testing.assert_allclose(two_sided_ema(x, span=1), x)  # α = 1: no smoothing
    assert two_sided_ema([]).size == 0
    np.testing.assert_allclose(two_sided_ema([4.0]), [4.0])


def test_two_sided_ema_impulse_by_hand():
    # forward: f = [0, α, (1-α)α]; backward: b = [(1-α)α, α, 0]
    out = two_sided_ema([0.0, 1.0, 0.0], span=10)
    a = ALPHA
    np.testing.assert_allclose(out, [(1 - a) * a / 2, a, (1 - a) * a / 2], rtol=1e-12)


def test_two_sided_ema_step_by_hand():
    x = [0.0] * 5 + [1.0] * 5
    out = two_sided_ema(x, span=10)
    a = ALPHA
    # before the step the forward EMA is 0 and the backward EMA decays from 1: (1-α)^(5-i)
    # after it the backward EMA is 1 and the forward EMA rises: 1 - (1-α)^(i-4)
    expected = [0.5 * (1 - a) ** (5 - i) for i in range(5)] + [0.5 * (1 + 1 - (1 - a) ** (i - 4)) for i in range(5, 10)]
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    np.testing.assert_allclose(out + out[::-1], 1.0)  # symmetric around the step: zero lag
    assert out[4] == pytest.approx(0.5 * (1 - a)) and out[5] == pytest.approx(1 - 0.5 * (1 - a))


# ------------------------------------------------------------------------------------- plots
def _rows(steps=24, switch_at=None, lag_scale=1.0, with_critic=True, extra=None):
    """Synthetic metric rows of every algorithm's keys (``extra(step) -> dict`` adds more)."""
    rows = []
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "train/success_rate": min(1.0, 0.3 + 0.02 * s + 0.05 * ((-1) ** s)),
            "train/response_length/mean": 40.0 - 0.5 * s,
            "actor/pg_loss": 0.1 / s,
            "async/policy_lag/mean": lag_scale * (1.0 + 0.1 * (s % 3)),
            "async/policy_lag/max": lag_scale * 3.0,
            "async/off_policy_token_ratio": lag_scale * 0.2,
            "async/clock_ticks": 5.0 * s,
            "trainer/step": float(s),
            "train/reward_mean": 0.2 + 0.02 * s,
            "rollout/mismatch_kl": 1e-4 * s,
        }
        if with_critic:
            row["critic/explained_var"] = -0.5 + 0.04 * s
            row["critic/value_loss"] = 1.0 / s
        if switch_at is not None and s == switch_at:
            row["li2sao/gate_opened"] = 1.0
        if extra is not None:
            row.update(extra(s))
        rows.append(row)
    return rows


def _li2sao_metrics(s):
    return {"li2sao/explained_var_residual": 0.05 * s, "li2sao/rank_acc": 0.5 + 0.01 * s,
            "li2sao/ema_explained_var": 0.04 * s, "li2sao/ema_rank_acc": 0.5 + 0.008 * s,
            "li2sao/gate_counter": float(max(0, s - 8)), "critic/ev_tokens": 0.02 * s, "critic/ev_terminal": 0.03 * s,
            "async/group_size": 4.0 if s <= 12 else 1.0}  # n_b until the switch (at 12 in these tests), then 1


def _sapo_metrics(s):
    return {"sapo/explained_var": 0.03 * s, "sapo/v_loss": 1.0 / s, "sapo/q_loss": 1.2 / s}


def _write_run(run_dir, steps=24, switch_at=None, lag_scale=1.0, with_critic=True, passk=None, algorithm=None,
               extra=None, config=None):
    run_dir.mkdir(parents=True)
    rows = _rows(steps, switch_at, lag_scale, with_critic, extra)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if algorithm is not None or config is not None:
        (run_dir / "config.json").write_text(json.dumps(config or {"algorithm": {"name": algorithm},
                                                                  "env": {"name": "toy_keys"}}))
    if passk is not None:
        (run_dir / "pass_at_k.json").write_text(json.dumps(passk))
    return run_dir


def _assert_png(path, min_bytes=10_000):
    assert path.exists(), path
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > min_bytes, f"{path} is only {len(data)} bytes"


def _panels(fig):
    """title -> axes of the visible panels (the figure's layout order), the run-facts cell aside."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible() and ax.get_title() != RUN_FACTS_TITLE}


def _texts(ax):
    return " ".join(t.get_text() for t in ax.texts)


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


_TAIL = ["policy lag", "off-policy tokens", "rollout / trainer mismatch"]
EXPECTED_PANELS = {
    "grpo": ["training accuracy", "reward", "policy loss", *_TAIL],
    "lisao": ["training accuracy", "reward", "critic explained variance", "critic value loss", "policy loss", *_TAIL],
    "ppo": ["training accuracy", "reward", "critic explained variance", "critic value loss", "policy loss", *_TAIL],
    "li2sao": ["training accuracy", "reward", "critic explained variance", "Li2SAO residual EV e_k",
               "Li2SAO rank accuracy a_k", "Li2SAO gate counter", "critic value loss", "policy loss",
               "rollout group size", *_TAIL],
    "sapo": ["training accuracy", "reward", "SAPO V explained variance", "SAPO V / Q losses", "policy loss", *_TAIL],
}
ALGO_EXTRA = {"grpo": None, "lisao": None, "ppo": None, "li2sao": _li2sao_metrics, "sapo": _sapo_metrics}


@pytest.mark.parametrize("algorithm", sorted(EXPECTED_PANELS))
def test_run_figure_has_the_panels_of_its_algorithm(algorithm):
    rows = _rows(with_critic=algorithm in ("lisao", "ppo", "li2sao"), extra=ALGO_EXTRA[algorithm],
                 switch_at=12 if algorithm == "li2sao" else None)
    assert infer_algorithm(rows) == ("lisao" if algorithm == "ppo" else algorithm)  # ppo logs what lisao logs
    fig = build_run_figure(rows, algorithm, {"algorithm": {"name": algorithm}})
    panels = _panels(fig)
    assert list(panels) == EXPECTED_PANELS[algorithm]
    for title, ax in panels.items():
        assert ax.lines, f"{title}: the synthetic run logs its metrics, so the panel must draw them"
        assert "not logged" not in _texts(ax), title
    _close(fig)


def test_panels_follow_what_the_run_logged_not_the_algorithms_name():
    """Issue 35, item 2: an algorithm of one's own (no built-in name) that logs a critic gets the critic's panels; a
    run named li2sao that logged no gate metrics shows none of the gate's panels."""
    own = build_run_figure(_rows(with_critic=True), "reinforce_with_critic", {"algorithm": {"name": "reinforce"}})
    assert list(_panels(own)) == EXPECTED_PANELS["lisao"]
    _close(own)
    named = build_run_figure(_rows(with_critic=False), "li2sao", {"algorithm": {"name": "li2sao"}})
    assert list(_panels(named)) == EXPECTED_PANELS["grpo"]
    _close(named)
    assert PANELS[0].title == "training accuracy" and len({p.title for p in PANELS}) == len(PANELS)


def test_sapo_figure_reads_sapo_metrics_not_the_critic():
    # the bug: a SAPO run said "no critic/explained_var in this run" although sapo/explained_var was logged
    fig = build_run_figure(_rows(with_critic=False, extra=_sapo_metrics), config={"algorithm": {"name": "sapo"}})
    panels = _panels(fig)
    (line,) = panels["SAPO V explained variance"].lines
    np.testing.assert_allclose(line.get_ydata(), [0.03 * s for s in range(1, 25)])
    labels = [l.get_label() for l in panels["SAPO V / Q losses"].lines]
    assert labels == ["V loss", "Q loss"]
    assert "critic explained variance" not in panels
    _close(fig)


def test_panel_without_data_shows_only_its_message():
    # a panel every run shows (policy loss, lag) on a run that did not log its metrics (an older run, or an algorithm
    # of one's own): the panel says so, and neither the switch line nor a threshold crosses the message. Panels of
    # optional parts (the gate, the critic) are left out when their metrics are missing.
    rows = [{k: v for k, v in r.items() if k not in ("actor/pg_loss", "async/policy_lag/mean", "async/policy_lag/max")}
            for r in _rows(steps=6, switch_at=3, with_critic=False)]
    fig = build_run_figure(rows, "li2sao", {})
    panels = _panels(fig)
    for title in ("policy loss", "policy lag"):
        ax = panels[title]
        assert len(ax.lines) == 0 and ax.get_legend() is None, title
        assert "not logged in this run" in _texts(ax), title
        assert list(ax.get_xticks()) == [] and list(ax.get_yticks()) == [], title
    assert not {"Li2SAO gate counter", "critic value loss", "critic explained variance"} & set(panels)
    acc = panels["training accuracy"]
    assert [l.get_label() for l in acc.lines][-1] == "switch @ 3"
    assert list(acc.lines[-1].get_xdata()) == [3, 3]
    _close(fig)


def test_li2sao_thresholds_from_metrics_then_config_then_defaults():
    def hline(ax, label_start):
        (line,) = [l for l in ax.lines if l.get_label().startswith(label_start)]
        return line.get_ydata()[0]

    logged = _rows(steps=5, extra=lambda s: {**_li2sao_metrics(s), "li2sao/eta_e": 0.3, "li2sao/eta_a": 0.7})
    fig = build_run_figure(logged, "li2sao", {"algorithm": {"gate": {"eta_e": 0.25, "eta_a": 0.6}}})
    panels = _panels(fig)
    assert hline(panels["Li2SAO residual EV e_k"], "η_e") == 0.3  # the logged metric wins
    assert hline(panels["Li2SAO rank accuracy a_k"], "η_a") == 0.7
    _close(fig)
    unlogged = _rows(steps=5, extra=_li2sao_metrics)
    fig = build_run_figure(unlogged, "li2sao", {"algorithm": {"gate": {"eta_e": 0.25, "eta_a": 0.6, "patience": 4}}})
    panels = _panels(fig)
    assert hline(panels["Li2SAO residual EV e_k"], "η_e") == 0.25  # the run's config.json
    assert hline(panels["Li2SAO rank accuracy a_k"], "η_a") == 0.6
    assert hline(panels["Li2SAO gate counter"], "M (patience)") == 4
    _close(fig)
    fig = build_run_figure(unlogged, "li2sao", {})
    panels = _panels(fig)
    assert hline(panels["Li2SAO residual EV e_k"], "η_e") == 0.2  # the spec's defaults
    assert hline(panels["Li2SAO rank accuracy a_k"], "η_a") == 0.65
    _close(fig)


def test_critic_ev_prefers_token_and_terminal_metrics():
    fig = build_run_figure(_rows(steps=5, extra=_li2sao_metrics), "li2sao", {})
    labels = [l.get_label() for l in _panels(fig)["critic explained variance"].lines]
    assert labels == ["all model tokens", "last token (terminal)"]
    _close(fig)
    fig = build_run_figure(_rows(steps=5), "lisao", {})  # only the older key: drawn, and named
    labels = [l.get_label() for l in _panels(fig)["critic explained variance"].lines]
    assert labels == ["all model tokens (critic/explained_var)"]
    _close(fig)


def test_step_ticks_are_integers_for_a_short_run():
    fig = build_run_figure(_rows(steps=3), "grpo", {})
    fig.canvas.draw()
    for title, ax in _panels(fig).items():
        ticks = ax.get_xticks()
        assert len(ticks) and all(float(t).is_integer() for t in ticks), (title, ticks)
    _close(fig)


def test_plot_run_renders_and_marks_a_forced_switch(tmp_path):
    run = _write_run(tmp_path / "li2sao-run", switch_at=12, algorithm="li2sao", extra=_li2sao_metrics)
    (run / "summary.json").write_text(json.dumps({"switch_forced": True}))
    out = plot_run(run)
    assert out == run / "training.png"
    _assert_png(out)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert switch_step(rows) == 12
    fig = build_run_figure(rows, "li2sao", {}, run_dir=run)
    assert _panels(fig)["training accuracy"].lines[-1].get_label() == "switch @ 12 (forced at T_max)"
    _close(fig)


def test_pass_at_k_panel_from_the_run_or_its_eval_folder(tmp_path):
    plain = _write_run(tmp_path / "a", algorithm="grpo")
    assert load_pass_at_k(plain) is None
    run = _write_run(tmp_path / "b", algorithm="grpo")
    (run / "eval").mkdir()
    (run / "eval" / "pass_at_k.json").write_text(json.dumps(
        {"sets": {"aime_2024": {"k": [1, 2], "pass": [0.1, 0.2]}}, "mean": {"k": [1, 2], "pass": [0.1, 0.2]}}))
    passk = load_pass_at_k(run)
    assert passk == {"k": [1, 2], "pass": [0.1, 0.2]}
    fig = build_run_figure(_rows(steps=4, with_critic=False), "grpo", {}, pass_at_k=passk)
    panels = _panels(fig)
    assert list(panels)[-1] == PASS_AT_K_TITLE
    assert [round(b.get_height(), 6) for b in panels[PASS_AT_K_TITLE].patches] == [0.1, 0.2]
    _close(fig)
    _assert_png(plot_run(run))


def test_pass_at_k_json_validation(tmp_path):
    assert load_pass_at_k(tmp_path) is None
    (tmp_path / "pass_at_k.json").write_text(json.dumps({"k": [1, 2], "pass": [0.5]}))
    with pytest.raises(ValueError, match="equal length"):
        load_pass_at_k(tmp_path)


def test_eval_figure_pass_at_k_per_year_and_success_per_category(tmp_path):
    math_report = {"env": "math", "n_samples": 4, "model_dir": "outputs/run/model",
                   "sets": {"aime_2024": {"k": [1, 2, 4], "pass": [0.1, 0.2, 0.3], "year": 2024},
                            "aime_2025": {"k": [1, 2, 4], "pass": [0.0, 0.1, 0.2], "year": 2025}},
                   "mean": {"k": [1, 2, 4], "pass": [0.05, 0.15, 0.25]}}
    fig = build_eval_figure(math_report)
    (ax,) = [a for a in fig.axes if a.get_visible()]
    assert ax.get_title() == "pass@k per AIME year"
    assert [l.get_label() for l in ax.lines] == ["aime_2024", "aime_2025", "mean over sets"]
    np.testing.assert_allclose(ax.lines[2].get_ydata(), [0.05, 0.15, 0.25])
    _close(fig)
    alfworld = {"env": "alfworld", "n_samples": 2,
                "sets": {"alfworld_valid_unseen": {"k": [1, 2], "pass": [0.25, 0.5], "success_rate": 0.25,
                                                   "success_by_category": {"Cool": 0.0, "Pick": 0.5, "All": 0.25}}},
                "mean": {"k": [1, 2], "pass": [0.25, 0.5]}}
    fig = build_eval_figure(alfworld)
    panels = _panels(fig)
    assert list(panels) == ["pass@k per set", "success per ALFWorld category"]
    bars = panels["success per ALFWorld category"].patches
    assert [round(b.get_height(), 6) for b in bars] == [0.0, 0.5, 0.25]  # Cool, Pick, All
    assert [t.get_text() for t in panels["success per ALFWorld category"].get_xticklabels()] == ["Cool", "Pick", "All"]
    _close(fig)
    _assert_png(plot_eval(alfworld, tmp_path / "eval.png"), min_bytes=5_000)
    with pytest.raises(ValueError, match="no sets"):
        build_eval_figure({"sets": {}})


@pytest.mark.slow
def test_comparison_of_two_runs(tmp_path):
    grpo = _write_run(tmp_path / "grpo", with_critic=False, lag_scale=2.0)
    li2sao = _write_run(tmp_path / "li2sao", switch_at=10, passk={"k": [1, 4], "pass": [0.5, 0.75]})
    out = compare_runs([grpo, li2sao])
    assert out == grpo / "comparison.png"
    _assert_png(out, min_bytes=30_000)
    by_clock = compare_runs([grpo, li2sao], out_path=tmp_path / "by_clock.png", x="clock")
    _assert_png(by_clock, min_bytes=30_000)


def test_plot_comparison_accepts_driver_histories(tmp_path):
    # a driver's history has trainer/step but no "step" key
    hist = [{"trainer/step": float(s), "train/success_rate": 0.1 * s, "async/clock_ticks": 3.0 * s}
            for s in range(1, 8)]
    out = plot_comparison({"a": hist, "b": hist[::-1][::-1]}, tmp_path / "cmp.png")
    _assert_png(out)
    with pytest.raises(ValueError, match="x must be"):
        plot_comparison({"a": hist}, tmp_path / "bad.png", x="wall")


@pytest.mark.slow
def test_plot_cli_two_runs(tmp_path):
    first = _write_run(tmp_path / "run1", switch_at=8)
    second = _write_run(tmp_path / "run2", lag_scale=0.5)
    proc = subprocess.run([sys.executable, "-m", "async_rl.plots", str(first), str(second)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for path in (first / "training.png", second / "training.png", first / "comparison.png"):
        _assert_png(path)
        assert str(path) in proc.stdout
    assert not (second / "comparison.png").exists()


def test_plot_cli_without_a_run_plots_the_last_run(tmp_path, capsys):
    from async_rl.models.export import write_last_run

    outputs = tmp_path / "outputs"
    with pytest.raises(SystemExit):  # nothing trained yet: the error says what to pass
        main(["--outputs", str(outputs)])
    assert "make plots RUN=outputs/<run>" in capsys.readouterr().err
    run = _write_run(outputs / "solo", algorithm="sapo", extra=_sapo_metrics, with_critic=False)
    write_last_run(outputs, run, run / "model")
    main(["--outputs", str(outputs)])
    _assert_png(run / "training.png")
    assert not (run / "comparison.png").exists()
    printed = capsys.readouterr().out
    assert f"plotting the last run, {run}" in printed and "training.png" in printed


def test_missing_metrics_file_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def test_plot_reads_the_eval_report_format(tmp_path):
    (tmp_path / "pass_at_k.json").write_text(json.dumps(
        {"sets": {"aime_2024": {"k": [1, 2], "pass": [0.1, 0.2]}}, "mean": {"k": [1, 2], "pass": [0.1, 0.2]}}))
    assert load_pass_at_k(tmp_path) == {"k": [1, 2], "pass": [0.1, 0.2]}


def test_trailing_ema_uses_past_steps_only():
    from async_rl.plots import EMA_LABEL, trailing_ema

    # by hand, α = 2/11: f = [0, 2/11, 2/11 * 9/11]
    np.testing.assert_allclose(trailing_ema([0.0, 1.0, 0.0], span=10), [0.0, 2 / 11, 18 / 121])
    x = [0.0] * 5 + [1.0] * 5
    out = trailing_ema(x)
    assert list(out[:5]) == [0.0] * 5  # no later step moves an earlier point (a two-sided EMA would)
    assert two_sided_ema(x)[4] > 0.0
    np.testing.assert_allclose(trailing_ema(x)[:7], trailing_ema(x[:7]))  # appending steps changes nothing before
    assert trailing_ema([]).size == 0
    fig = build_run_figure(_rows(steps=10, with_critic=False), "grpo", {})
    acc = _panels(fig)["training accuracy"]
    raw, smooth = acc.lines[0], acc.lines[1]
    assert raw.get_marker() == "." and smooth.get_label() == EMA_LABEL and "past steps only" in EMA_LABEL
    np.testing.assert_allclose(smooth.get_ydata(), trailing_ema(raw.get_ydata()))
    _close(fig)


def test_units_panels_and_the_explained_variance_note():
    rows = _rows(steps=20, with_critic=True)
    fig = build_run_figure(rows, "lisao", {})
    panels = _panels(fig)
    assert panels["policy lag"].get_ylabel() == "versions behind the trainer"
    assert panels["off-policy tokens"].get_ylabel() == "fraction of model tokens"
    assert panels["rollout / trainer mismatch"].get_ylabel() == "nats per token"
    np.testing.assert_allclose(panels["rollout / trainer mismatch"].lines[0].get_ydata(), [1e-4 * s for s in range(1, 21)])
    assert all(ax.get_xlabel() == "step (optimizer batches)" for ax in panels.values())
    assert "returns barely vary" not in _texts(panels["critic explained variance"])  # success ~0.7: no note
    _close(fig)
    solved = [{**r, "train/success_rate": 1.0} for r in rows]
    fig = build_run_figure(solved, "lisao", {})
    assert "returns barely vary" in _texts(_panels(fig)["critic explained variance"])
    assert sum(ax.get_visible() for ax in fig.axes) == len(EXPECTED_PANELS["lisao"]) + 1  # + the run-facts cell
    _close(fig)


@pytest.mark.parametrize("algorithm", sorted(EXPECTED_PANELS))
@pytest.mark.parametrize("with_eval", [False, True])
def test_the_grid_has_no_empty_cell_and_the_spare_cells_say_what_the_run_was(algorithm, with_eval):
    """Issue 38, item 6: every cell of training.png shows something. Panels fill the grid row by row; the rest of
    the last row is one cell of run facts (algorithm, env, model, steps, seed, batch, learning rates, switch)."""
    rows = _rows(with_critic=algorithm in ("lisao", "ppo", "li2sao"), extra=ALGO_EXTRA[algorithm],
                 switch_at=12 if algorithm == "li2sao" else None)
    config = {"algorithm": {"name": algorithm, "train_batch_trajectories": 16, "group_size": 4, "actor_lr": 1e-6},
              "env": {"name": "toy_keys"}, "model": {"dir": "outputs/models/tiny-toy_keys"}, "seed": 3,
              "trainer": {"scheduler": "concurrent"}}
    fig = build_run_figure(rows, algorithm, config, pass_at_k={"k": [1, 2], "pass": [0.4, 0.6]} if with_eval else None)
    assert all(ax.get_visible() for ax in fig.axes)
    n_panels = len(EXPECTED_PANELS[algorithm]) + with_eval
    facts = [ax for ax in fig.axes if ax.get_title() == RUN_FACTS_TITLE]
    assert len(fig.axes) == n_panels + len(facts)
    if n_panels % 3 == 0:
        assert facts == []
    else:  # one cell spanning the rest of the last row
        (ax,) = facts
        spec = ax.get_subplotspec()
        assert (spec.rowspan.start, spec.colspan.start, spec.colspan.stop) == ((n_panels - 1) // 3, n_panels % 3, 3)
        text = _texts(ax)
        for fact in ("algorithm: " + algorithm, "env: toy_keys", "model: outputs/models/tiny-toy_keys",
                     "steps logged: 24 (to step 24)", "seed: 3", "batch: 16 trajectories, group size 4",
                     "learning rates: actor 1e-06", "scheduler: concurrent"):
            assert fact in text, (fact, text)
        if algorithm == "li2sao":
            assert "switch @ 12" in text
    _close(fig)


def test_mismatch_panel_draws_only_steps_with_tokens_at_the_trainers_version():
    """``rollout/mismatch_kl`` is 0 by construction on a step where every token lagged (no token to compare): the
    panel leaves such steps out and says how many, instead of drawing a flat, false 0 (the demo at lag 4)."""
    rows = _rows(steps=10, with_critic=True)
    rows = [{**r, "rollout/mismatch_tokens": 50.0 if r["step"] <= 3 else 0.0,
             "rollout/mismatch_kl": r["rollout/mismatch_kl"] if r["step"] <= 3 else 0.0} for r in rows]
    fig = build_run_figure(rows, "lisao", {})
    ax = _panels(fig)["rollout / trainer mismatch"]
    assert list(ax.lines[0].get_xdata()) == [1, 2, 3]
    assert "7 of 10 steps had no token sampled at the trainer's version" in _texts(ax)
    _close(fig)
    lagged = [{**r, "rollout/mismatch_tokens": 0.0, "rollout/mismatch_kl": 0.0} for r in rows]
    fig = build_run_figure(lagged, "lisao", {})
    ax = _panels(fig)["rollout / trainer mismatch"]
    assert len(ax.lines) == 0 and "10 of 10 steps had no token" in _texts(ax)
    _close(fig)

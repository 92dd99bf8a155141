"""Paper-style figures from a run's ``metrics.jsonl`` and an evaluation's ``pass_at_k.json``.

``training.png`` (one per run; the panels whose metrics the run logged, :func:`panels_for`; the Li2SAO
switch dashed; a pass@k panel once evaluated), ``comparison.png`` (several runs, written to the first run
directory) and ``eval.png`` (written by ``python -m async_rl.eval``). Smoothed curves use :func:`trailing_ema`
(span 10, one-sided: a point uses that step and earlier ones only, as a live dashboard would), drawn over the
raw points and labelled as such; :func:`two_sided_ema` (zero-lag, uses later steps) is kept for the benchmark
figures that say so.

    python -m async_rl.plots [outputs/<run> ...] [--x clock]   # no run: the last run (outputs/last_run.json)

Details: docs/metrics.md (Figures; Smoothing in the plots).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from async_rl.validation import add_settings_arguments, setting, settings_from_arguments

EMA_SPAN = 10  # span of the EMA used in every figure
#: the legend of a smoothed curve: says what it averages (a one-sided EMA lags a change by ~span/2 steps)
EMA_LABEL = f"trailing EMA (span {EMA_SPAN}, past steps only)"


@dataclass(frozen=True)
class Series:
    """One curve: the first of ``keys`` the run logged (newer names first, older fallbacks after)."""

    keys: tuple[str, ...]
    label: str
    smooth: bool = False  # raw points + the trailing EMA
    count_key: Optional[str] = None  # a step is drawn only where this count is > 0 (its value is undefined at 0)


@dataclass(frozen=True)
class Threshold:
    """A horizontal line: the metric ``key`` when logged, else ``config[algorithm][gate][config_key]``."""

    label: str
    key: Optional[str]
    config_key: str
    default: float


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    ylabel: str = ""
    thresholds: tuple[Threshold, ...] = field(default_factory=tuple)
    # shown when the run logged any of these keys (None: its series' keys; () : every run, "not logged" when empty)
    shown_if_logged: Optional[tuple[str, ...]] = None

    def shown_for(self, logged: set[str]) -> bool:
        keys = self.shown_if_logged if self.shown_if_logged is not None else \
            tuple(key for series in self.series for key in series.keys)
        return not keys or any(key in logged for key in keys)


ACCURACY = Panel("training accuracy", (Series(("train/success_rate",), "success rate", smooth=True),),
                 "fraction of trajectories solved", shown_if_logged=())
# lag (versions) and the off-policy ratio (a fraction) have different units: one panel each
LAG = Panel("policy lag", (Series(("async/policy_lag/mean",), "mean lag"), Series(("async/policy_lag/max",), "max lag")),
            "versions behind the trainer", shown_if_logged=())
OFF_POLICY = Panel("off-policy tokens", (Series(("async/off_policy_token_ratio",), "lag > 1"),),
                   "fraction of model tokens", shown_if_logged=())
# the env's own reward (WebShop: the purchase score in [0, 1]; success is the accuracy panel's score == 1)
REWARD = Panel("reward", (Series(("train/reward_mean",), "mean reward per trajectory", smooth=True),),
               "env reward (+ shaping)", shown_if_logged=())
# measured on tokens sampled at the trainer's own version only: a step with none logs 0, which is not a measurement
MISMATCH = Panel("rollout / trainer mismatch", (Series(("rollout/mismatch_kl",), "KL(rollout || trainer)",
                                                       count_key="rollout/mismatch_tokens"),), "nats per token",
                 shown_if_logged=())
POLICY_LOSS = Panel("policy loss", (Series(("actor/pg_loss",), "actor/pg_loss"),), "loss (advantage-weighted)",
                    shown_if_logged=())
CRITIC_EV = Panel("critic explained variance",
                  (Series(("critic/ev_tokens", "critic/explained_var"), "all model tokens"),
                   Series(("critic/ev_terminal",), "last token (terminal)")), "1 - Var(G-V)/Var(G)")
CRITIC_LOSS = Panel("critic value loss",
                    (Series(("critic/value_loss",), "value loss (Eq. 10 residual in the bootstrap, Eq. 5 otherwise)"),),
                    "loss")
LI2SAO_EV = Panel("Li2SAO residual EV e_k",
                  (Series(("li2sao/explained_var_residual",), "e_k"), Series(("li2sao/ema_explained_var",), "EMA")),
                  "explained variance", (Threshold("η_e", "li2sao/eta_e", "eta_e", 0.2),))
LI2SAO_RANK = Panel("Li2SAO rank accuracy a_k",
                    (Series(("li2sao/rank_acc",), "a_k"), Series(("li2sao/ema_rank_acc",), "EMA")),
                    "fraction of pairs", (Threshold("η_a", "li2sao/eta_a", "eta_a", 0.65),))
LI2SAO_GATE = Panel("Li2SAO gate counter", (Series(("li2sao/gate_counter",), "consecutive ready steps"),), "steps",
                    (Threshold("M (patience)", None, "patience", 10),))
# every run logs its group size; it moves only where a readiness gate switches it (Li2SAO)
GROUP_SIZE = Panel("rollout group size", (Series(("async/group_size",), "n (Li2SAO: n_b, then 1 after the switch)"),),
                   "responses per prompt", shown_if_logged=("li2sao/gate_counter",))
SAPO_EV = Panel("SAPO V explained variance", (Series(("sapo/explained_var",), "V vs turn targets"),),
                "1 - Var(y-V)/Var(y)")
SAPO_LOSSES = Panel("SAPO V / Q losses", (Series(("sapo/v_loss",), "V loss"), Series(("sapo/q_loss",), "Q loss")),
                    "loss")

#: the panels of ``training.png``, in order: a run shows those whose metrics it logged (:func:`panels_for`); a
#: pass@k panel is appended when an evaluation exists. No algorithm name decides: an algorithm of one's own that
#: logs ``critic/value_loss`` gets the critic's panels.
PANELS: tuple[Panel, ...] = (ACCURACY, REWARD, CRITIC_EV, SAPO_EV, LI2SAO_EV, LI2SAO_RANK, LI2SAO_GATE, CRITIC_LOSS,
                             SAPO_LOSSES, POLICY_LOSS, GROUP_SIZE, LAG, OFF_POLICY, MISMATCH)


def panels_for(rows: Sequence[Mapping]) -> tuple[Panel, ...]:
    """The panels of a run's ``training.png``: every panel of :data:`PANELS` whose metrics the run logged."""
    logged = {key for row in rows for key in row}
    return tuple(panel for panel in PANELS if panel.shown_for(logged))


PASS_AT_K_TITLE = "pass@k (eval)"
PANEL_COLUMNS = 3

# (metric keys, first present wins per run; panel title; y label) of the comparison figure
COMPARISON_PANELS = [
    (("train/success_rate",), "training accuracy", "success rate"),
    (("critic/ev_tokens", "critic/explained_var", "sapo/explained_var"), "value explained variance",
     "1 - Var(G-V)/Var(G)"),
    (("train/response_length/mean",), "response length", "model tokens / trajectory"),
    (("async/policy_lag/mean",), "mean policy lag", "versions"),
    (("async/off_policy_token_ratio",), "off-policy token ratio (lag > 1)", "fraction of model tokens"),
]

X_KEYS = {"step": "step", "clock": "async/clock_ticks"}


# ---------------------------------------------------------------------------------------------- data
def load_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass a run directory written by async_rl.train")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's resolved config (``config.json``, written by ``async_rl.train``); ``{}`` when absent."""
    path = Path(run_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def infer_algorithm(rows: Sequence[Mapping], config: Optional[Mapping[str, Any]] = None) -> str:
    """``config["algorithm"]["name"]`` when known, else from the metric prefixes the run logged."""
    name = ((config or {}).get("algorithm") or {}).get("name") if isinstance((config or {}).get("algorithm"),
                                                                              Mapping) else None
    if name:
        return str(name)
    keys = {key for row in rows for key in row}
    if any(key.startswith("sapo/") for key in keys):
        return "sapo"
    if any(key.startswith("li2sao/") for key in keys):
        return "li2sao"
    if any(key.startswith("critic/") for key in keys):
        return "lisao"
    return "grpo"


def evaluates_run_model(run_dir: str | Path, report: Any) -> Optional[str]:
    """None when ``report`` (a pass_at_k.json's content) may be drawn with the run in ``run_dir``; else why not.

    A run with an exported model (``<run_dir>/model``) shows only an evaluation that recorded the same model
    (``async_rl.eval`` writes ``"model"``: :func:`async_rl.run_dir.model_identity`, whose fingerprint changes with
    every export); an evaluation that records no model cannot be checked and is not drawn there either. A
    folder without a model (hand-made, or a run with ``trainer.export_model=false``) has nothing to contradict."""
    from async_rl.run_dir import model_identity

    model = Path(run_dir) / "model"
    if not (model / "config.json").is_file():
        return None
    recorded = report.get("model") if isinstance(report, dict) else None
    if not isinstance(recorded, dict) or "fingerprint" not in recorded:
        return (f"it records no model, and {model} may have changed since (rerun the evaluation: "
                f"make eval MODEL={model})")
    current = model_identity(model)
    if recorded["fingerprint"] != current["fingerprint"]:
        def shown(m):
            return (f"{m.get('model_dir')}" + (f" (run {m['run_name']}, step {m['step']}, exported {m['exported_at']})"
                                               if "step" in m else ""))
        return (f"it evaluates {shown(recorded)}, not this run's model {shown(current)} (rerun: make eval "
                f"MODEL={model})")
    return None


def _pass_at_k_file(run_dir: str | Path) -> Optional[Path]:
    """``<run_dir>/pass_at_k.json``, else ``<run_dir>/eval/pass_at_k.json`` (where ``async_rl.eval`` writes
    the evaluation of a run's exported model)."""
    for path in (Path(run_dir) / "pass_at_k.json", Path(run_dir) / "eval" / "pass_at_k.json"):
        if path.exists():
            return path
    return None


def load_pass_at_k(run_dir: str | Path) -> Optional[dict[str, list[float]]]:
    """``{"k": [...], "pass": [...]}`` from the run's ``pass_at_k.json`` (see :func:`_pass_at_k_file`); None
    when there is none, or when it is not the evaluation of this run's model (:func:`evaluates_run_model`)."""
    path = _pass_at_k_file(run_dir)
    if path is None:
        return None
    data = json.loads(path.read_text())
    mismatch = evaluates_run_model(run_dir, data)
    if mismatch is not None:
        print(f"note: {path} is not drawn: {mismatch}", flush=True)
        return None
    if isinstance(data, dict) and "k" not in data and isinstance(data.get("mean"), dict):
        data = data["mean"]  # the report `python -m async_rl.eval` writes: plot the mean over its sets
    if not isinstance(data, dict) or "k" not in data or "pass" not in data:
        raise ValueError(f"{path}: expected {{\"k\": [...], \"pass\": [...]}}, got keys {sorted(data)}")
    ks, vals = list(data["k"]), list(data["pass"])
    if len(ks) != len(vals) or not ks:
        raise ValueError(f"{path}: 'k' and 'pass' must be non-empty lists of equal length ({len(ks)} vs {len(vals)})")
    return {"k": [int(k) for k in ks], "pass": [float(v) for v in vals]}


def trailing_ema(values: Sequence[float], span: int = EMA_SPAN) -> np.ndarray:
    """One-sided EMA, the smoothing of every figure: ``f_0 = x_0``, ``f_i = α x_i + (1-α) f_{i-1}`` with
    ``α = 2/(span+1)``. ``f_i`` uses steps ``0..i`` only (no future step moves a past point), so a change shows
    with a lag of about ``span/2`` steps."""
    x = np.asarray(values, dtype=np.float64)
    out = np.empty_like(x)
    alpha = 2.0 / (span + 1.0)
    acc = x[0] if x.size else 0.0
    for i, v in enumerate(x):
        acc = alpha * v + (1.0 - alpha) * acc
        out[i] = acc
    return out


def two_sided_ema(values: Sequence[float], span: int = EMA_SPAN) -> np.ndarray:
    """Zero-lag smoothing for plots: the mean of a forward and a backward EMA.

    Forward: ``f_0 = x_0``, ``f_i = α x_i + (1-α) f_{i-1}`` with ``α = 2/(span+1)``; backward: the same
    recursion run from the last value to the first (``b_{n-1} = x_{n-1}``). Returns ``(f + b) / 2``.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return x
    alpha = 2.0 / (span + 1.0)

    def ema(seq: np.ndarray) -> np.ndarray:
        out = np.empty_like(seq)
        acc = seq[0]
        for i, v in enumerate(seq):
            acc = alpha * v + (1.0 - alpha) * acc
            out[i] = acc
        return out

    return 0.5 * (ema(x) + ema(x[::-1])[::-1])


def _step_of(row: Mapping) -> Optional[float]:
    """The x value of a row: ``step`` (metrics.jsonl) or ``trainer/step`` (a driver's history)."""
    for key in ("step", "trainer/step"):
        if key in row:
            return row[key]
    return None


def _x_of(row: Mapping, x_key: str) -> Optional[float]:
    return _step_of(row) if x_key == "step" else row.get(x_key)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))


def _series(rows: Sequence[Mapping], key: str, x_key: str = "step",
            count_key: Optional[str] = None) -> tuple[list[float], list[float]]:
    xs, vals = [], []
    for row in rows:
        x = _x_of(row, x_key)
        if count_key is not None and _finite(row.get(count_key)) and float(row[count_key]) <= 0:
            continue  # a logged count of 0 (a run that does not log the count keeps every step)
        if key in row and _finite(row[key]) and x is not None:
            xs.append(int(x) if x_key == "step" else float(x))
            vals.append(float(row[key]))
    return xs, vals


def switch_step(rows: Sequence[Mapping]) -> Optional[int]:
    """Step at which the Li2SAO readiness gate opened (``li2sao/gate_opened``); None when it never did."""
    for row in rows:
        if row.get("li2sao/gate_opened"):
            step = _step_of(row)
            return int(step) if step is not None else None
    return None


def _switch_x(rows: Sequence[Mapping], x_key: str) -> Optional[float]:
    for row in rows:
        if row.get("li2sao/gate_opened"):
            return _x_of(row, x_key)
    return None


# ---------------------------------------------------------------------------------------------- figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _pass_at_k_bars(ax, data: Mapping[str, Mapping[str, list[float]]],
                    colors: Optional[Mapping[str, str]] = None) -> None:
    """Grouped bars: one group per k, one bar per run (in the run's colour when ``colors`` is given)."""
    ks = sorted({k for d in data.values() for k in d["k"]})
    width = 0.8 / max(len(data), 1)
    for i, (label, d) in enumerate(data.items()):
        lookup = dict(zip(d["k"], d["pass"]))
        pos = [j + (i - (len(data) - 1) / 2) * width for j, k in enumerate(ks) if k in lookup]
        vals = [lookup[k] for k in ks if k in lookup]
        color = (colors or {}).get(label, f"C{i % 10}")
        bars = ax.bar(pos, vals, width=width, label=label, color=color)
        for bar, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1.05)
    ax.set_title(PASS_AT_K_TITLE, fontsize=10)
    if colors is not None or len(data) > 1:
        ax.legend(fontsize=7)


def _integer_steps(ax) -> None:
    """Steps are whole numbers: no 2.5 on the axis, however few steps the run has."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _no_data(ax, message: str) -> None:
    """An empty panel: the message alone, centred, with no axes, ticks or lines to cross it."""
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="gray",
            wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def _threshold_value(threshold: Threshold, rows: Sequence[Mapping], config: Mapping[str, Any]) -> float:
    if threshold.key is not None:
        for row in reversed(rows):
            if threshold.key in row and _finite(row[threshold.key]):
                return float(row[threshold.key])
    gate = ((config.get("algorithm") or {}).get("gate") or {}) if isinstance(config.get("algorithm"), Mapping) else {}
    value = gate.get(threshold.config_key) if isinstance(gate, Mapping) else None
    return float(value) if _finite(value) else float(threshold.default)


def _draw_panel(ax, panel: Panel, rows: Sequence[Mapping], config: Mapping[str, Any], switch: Optional[int],
                switch_label: Optional[str], x_range: Optional[tuple[int, int]] = None) -> bool:
    """Draw one panel; returns False (and shows only a message) when the run logged none of its metrics."""
    drawn = False
    for i, series in enumerate(panel.series):
        key = next((k for k in series.keys if _series(rows, k, count_key=series.count_key)[0]), None)
        if key is None:
            continue
        steps, values = _series(rows, key, count_key=series.count_key)
        color = f"C{i}"
        if series.smooth:
            ax.plot(steps, values, color=color, alpha=0.35, linewidth=0.6, marker=".", markersize=3,
                    label=f"{series.label} (raw)")
            ax.plot(steps, trailing_ema(values), color=color, linewidth=1.8, label=EMA_LABEL)
        else:
            ax.plot(steps, values, color=color, linewidth=1.4, marker="." if len(steps) < 30 else None,
                    label=series.label if key == series.keys[0] else f"{series.label} ({key})")
        drawn = True
    ax.set_title(panel.title, fontsize=10)
    if not drawn:
        note = panel_note(panel, rows)
        keys = sorted({k for series in panel.series for k in series.keys})
        _no_data(ax, note or "not logged in this run:\n" + "\n".join(keys))
        return False
    for threshold in panel.thresholds:
        value = _threshold_value(threshold, rows, config)
        ax.axhline(value, color="gray", linestyle=":", linewidth=1.2, label=f"{threshold.label} = {value:g}")
    if switch is not None:
        ax.axvline(switch, color="k", linestyle="--", linewidth=1, label=switch_label)
    if x_range is not None:  # every panel spans the whole run (Li2SAO's gate metrics stop at the switch)
        lo, hi = x_range
        ax.set_xlim(lo - 0.5, hi + 0.5) if lo == hi else ax.set_xlim(lo, hi)
    ax.set_xlabel("step (optimizer batches)")
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel, fontsize=8)
    _integer_steps(ax)
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    note = panel_note(panel, rows)
    if note:
        ax.text(0.02, 0.02, note, transform=ax.transAxes, fontsize=6.5, color="dimgray", va="bottom",
                bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"})
    return True


def panel_note(panel: Panel, rows: Sequence[Mapping]) -> Optional[str]:
    """A short note where a measured effect would mislead: explained variance (``1 - Var(G-V)/Var(G)``) of a
    run whose recent success is near 1 has almost no return variance to explain, so it falls toward 0 or
    below (or is not logged) whatever the critic knows."""
    if panel == MISMATCH:
        counts = [float(r["rollout/mismatch_tokens"]) for r in rows if _finite(r.get("rollout/mismatch_tokens"))]
        empty = sum(1 for c in counts if c <= 0)
        if counts and empty:
            return (f"{empty} of {len(counts)} steps had no token sampled at the trainer's version\n"
                    "(every token lagged): nothing to compare there, not drawn")
        return None
    if panel not in (CRITIC_EV, SAPO_EV):
        return None
    _, success = _series(rows, "train/success_rate")
    recent = success[-max(len(success) // 10, 1):]
    if recent and sum(recent) / len(recent) >= 0.95:
        return (f"late success ≈ {sum(recent) / len(recent):.2f}: returns barely vary,\n"
                "so explained variance near 0 says little about the critic")
    return None


def _switch_label(run_dir: Optional[Path], switch: Optional[int]) -> Optional[str]:
    if switch is None:
        return None
    forced = None
    if run_dir is not None:
        try:
            forced = json.loads((run_dir / "summary.json").read_text()).get("switch_forced")
        except (OSError, ValueError, AttributeError):
            forced = None
    return f"switch @ {switch}" + (" (forced at T_max)" if forced else " (gate opened)" if forced is False else "")


def build_run_figure(rows: Sequence[Mapping], algorithm: Optional[str] = None,
                     config: Optional[Mapping[str, Any]] = None,
                     pass_at_k: Optional[Mapping[str, list[float]]] = None, run_dir: Optional[Path] = None,
                     title: Optional[str] = None):
    """The ``training.png`` figure of one run (a matplotlib Figure; the caller saves and closes it).

    Args:
        rows: the run's metric rows (``metrics.jsonl`` lines or a driver's history).
        algorithm: named in the title and the run-facts cell; None = :func:`infer_algorithm`. The panels are
            those whose metrics the run logged (:func:`panels_for`), whatever the algorithm.
        config: the run's config (thresholds fall back to ``algorithm.gate.*``); None = ``{}``.
        pass_at_k: ``{"k", "pass"}`` of an evaluation: adds a bar panel.
        run_dir: where ``summary.json`` says whether the switch was forced (optional).
    """
    config = dict(config or {})
    algorithm = algorithm or infer_algorithm(rows, config)
    panels = panels_for(rows)
    n_panels = len(panels) + (pass_at_k is not None)
    cols = min(PANEL_COLUMNS, n_panels)
    nrows = math.ceil(n_panels / cols)
    plt = _pyplot()
    fig = plt.figure(figsize=(5.2 * cols, 3.9 * nrows), layout="constrained")
    grid = fig.add_gridspec(nrows, cols)
    flat = [fig.add_subplot(grid[i // cols, i % cols]) for i in range(n_panels)]
    switch = switch_step(rows)
    label = _switch_label(run_dir, switch)
    steps = [int(x) for x in (_step_of(row) for row in rows) if x is not None]
    x_range = (min(steps), max(steps)) if steps else None
    for ax, panel in zip(flat, panels):
        _draw_panel(ax, panel, rows, config, switch, label, x_range)
    if pass_at_k is not None:
        _pass_at_k_bars(flat[len(panels)], {"mean over sets": pass_at_k})
    if n_panels % cols:  # the rest of the last row: what the run was, in one cell (no empty cells)
        _run_facts_cell(fig.add_subplot(grid[nrows - 1, n_panels % cols:]), rows, algorithm, config, switch, label)
    fig.suptitle(title or f"{algorithm}", fontsize=11)
    return fig


RUN_FACTS_TITLE = "run"


def run_facts(rows: Sequence[Mapping], algorithm: str, config: Mapping[str, Any], switch: Optional[int],
              switch_label: Optional[str] = None) -> list[str]:
    """What the run was, for the figure's spare cell: algorithm, env, model, steps, seed, the batch and its
    learning rates, the scheduler, and (a run that logs a readiness gate: Li2SAO) where the switch happened. Keys the config lacks are left out."""
    def get(path: str):
        node: Any = config
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    steps = [int(x) for x in (_step_of(row) for row in rows) if x is not None]
    facts = [f"algorithm: {algorithm}"]
    if get("env.name"):
        facts.append(f"env: {get('env.name')}")
    model = get("model.packaged") or get("model.dir")
    if model:
        facts.append(f"model: {model}")
    facts.append(f"steps logged: {len(steps)}" + (f" (to step {max(steps)})" if steps else ""))
    if get("seed") is not None:
        facts.append(f"seed: {get('seed')}")
    batch = get("algorithm.train_batch_trajectories")
    if batch is not None:
        group = get("algorithm.group_size")
        facts.append(f"batch: {batch} trajectories" + (f", group size {group}" if group is not None else ""))
    rates = [f"{name} {get(f'algorithm.{key}'):g}" for name, key in (("actor", "actor_lr"), ("critic", "critic_lr"))
             if isinstance(get(f"algorithm.{key}"), (int, float))]
    if rates:
        facts.append("learning rates: " + ", ".join(rates))
    if get("trainer.scheduler"):
        facts.append(f"scheduler: {get('trainer.scheduler')}")
    if any("li2sao/gate_counter" in row for row in rows):  # a gated run (it logs its gate), whatever its name
        facts.append(switch_label or (f"switch @ {switch}" if switch is not None else "switch: not in this run"))
    return facts


def _run_facts_cell(ax, rows, algorithm, config, switch, switch_label) -> None:
    ax.text(0.02, 0.98, "\n".join(run_facts(rows, algorithm, config, switch, switch_label)), ha="left", va="top",
            transform=ax.transAxes, fontsize=8, family="monospace")
    ax.set_title(RUN_FACTS_TITLE, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def plot_run(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/training.png``: the panels of what the run logged (:func:`build_run_figure`), plus
    pass@k when the run directory or its ``eval/`` holds ``pass_at_k.json``."""
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    config = load_run_config(run_dir)
    algorithm = infer_algorithm(rows, config)
    env = ((config.get("env") or {}).get("name") if isinstance(config.get("env"), Mapping) else None)
    title = f"{run_dir.name}: {algorithm}" + (f" on {env}" if env else "") + f", {len(rows)} steps"
    fig = build_run_figure(rows, algorithm, config, load_pass_at_k(run_dir), run_dir, title=title)
    out = run_dir / "training.png"
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


# ---------------------------------------------------------------------------------------------- eval
def build_eval_figure(report: Mapping[str, Any]):
    """The ``eval.png`` figure of an evaluation report (``pass_at_k.json`` content): pass@k against k for
    every set (one line per AIME year, the mean over sets dashed) and, when the sets carry them, success
    per category (ALFWorld) or success and mean score (WebShop, agent envs without categories)."""
    sets: Mapping[str, Mapping[str, Any]] = report.get("sets") or {}
    if not sets:
        raise ValueError("the eval report has no sets")
    categories = any("success_by_category" in r for r in sets.values())
    agent = categories or str(report.get("env")) in ("alfworld", "webshop")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if agent else 1, figsize=(11 if agent else 6, 4.2), squeeze=False,
                             layout="constrained")
    ax = axes[0][0]
    years = any(r.get("year") is not None for r in sets.values())
    all_ks = sorted({int(k) for r in sets.values() for k in r.get("k", [])})
    for i, (name, result) in enumerate(sets.items()):
        label = name + (f" ({result['year']})" if result.get("year") is not None and str(result["year"]) not in name
                        else "")
        ax.plot(result["k"], result["pass"], marker="o", color=f"C{i % 10}", label=label)
    mean = report.get("mean") or {}
    if len(sets) > 1 and mean.get("k"):
        ax.plot(mean["k"], mean["pass"], color="k", linestyle="--", marker="s", label="mean over sets")
    if len(all_ks) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(all_ks, [str(k) for k in all_ks])
    ax.set_xlabel("k (samples per problem drawn)")
    ax.set_ylabel("pass@k")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("pass@k per AIME year" if years else "pass@k per set", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    if agent:
        ax = axes[0][1]
        if categories:
            names = sorted({c for r in sets.values() for c in r.get("success_by_category", {}) if c != "All"}) + ["All"]
            width = 0.8 / len(sets)
            for i, (name, result) in enumerate(sets.items()):
                values = [result.get("success_by_category", {}).get(c, float("nan")) for c in names]
                pos = [j + (i - (len(sets) - 1) / 2) * width for j in range(len(names))]
                bars = ax.bar(pos, values, width=width, color=f"C{i % 10}", label=name)
                for bar, value in zip(bars, values):
                    if _finite(value):
                        ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, value), ha="center",
                                    va="bottom", fontsize=6)
            ax.set_xticks(range(len(names)), names)
            ax.set_title("success per ALFWorld category", fontsize=10)
        else:
            names = list(sets)
            pos = np.arange(len(names))
            success = [float(sets[n].get("success_rate", float("nan"))) for n in names]
            score = [float(sets[n].get("score_mean", float("nan"))) for n in names]
            ax.bar(pos - 0.2, success, width=0.4, label="success rate")
            ax.bar(pos + 0.2, score, width=0.4, label="mean score")
            ax.set_xticks(pos, names)
            ax.set_title("success and score", fontsize=10)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("fraction")
        ax.legend(fontsize=7, loc="upper right")
    model = report.get("model_dir")
    fig.suptitle(f"{report.get('env', '')}: n = {report.get('n_samples', '?')} samples per problem"
                 + (f" ({Path(str(model)).parent.name or model})" if model else ""), fontsize=10)
    return fig


def plot_eval(report: Mapping[str, Any], out_path: str | Path) -> Path:
    """Write :func:`build_eval_figure` of ``report`` to ``out_path`` (``async_rl.eval`` writes eval.png)."""
    fig = build_eval_figure(report)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def plot_comparison(
    runs: Mapping[str, Sequence[Mapping]],
    out_path: str | Path,
    pass_at_k: Optional[Mapping[str, Mapping[str, list[float]]]] = None,
    x: str = "step",
    title: Optional[str] = None,
) -> Path:
    """Comparison figure of several runs (``label -> metric rows``), written to ``out_path``.

    Args:
        runs: per run, its rows (``metrics.jsonl`` lines or a driver's history; the x value is ``step`` or
            ``trainer/step``).
        out_path: PNG to write.
        pass_at_k: optional ``label -> {"k": [...], "pass": [...]}``; drawn as grouped bars in the last panel.
        x: ``"step"`` (trainer steps) or ``"clock"`` (simulated clock ticks, ``async/clock_ticks``).
        title: optional figure title.
    """
    if x not in X_KEYS:
        raise ValueError(f"x must be one of {sorted(X_KEYS)}, got {x!r}")
    if not runs:
        raise ValueError("plot_comparison needs at least one run")
    x_key = X_KEYS[x]
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), layout="constrained")
    flat = list(axes.flat)
    for ax, (keys, panel_title, ylabel) in zip(flat, COMPARISON_PANELS):
        drawn = False
        for i, (label, rows) in enumerate(runs.items()):
            color = f"C{i % 10}"
            key = next((k for k in keys if _series(rows, k, x_key)[0]), keys[0])
            xs, vals = _series(rows, key, x_key)
            if xs:
                ax.plot(xs, vals, color=color, alpha=0.3, linewidth=0.6, marker=".", markersize=2.5)
                ax.plot(xs, trailing_ema(vals), color=color, linewidth=1.8, label=label)
                drawn = True
            sw = _switch_x(rows, x_key)
            if sw is not None:
                ax.axvline(sw, color=color, linestyle="--", linewidth=1,
                           label=f"{label}: switch @ {switch_step(rows)}")
        ax.set_title(f"{panel_title} (dots raw; line: trailing EMA, span {EMA_SPAN})", fontsize=9)
        if not drawn:
            for line in list(ax.lines):  # a switch line alone would cross the message
                line.remove()
            _no_data(ax, "not logged in these runs:\n" + "\n".join(keys))
            continue
        ax.set_xlabel("step" if x == "step" else "simulated clock ticks")
        ax.set_ylabel(ylabel, fontsize=8)
        if x == "step":
            _integer_steps(ax)
        ax.legend(fontsize=7, loc="best", framealpha=0.8)
    last = flat[len(COMPARISON_PANELS)]
    passk = {k: v for k, v in (pass_at_k or {}).items() if v is not None}
    if passk:
        _pass_at_k_bars(last, passk, colors={label: f"C{i % 10}" for i, label in enumerate(runs)})
    else:
        last.set_title(PASS_AT_K_TITLE, fontsize=10)
        _no_data(last, "no pass_at_k.json in these runs")
    if title:
        fig.suptitle(title)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Run directory names, made unique with their parent's name when two runs share a name."""
    names = [p.name for p in run_dirs]
    out = []
    for p, name in zip(run_dirs, names):
        label = name if names.count(name) == 1 else f"{p.parent.name}/{name}"
        while label in out:
            label += "'"
        out.append(label)
    return out


def compare_runs(run_dirs: Sequence[str | Path], out_path: Optional[str | Path] = None, x: str = "step") -> Path:
    """Comparison figure of run directories; written to ``<first run>/comparison.png`` by default."""
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("compare_runs needs at least one run directory")
    labels = _labels(dirs)
    runs = {label: load_metrics(d) for label, d in zip(labels, dirs)}
    passk = {label: load_pass_at_k(d) for label, d in zip(labels, dirs)}
    return plot_comparison(runs, out_path or dirs[0] / "comparison.png", pass_at_k=passk, x=x)


def last_run_dir(output_root: str | Path = "outputs") -> Path:
    """The run directory ``<output_root>/last_run.json`` names (written at the end of every training run)."""
    from async_rl.models.export import read_last_run

    record = read_last_run(output_root)
    if record is None:
        raise FileNotFoundError(f"no run given and {Path(output_root) / 'last_run.json'} does not exist: pass a run "
                                "directory (make plots RUN=outputs/<run>) or train one first")
    run_dir = Path(record["run_dir"])
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{Path(output_root) / 'last_run.json'} names {run_dir}, which has no metrics.jsonl "
                                "any more: pass a run directory (make plots RUN=outputs/<run>)")
    return run_dir


@dataclass
class PlotOptions:
    """``python -m async_rl.plots`` options, each a setting (type, default, choices, meaning)."""

    runs: list[str] = setting([], "run directories (outputs/<run_name>); none = the last run")
    x: str = setting("step", "x axis of the comparison figure: trainer steps or simulated clock ticks",
                     choices=tuple(sorted(X_KEYS)))
    outputs: str = setting("outputs", "training output root holding last_run.json", non_empty=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_settings_arguments(parser, PlotOptions, positional=("runs",))
    args = settings_from_arguments(PlotOptions, parser.parse_args(argv))
    runs = list(args.runs)
    if not runs:
        try:
            runs = [str(last_run_dir(args.outputs))]
        except (FileNotFoundError, ValueError) as exc:
            parser.exit(2, f"error: {exc}\n")
        print(f"no run given: plotting the last run, {runs[0]} (from {Path(args.outputs) / 'last_run.json'})")
    for run in runs:
        print(plot_run(run))
    if len(runs) > 1:
        print(compare_runs(runs, x=args.x))


if __name__ == "__main__":
    main()

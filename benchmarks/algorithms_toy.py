"""GRPO, LiSAO, Li2SAO, SAPO and PPO on toy_keys, 5 seeds each: the papers' phenomena, measured.

Every algorithm trains the same SFT-warm-started tiny model (``_training.warm_model``) with the asynchronous
deterministic driver (B = 32 trajectories per step, in-flight capacity B, staleness cap 4, actor lr 3e-4 and
critic lr 1e-3 as in ``make demo``): GRPO n = 4 (Eq. 1, ``ppo_clip``); LiSAO n = 1 with 3 critic warm-up
steps and DIS; Li2SAO bootstraps with n = 4 and switches to n = 1 when its readiness gate opens; SAPO n = 1
(one backbone); PPO n = 1 with a separate critic (attention trained, fixed λ = 0.95). Seeds change the
prompt order, the sampling and the critic's value-head initialisation; the SFT model is the same for all.

Li2SAO's gate keeps the paper's thresholds (β 0.9, η_e 0.2, η_a 0.65) with T_min, M and T_max scaled to the
run length (``gate_for``: 60 / 10 / 150 of the paper's 500 steps would leave no room in a CPU-sized run).

What it measures, per algorithm (mean, 95 % t-interval over seeds, and every seed):

* training accuracy curves (``train/success_rate`` per step) with the band of the seed mean's 95 % interval;
* final accuracy (mean of the last ``steps/8`` steps) and the worst seed;
* the cold-critic gap: accuracy over the first quarter of the run minus GRPO's, and the critic's explained
  variance (over model tokens) on the first steps;
* Li2SAO: the switch step per seed and whether the gate opened on evidence (``forced`` false) or at T_max,
  and the gate's EMAs at the switch;
* policy lag: mean over the steps after Li2SAO's switch, for every algorithm over the *same* steps, so the
  comparison with GRPO is at the same trajectory budget (B per step).

Run: ``.venv/bin/python benchmarks/algorithms_toy.py [--quick] [--steps N] [--seeds S] [--algorithms a,b]``;
writes benchmarks/results/algorithms_toy.{json,png} (``--quick``: algorithms_toy_quick.{json,png}, 1 seed, 24
steps). The default (40 steps, 5 seeds, 25 runs) took 24 min on the shared 2-core box (load average 20 falling
to 4; one run took 13-30 s once the load was down to about 4). The JSON is rewritten after every run, so a
benchmark interrupted part way keeps what finished (``"complete": false``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import _common as C
import _training as T

B = 32
# the demo's learning rates (conf/demo.yaml): at actor lr 1e-3 the policy leaves 0.9 within ~10 steps and the
# mixed groups every critic-readiness statistic needs run out before a scaled T_min
ACTOR_LR = 3e-4
CRITIC_LR = 1e-3
ALGORITHMS = ("grpo", "lisao", "li2sao", "sapo", "ppo")
# two-sided 95 % Student-t quantiles by degrees of freedom (n - 1); larger samples use the normal 1.96
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def gate_for(steps: int):
    """Li2SAO's gate for a run of ``steps``: T_min = steps/4, M = 5 (3 under 24 steps), T_max = steps/2 + M."""
    from async_rl.config import GateConfig

    patience = 5 if steps >= 24 else 3
    t_min = max(1, round(steps / 4))
    return GateConfig(t_min=t_min, patience=patience, t_max=max(t_min + patience, round(steps / 2) + patience))


def algo_overrides(name: str, steps: int) -> dict:
    lrs = {"actor_lr": ACTOR_LR, "critic_lr": CRITIC_LR}
    if name == "li2sao":
        return {**lrs, "gate": gate_for(steps)}
    if name == "ppo":
        return {**lrs, "gae_lambda": 0.95, "critic_updates_per_batch": 1, "freeze_critic_attention": False}
    return lrs


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the two-sided 95 % t-interval); half-width 0 for one value, nan for none."""
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan"), float("nan")
    if len(vals) == 1:
        return vals[0], 0.0
    t = T95.get(len(vals) - 1, 1.96)
    return statistics.fmean(vals), t * statistics.stdev(vals) / math.sqrt(len(vals))


def window_mean(values: list[float], start: int, stop: int) -> float:
    part = [v for v in values[start:stop] if v == v]
    return sum(part) / len(part) if part else float("nan")


def gate_record(run: T.RunResult) -> dict:
    """Li2SAO: step of the switch, whether T_max forced it, and the gate's EMAs on that step."""
    row = next((m for m in run.history if m.get("li2sao/gate_opened")), None)
    if row is None:
        return {"switch_step": None, "switch_forced": None}
    patience = run.extra["algorithm"]["gate"]["patience"]
    return {"switch_step": run.switch_step,
            "switch_forced": bool(row.get("li2sao/gate_counter", 0) < patience),
            "ema_explained_var_at_switch": row.get("li2sao/ema_explained_var"),
            "ema_rank_acc_at_switch": row.get("li2sao/ema_rank_acc"),
            "first_step_ema_e_above_eta": next((i + 1 for i, m in enumerate(run.history)
                                                if m.get("li2sao/ema_explained_var", 0.0) > m.get("li2sao/eta_e", 1)),
                                               None)}


def seed_record(run: T.RunResult, steps: int) -> dict:
    acc = run.series("train/success_rate")
    tail = max(2, round(steps / 8))
    quarter = max(1, round(steps / 4))
    record = {
        "seed": run.extra["seed"],
        "final_accuracy": window_mean(acc, len(acc) - tail, len(acc)),
        "first_quarter_accuracy": window_mean(acc, 0, quarter),
        "critic_ev_tokens_first_steps": [m.get("critic/ev_tokens") for m in run.history[:quarter]],
        "mean_policy_lag": run.mean("async/policy_lag/mean"),
        "off_policy_token_ratio": run.mean("async/off_policy_token_ratio"),
        "sim_clock_ticks": run.clock_ticks,
        "dropped_stale": run.dropped_stale,
        "wall_s": run.wall_s,
        "curve": acc,
        "policy_lag_curve": run.series("async/policy_lag/mean"),
    }
    if run.extra["algorithm"]["name"] == "li2sao":
        record.update(gate_record(run))
        record["discarded_at_switch"] = run.discarded_at_switch
        record["ema_explained_var_curve"] = [m.get("li2sao/ema_explained_var") for m in run.history]
        record["explained_var_residual_curve"] = [m.get("li2sao/explained_var_residual") for m in run.history]
    return record


def summarise(per_algo: dict[str, list[dict]], steps: int) -> dict:
    grpo = per_algo.get("grpo", [])
    grpo_final = mean_ci([r["final_accuracy"] for r in grpo])[0]
    grpo_early = mean_ci([r["first_quarter_accuracy"] for r in grpo])[0]
    switches = [r["switch_step"] for r in per_algo.get("li2sao", []) if r.get("switch_step")]
    # the lag comparison window: from the latest Li2SAO switch to the end, the same steps for every algorithm
    lag_from = max(switches) if switches else None
    out = {}
    for name, records in per_algo.items():
        final_m, final_ci = mean_ci([r["final_accuracy"] for r in records])
        early_m, early_ci = mean_ci([r["first_quarter_accuracy"] for r in records])
        summary = {
            "seeds": len(records),
            "final_accuracy_mean": final_m, "final_accuracy_ci95": final_ci,
            "final_accuracy_worst_seed": min((r["final_accuracy"] for r in records), default=float("nan")),
            "first_quarter_accuracy_mean": early_m, "first_quarter_accuracy_ci95": early_ci,
            "early_gap_vs_grpo": early_m - grpo_early if grpo else None,
            "mean_policy_lag": mean_ci([r["mean_policy_lag"] for r in records])[0],
            "sim_clock_ticks_mean": mean_ci([r["sim_clock_ticks"] for r in records])[0],
        }
        if grpo:
            summary["worst_seed_minus_grpo_mean"] = summary["final_accuracy_worst_seed"] - grpo_final
        if lag_from is not None:
            lags = [window_mean(r["policy_lag_curve"], lag_from, len(r["policy_lag_curve"])) for r in records]
            summary["policy_lag_after_switch"], summary["policy_lag_after_switch_ci95"] = mean_ci(lags)
            summary["policy_lag_window_from_step"] = lag_from + 1
        if name == "li2sao":
            summary["switch_steps"] = [r["switch_step"] for r in records]
            summary["switch_forced"] = [r["switch_forced"] for r in records]
            summary["gate_opened_on_evidence_every_seed"] = all(r["switch_forced"] is False for r in records)
        out[name] = summary
    return out


def plot(per_algo: dict[str, list[dict]], path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    for i, (name, records) in enumerate(per_algo.items()):
        color = f"C{i}"
        curves = np.array([r["curve"] for r in records if len(r["curve"]) == steps], dtype=float)
        if curves.size == 0:
            continue
        x = np.arange(1, steps + 1)
        mean = curves.mean(axis=0)
        n = curves.shape[0]
        half = (T95.get(n - 1, 1.96) * curves.std(axis=0, ddof=1) / np.sqrt(n)) if n > 1 else np.zeros(steps)
        axes[0].plot(x, mean, color=color, linewidth=2, label=f"{name} ({n} seeds)")
        axes[0].fill_between(x, np.clip(mean - half, 0, 1), np.clip(mean + half, 0, 1), color=color, alpha=0.15)
        lags = np.array([r["policy_lag_curve"] for r in records if len(r["policy_lag_curve"]) == steps], dtype=float)
        if lags.size:
            axes[2].plot(x, lags.mean(axis=0), color=color, linewidth=1.5, label=name)
        if name == "li2sao":
            for j, r in enumerate(records):
                if r.get("switch_step"):
                    style = ":" if r["switch_forced"] else "--"
                    for ax in (axes[0], axes[2]):
                        ax.axvline(r["switch_step"], color=color, linestyle=style, linewidth=0.8,
                                   label=("li2sao switch (-- evidence, : forced)" if j == 0 and ax is axes[0]
                                          else None))
                ema = [v if v is not None else np.nan for v in r["ema_explained_var_curve"]]
                axes[1].plot(np.arange(1, len(ema) + 1), ema, color=color, alpha=0.8, linewidth=1,
                             label="li2sao EMA e_k (one line per seed)" if j == 0 else None)
            gate = gate_for(steps)
            axes[1].axhline(gate.eta_e, color="black", linestyle="--", linewidth=0.8, label=f"η_e = {gate.eta_e}")
            axes[1].axvline(gate.t_min, color="gray", linewidth=0.8, label=f"T_min = {gate.t_min}")
    axes[0].set_title("training accuracy (mean over seeds, band = 95 % t-interval)")
    axes[0].set_ylabel("success rate")
    axes[1].set_title("Li2SAO readiness: EMA of e_k (terminal residual EV)")
    axes[2].set_title("mean policy lag per step (mean over seeds)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(f"toy_keys, B={B}, async in-flight, {steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 24 steps")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 40; quick 24)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 5; quick 1)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset")
    args = parser.parse_args(argv)
    steps = args.steps or (24 if args.quick else 40)
    seeds = list(range(args.seeds or (1 if args.quick else 5)))
    names = [n.strip() for n in args.algorithms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown or not names:
        raise SystemExit(f"--algorithms: unknown {unknown}; choose from {', '.join(ALGORITHMS)}")
    if steps < 8:
        raise SystemExit(f"--steps {steps}: need at least 8 so that the gate and the accuracy windows fit")
    C.set_threads()
    C.quiet_libraries()
    machine = C.machine_info()
    model = T.warm_model()
    started = time.perf_counter()
    stem = C.result_stem("algorithms_toy", args.quick)
    setup = {"batch_trajectories": B, "steps": steps, "seeds": seeds, "staleness_cap": 4,
             "max_inflight_trajectories": B, "actor_lr": ACTOR_LR, "critic_lr": CRITIC_LR,
             "presets": {n: {k: (vars(v) if hasattr(v, "__dataclass_fields__") else v)
                             for k, v in {**T.ALGO_PRESETS.get(n, {}), **algo_overrides(n, steps)}.items()}
                         for n in names},
             "final_accuracy_window_steps": max(2, round(steps / 8)),
             "first_quarter_steps": max(1, round(steps / 4)),
             "model": T.MODEL_DESCRIPTION}

    per_algo: dict[str, list[dict]] = {}
    bar = C.progress(steps * len(names) * len(seeds), "algorithms_toy")
    results: dict = {}
    for seed in seeds:  # seed-major: an interrupted run still has every algorithm on the first seeds
        for name in names:
            run = T.run_algorithm(name, model, label=f"{name} s{seed}", steps=steps, batch=B, seed=seed,
                                  algo_overrides=algo_overrides(name, steps), on_step=lambda m: bar.update(1))
            record = seed_record(run, steps)
            per_algo.setdefault(name, []).append(record)
            gate = (f", switch {record['switch_step']} ({'forced' if record['switch_forced'] else 'evidence'})"
                    if name == "li2sao" else "")
            print(f"  {name} seed {seed}: first quarter {record['first_quarter_accuracy']:.2f}, final "
                  f"{record['final_accuracy']:.2f}, lag {record['mean_policy_lag']:.2f}{gate}, {run.wall_s:.0f} s",
                  flush=True)
            results = {
                "benchmark": "algorithms_toy",
                "description": "GRPO / LiSAO / Li2SAO / SAPO / PPO on toy_keys, B=32, async in-flight",
                "quick": args.quick, "complete": False, "setup": setup,
                "summary": summarise(per_algo, steps), "algorithms": per_algo,
                "total_benchmark_wall_s": time.perf_counter() - started, "machine": machine,
            }
            C.save_json(stem, results)
    bar.close()
    results["complete"] = True
    json_path = C.save_json(stem, results)
    png = C.RESULTS / f"{stem}.png"
    plot(per_algo, png, steps)

    summary = results["summary"]
    print(f"\ntoy_keys, B={B}, {steps} steps, seeds {seeds}; mean ± 95 % t-interval over seeds")
    rows = []
    for name in names:
        s = summary[name]
        rows.append([name, f"{s['first_quarter_accuracy_mean']:.3f} ± {s['first_quarter_accuracy_ci95']:.3f}",
                     f"{s['final_accuracy_mean']:.3f} ± {s['final_accuracy_ci95']:.3f}",
                     s["final_accuracy_worst_seed"], s["mean_policy_lag"],
                     s.get("policy_lag_after_switch", float("nan")),
                     str(list(zip(s["switch_steps"], ["forced" if f else "evidence" for f in s["switch_forced"]])))
                     if name == "li2sao" else "-"])
    C.print_table(rows, ["algorithm", "acc first 1/4", "final acc", "worst seed", "mean lag", "lag after switch",
                         "li2sao switch"])
    print(f"\nwrote {json_path} and {png}")
    return results


if __name__ == "__main__":
    main()

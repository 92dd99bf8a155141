"""Group rollout (GRPO, n = 4) vs single rollout (LiSAO, n = 1) at the same trajectory budget, asynchronous.

Both train B = 32 trajectories per step for the same number of steps on toy_keys with the same asynchronous
in-flight driver (staleness cap k = 4, chunk 8 tokens); only the group size differs
(the paper's App. G.4-G.5 on a small scale). With n = 4 a finished trajectory waits in the buffer until the
slowest of its 3 siblings finishes (the group barrier), and a whole group is dropped when any member holds a
token older than k versions. With n = 1 every trajectory is released the moment it finishes.

Reported per run: simulated step time (clock ticks per step; 1 tick = one 8-token generation chunk for every
live request, 1 update = ``update_ticks`` ticks), mean policy lag, off-policy token ratio (lag > 1), trajectories dropped for
staleness, trainer idle fraction, and real wall time (one process, labelled as such). Run in two regimes of
the simulated clock -- trainer-bound (``update_ticks`` = 4: one update takes longer than generating a batch,
so batches queue and age in the buffer) and rollout-bound (``update_ticks`` = 1: the trainer waits for data,
which is where the group barrier can cost time) -- at in-flight capacity B and 2 B. LiSAO runs without
critic warm-up here (``critic_warmup_steps=0``), so both update the actor at every step and their policy
versions advance at the same rate.

Run: ``.venv/bin/python benchmarks/group_vs_single.py [--quick]``; writes
benchmarks/results/group_vs_single.{json,png} (``--quick``: group_vs_single_quick.{json,png}).

``--long-tail``: the papers' regime. toy_keys' long-tailed variant (every episode first thinks for a forced,
lognormally drawn number of tokens: median 24, sigma 1, so p99 = 10x the median; each group member draws its
own), GRPO with a group of 8 against LiSAO n = 1 at the same trajectory budget (B = 32), rollout-bound
(``update_ticks`` = 1), on the simulated clock (deterministic scheduler) and on the concurrent scheduler (real
threads, real time), at in-flight capacity B; the simulated clock also at 2 B (not with ``--quick``). Each run is
measured by ``lag_probe.py`` (its lag split into generation, group wait, batch wait and update in flight; slot
occupancy; the simulated step time's factors). Writes results/group_vs_single_longtail.json with
``single_over_group`` (mean lag and step time, simulated clock, in-flight B), the same on the concurrent
scheduler and at 2 B, ``limits*`` (the probe's numbers, single beside group), per-arm numbers, per-arm
response lengths (the forced part is drawn from the same distribution in both arms; the rest is the policy's)
and the distribution.
"""

from __future__ import annotations

import argparse
import time

import _common as C
import _training as T
import lag_probe

B = 32
# both arms' actor lr: inside the stability map's safe region (docs/algorithms.md, Stability). At _common's 1e-3,
# LiSAO's DIS collapsed in 3 of the 4 grid runs of commit dc61639 (results/group_vs_single_lr0.001.json), and a
# collapsed arm's responses (57-63 model tokens against 13) would be read as a scheduling effect
ACTOR_LR = 3e-4
ARMS = [
    ("GRPO n=4", "grpo", {"group_size": 4}),
    ("LiSAO n=1", "lisao", {"group_size": 1, "critic_warmup_steps": 0}),
]


def summarize(run: T.RunResult, inflight: int, update_ticks: int) -> dict:
    n = max(len(run.history), 1)
    acc = run.series("train/success_rate")
    return {
        "label": run.label,
        "update_ticks": update_ticks,
        "max_inflight_trajectories": inflight,
        "steps": len(run.history),
        "trajectories_trained": int(sum(run.series("train/batch_trajectories"))),
        "trajectories_generated": run.trajectories_finished,
        "sim_clock_ticks": run.clock_ticks,
        "sim_ticks_per_step": run.clock_ticks / n if run.clock_ticks is not None else None,  # concurrent: none
        # of simulated ticks (deterministic runs; None on the concurrent scheduler), and of real time
        "sim_trainer_idle_frac": run.history[-1].get("sim/trainer_idle_frac"),
        "trainer_idle_frac": run.history[-1].get("perf/trainer_idle_frac"),
        "mean_policy_lag": run.mean("async/policy_lag/mean"),
        "max_policy_lag": max(run.series("async/policy_lag/max") or [0.0]),
        "off_policy_token_ratio": run.mean("async/off_policy_token_ratio"),
        "dropped_stale": run.dropped_stale,
        "dropped_stale_frac_of_generated": run.dropped_stale / max(run.trajectories_finished, 1),
        "mean_buffer_ready": run.mean("async/buffer_ready"),
        "response_length_mean": run.mean("train/response_length/mean"),
        "wall_s": run.wall_s,
        "accuracy_final_20pct": C.window_mean(acc, 1.0, 0.2),
    }


def plot(rows: list[dict], runs: dict[str, T.RunResult], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 5))
    for ax, ut in ((axes[0], 4), (axes[1], 1)):
        for label, run in runs.items():
            if f"update_ticks={ut}" not in label:
                continue
            style = "--" if "2B" in label else "-"
            color = f"C{0 if 'GRPO' in label else 1}"
            ax.plot(range(1, len(run.history) + 1), run.series("async/policy_lag/mean"), style, color=color,
                    label=label.rsplit(", update_ticks", 1)[0])
        regime = "trainer-bound" if ut > 1 else "rollout-bound"
        ax.set_title(f"mean policy lag per batch, update_ticks={ut} ({regime})")
        ax.set_xlabel("step")
        ax.set_ylabel("versions")
        ax.legend(fontsize=7)
    labels = [f"{r['label'].split(' ')[0]}\n{'B' if r['max_inflight_trajectories'] == B else '2B'}, "
              f"ut={r['update_ticks']}" for r in rows]
    colors = [f"C{0 if 'GRPO' in r['label'] else 1}" for r in rows]
    for ax, key, title in ((axes[2], "sim_ticks_per_step", "simulated step time (ticks / step)"),
                           (axes[3], "dropped_stale", "trajectories dropped for staleness")):
        bars = ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        for bar, r in zip(bars, rows):
            ax.annotate(C.fmt(r[key], 2), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_xlabel("arm / in-flight capacity / update_ticks")
        ax.set_title(title)
    fig.suptitle(f"group (GRPO n=4, blue) vs single rollout (LiSAO n=1, orange), B={B}, same trajectory budget, "
                 "async in-flight")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def length_distribution(spec: dict, draws: int = 20000) -> dict:
    """Quantiles of the forced thinking-turn length, drawn as the episodes draw it."""
    from async_rl.driver.episode import forced_turn_tokens

    values = sorted(forced_turn_tokens(spec, f"p{i}/r0") for i in range(draws))
    q = {f"p{p}": values[min(draws - 1, int(p / 100 * draws))] for p in (10, 50, 90, 99)}
    return {"spec": spec, "draws": draws, "mean": sum(values) / draws, **q, "p99_over_median": q["p99"] / q["p50"]}


def main_long_tail(args) -> dict:
    from async_rl.envs.toy import LONG_TAIL_DEFAULT

    steps = args.steps or (12 if args.quick else 24)
    arms = [("GRPO n=8", "grpo", {"group_size": 8}),
            ("LiSAO n=1", "lisao", {"group_size": 1, "critic_warmup_steps": 0})]
    machine = C.machine_info()
    model = T.warm_model()
    rows, started = [], time.perf_counter()
    # in-flight capacity B is the headline; 2 B (simulated clock) shows the buffer holding up a group's launch
    cells = [("deterministic", B), ("concurrent", B)] + ([] if args.quick else [("deterministic", 2 * B)])
    for scheduler, inflight in cells:
        for arm, algo, overrides in arms:
            label = f"{arm}, {scheduler}" + ("" if inflight == B else ", in-flight 2B")
            with lag_probe.probe() as measured:
                run = T.run_algorithm(algo, model, label=label, steps=steps, batch=B, seed=args.seed,
                                      algo_overrides={**overrides, "actor_lr": args.actor_lr}, scheduler=scheduler,
                                      long_tail=LONG_TAIL_DEFAULT,
                                      driver_overrides={"synchronous": False, "max_inflight_trajectories": inflight,
                                                        "update_ticks": 1})
            row = summarize(run, inflight, 1)
            row["probe"] = measured.summary(inflight, len(run.history), run.clock_ticks, run.generated_tokens)
            if abs(row["probe"]["mean_policy_lag"] - row["mean_policy_lag"]) > 1e-6:
                raise AssertionError(f"{label}: the probe's lag {row['probe']['mean_policy_lag']} is not the "
                                     f"run's {row['mean_policy_lag']}")
            row["scheduler"] = scheduler
            row["response_length_max_mean"] = run.mean("train/response_length/max")
            row["wall_s_per_step"] = run.wall_s / max(len(run.history), 1)
            rows.append(row)
            print(f"  done {label}: {run.clock_ticks} ticks, {run.wall_s:.1f} s wall, lag "
                  f"{row['mean_policy_lag']:.2f}, resp len {row['response_length_mean']:.1f}", flush=True)

    def pick(scheduler: str, inflight: int, arm: str) -> dict:
        return next(r for r in rows if r["scheduler"] == scheduler and r["max_inflight_trajectories"] == inflight
                    and r["label"].startswith(arm))

    def ratios(scheduler: str, time_key: str, inflight: int = B) -> dict:
        g, s = pick(scheduler, inflight, "GRPO"), pick(scheduler, inflight, "LiSAO")
        return {"mean_lag": s["mean_policy_lag"] / max(g["mean_policy_lag"], 1e-9),
                "step_time": s[time_key] / g[time_key],
                "response_length": s["response_length_mean"] / g["response_length_mean"],
                "step_time_key": time_key}

    def limits(scheduler: str, inflight: int = B) -> dict:
        """What each arm's lag and step time are made of (lag_probe.py), single beside group."""
        g, s = (pick(scheduler, inflight, arm)["probe"] for arm in ("GRPO", "LiSAO"))
        out = {"lag_components": {k: {"single": s["lag_components"][k], "group": g["lag_components"][k]}
                                  for k in lag_probe.COMPONENTS},
               "slot_occupancy": {"single": s["slots"]["slot_occupancy"], "group": g["slots"]["slot_occupancy"]}}
        if "step_time" in s:  # single over group of each factor: their product is the step-time ratio
            factors = {k: s["step_time"][k] / g["step_time"][k] for k in s["step_time"]}
            out["step_time_factors_single_over_group"] = factors
        return out

    results = {
        "benchmark": "group_vs_single --long-tail",
        "quick": args.quick,
        "setup": {"batch_trajectories": B, "steps": steps, "seed": args.seed, "staleness_cap": 4, "chunk_tokens": 8,
                  "update_ticks": 1, "max_inflight_trajectories": sorted({c for _, c in cells}),
                  "env": "toy_keys, long-tailed variant",
                  "lisao_critic_warmup_steps": 0, "actor_lr": args.actor_lr, "model": T.MODEL_DESCRIPTION},
        "length_distribution": length_distribution({**LONG_TAIL_DEFAULT, "seed": args.seed}),
        "single_over_group": ratios("deterministic", "sim_ticks_per_step"),
        "single_over_group_concurrent": ratios("concurrent", "wall_s_per_step"),
        "limits": limits("deterministic"),
        "limits_concurrent": limits("concurrent"),
        **({} if args.quick else {"single_over_group_inflight_2B": ratios("deterministic", "sim_ticks_per_step", 2 * B),
                                  "limits_inflight_2B": limits("deterministic", 2 * B)}),
        "goal": {"mean_lag": 0.5, "step_time": 0.7},
        "runs": rows,
        "total_benchmark_wall_s": time.perf_counter() - started,
        "machine": machine,
    }
    path = C.save_json(C.result_stem("group_vs_single_longtail" + _lr_suffix(args), args.quick), results)
    C.print_table([[r["label"], r["sim_ticks_per_step"] if r["sim_clock_ticks"] else "-", r["wall_s_per_step"],
                    r["mean_policy_lag"], r["dropped_stale"], r["response_length_mean"], r["accuracy_final_20pct"]]
                   for r in rows], ["run", "ticks/step", "wall s/step", "mean lag", "dropped", "resp len", "final acc"])
    d = results["length_distribution"]
    print(f"forced lengths: median {d['p50']}, p90 {d['p90']}, p99 {d['p99']} ({d['p99_over_median']:.1f}x median)")
    for key in ("single_over_group", "single_over_group_concurrent", "single_over_group_inflight_2B"):
        if key not in results:
            continue
        r = results[key]
        print(f"{key}: mean lag {r['mean_lag']:.2f}x, step time {r['step_time']:.2f}x "
              f"(goal 0.5x / 0.7x), response length {r['response_length']:.2f}x")
    for key in ("limits", "limits_concurrent", "limits_inflight_2B"):
        if key not in results:
            continue
        parts = ", ".join(f"{k} {v['single']:.2f} / {v['group']:.2f}"
                          for k, v in results[key]["lag_components"].items())
        occupancy = results[key]["slot_occupancy"]
        print(f"{key}: lag components single / group: {parts}; slot occupancy {occupancy['single']:.2f} / "
              f"{occupancy['group']:.2f}")
    factors = results["limits"]["step_time_factors_single_over_group"]
    print("step time, single over group = tokens per step / tokens per busy tick / busy fraction: "
          + ", ".join(f"{k} {v:.3f}" for k, v in factors.items()))
    print(f"wrote {path}")
    return results


def _lr_suffix(args) -> str:
    """Results of a non-default actor lr get their own files (e.g. group_vs_single_lr0.001.json)."""
    return "" if args.actor_lr == ACTOR_LR else f"_lr{args.actor_lr:g}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, in-flight B only (~1 min)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 36; quick 12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--actor-lr", type=float, default=ACTOR_LR,
                        help=f"both arms (default {ACTOR_LR:g}); another value writes results named _lr<value>")
    parser.add_argument("--long-tail", action="store_true",
                        help="long-tailed lengths, group of 8 vs single, both schedulers (module docstring)")
    args = parser.parse_args(argv)
    if args.long_tail:
        C.set_threads()
        C.quiet_libraries()
        return main_long_tail(args)
    steps = args.steps or (12 if args.quick else 36)
    C.set_threads()
    C.quiet_libraries()
    machine = C.machine_info()
    model = T.warm_model()
    capacities = [B] if args.quick else [B, 2 * B]
    regimes = [4, 1]  # update_ticks: trainer-bound, rollout-bound
    cells = [(ut, inflight) for ut in regimes for inflight in capacities]
    bar = C.progress(steps * len(ARMS) * len(cells), "group_vs_single")
    runs: dict[str, T.RunResult] = {}
    rows = []
    started = time.perf_counter()
    for ut, inflight in cells:
        for arm, algo, overrides in ARMS:
            label = f"{arm}, in-flight {'B' if inflight == B else '2B'}, update_ticks={ut}"
            run = T.run_algorithm(algo, model, label=label, steps=steps, batch=B, seed=args.seed,
                                  algo_overrides={**overrides, "actor_lr": args.actor_lr},
                                  driver_overrides={"synchronous": False, "max_inflight_trajectories": inflight,
                                                    "update_ticks": ut},
                                  on_step=lambda m: bar.update(1))
            runs[label] = run
            rows.append(summarize(run, inflight, ut))
            print(f"  done {label}: {run.clock_ticks} ticks, {run.wall_s:.1f} s wall", flush=True)
    bar.close()

    ratios = {}
    for ut, inflight in cells:
        cell = [r for r in rows if r["max_inflight_trajectories"] == inflight and r["update_ticks"] == ut]
        g = next(r for r in cell if r["label"].startswith("GRPO"))
        s = next(r for r in cell if r["label"].startswith("LiSAO"))
        ratios[f"in-flight {'B' if inflight == B else '2B'}, update_ticks={ut}"] = {
            "step_time_group_over_single": g["sim_ticks_per_step"] / s["sim_ticks_per_step"],
            "mean_lag_group_over_single": g["mean_policy_lag"] / max(s["mean_policy_lag"], 1e-9),
            "off_policy_ratio_group_minus_single": g["off_policy_token_ratio"] - s["off_policy_token_ratio"],
            "dropped_stale_group": g["dropped_stale"],
            "dropped_stale_single": s["dropped_stale"],
        }
    results = {
        "benchmark": "group_vs_single",
        "description": "GRPO n=4 vs LiSAO n=1 at B=32 and equal steps (equal trained-trajectory budget), async",
        "quick": args.quick,
        "setup": {"batch_trajectories": B, "steps": steps, "seed": args.seed, "staleness_cap": 4, "chunk_tokens": 8,
                  "update_ticks": regimes, "max_inflight_trajectories": capacities, "env": "toy_keys",
                  "lisao_critic_warmup_steps": 0, "actor_lr": args.actor_lr,
                  "model": "tiny Qwen2 (hidden 64, 2 layers), SFT warm start on toy_keys"},
        "clock_model": "1 tick = one 8-token generation chunk for every live request; 1 trainer update = "
                       "update_ticks ticks (4: trainer-bound, 1: rollout-bound)",
        "runs": rows,
        "ratios": ratios,
        "total_benchmark_wall_s": time.perf_counter() - started,
        "machine": machine,
    }
    stem = C.result_stem("group_vs_single" + _lr_suffix(args), args.quick)
    json_path = C.save_json(stem, results)
    png = C.RESULTS / f"{stem}.png"
    plot(rows, runs, png)

    print(f"\nB={B}, {steps} steps (= {steps * B} trained trajectories per run), toy_keys, seed {args.seed}")
    C.print_table([[r["label"], r["sim_ticks_per_step"], r["mean_policy_lag"], r["max_policy_lag"],
                    r["off_policy_token_ratio"], r["dropped_stale"], r["trajectories_generated"],
                    r["sim_trainer_idle_frac"], r["response_length_mean"], r["wall_s"], r["accuracy_final_20pct"]]
                   for r in rows],
                  ["run", "ticks/step", "mean lag", "max lag", "off-policy", "dropped", "generated", "trainer idle (sim)",
                   "resp len", "wall s", "final acc"])
    print()
    for cap, r in ratios.items():
        print(f"{cap}: step time group/single = {r['step_time_group_over_single']:.2f}x, mean lag group/single = "
              f"{r['mean_lag_group_over_single']:.2f}x, off-policy ratio group - single = "
              f"{r['off_policy_ratio_group_minus_single']:+.3f}, dropped stale {r['dropped_stale_group']} vs "
              f"{r['dropped_stale_single']}")
    print(f"\nwrote {json_path} and {png}")
    return results


if __name__ == "__main__":
    main()

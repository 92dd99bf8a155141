"""Asynchronous in-flight training vs the colocated synchronous baseline, same algorithm, same task.

GRPO (B = 32 trajectories, n = 4) on toy_keys (multi-turn, long-tailed response lengths: a few long "think"
turns hold up a synchronous batch) with the SFT-warm-started tiny model, same seed:

- ``sync``: deterministic driver, ``DriverConfig(synchronous=True)`` -- generate one batch under the current
  weights, train, publish, repeat (rollout idle while training, trainer idle while generating);
- ``async in-flight B`` / ``2B``: deterministic driver, ``synchronous=False`` -- the rollout keeps up to B (2 B,
  the driver's default) trajectories going, weights are published in flight, groups holding a token older
  than the staleness cap (k = 4 versions) are dropped;
- ``async concurrent`` (real threads): the concurrent scheduler (``driver/concurrent.py``), a rollout thread
  generating while the trainer trains, in real time, in-flight B.

Two clocks, each labelled for what it is:
(a) the **simulated clock** (``async/clock_ticks`` at the end of the run, deterministic runs): the
    deterministic scheduler models one generation chunk (``chunk_tokens`` = 8 tokens for every live request)
    as one tick and one trainer update as ``update_ticks`` ticks (4 by default). The sync/async tick ratio
    is the speed-up the overlap buys *under that model*; the full run also sweeps ``update_ticks`` (1, 4, 16)
    because the speed-up depends on the ratio of training to generation time.
(b) the **real wall clock** of each run's training loop (model loading excluded; sync and the concurrent
    arm are run ``--wall-repeats`` = 3 times and the median is reported). The deterministic
    scheduler runs rollout and training one after the other in one process, so its real wall time shows no
    overlap. It still differs between the deterministic runs, for other reasons: on the tiny CPU model a
    generation chunk costs about the same whatever the number of live requests, so the sync run pays for its
    extra generation ticks (a batch tailing off to a few long requests), while an async run generates more
    trajectories (some in flight at the end, some dropped as stale). Only the concurrent run overlaps in real
    time; on this shared 2-core CPU its number depends on what else the machine is doing.

Run: ``.venv/bin/python benchmarks/async_vs_sync.py [--quick]``; writes benchmarks/results/async_vs_sync.{json,png}
(``--quick``: async_vs_sync_quick.{json,png}).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common as C
import _training as T

B, N = 32, 4
SYNC = "sync"
CONCURRENT = "async concurrent in-flight B (real threads)"


def summarize(run: T.RunResult) -> dict:
    acc = run.series("train/success_rate")
    last = run.history[-1]
    n = max(len(run.history), 1)
    ticks = run.clock_ticks
    return {
        "label": run.label,
        "scheduler": run.extra["scheduler"],
        "steps": len(run.history),
        "sim_clock_ticks": ticks,
        "sim_ticks_per_step": ticks / n if ticks is not None else None,
        "trainer_busy_ticks": run.trainer_busy_ticks if ticks is not None else None,
        "rollout_busy_ticks": run.rollout_busy_ticks if ticks is not None else None,
        # fractions of simulated ticks (deterministic runs only) and of real time (every run)
        "sim_trainer_idle_frac": last.get("sim/trainer_idle_frac"),
        "sim_rollout_idle_frac": last.get("sim/rollout_idle_frac"),
        "trainer_idle_frac": last["perf/trainer_idle_frac"],
        "rollout_idle_frac": last["perf/rollout_idle_frac"],
        "wall_s": run.wall_s,
        "wall_s_per_step": run.wall_s / n,
        "trajectories_generated": run.trajectories_finished,
        "trajectories_trained": int(sum(run.series("train/batch_trajectories"))),
        "generated_tokens": run.generated_tokens,
        "mean_policy_lag": run.mean("async/policy_lag/mean"),
        "max_policy_lag": max(run.series("async/policy_lag/max") or [0.0]),
        "off_policy_token_ratio": run.mean("async/off_policy_token_ratio"),
        "dropped_stale": run.dropped_stale,
        "response_length_mean": run.mean("train/response_length/mean"),
        "response_length_max": max(run.series("train/response_length/max") or [0.0]),
        "accuracy_first_10pct": C.window_mean(acc, 0.1, 0.1),
        "accuracy_final_20pct": C.window_mean(acc, 1.0, 0.2),
    }


def steps_reached_by(run: T.RunResult, key: str, limit: float) -> int:
    """Trainer steps the run had started by ``limit`` on the clock ``key`` (``async/clock_ticks``, ``perf/wall_s``)."""
    return sum(1 for m in run.history if m.get(key, float("inf")) <= limit)


def plot(rows: list[dict], runs: dict[str, T.RunResult], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from async_rl.plots import two_sided_ema

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
    for i, (label, run) in enumerate(runs.items()):
        color = f"C{i}"
        acc = run.series("train/success_rate")
        ema = two_sided_ema(acc)
        if run.clock_ticks is not None:
            ticks = run.series("async/clock_ticks")
            axes[0].plot(ticks, acc, color=color, alpha=0.25, linewidth=0.8)
            axes[0].plot(ticks, ema, color=color, label=label)
        axes[1].plot(run.series("perf/wall_s"), ema, color=color, label=label)
        axes[2].plot(range(1, len(run.history) + 1), run.series("async/policy_lag/mean"), color=color, label=label)
    axes[0].set_xlabel("simulated clock ticks (1 tick = one 8-token chunk; 1 update = 4 ticks)")
    axes[0].set_title("accuracy vs simulated time (deterministic runs)")
    axes[1].set_xlabel("real seconds (deterministic runs: serial, no overlap)")
    axes[1].set_title("accuracy vs real wall time")
    for ax in axes[:2]:
        ax.set_ylabel("training accuracy (EMA span 10)")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("mean policy lag (versions)")
    axes[2].set_title("policy lag")
    for ax in axes[:3]:
        ax.legend(fontsize=7)
    base_ticks, base_wall = rows[0]["sim_clock_ticks"], rows[0]["wall_s"]
    w = 0.38
    for i, r in enumerate(rows):
        for offset, value, color, name in (
                (-w / 2, r["sim_clock_ticks"] / base_ticks if r["sim_clock_ticks"] else None, "C0",
                 "simulated clock ticks"),
                (w / 2, r["wall_s"] / base_wall, "C1", "real wall time")):
            if value is None:
                axes[3].annotate("n/a", (i + offset, 0.02), ha="center", fontsize=7)
                continue
            axes[3].bar(i + offset, value, w, color=color, label=name if i == 0 else None)
            axes[3].annotate(f"{value:.2f}", (i + offset, value), ha="center", va="bottom", fontsize=7)
    axes[3].set_xticks(range(len(rows)), [r["label"].replace(" (", "\n(").replace("in-flight", "\nin-flight")
                                          for r in rows], fontsize=6.5)
    axes[3].set_ylabel(f"time relative to {rows[0]['label']}")
    axes[3].set_title(f"time for {rows[0]['steps']} steps (lower is faster)")
    axes[3].legend(fontsize=7)
    fig.suptitle(f"GRPO B={B} n={N} on toy_keys: synchronous vs asynchronous in-flight")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no 2B arm, no update_ticks sweep (~1 min)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 36; quick 12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wall-repeats", type=int, default=None,
                        help="runs of sync and of the concurrent arm for real wall time; the median is reported "
                             "(default 3; quick 1)")
    args = parser.parse_args(argv)
    steps = args.steps or (12 if args.quick else 36)
    C.set_threads()
    C.quiet_libraries()
    machine = C.machine_info()
    model = T.warm_model()

    main_cfgs = [
        (SYNC, {"synchronous": True}, "deterministic"),
        ("async in-flight B", {"synchronous": False, "max_inflight_trajectories": B}, "deterministic"),
        ("async in-flight 2B", {"synchronous": False, "max_inflight_trajectories": 2 * B}, "deterministic"),
        (CONCURRENT, {"synchronous": False, "max_inflight_trajectories": B}, "concurrent"),
    ]
    if args.quick:
        main_cfgs = [c for c in main_cfgs if "2B" not in c[0]]
    sweep_cfgs = [] if args.quick else [
        (f"{name} update_ticks={ut}", {**cfg, "update_ticks": ut}, sched)
        for ut in (1, 16) for name, cfg, sched in main_cfgs[:2]
    ]
    repeats = max(1, args.wall_repeats or (1 if args.quick else 3))
    repeat_cfgs = [c for c in main_cfgs if c[0] in (SYNC, CONCURRENT)] * (repeats - 1)
    bar = C.progress(steps * (len(main_cfgs) + len(sweep_cfgs) + len(repeat_cfgs)), "async_vs_sync")
    walls: dict[str, list[float]] = {}
    runs: dict[str, T.RunResult] = {}
    started = time.perf_counter()
    for label, overrides, scheduler in main_cfgs + sweep_cfgs + repeat_cfgs:
        r = T.run_algorithm("grpo", model, label=label, steps=steps, batch=B, seed=args.seed,
                            algo_overrides={"group_size": N}, driver_overrides=overrides,
                            scheduler=scheduler, on_step=lambda m: bar.update(1))
        runs.setdefault(label, r)  # metrics of the first run; repeats only add wall-time samples
        walls.setdefault(label, []).append(r.wall_s)
        print(f"  done {label}: {r.clock_ticks if r.clock_ticks is not None else '-'} ticks, "
              f"{r.wall_s:.1f} s wall", flush=True)
    bar.close()

    main_rows = [summarize(runs[label]) for label, _, _ in main_cfgs]
    for row in main_rows:  # real wall time: the median of the repeats (one sample for the other arms)
        row["wall_s_samples"] = walls[row["label"]]
        row["wall_s"] = statistics.median(walls[row["label"]])
        row["wall_s_per_step"] = row["wall_s"] / max(row["steps"], 1)
    sync = main_rows[0]
    ratios = {}
    for row in main_rows[1:]:
        entry = {"wall_ratio_sync_over_async": sync["wall_s"] / row["wall_s"],
                 "sync_steps_done_in_same_wall_time": steps_reached_by(runs[SYNC], "perf/wall_s", row["wall_s"])}
        if row["sim_clock_ticks"] is not None:
            entry["sim_clock_speedup_sync_over_async"] = sync["sim_clock_ticks"] / row["sim_clock_ticks"]
            entry["sync_steps_done_when_async_finished"] = steps_reached_by(runs[SYNC], "async/clock_ticks",
                                                                            row["sim_clock_ticks"])
        ratios[row["label"]] = entry
    sweep = [{"update_ticks": 4, "sync_ticks": sync["sim_clock_ticks"], "async_ticks": main_rows[1]["sim_clock_ticks"],
              "sim_clock_speedup_sync_over_async": ratios[main_rows[1]["label"]]["sim_clock_speedup_sync_over_async"],
              "async_mean_policy_lag": main_rows[1]["mean_policy_lag"],
              "async_sim_trainer_idle_frac": main_rows[1]["sim_trainer_idle_frac"],
              "sync_sim_trainer_idle_frac": sync["sim_trainer_idle_frac"]}]
    for ut in (1, 16) if sweep_cfgs else ():
        s, a = runs[f"{SYNC} update_ticks={ut}"], runs[f"async in-flight B update_ticks={ut}"]
        sweep.append({"update_ticks": ut, "sync_ticks": s.clock_ticks, "async_ticks": a.clock_ticks,
                      "sim_clock_speedup_sync_over_async": s.clock_ticks / a.clock_ticks,
                      "async_mean_policy_lag": a.mean("async/policy_lag/mean"),
                      "async_sim_trainer_idle_frac": a.history[-1]["sim/trainer_idle_frac"],
                      "sync_sim_trainer_idle_frac": s.history[-1]["sim/trainer_idle_frac"]})
    sweep.sort(key=lambda s: s["update_ticks"])

    results = {
        "benchmark": "async_vs_sync",
        "description": "GRPO B=32 n=4 on toy_keys: DriverConfig(synchronous=True) vs async in-flight, same seed",
        "quick": args.quick,
        "setup": {"algorithm": "grpo", "batch_trajectories": B, "group_size": N, "steps": steps, "seed": args.seed,
                  "staleness_cap": 4, "chunk_tokens": 8, "update_ticks": 4, "env": "toy_keys",
                  "max_new_tokens_per_turn": 24, "max_turns": 4, "max_response_tokens": 160,
                  "model": "tiny Qwen2 (hidden 64, 2 layers), SFT warm start on toy_keys"},
        "clock_model": "deterministic scheduler: one generation chunk (8 tokens for every live request) = 1 tick, "
                       "one trainer update = update_ticks ticks",
        "wall_repeats": repeats,
        "wall_clock_note": "real seconds of the training loop (model loading excluded); sync and concurrent: "
                           "median of wall_repeats runs (wall_s_samples). Deterministic runs are "
                           "serial in one process (no overlap); their differences come from generation ticks (a "
                           "tiny-model chunk costs about the same at any batch size), amounts generated and "
                           "machine load. The concurrent run overlaps rollout and training in two threads on a "
                           "shared 2-core CPU.",
        "main": main_rows,
        "ratios": ratios,
        "update_ticks_sweep": sweep,
        "total_benchmark_wall_s": time.perf_counter() - started,
        "machine": machine,
    }
    stem = C.result_stem("async_vs_sync", args.quick)
    json_path = C.save_json(stem, results)
    png = C.RESULTS / f"{stem}.png"
    plot(main_rows, {label: runs[label] for label, _, _ in main_cfgs}, png)

    print(f"\nGRPO B={B} n={N}, toy_keys, {steps} steps, seed {args.seed}")
    C.print_table([[r["label"], r["sim_clock_ticks"] if r["sim_clock_ticks"] is not None else "-",
                    r["wall_s"], r["sim_trainer_idle_frac"], r["trainer_idle_frac"], r["rollout_idle_frac"],
                    r["mean_policy_lag"],
                    r["off_policy_token_ratio"], r["dropped_stale"], r["accuracy_final_20pct"]] for r in main_rows],
                  ["run", "sim ticks", "wall s", "trainer idle (sim)", "trainer idle (real)", "rollout idle (real)",
                   "mean lag", "off-policy", "dropped", "final acc"])
    print("(sim: fraction of simulated ticks, deterministic runs; real: fraction of wall time not training / "
          "not generating, every run)\n")
    for label, r in ratios.items():
        sim = (f"simulated-clock speed-up sync/async = {r['sim_clock_speedup_sync_over_async']:.2f}x "
               f"(sync had reached step {r['sync_steps_done_when_async_finished']}/{steps}); "
               if "sim_clock_speedup_sync_over_async" in r else "")
        kind = "real time, overlapped" if label == CONCURRENT else "one process, no overlap"
        print(f"{label}: {sim}real wall ratio sync/async = {r['wall_ratio_sync_over_async']:.2f}x ({kind})")
    if len(sweep) > 1:
        print("\nupdate_ticks sweep, sync vs async in-flight B (simulated clock): " + "; ".join(
            f"update_ticks={s['update_ticks']}: {s['sim_clock_speedup_sync_over_async']:.2f}x, "
            f"async lag {s['async_mean_policy_lag']:.2f}" for s in sweep))
    print(f"\nwrote {json_path} and {png}")
    return results


if __name__ == "__main__":
    main()

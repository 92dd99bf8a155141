"""Staleness-versus-stability map of the single-rollout policy losses on toy_keys (issue 19, item 2).

Grid: policy loss {dis, dis_clip, ppo_clip} x staleness cap k {0, 2, 4} x actor lr {3e-4, 1e-3} x seeds.
Every run is LiSAO's single-rollout pipeline (n = 1, separate frozen-attention critic, K = 2 critic passes,
skip-observation GAE with the length-adaptive λ, whitened advantages; ``_training.ALGO_PRESETS["lisao"]``:
3 critic warm-up steps, critic lr 1e-3, B = 32, in-flight capacity B) on the asynchronous deterministic
driver; only the policy loss, the cap and the actor lr change:

* ``dis``: spec §3's DIS, ratio ρ unclipped inside the band (0.7, 6.0), zero weight outside;
* ``dis_clip``: the same band with the PPO clip (ε_low 0.2, ε_high 0.28) inside it (Li2SAO's bootstrap loss);
* ``ppo_clip``: Eq. 1 (DAPO clip, no band).

Per run: final success (mean ``train/success_rate`` of the last 5 steps), collapse (the run reached >= 0.9
and afterwards stayed below 0.5 for >= 5 consecutive steps; ``async_rl.run_summary.collapse_step``), dip (it fell
below 0.5 at any step after reaching 0.9), peak ``actor/ppo_kl`` (the k1 estimate of
KL(behaviour || current) over the batch's model tokens), peak ``actor/dis_kept_kl`` (k3 over the tokens inside
the DIS band; ``dis`` and ``dis_clip`` only), peak ``actor/dis_masked_frac``, the longest mean
response, the mean policy lag, and the per-step series of those.

Run: ``nice -n 10 .venv/bin/python benchmarks/stability_map.py [--steps 30] [--seeds 0,1,2]
[--model DIR] [--plot-only]``. ``--model`` reuses an SFT warm start already on disk (e.g. the demo's
``outputs/models/tiny-toy_keys/sft``, built with the same tiny-model and SFT defaults as
``_training.warm_model``); without it the benchmark builds and caches its own. Writes
benchmarks/results/stability_map.json after every run (``complete: false`` until the last) and
stability_map.png (three panels: collapse and dip counts, mean final success and mean peak KL per cell).
``--workers 2`` trains two runs at once (one process each); ``--resume`` keeps the saved runs and trains the rest,
``--first`` puts named cells at the head of the queue; ``--plot-only`` fills in a map cut short (the lag-0 copies,
the cells) and draws it. On the shared 2-core box (load 8-15) one 25-step run took 2-6 minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import _common as C
import _training as T
from async_rl.run_summary import COLLAPSE_HIGH, COLLAPSE_LOW, COLLAPSE_STEPS, collapse_step

LOSSES = ("dis", "dis_clip", "ppo_clip")
CAPS = (0, 2, 4)
LRS = (3e-4, 1e-3)
FINAL_WINDOW = 5  # final success = mean of the last steps
SERIES = {"success": "train/success_rate", "kl": "actor/ppo_kl", "masked": "actor/dis_masked_frac",
          "length": "train/response_length/mean", "lag": "async/policy_lag/mean", "ev": "critic/explained_var",
          "clipfrac": "actor/pg_clipfrac", "grad_norm": "actor/grad_norm", "kept_kl": "actor/dis_kept_kl"}


def after_peak(success: list[float]) -> dict:
    """The lowest success after the run first reached COLLAPSE_HIGH (None if it never did), and whether it fell
    below COLLAPSE_LOW at all then (a dip: a collapse needs COLLAPSE_STEPS such steps in a row)."""
    first = next((i for i, v in enumerate(success) if v >= COLLAPSE_HIGH), None)
    low = min(success[first:]) if first is not None else None
    return {"first_reached_step": None if first is None else first + 1, "min_success_after_reach": low,
            "dip": low is not None and low < COLLAPSE_LOW}


def summarise(history: list[dict]) -> dict:
    series = {name: [float(m[key]) if key in m and m[key] == m[key] else None for m in history]
              for name, key in SERIES.items()}
    success = [v if v is not None else 0.0 for v in series["success"]]
    kls = [v for v in series["kl"] if v is not None]
    masked = [v for v in series["masked"] if v is not None]
    kept = [v for v in series["kept_kl"] if v is not None]
    lags = [v for v in series["lag"] if v is not None]
    start = collapse_step(success)
    tail = success[-FINAL_WINDOW:]
    return {**after_peak(success), 
        "final_success": sum(tail) / len(tail),
        "max_success": max(success),
        "collapse": start is not None,
        "collapse_step": start,
        "peak_kl": max(kls) if kls else None,
        "peak_masked_frac": max(masked) if masked else None,
        "peak_kept_kl": max(kept) if kept else None,  # DIS losses only (actor/dis_kept_kl)
        "peak_response_length": max(v for v in series["length"] if v is not None),
        "mean_policy_lag": sum(lags) / len(lags) if lags else None,
        "series": series,
    }


def cell_key(loss: str, cap: int, lr: float) -> str:
    return f"{loss}|k={cap}|lr={lr:g}"


def aggregate(runs: list[dict]) -> dict:
    cells: dict[str, dict] = {}
    for loss, cap, lr in itertools.product(LOSSES, CAPS, LRS):
        rs = [r for r in runs if (r["loss"], r["staleness_cap"], r["actor_lr"]) == (loss, cap, lr)]
        if not rs:
            continue
        kls = [r["peak_kl"] for r in rs if r["peak_kl"] is not None]
        cells[cell_key(loss, cap, lr)] = {
            "loss": loss, "staleness_cap": cap, "actor_lr": lr, "runs": len(rs),
            "collapses": sum(r["collapse"] for r in rs),
            "dips": sum(after_peak(r["series"]["success"])["dip"] for r in rs),
            "final_success_mean": sum(r["final_success"] for r in rs) / len(rs),
            "final_success_min": min(r["final_success"] for r in rs),
            "peak_kl_mean": sum(kls) / len(kls) if kls else None,
            "peak_kl_max": max(kls) if kls else None,
            "peak_kept_kl_max": max((r["peak_kept_kl"] for r in rs if r.get("peak_kept_kl") is not None), default=None),
            "seeds": [r["seed"] for r in rs],
        }
    return cells


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = payload["cells"]
    rows = [(loss, lr) for loss in LOSSES for lr in LRS]
    panels = [("collapses", f"collapsed runs (dip: < {COLLAPSE_LOW} after >= {COLLAPSE_HIGH})", "Reds", (0, max(1, len(payload["seeds"])))),
              ("final_success_mean", "final success (mean)", "Greens", (0, 1)),
              ("peak_kl_mean", "peak actor/ppo_kl (mean)", "Purples", None)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    for ax, (field, title, cmap, limits) in zip(axes, panels):
        grid = np.full((len(rows), len(CAPS)), np.nan)
        for i, (loss, lr) in enumerate(rows):
            for j, cap in enumerate(CAPS):
                cell = cells.get(cell_key(loss, cap, lr))
                if cell is not None and cell[field] is not None:
                    grid[i, j] = cell[field]
        vmin, vmax = limits if limits else (0, np.nanmax(grid) if np.isfinite(grid).any() else 1)
        im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        for i in range(len(rows)):
            for j in range(len(CAPS)):
                cell = cells.get(cell_key(rows[i][0], CAPS[j], rows[i][1]))
                if cell is None:
                    continue
                text = (f"{cell['collapses']}/{cell['runs']}\n{cell.get('dips', 0)} dip(s)" if field == "collapses"
                        else "n/a" if cell[field] is None else f"{cell[field]:.2f}")
                ax.text(j, i, text, ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(CAPS)), [f"k={c}" for c in CAPS])
        ax.set_yticks(range(len(rows)), [f"{loss} lr {lr:g}" for loss, lr in rows])
        ax.set_title(title)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"LiSAO single rollout on toy_keys, {payload['steps']} steps, seeds {payload['seeds']} "
                 f"(collapse: >= {COLLAPSE_HIGH} then < {COLLAPSE_LOW} for >= {COLLAPSE_STEPS} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def one_run(job: tuple) -> dict:
    """Train one grid cell and summarise it (runs in a worker process); ``extra`` = more algorithm overrides."""
    loss, cap, lr, seed, steps, model, *extra = job
    overrides = {"policy_loss": loss, "actor_lr": lr, **(extra[0] if extra else {})}
    result = T.run_algorithm("lisao", model, label=f"{loss} k={cap} lr={lr:g} seed={seed}", steps=steps, seed=seed,
                             algo_overrides=overrides, driver_overrides={"staleness_cap": cap})
    return {"loss": loss, "staleness_cap": cap, "actor_lr": lr, "seed": seed, "wall_s": result.wall_s,
            "dropped_stale": result.dropped_stale, "derived_from": None, **summarise(result.history)}


def plan(losses: list[str], seeds: list[int]) -> tuple[list[tuple], list[tuple]]:
    """(runs to train, lag-0 cells to copy). At k = 0 every kept token has lag 0, so ρ = 1 on every token: the
    DIS band and the PPO clip are both inactive and the three losses give the same gradient, bit for bit. There
    ``ppo_clip`` trains every seed, ``dis`` trains the first seed as a check (``lag0_check`` in the JSON compares
    the two series) and the other (loss, k = 0, seed) cells are copies of ``ppo_clip``'s run."""
    train, copy = [], []
    # seed by seed, every cell of a seed before the next seed, the riskiest cells first: a map cut short still
    # covers every cell
    for seed in seeds:
        for lr in sorted(LRS, reverse=True):
            for cap in sorted(CAPS, reverse=True):
                for loss in losses:
                    if cap == 0 and loss != "ppo_clip" and "ppo_clip" in losses and \
                            not (loss == "dis" and seed == seeds[0]):
                        copy.append((loss, cap, lr, seed))
                    else:
                        train.append((loss, cap, lr, seed))
    return train, copy


def copy_lag0_cells(runs: list[dict], copy: list[tuple]) -> list[dict]:
    """Rows for the (loss, k = 0, seed) cells :func:`plan` does not train: ``ppo_clip``'s run where it exists."""
    out = []
    for loss, cap, lr, seed in copy:
        ref = next((r for r in runs if (r["loss"], r["staleness_cap"], r["actor_lr"], r["seed"]) ==
                    ("ppo_clip", cap, lr, seed)), None)
        if ref is not None:
            out.append({**ref, "loss": loss, "derived_from": "ppo_clip (k = 0: ρ = 1 on every token)"})
    return out


def lag0_checks(runs: list[dict]) -> list[dict]:
    """For each lr, whether the k = 0 ``dis`` run reproduced ``ppo_clip``'s series exactly."""
    out = []
    for r in runs:
        if r["staleness_cap"] != 0 or r["loss"] != "dis" or r["derived_from"]:
            continue
        ref = next((q for q in runs if (q["loss"], q["staleness_cap"], q["actor_lr"], q["seed"]) ==
                    ("ppo_clip", 0, r["actor_lr"], r["seed"])), None)
        if ref is not None:
            same = all(r["series"][k] == ref["series"][k] for k in ("success", "kl", "length", "grad_norm"))
            out.append({"actor_lr": r["actor_lr"], "seed": r["seed"], "dis_equals_ppo_clip": same})
    return out


def ablation(args) -> None:
    """One (loss, k, lr, seed) cell trained once per variant, each changing one algorithm setting: whitening off
    (does the advantage scale, unit variance even when the batch has saturated, drive the cell's KL spike?) and
    the DAPO overlong penalty off (the map's runs apply it, the algorithm default). The reference run is the
    map's own row for the cell (same seed, same code), read from stability_map.json when it is there."""
    loss, cap, lr, seed = args.ablation.split(",")
    cell = (loss, int(cap), float(lr), int(seed))
    model = args.model or T.warm_model()
    payload = {"benchmark": "stability_ablation", "machine": C.machine_info(), **C.git_provenance(),
               "model": str(model), "steps": args.steps, "cell": dict(zip(("loss", "staleness_cap", "actor_lr",
                                                                           "seed"), cell)), "runs": []}
    started = time.perf_counter()
    defaults = {"whiten_advantages": True, "overlong_penalty": True}
    for change in ({"whiten_advantages": False}, {"overlong_penalty": False}):
        row = one_run((*cell, args.steps, str(model), change))
        payload["runs"].append({**defaults, **change, "changed": change, **row})
    map_path = C.RESULTS / "stability_map.json"
    if map_path.exists():
        ref = next((r for r in json.loads(map_path.read_text())["runs"] if (r["loss"], r["staleness_cap"],
                    r["actor_lr"], r["seed"]) == cell and r["series"]["success"][:1]), None)
        if ref is not None:
            payload["runs"].append({**defaults, "changed": {}, "from": "stability_map.json", **ref})
    payload["elapsed_s"] = time.perf_counter() - started
    C.save_json("stability_ablation", payload)
    for r in payload["runs"]:
        print(f"changed {r['changed'] or 'nothing (the map run)'}: final {r['final_success']:.2f} "
              f"max {r['max_success']:.2f} collapse {r['collapse_step']} peak kl {r['peak_kl']:.3f} "
              f"peak length {r['peak_response_length']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--model", default=None, help="an SFT warm start on disk (default: _training.warm_model())")
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--workers", type=int, default=1, help="runs trained at once (one process each)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON")
    parser.add_argument("--resume", action="store_true", help="keep the runs in the saved JSON, train the rest")
    parser.add_argument("--first", default="", metavar="LOSS,K,LR,SEED;...", help="train these cells first")
    parser.add_argument("--ablation", default=None, metavar="LOSS,K,LR,SEED",
                        help="instead of the grid: one cell without whitened advantages, and without the "
                             "overlong penalty (writes stability_ablation.json)")
    args = parser.parse_args()
    if args.ablation:
        ablation(args)
        return
    json_path, png_path = C.RESULTS / "stability_map.json", C.RESULTS / "stability_map.png"
    if args.plot_only:  # also fills in the lag-0 copies and cells of a run cut short (complete stays false)
        payload = json.loads(json_path.read_text())
        trained = [{**r, **after_peak(r["series"]["success"])} for r in payload["runs"] if not r.get("derived_from")]
        payload["runs"] = trained + copy_lag0_cells(trained, plan(payload["losses"], payload["seeds"])[1])
        payload["cells"] = aggregate(payload["runs"])
        payload["lag0_check"] = lag0_checks(payload["runs"])
        C.save_json("stability_map", payload)
        plot(payload, png_path)
        print(f"wrote {png_path}")
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    losses = [s for s in args.losses.split(",") if s]
    model = args.model or T.warm_model()
    train, copy = plan(losses, seeds)
    payload = {
        "benchmark": "stability_map", "complete": False, "machine": C.machine_info(), **C.git_provenance(),
        "model": str(model), "steps": args.steps, "seeds": seeds, "losses": losses, "staleness_caps": list(CAPS),
        "actor_lrs": list(LRS), "workers": args.workers,
        "settings": {"algorithm": "lisao", **T.ALGO_PRESETS["lisao"], "batch": 32, "critic_lr": 1e-3,
                     "max_inflight_trajectories": 32},
        "collapse_rule": {"reach": COLLAPSE_HIGH, "below": COLLAPSE_LOW, "for_steps": COLLAPSE_STEPS},
        "final_window": FINAL_WINDOW, "trained_runs": len(train), "copied_lag0_cells": len(copy),
        "runs": [], "cells": {}, "lag0_check": [],
    }
    if args.resume and json_path.exists():
        saved = json.loads(json_path.read_text())
        if (saved["steps"], saved["losses"]) != (args.steps, losses):
            raise SystemExit(f"--resume: {json_path} has steps {saved['steps']}, losses {saved['losses']}")
        payload["runs"] = [r for r in saved["runs"] if not r.get("derived_from")]
        payload["resumed_from_commit"] = saved.get("git_commit")
        payload["elapsed_s"] = float(saved.get("elapsed_s", 0.0))
        done = {(r["loss"], r["staleness_cap"], r["actor_lr"], r["seed"]) for r in payload["runs"]}
        train = [cell for cell in train if cell not in done]
    if args.first:
        wanted = [(loss, int(k), float(lr), int(seed)) for loss, k, lr, seed in
                  (item.split(",") for item in args.first.split(";") if item)]
        train = [cell for cell in wanted if cell in train] + [cell for cell in train if cell not in wanted]
    started = time.perf_counter() - float(payload.get("elapsed_s", 0.0))

    def record(row: dict, n: int) -> None:
        payload["runs"].append(row)
        payload["cells"] = aggregate(payload["runs"])
        payload["lag0_check"] = lag0_checks(payload["runs"])
        payload["elapsed_s"] = time.perf_counter() - started
        C.save_json("stability_map", payload)
        print(f"[{n}/{len(train)}] {row['loss']} k={row['staleness_cap']} lr={row['actor_lr']:g} seed={row['seed']}: "
              f"final {row['final_success']:.2f} max {row['max_success']:.2f} collapse {row['collapse_step']} "
              f"peak kl {row['peak_kl']:.3f} ({row['wall_s']:.0f} s)", flush=True)

    jobs = [(*cell, args.steps, str(model)) for cell in train]
    if args.workers <= 1:
        for n, job in enumerate(jobs, 1):
            record(one_run(job), n)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(one_run, job) for job in jobs]
            for n, future in enumerate(as_completed(futures), 1):
                record(future.result(), n)
    payload["runs"] += copy_lag0_cells(payload["runs"], copy)
    payload["cells"] = aggregate(payload["runs"])
    payload["complete"] = True
    payload["elapsed_s"] = time.perf_counter() - started
    C.save_json("stability_map", payload)
    plot(payload, png_path)
    rows = [[c["loss"], c["staleness_cap"], c["actor_lr"], f"{c['collapses']}/{c['runs']}",
             c["final_success_mean"], c["final_success_min"], c["peak_kl_mean"]] for c in payload["cells"].values()]
    C.print_table(rows, ["loss", "k", "lr", "collapses", "final mean", "final min", "peak kl"])
    print(f"lag-0 check: {payload['lag0_check']}")
    print(f"wrote {json_path} and {png_path} ({payload['elapsed_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()

"""What the group barrier alone can do to policy lag under the long-tail workload: an idealised model
set beside ``group_vs_single.py --long-tail``'s measurement (issue 22).

The model keeps only the barrier. Every episode's response is its forced thinking turn (drawn exactly as
the episodes draw it, ``forced_turn_tokens``) plus the game's turns (the measured mean response length minus the
forced mean, a constant). Tokens are generated ``chunk_tokens`` per tick from the moment the episode starts,
and a group's 8 members start together. The trainer publishes a version every ``ticks_per_step`` ticks, at a
random phase. A token's lag is the number of publications between its sampling and its release: the
trajectory's own end (single) or its group's longest member's end (group). That is a proxy for the spec's
per-token lag (``async/policy_lag/mean``), which counts up to the update that consumes the batch, so it
counts at most the same. A trajectory (single) or group holding a token with lag above the staleness cap is
dropped, as ``TrajectoryBuffer.drop_stale`` drops it at batch time. There are no slots, no launch waits and
no buffer queues. The model's ratio shows what the barrier itself does under this length distribution;
its gap to the measured ratio is what the model leaves out.

Reads ``results/group_vs_single_longtail.json`` (its setup, step times, lengths and lags) and writes
``results/longtail_barrier_model.json``. Run: ``.venv/bin/python benchmarks/longtail_barrier_model.py`` (seconds).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

GROUP = 8
GROUPS = 4000  # groups drawn per arm and setting (32000 episodes)


def model_lag(lengths: list[list[int]], ticks_per_step: float, chunk_tokens: int, cap: int | None,
              grouped: bool, rng: random.Random) -> dict:
    """Token-weighted mean lag and the dropped fraction of trajectories, for groups of response lengths."""
    step_tokens = ticks_per_step * chunk_tokens  # tokens one request generates between two publications
    lag_sum = tokens = dropped = kept = 0
    for group in lengths:
        units = [group] if grouped else [[n] for n in group]
        for unit in units:
            release = max(unit)  # tokens from the common start until the unit is released
            phase = rng.random()
            lags = [[math.floor((release - k) / step_tokens + phase) for k in range(n)] for n in unit]
            if cap is not None and max(max(x) for x in lags) > cap:
                dropped += len(unit)
                continue
            kept += len(unit)
            lag_sum += sum(map(sum, lags))
            tokens += sum(unit)
    return {"mean_lag": lag_sum / tokens, "dropped_frac": dropped / (dropped + kept)}


def main() -> dict:
    from async_rl.driver.episode import forced_turn_tokens

    started = time.perf_counter()
    measured = json.loads((C.RESULTS / "group_vs_single_longtail.json").read_text())
    setup, spec = measured["setup"], measured["length_distribution"]["spec"]
    runs = {r["label"]: r for r in measured["runs"] if r["scheduler"] == "deterministic"}
    group_run, single_run = runs["GRPO n=8, deterministic"], runs["LiSAO n=1, deterministic"]
    game_tokens = round((group_run["response_length_mean"] + single_run["response_length_mean"]) / 2
                        - measured["length_distribution"]["mean"])
    lengths = [[forced_turn_tokens(spec, f"p{g}/r{j}") + game_tokens for j in range(GROUP)] for g in range(GROUPS)]
    chunk, cap = setup["chunk_tokens"], setup["staleness_cap"]
    steps = {"single": single_run["sim_ticks_per_step"], "group": group_run["sim_ticks_per_step"]}
    settings = {
        "measured step times, cap": (steps["single"], steps["group"], cap),
        "equal step times (single's), cap": (steps["single"], steps["single"], cap),
        "measured step times, no cap": (steps["single"], steps["group"], None),
        "equal step times (single's), no cap": (steps["single"], steps["single"], None),
    }
    rng = random.Random(0)
    model = {}
    for name, (single_ticks, group_ticks, setting_cap) in settings.items():
        single = model_lag(lengths, single_ticks, chunk, setting_cap, grouped=False, rng=rng)
        group = model_lag(lengths, group_ticks, chunk, setting_cap, grouped=True, rng=rng)
        model[name] = {"single": single, "group": group, "single_over_group": single["mean_lag"] / group["mean_lag"]}
    result = {
        "benchmark": "longtail_barrier_model", "source": "results/group_vs_single_longtail.json",
        "source_commit": measured["machine"]["git_commit"],
        "inputs": {"chunk_tokens": chunk, "staleness_cap": cap, "ticks_per_step": steps, "group_size": GROUP,
                   "groups": GROUPS, "game_tokens": game_tokens, "length_spec": spec},
        "model": model,
        "measured": {"single_mean_lag": single_run["mean_policy_lag"], "group_mean_lag": group_run["mean_policy_lag"],
                     "single_over_group": measured["single_over_group"]["mean_lag"],
                     "single_dropped_frac": single_run["dropped_stale_frac_of_generated"],
                     "group_dropped_frac": group_run["dropped_stale_frac_of_generated"]},
        "goal": measured["goal"],
        "total_wall_s": round(time.perf_counter() - started, 1),
        "machine": C.machine_info(),
    }
    path = C.save_json("longtail_barrier_model", result)
    for name, row in model.items():
        print(f"model, {name}: single {row['single']['mean_lag']:.2f} (dropped {row['single']['dropped_frac']:.3f}), "
              f"group {row['group']['mean_lag']:.2f} (dropped {row['group']['dropped_frac']:.3f}), "
              f"ratio {row['single_over_group']:.2f}")
    m = result["measured"]
    print(f"measured: single {m['single_mean_lag']:.2f}, group {m['group_mean_lag']:.2f}, ratio {m['single_over_group']:.2f}")
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()

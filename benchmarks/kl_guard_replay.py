"""Replay the KL guard on every step of the stability maps' trained runs (issue 19; docs/algorithms.md, Stability).

For each map and each rule (``algorithm.kl_warn_threshold``, ``algorithm.kl_warn_kept_threshold``) the script feeds
the per-step ``actor/ppo_kl`` and ``actor/dis_kept_kl`` series saved in ``stability_map.json`` through
``async_rl.driver.kl_guard.KLGuard``, the class the trainer runs, and counts:

* runs warned: at least one step over the rule;
* dips warned: runs that dipped (a step below 0.5 after first reaching 0.9, ``stability_map.after_peak``) whose
  first warning came at an earlier step than the dip, with the lead in steps;
* false alarms: runs that warned and never dipped.

Lag-0 copies (``derived_from``) are not trained runs and are left out. Maps of earlier commits are read from git
history with ``--map REV`` (the file ``benchmarks/results/stability_map.json`` at that revision).

Run: ``.venv/bin/python benchmarks/kl_guard_replay.py [--map REV ...] [--rule KL,KEPT ...]``; writes
benchmarks/results/kl_guard_replay.json. Default: the map in results/ and the maps of commits 1c93eb5, dc61639 and
515f182 (saved at revisions 8b2044b, 652f16b and 02363d3), rules (0.1, 0), (0.1, 0.02) and (0.1, 0.025).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess

import _common as C
from async_rl.driver.kl_guard import KLGuard
from stability_map import after_peak

MAP_FILE = "benchmarks/results/stability_map.json"
DEFAULT_REVISIONS = ("8b2044b", "652f16b", "02363d3")
DEFAULT_RULES = ((0.1, 0.0), (0.1, 0.02), (0.1, 0.025))


def load_map(revision: str | None) -> dict:
    """The map in results/ (``revision`` None) or the one committed at ``revision``."""
    if revision is None:
        return json.loads((C.RESULTS / "stability_map.json").read_text())
    text = subprocess.run(["git", "show", f"{revision}:{MAP_FILE}"], cwd=C.REPO, capture_output=True, text=True,
                          check=True, timeout=60).stdout
    return json.loads(text)


def dip_step(success: list) -> int | None:
    """1-based step of the first value below 0.5 after the run first reached 0.9 (None: no dip)."""
    values = [v if v is not None else 0.0 for v in success]
    reach = after_peak(values)
    if not reach["dip"]:
        return None
    first = reach["first_reached_step"] - 1
    return next(i + 1 for i in range(first, len(values)) if values[i] < 0.5)


def first_warning(run: dict, threshold: float, kept_threshold: float) -> int | None:
    """1-based step of the guard's first warning on the run's saved series (None: never warned)."""
    guard = KLGuard(threshold, stream=io.StringIO(), kept_threshold=kept_threshold)
    for index, (kl, kept) in enumerate(zip(run["series"]["kl"], run["series"]["kept_kl"])):
        metrics = {"actor/updated": kl is not None, "actor/ppo_kl": kl}
        if kept is not None:
            metrics["actor/dis_kept_kl"] = kept
        guard.check(index + 1, metrics)
    return guard.warned_steps[0] if guard.warned_steps else None


def run_name(run: dict) -> str:
    return f"{run['loss']} lr={run['actor_lr']:g} k={run['staleness_cap']} seed={run['seed']}"


def replay(payload: dict, threshold: float, kept_threshold: float) -> dict:
    trained = [r for r in payload["runs"] if not r.get("derived_from")]
    warned, dips, false_alarms, missed = [], [], [], []
    for run in trained:
        warning, dip = first_warning(run, threshold, kept_threshold), dip_step(run["series"]["success"])
        if warning is not None:
            warned.append(run_name(run))
        if dip is not None:
            entry = {"run": run_name(run), "dip_step": dip, "first_warning_step": warning,
                     "warned_before": warning is not None and warning < dip}
            entry["lead_steps"] = dip - warning if entry["warned_before"] else None
            dips.append(entry)
            if not entry["warned_before"]:
                missed.append(run_name(run))
        elif warning is not None:
            false_alarms.append({"run": run_name(run), "first_warning_step": warning})
    return {"kl_warn_threshold": threshold, "kl_warn_kept_threshold": kept_threshold,
            "trained_runs": len(trained), "runs_warned": len(warned), "dips": len(dips),
            "dips_warned": sum(d["warned_before"] for d in dips), "missed_dips": missed,
            "false_alarms": false_alarms, "dip_runs": dips,
            "warned_at_lr_3e-4": [name for name in warned if "lr=0.0003 " in name]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--map", action="append", default=None, metavar="REV",
                        help="a git revision whose stability_map.json to replay too (repeatable; default: "
                             + ", ".join(DEFAULT_REVISIONS) + ")")
    parser.add_argument("--rule", action="append", default=None, metavar="KL,KEPT",
                        help="kl_warn_threshold,kl_warn_kept_threshold (repeatable)")
    args = parser.parse_args()
    revisions = args.map if args.map is not None else list(DEFAULT_REVISIONS)
    rules = [tuple(float(x) for x in r.split(",")) for r in args.rule] if args.rule else list(DEFAULT_RULES)
    maps = []
    for revision in [None, *revisions]:
        payload = load_map(revision)
        maps.append({"source": "results/stability_map.json" if revision is None else f"{revision}:{MAP_FILE}",
                     "map_commit": payload.get("git_commit"), "map_git_dirty": payload.get("git_dirty"),
                     "complete": payload.get("complete"),
                     "rules": [replay(payload, kl, kept) for kl, kept in rules]})
    out = {"benchmark": "kl_guard_replay", "machine": C.machine_info(), **C.git_provenance(), "maps": maps}
    C.save_json("kl_guard_replay", out)
    for m in maps:
        for r in m["rules"]:
            print(f"map {m['map_commit']} ({m['source']}) rule ({r['kl_warn_threshold']:g}, "
                  f"{r['kl_warn_kept_threshold']:g}): warned {r['runs_warned']}/{r['trained_runs']}, dips warned "
                  f"{r['dips_warned']}/{r['dips']} (missed {r['missed_dips']}), false alarms "
                  f"{[a['run'] for a in r['false_alarms']]}, at lr 3e-4: {r['warned_at_lr_3e-4']}")


if __name__ == "__main__":
    main()

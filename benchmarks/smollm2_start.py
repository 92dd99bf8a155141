"""Where the real-model recipe starts: SmolLM2's success on its task before RL, with and without the warm start
(issue 36, item 3: the recipe is chosen so that success at temperature 1.0 starts between 10 % and 60 %).

Composes ``recipes/smollm2.yaml`` as the CLI does (``--overrides`` change the task or the warm start), builds its training tasks,
runs its SFT warm start through the trainer's own ``prepare_model`` into a temporary folder (timed; the recipe's
cached one is not touched), then evaluates the base model and the warm start with ``async_rl.eval`` on the
recipe's held-out items: ``--problems`` problems x ``--samples`` samples at temperature 1.0 on the hf engine.
Saves ``results/smollm2_start.json`` (success, pass@k, mean response tokens, seconds).

    .venv/bin/python benchmarks/smollm2_start.py [--problems 50] [--samples 4] [--overrides KEY=VALUE ...]
        [--out smollm2_start]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, quiet_libraries, save_json, set_threads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def evaluate(model_dir: str, env_cfg, problems: int, samples: int, out_dir: Path) -> dict:
    from omegaconf import OmegaConf

    from async_rl.eval import EvalConfig, run_eval

    cfg = OmegaConf.structured(EvalConfig(model_dir=model_dir, env=env_cfg.name, n_samples=samples,
                                          ks=[k for k in (1, 2, 4, 8) if k <= samples], temperature=1.0,
                                          limit=problems, output_dir=str(out_dir), save_samples=False, plot=False))
    started = time.perf_counter()
    report = run_eval(cfg, env_cfg)
    [(name, result)] = list(report["sets"].items())
    return {"set": name, "problems": len(result["per_problem"]), "samples_per_problem": samples,
            "success_rate": result.get("success_rate"), "pass_at_k": dict(zip(result["k"], result["pass"])),
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=50)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides, e.g. env.dataset=gsm_symbolic model.sft.noise=0")
    parser.add_argument("--out", default="smollm2_start", help="result file stem under results/")
    args = parser.parse_args(argv)
    set_threads()
    quiet_libraries()
    from async_rl.cli_config import compose_command_line
    from async_rl.train import make_tasks, prepare_model

    cfg = compose_command_line(["--config-dir", str(REPO / "recipes"), "--config-name", "smollm2",
                                *args.overrides])  # as the CLI composes it
    with tempfile.TemporaryDirectory(prefix="smollm2_start_") as tmp:
        tmp_path = Path(tmp)
        cfg.model.sft.dir = str(tmp_path / "sft")  # a fresh warm start, timed; the recipe's cache is left alone
        tasks = make_tasks(cfg.env, cfg.seed)
        started = time.perf_counter()
        warm = prepare_model(cfg.model, cfg.env.name, cfg.seed, env_cfg=cfg.env, tasks=tasks)
        warm_start_s = time.perf_counter() - started
        base = str(REPO / cfg.model.dir)
        rows = {"base": evaluate(base, cfg.env, args.problems, args.samples, tmp_path / "eval_base"),
                "warm_start": evaluate(warm, cfg.env, args.problems, args.samples, tmp_path / "eval_warm")}
        import json

        sft_stats = json.loads((Path(warm) / "sft_stats.json").read_text())
    payload = {"benchmark": "smollm2_start", "machine": machine_info(), "recipe": "recipes/smollm2.yaml",
               "overrides": args.overrides, "dataset": cfg.env.dataset, "temperature": 1.0,
               "warm_start_s": round(warm_start_s, 1),
               "sft": {k: sft_stats.get(k) for k in ("steps", "num_demos", "noise", "lr", "batch_size",
                                                     "initial_loss", "final_loss", "seconds")},
               "target_band": [0.10, 0.60], "eval": rows,
               "in_band": {name: 0.10 <= row["success_rate"] <= 0.60 for name, row in rows.items()}}
    path = save_json(args.out, payload)
    for name, row in rows.items():
        print(f"{name}: success {row['success_rate']:.3f} at temperature 1.0 ({row['problems']} problems x "
              f"{row['samples_per_problem']}; pass@k {row['pass_at_k']}); {row['seconds']} s")
    print(f"warm start {warm_start_s:.0f} s; saved {path}")
    return payload


if __name__ == "__main__":
    main()

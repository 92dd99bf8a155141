"""How much RL could gain by sharpening alone: the real-model recipe's warm start, greedy vs sampled (issue 36).

RL on a policy that answers in a few tokens, with no room to compute, mostly sharpens each question's answer
distribution towards its mode. So the most sharpening can give is the share of held-out problems whose *modal*
sampled answer is right, which greedy decoding approximates. For the recipe's cached SFT warm start
(``outputs/models/smollm2-sft-<dataset>-<steps>steps``, made first if missing, as the recipe does) on the recipe's held-out items
(``--overrides`` change the task, e.g. ``env.dataset_config.max_digits=1``), this evaluates with ``async_rl.eval``:
greedy (1 sample) and temperature 1.0 (``--samples`` samples), and from the sampled answers the share of problems
whose most frequent answer is right. Saves ``results/<--out>.json``.

    .venv/bin/python benchmarks/smollm2_answers.py [--problems 100] [--samples 8] [--overrides KEY=VALUE ...]
        [--out smollm2_answers]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, quiet_libraries, save_json, set_threads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def sample_rows(model_dir: str, env_cfg, problems: int, samples: int, temperature: float, out_dir: Path) -> list:
    from omegaconf import OmegaConf

    from async_rl.eval import EvalConfig, run_eval

    cfg = OmegaConf.structured(EvalConfig(model_dir=model_dir, env=env_cfg.name, n_samples=samples, ks=[1],
                                          temperature=temperature, limit=problems, output_dir=str(out_dir),
                                          save_samples=True, plot=False))
    run_eval(cfg, env_cfg)
    return [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines() if line.strip()]


def extracted(response: str) -> str:
    """The text the answer tag holds (what the scorer reads), or the whole response when there is none."""
    start, end = response.find("<answer>"), response.find("</answer>")
    return response[start + len("<answer>"):end].strip() if 0 <= start < end else response.strip()


def summary(rows: list) -> dict:
    by_problem = collections.defaultdict(list)
    for row in rows:
        by_problem[row["problem_id"]].append(row)
    modal_right = 0
    for answers in by_problem.values():
        counts = collections.Counter(extracted(row["response"]) for row in answers)
        top = max(counts.values())
        right = {extracted(row["response"]) for row in answers if row["correct"]}
        # a tie between a right and a wrong answer counts as half
        modal = [answer for answer, count in counts.items() if count == top]
        modal_right += sum(answer in right for answer in modal) / len(modal)
    return {"problems": len(by_problem), "samples": len(rows),
            "success_rate": sum(row["correct"] for row in rows) / max(1, len(rows)),
            "modal_answer_right": modal_right / max(1, len(by_problem)),
            "examples": [{"answer": answers[0]["answer"], "responses": [extracted(r["response"]) for r in answers]}
                         for answers in list(by_problem.values())[:6]]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides of the recipe")
    parser.add_argument("--out", default="smollm2_answers", help="result file stem under results/")
    args = parser.parse_args(argv)
    set_threads()
    quiet_libraries()
    from async_rl.cli_config import compose_command_line
    from async_rl.train import make_tasks, prepare_model

    cfg = compose_command_line(["--config-dir", str(REPO / "recipes"), "--config-name", "smollm2", *args.overrides])
    warm = prepare_model(cfg.model, cfg.env.name, cfg.seed, env_cfg=cfg.env, tasks=make_tasks(cfg.env, cfg.seed))
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="smollm2_answers_") as tmp:
        greedy = summary(sample_rows(warm, cfg.env, args.problems, 1, 0.0, Path(tmp) / "greedy"))
        sampled = summary(sample_rows(warm, cfg.env, args.problems, args.samples, 1.0, Path(tmp) / "sampled"))
    payload = {"benchmark": "smollm2_answers", "machine": machine_info(), "recipe": "recipes/smollm2.yaml",
               "overrides": args.overrides, "dataset": cfg.env.dataset, "warm_start_dir": str(Path(warm).name),
               "greedy": {k: v for k, v in greedy.items() if k != "modal_answer_right"},
               "temperature_1": sampled, "seconds": round(time.perf_counter() - began, 1)}
    path = save_json(args.out, payload)
    print(f"{cfg.env.dataset} {args.overrides}: greedy success {greedy['success_rate']:.3f}; temperature 1.0 success "
          f"{sampled['success_rate']:.3f}, modal answer right on {sampled['modal_answer_right']:.3f} of "
          f"{sampled['problems']} problems; saved {path}")
    return payload


if __name__ == "__main__":
    main()

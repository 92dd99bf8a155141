"""HFRolloutEngine generation throughput vs batch size on a tiny Qwen2 (CPU by default).

Builds a tiny model in a temp dir, then for batch sizes 1..64 generates ``--new-tokens``
tokens per request (eos ignored, so every request runs to the limit) from prompts of mixed
length, and reports generated tokens/s (median of ``--repeats`` timed runs after a
warm-up). For reference it also times transformers' own ``model.generate`` (sampling, KV
cache, no per-token log-probs / versions / stop handling) on the same prompts.
Saves JSON with machine info to benchmarks/results/rollout_throughput.json.

Run: ``.venv/bin/python benchmarks/rollout_throughput.py [--device cuda] [--model-path DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_provenance  # noqa: E402

from async_rl.models.tiny import make_tiny_model  # noqa: E402
from async_rl.rollout import GenerationRequest, HFRolloutEngine, SamplingParams

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "rollout_throughput.json"


def make_prompts(batch_size: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 8..48 tokens (mixed lengths exercise the left-padded prefill)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 49, (batch_size,), generator=generator).tolist()
    # Skip the first ids: they are special tokens in the tiny vocabulary.
    return [torch.randint(16, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels, lazy imports)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_engine(engine: HFRolloutEngine, prompts, new_tokens: int, repeats: int) -> float:
    def run():
        requests = [
            GenerationRequest(i, p, SamplingParams(max_new_tokens=new_tokens, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        outputs = engine.generate(requests)
        assert all(o.num_tokens == new_tokens for o in outputs)

    return median_seconds(run, repeats)


def time_hf_generate(engine: HFRolloutEngine, prompts, new_tokens: int, repeats: int) -> float:
    model, device = engine.model, engine.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), engine.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    def run():
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=engine.pad_token_id,
            )
        assert out.shape[1] == width + new_tokens

    return median_seconds(run, repeats)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-path", default=None, help="local checkpoint; default: a fresh tiny Qwen2")
    parser.add_argument("--no-hf-generate", action="store_true", help="skip the model.generate reference")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the tiny model's ops are too small to split, and "
        "on a busy 2-core box 2 threads were ~10x slower from OpenMP contention)",
    )
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or make_tiny_model(Path(tmp) / "tiny", seed=0)
        engine = HFRolloutEngine(model_path, device=args.device)
        config = engine.model.config
        rows = []
        print(f"{'batch':>5} {'engine tok/s':>13} {'engine s':>9} {'hf.generate tok/s':>18} {'ratio':>6}")
        for batch_size in args.batch_sizes:
            prompts = make_prompts(batch_size, engine.vocab_size, seed=batch_size)
            generated = batch_size * args.new_tokens
            engine_seconds = time_engine(engine, prompts, args.new_tokens, args.repeats)
            row = {
                "batch_size": batch_size,
                "new_tokens_per_request": args.new_tokens,
                "prompt_lengths": [len(p) for p in prompts],
                "engine_seconds": engine_seconds,
                "engine_tokens_per_s": generated / engine_seconds,
            }
            if not args.no_hf_generate:
                hf_seconds = time_hf_generate(engine, prompts, args.new_tokens, args.repeats)
                row["hf_generate_seconds"] = hf_seconds
                row["hf_generate_tokens_per_s"] = generated / hf_seconds
            rows.append(row)
            hf_rate = row.get("hf_generate_tokens_per_s")
            print(
                f"{batch_size:>5} {row['engine_tokens_per_s']:>13.1f} {engine_seconds:>9.3f} "
                + (f"{hf_rate:>18.1f} {row['engine_tokens_per_s'] / hf_rate:>6.2f}" if hf_rate else "")
            )

    result = {
        "benchmark": "HFRolloutEngine generated tokens/s (median of repeats, prefill included)",
        "model": {
            "path": str(args.model_path) if args.model_path else "tiny Qwen2 (async_rl.models.tiny defaults)",
            "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size,
            "dtype": str(next(engine.model.parameters()).dtype),
        },
        "sampling": {"temperature": 1.0, "top_p": 1.0, "ignore_eos": True},
        "repeats": args.repeats,
        "rows": rows,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": args.device,
            "cuda": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            **git_provenance(),
        },
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out_path}")
    return result


if __name__ == "__main__":
    main()

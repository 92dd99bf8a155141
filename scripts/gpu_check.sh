#!/usr/bin/env bash
# One unattended check of the GPU rollout path (issue 10, item 7), for a 1-GPU machine, <= 10 minutes:
#   bash scripts/gpu_check.sh            (log: $OUT/gpu_check.log, results: $OUT/gpu_check_vllm.json)
#   WHEELHOUSE=/path/to/wheels bash scripts/gpu_check.sh   (offline machine: install from a local wheel directory)
# 1. installs the `vllm` profile (vllm 0.27.1 on torch 2.13.0, verl 0.9.1) in .venv-gpu;
# 2. builds a tiny Qwen2 locally (head dim 64, which every vLLM attention backend supports);
# 3. one vLLM replica (our AsyncLLM server, docs/rollout.md §10) behind our ReplicaPool: tokens/s, update latency through
#    the object-store checkpoint engine, and vLLM-vs-trainer log-prob agreement per token (mean / max abs
#    difference, fraction outside the DIS interval) -- scripts/gpu_check_vllm.py;
# 4. a short asynchronous Li2SAO run with rollout.engine=vllm rollout.replicas=1 (actor and critic on CPU
#    worker groups, the replica on the GPU), 24 steps: its reward must rise (mean success of the last 6 steps
#    >= the first 6 + 0.10; the CPU vLLM demo went 0.38 -> 0.75 in 20 steps), then prints its tokens/s and
#    update latency from metrics.jsonl.
# 5. the same run with rollout.mode=hybrid (our hf engine inside the CUDA train rank, docs/rollout.md §8);
# 6. vLLM in the hybrid engine: sleep frees GPU memory, an update wakes it, every request keeps its returned tokens
#    and later tokens carry the new version -- scripts/gpu_check_sleep.py.
# Not covered on one GPU: rollout.weight_sync=checkpoint_manager rollout.checkpoint_backend=nccl needs the
# trainer and the vLLM replica on two different GPUs (NCCL refuses two ranks on one device; docs/rollout.md §9).
# Worst-case time: the step timeouts add up to 180 + 20 + 30 + 100 + 150 + 50 + 70 = 600 s (creating the venv and
# reading the run's metrics take seconds and have no timeout of their own).
# Every step has its own timeout; the script goes on after a failed step and exits non-zero at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
START=$(date +%s)
FAILED=0
step() { echo; echo "== [$(( $(date +%s) - START )) s] $*"; }
fail() { echo "FAILED: $*"; FAILED=1; }

step "install the vllm profile into .venv-gpu"
PIP_ARGS=()
if [ -n "${WHEELHOUSE:-}" ]; then PIP_ARGS=(--no-index --find-links "$WHEELHOUSE"); fi
python3.11 -m venv .venv-gpu || { echo "FAILED: python3.11 -m venv"; exit 1; }
. .venv-gpu/bin/activate
timeout 180 pip install -q "${PIP_ARGS[@]}" -e ".[vllm,test]" || { echo "FAILED: pip install .[vllm]"; exit 1; }
timeout 20 python - <<'PY' || { echo "FAILED: no CUDA GPU visible"; exit 1; }
import torch, transformers, vllm, verl
print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "verl", verl.__version__)
assert torch.cuda.is_available(), "no CUDA GPU"
print("gpu", torch.cuda.get_device_name(0))
PY

MODEL=outputs/gpu_check/tiny-h256
step "build the tiny model ($MODEL)"
timeout 30 python -m async_rl.models.tiny --out "$MODEL" --hidden-size 256 --num-heads 4 --num-kv-heads 2 \
  --intermediate-size 512 || fail "tiny model"

step "vLLM replica: tokens/s, in-flight update latency, log-prob agreement"
PYTHONUNBUFFERED=1 timeout 100 python scripts/gpu_check_vllm.py --model "$MODEL" --out "$OUT_DIR/gpu_check_vllm.json" \
  || fail "vLLM replica check"

RUN=gpu-check-li2sao-vllm
step "short async Li2SAO run: rollout.engine=vllm rollout.replicas=1"
PYTHONUNBUFFERED=1 timeout 150 python -m async_rl.train --config-name demo trainer.workers=ray \
  trainer.scheduler=concurrent trainer.device=cpu rollout.device=cuda rollout.engine=vllm rollout.replicas=1 \
  model.dir=outputs/gpu_check/tiny-demo-h256 model.hidden_size=256 algorithm.train_batch_trajectories=16 \
  trainer.driver.total_steps=24 trainer.wandb=false trainer.run_name=$RUN trainer.output_dir=outputs/gpu_check \
  || fail "async Li2SAO run on vLLM"
python - "outputs/gpu_check/$RUN/metrics.jsonl" <<'PY' || fail "the run on vLLM did not learn (or left no metrics)"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
lat = [r["rollout/update_latency_s"] for r in rows if r.get("rollout/update_latency_s")]
print(f"steps {len(rows)}, tokens/s {rows[-1]['perf/tokens_per_s']:.1f}, "
      f"in-flight update latency median {statistics.median(lat) if lat else float('nan'):.3f} s, "
      f"replica aborted requests {rows[-1].get('async/replica_aborted', 0):.0f}")
mismatch = [r["rollout/mismatch_kl"] for r in rows if "rollout/mismatch_kl" in r]
print(f"rollout/mismatch_kl (vLLM vs trainer, k3): mean {statistics.mean(mismatch):.2e} over {len(mismatch)} steps"
      if mismatch else "rollout/mismatch_kl: no step had tokens at the trainer's own version")
success = [r["train/success_rate"] for r in rows if "train/success_rate" in r]
first, last = statistics.mean(success[:6]), statistics.mean(success[-6:])
print(f"train/success_rate: first 6 steps {first:.3f}, last 6 steps {last:.3f} ({len(success)} steps)")
assert len(success) >= 24, f"only {len(success)} steps logged"
assert last >= first + 0.10, f"reward did not rise: {first:.3f} -> {last:.3f}"
PY

RUN=gpu-check-li2sao-hybrid
step "short async Li2SAO run: rollout.mode=hybrid (hf engine inside the train rank, on the GPU)"
PYTHONUNBUFFERED=1 timeout 50 python -m async_rl.train --config-name demo trainer.workers=ray \
  trainer.scheduler=concurrent trainer.device=cuda rollout.mode=hybrid \
  model.dir=outputs/gpu_check/tiny-demo-h256 model.hidden_size=256 algorithm.train_batch_trajectories=16 \
  trainer.driver.total_steps=8 trainer.wandb=false trainer.run_name=$RUN trainer.output_dir=outputs/gpu_check \
  || fail "async Li2SAO run, hybrid hf on CUDA"

step "vLLM in the hybrid engine: sleep and wake-up on the GPU"
PYTHONUNBUFFERED=1 timeout 70 python scripts/gpu_check_sleep.py --model "$MODEL" || fail "vLLM sleep / wake-up"

step "done (exit status $FAILED)"
exit $FAILED

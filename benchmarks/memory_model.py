"""Peak memory per rank of an actor, critic or SAPO update: an analytic model, checked against measurement.

    python benchmarks/memory_model.py            # recipes table + CPU check (about 5 minutes on 2 cores)
    python benchmarks/memory_model.py --predict  # recipes table only (instant)

What it predicts (bytes per rank, steady state: AdamW state exists from the first step on)
-----------------------------------------------------------------------------------------
``peak = params + adam + max(A, B) (+ the frozen SAPO reference)`` with W data-parallel ranks, N
parameters, N_t trainable (the critic freezes attention):

* params ``4N/W`` (fp32 masters), adam ``8 N_t/W`` (fp32 exp_avg + exp_avg_sq), grads ``4 N_t/W``;
* A, the forward/backward of the *last* micro-batch (earlier micro-batches left their gradients):
  ``grads (if more than one micro-batch, else the LM-head/embedding gradient only) + activations +
  LM-head logits + gathered parameters``;
* B, the optimizer step: ``grads`` plus AdamW's per-parameter temporaries (two fp32 copies of the
  largest tensor).

Activations are counted from what autograd saves for one Hugging Face Qwen2/Qwen3 decoder layer per
token (``layer_activation_bytes``; every term is a tensor named in its docstring), for the three
compute paths of the engine: fp32; bf16 autocast over fp32 parameters (world size 1); bf16 FSDP2
mixed precision (world size > 1). With activation checkpointing only each layer's input is kept plus
one layer's activations during its recompute. The LM head costs ``per_position x V`` bytes for every
position computed at once (all response positions of the micro-batch, or one chunk with chunked
log-probs). FSDP2 keeps the root unit (embeddings, LM head, final norm) gathered through forward and
backward and two decoder units at a time (prefetch). World size 1 under bf16 autocast keeps a bf16 copy
of every matmul weight from forward to backward.

What it measures (CPU, world size 1, tiny models)
--------------------------------------------------
Each setting runs in a fresh process with glibc's mmap threshold pinned to 64 KiB
(``MALLOC_MMAP_THRESHOLD_``), so every tensor buffer is its own mapping and is returned to the OS when
freed: resident memory then follows live tensor bytes. After a warm-up update (lazy inits, AdamW state),
the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``), one update runs, and ``VmHWM`` is read.
Measured = that peak minus the RSS before the model was built (imports, allocator and thread pools are
not the model's). The same quantity is predicted. Results: ``benchmarks/results/memory_model.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1024 ** 3
MIB = 1024 ** 2


# ---------------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShape:
    """The config numbers the memory of a Qwen2/Qwen3-style decoder depends on."""

    name: str
    hidden: int  # h
    intermediate: int  # I (SwiGLU width)
    layers: int  # L
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    vocab: int  # V
    tied_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q, k, v
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head
    source_dir: Optional[str] = None  # a pretrained model to load for measuring (None: built from these numbers)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        h, q, k = self.hidden, self.q_width, self.kv_width
        params = h * q + 2 * h * k + q * h
        if self.qkv_bias:
            params += q + 2 * k
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def layer_params(self) -> int:
        return self.attention_params() + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def layer_matmul_params(self) -> int:
        h, q, k = self.hidden, self.q_width, self.kv_width
        return h * q + 2 * h * k + q * h + 3 * h * self.intermediate

    def root_params(self) -> int:
        """Embeddings, LM head (if untied) and the final norm: FSDP2's root unit."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.hidden

    def num_params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


def shape_from_config(model_dir: str, name: str) -> ModelShape:
    """The shape of a Hugging Face Llama/Qwen2/Qwen3 checkpoint, read from its ``config.json``.

    Llama's decoder layer (RMSNorm, GQA attention with RoPE, SwiGLU MLP) saves the same tensors as Qwen2's;
    ``attention_bias`` is Qwen2's q/k/v bias."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return ModelShape(name, hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                      layers=config["num_hidden_layers"], heads=heads, kv_heads=config.get("num_key_value_heads", heads),
                      head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab=config["vocab_size"],
                      tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                      qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                      qk_norm=config.get("model_type") == "qwen3", source_dir=str(model_dir))


# Qwen/Qwen3-4B config.json (public): hidden_size 2560, intermediate_size 9728, num_hidden_layers 36,
# num_attention_heads 32, num_key_value_heads 8, head_dim 128, vocab_size 151936, tie_word_embeddings true;
# Qwen3 has q_norm / k_norm and no q/k/v bias. 4.02e9 parameters.
QWEN3_4B = ModelShape("Qwen3-4B", hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128,
                      vocab=151936, tied_embeddings=True, qkv_bias=False, qk_norm=True)


# ---------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class UpdateSetting:
    """One update on one rank."""

    role: str  # actor | critic | sapo
    world_size: int  # data-parallel ranks of this role
    precision: str  # bf16 | fp32
    rows: int  # trajectories per rank per optimizer step
    prompt_len: int  # padded prompt width P
    response_len: int  # padded response width R
    max_tokens_per_micro_batch: Optional[int] = None  # None = the whole batch in one micro-batch
    activation_checkpointing: bool = False
    logits_chunk_tokens: Optional[int] = 1024  # None = full logits
    frozen_attention: bool = True  # critic only

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    def micro_batch_rows(self) -> int:
        if self.max_tokens_per_micro_batch is None:
            return self.rows
        return max(1, min(self.rows, self.max_tokens_per_micro_batch // self.seq_len))

    def micro_batches(self) -> int:
        return math.ceil(self.rows / self.micro_batch_rows())

    def path(self) -> str:
        """Compute path of the engine: fp32 | autocast (bf16, world size 1) | fsdp_mp (bf16, sharded)."""
        if self.precision == "fp32":
            return "fp32"
        return "autocast" if self.world_size == 1 else "fsdp_mp"


def layer_activation_bytes(shape: ModelShape, path: str) -> float:
    """Bytes autograd saves per token for one decoder layer (HF Qwen2/Qwen3, SDPA with native GQA).

    fp32 (all tensors 4 bytes): per RMSNorm its input x, the normalised x and the scaled output (3h) and
    1/rms; q/k/v read the norm output (shared); SDPA keeps q and k after RoPE, v, its output (= o_proj's
    input) and a per-head log-sum-exp (2q + 2k + heads); the MLP keeps gate, silu(gate), up and their
    product (4I). Qwen3's q/k norms add x and x-normalised on q and k and 1/rms per head.

    bf16 autocast over fp32 parameters (world size 1): the residual stream stays fp32; each RMSNorm
    keeps x and x-normalised in fp32 (8h); every matmul casts its input to bf16 separately (q, k, v:
    3 x 2h; gate, up: 2 x 2h); SDPA casts q, k after RoPE to bf16 (2q + 2k), keeps bf16 v and output
    (2k + 2q); the MLP's four tensors are bf16 (8I). Qwen3 norms: fp32 copy and bf16 output (6q + 6k).

    bf16 FSDP2 mixed precision (bf16 parameters, bf16 residual stream): each RMSNorm keeps an fp32 copy
    of x (4h) and bf16 x-normalised and output (2h + 2h); attention and MLP as in autocast but with no
    extra input casts.
    """
    h, q, k, i = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate
    heads, kv_heads = shape.heads, shape.kv_heads
    if path == "fp32":
        per = 2 * (3 * 4 * h + 4) + 4 * (2 * q + 2 * k) + 4 * heads + 4 * 4 * i
        if shape.qk_norm:
            per += 4 * (2 * q + 2 * k) + 4 * (heads + kv_heads)
    elif path == "autocast":
        per = 2 * (8 * h + 4) + 3 * 2 * h + 2 * 2 * h + 2 * (2 * q + 2 * k) + 4 * heads + 4 * 2 * i
        if shape.qk_norm:
            per += 6 * q + 6 * k + 4 * (heads + kv_heads)
    elif path == "fsdp_mp":
        per = 2 * (8 * h + 4) + 2 * (2 * q + 2 * k) + 4 * heads + 4 * 2 * i
        if shape.qk_norm:
            per += 6 * q + 6 * k + 4 * (heads + kv_heads)
    else:
        raise ValueError(f"unknown compute path {path!r}")
    return float(per)


def residual_bytes(path: str) -> int:
    """Bytes per hidden unit of the residual stream (what a checkpointed layer keeps: its input)."""
    return 2 if path == "fsdp_mp" else 4


def logits_bytes_per_position(path: str, with_entropy: bool) -> float:
    """Bytes per vocabulary entry per position alive while one block of logits is differentiated.

    float32 logits / temperature kept for ``logsumexp`` (4; in fp32 with temperature 1 and no banned id this
    is the matmul's output itself), in backward ``exp(x - lse)`` and the gradient (4 + 4) and the gradient's
    copy through the gather (4); bf16 adds the bf16 gradient into the matmul (2; the bf16 logits out of it
    are freed once upcast). The entropy keeps probs and the finite logits and their product (3 x 4)."""
    per = 16.0 if path == "fp32" else 18.0
    return per + (12.0 if with_entropy else 0.0)


def predict(shape: ModelShape, s: UpdateSetting) -> dict[str, float]:
    """Predicted bytes per rank, by component, and ``peak``."""
    if s.role not in ("actor", "critic", "sapo"):
        raise ValueError(f"role must be actor, critic or sapo, got {s.role!r}")
    path = s.path()
    world = s.world_size
    compute_bytes = 4 if path == "fp32" else 2
    if s.role == "critic":
        n_params = shape.num_params() - (0 if shape.tied_embeddings else shape.vocab * shape.hidden) + shape.hidden + 1
        frozen = shape.layers * shape.attention_params() if s.frozen_attention else 0
    else:
        n_params, frozen = shape.num_params(), 0
    n_trainable = n_params - frozen
    params = 4 * n_params / world
    adam = 8 * n_trainable / world
    grads = 4 * n_trainable / world

    rows = s.micro_batch_rows()
    tokens = rows * s.seq_len
    positions = rows * s.response_len
    per_layer = layer_activation_bytes(shape, path)
    r = residual_bytes(path)
    # final norm (x, normalised; fp32 copy under bf16), RoPE cos/sin shared by all layers, the response
    # positions' hidden states handed to the LM head
    base = tokens * (8 * shape.hidden + 2 * shape.head_dim * r) + positions * shape.hidden * r
    if s.role == "critic":
        logits = positions * 4.0 * 8  # the value head: one fp32 scalar per position and its grads
    else:
        block = positions if s.logits_chunk_tokens is None else min(s.logits_chunk_tokens, positions)
        logits = block * shape.vocab * logits_bytes_per_position(path, with_entropy=s.role == "sapo")
    if s.activation_checkpointing:
        activations = tokens * shape.layers * shape.hidden * r + base
        transient = max(logits, tokens * per_layer)
    else:
        activations = tokens * shape.layers * per_layer + base
        transient = logits

    # parameters in compute form
    gathered = 0.0
    if world > 1:
        # FSDP2: the root unit stays gathered; two decoder units gathered at once (prefetch); in backward a
        # unit's unsharded gradient (parameter dtype) and its fp32 copy for the reduce-scatter
        param_bytes = 2 if path == "fsdp_mp" else 4
        gathered = (param_bytes * shape.root_params() + 2 * param_bytes * shape.layer_params()
                    + (param_bytes + 4) * shape.layer_params())
    elif path == "autocast":
        matmul = shape.layers * shape.layer_matmul_params() + (0 if s.role == "critic" else shape.vocab * shape.hidden)
        # bf16 casts live from forward to backward (saved by each matmul); with checkpointing only the
        # recomputed layer's and the LM head's (the autocast cache ends with the forward)
        gathered = 2 * matmul if not s.activation_checkpointing else 2 * (shape.layer_matmul_params()
                                                                            + shape.vocab * shape.hidden)
    head_grad = 4 * shape.vocab * shape.hidden / world if s.role != "critic" else 0.0
    grads_during_forward = grads if s.micro_batches() > 1 else head_grad
    phase_a = grads_during_forward + activations + transient + gathered
    largest = max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate) / world
    phase_b = grads + 2 * 4 * largest
    reference = n_params * compute_bytes if s.role == "sapo" else 0.0  # a full frozen copy on every rank
    peak = params + adam + max(phase_a, phase_b) + reference
    return {"params": params, "adam": adam, "grads": grads, "activations": activations, "transient": transient,
            "gathered": gathered, "reference": reference, "phase_a": phase_a, "phase_b": phase_b, "peak": peak,
            "micro_batches": s.micro_batches(), "micro_batch_rows": rows}


# ---------------------------------------------------------------------------------------------------- recipes
def recipe_settings() -> list[tuple[str, UpdateSetting, int]]:
    """(label, setting, GPU memory in bytes) for the Qwen3-4B recipes on one 8 x 80 GB node.

    AIME / DAPO-Math (recipes/aime.yaml): B = 128 trajectories per step, prompts padded to 1024, responses
    to 8192 (env/math.yaml). ALFWorld / WebShop with SAPO on all 8 GPUs: B = 128, prompt 2048, response
    slot 8192 (multi-turn, observations inside the slot). Token budget 16k, bf16, checkpointing, chunks of
    1024 positions: the settings the recipes need (docs/engine.md §7).
    """
    gpu = 80 * 10 ** 9
    common = dict(precision="bf16", max_tokens_per_micro_batch=16384, activation_checkpointing=True,
                  logits_chunk_tokens=1024)
    aime = dict(prompt_len=1024, response_len=8192, **common)
    sapo = dict(prompt_len=2048, response_len=8192, **common)
    out = []
    for actor_gpus, critic_gpus in ((4, 4), (2, 6)):
        out.append((f"actor {actor_gpus}+{critic_gpus}", UpdateSetting("actor", actor_gpus, rows=128 // actor_gpus,
                                                                       **aime), gpu))
        critic_rows = math.ceil(128 / critic_gpus)
        out.append((f"critic {actor_gpus}+{critic_gpus}", UpdateSetting("critic", critic_gpus, rows=critic_rows, **aime),
                    gpu))
    out.append(("SAPO on 8", UpdateSetting("sapo", 8, rows=128 // 8, **sapo), gpu))
    out.append(("actor 4+4, no budget/ckpt/chunks", UpdateSetting("actor", 4, "bf16", 32, 1024, 8192,
                                                                  None, False, None), gpu))
    out.append(("actor 4+4, fp32", UpdateSetting("actor", 4, rows=32, **{**aime, "precision": "fp32"}), gpu))
    return out


def recipes_table() -> list[dict]:
    rows = []
    for label, setting, capacity in recipe_settings():
        p = predict(QWEN3_4B, setting)
        components = {k: v / GIB for k, v in p.items() if k not in ("micro_batches", "micro_batch_rows")}
        rows.append({"label": label, "setting": asdict(setting), "predicted_gib": p["peak"] / GIB,
                     "fits_80gb": p["peak"] < capacity, "components_gib": components,
                     "micro_batches": p["micro_batches"], "micro_batch_rows": p["micro_batch_rows"]})
    return rows


# ---------------------------------------------------------------------------------------------------- measuring
TINY = ModelShape("tiny-qwen2", hidden=128, intermediate=352, layers=4, heads=4, kv_heads=2, head_dim=32,
                  vocab=8192, tied_embeddings=False, qkv_bias=True, qk_norm=False)
TINY_QWEN3 = replace(TINY, name="tiny-qwen3", qkv_bias=False, qk_norm=True)

CHECKS: list[tuple[ModelShape, UpdateSetting]] = [
    (TINY, UpdateSetting("actor", 1, "fp32", 2, 128, 384, None, False, None)),
    (TINY, UpdateSetting("actor", 1, "fp32", 2, 128, 384, None, False, 256)),
    (TINY, UpdateSetting("actor", 1, "fp32", 2, 128, 384, None, True, 256)),
    (TINY, UpdateSetting("actor", 1, "fp32", 4, 128, 384, 1024, True, 256)),
    (TINY, UpdateSetting("actor", 1, "bf16", 2, 128, 384, None, False, None)),
    (TINY, UpdateSetting("actor", 1, "bf16", 2, 128, 384, None, True, 256)),
    (TINY_QWEN3, UpdateSetting("actor", 1, "fp32", 2, 128, 384, None, False, 256)),
    (TINY, UpdateSetting("critic", 1, "fp32", 2, 128, 384, None, False, None)),
    (TINY, UpdateSetting("sapo", 1, "fp32", 2, 128, 384, None, False, 256)),
]


# The real-model recipe (recipes/smollm2.yaml): 16 trajectories a step, prompts of ~80 tokens with SmolLM2's system
# prompt padded to 96, answers of at most 24 tokens padded to 32; the trainer defaults (one micro-batch, no
# checkpointing, log-probs in chunks of 1024 positions). SAPO's reserved readouts are the vocabulary's last ids here.
SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "outputs" / "models" / "smollm2"
SMOLLM2_SETTINGS: list[UpdateSetting] = [
    UpdateSetting("actor", 1, "fp32", 16, 96, 32, None, False, 1024),
    UpdateSetting("actor", 1, "bf16", 16, 96, 32, None, False, 1024),
    UpdateSetting("critic", 1, "fp32", 16, 96, 32, None, False, None),
    UpdateSetting("actor", 1, "fp32", 16, 96, 32, None, True, 1024),
]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _build_model(shape: ModelShape):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if shape.source_dir is not None:  # a pretrained checkpoint, loaded as the trainer loads model=local
        from async_rl.models.loading import load_causal_lm

        return load_causal_lm(shape.source_dir, dtype=torch.float32, attn_implementation="sdpa")

    cls, cfg_cls = (Qwen3ForCausalLM, Qwen3Config) if shape.qk_norm else (Qwen2ForCausalLM, Qwen2Config)
    config = cfg_cls(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                     num_hidden_layers=shape.layers, num_attention_heads=shape.heads, head_dim=shape.head_dim,
                     num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tied_embeddings,
                     attn_implementation="sdpa")
    torch.manual_seed(0)
    return cls(config)


def _batch(s: UpdateSetting, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 2, (s.rows, s.seq_len), generator=g)  # the last two ids: SAPO's readouts
    full = torch.ones(s.rows, s.response_len)
    return {"prompts": ids[:, :s.prompt_len], "responses": ids[:, s.prompt_len:],
            "prompt_mask": torch.ones(s.rows, s.prompt_len), "response_attention": full, "response_mask": full.clone(),
            "token_turn_index": torch.zeros(s.rows, s.response_len, dtype=torch.long),
            "token_level_rewards": torch.zeros(s.rows, s.response_len),
            "advantages": torch.randn(s.rows, s.response_len, generator=g),
            "behaviour_log_probs": -torch.rand(s.rows, s.response_len, generator=g) * 3}


def _update_fn(shape: ModelShape, s: UpdateSetting):
    """A callable running one update of ``s.role`` on a batch, the same code path as the roles."""
    from async_rl.engine import FSDPEngine, MicroBatchPlan, OptimizerConfig
    from async_rl.models.critic import CriticModel, freeze_attention
    from async_rl.models.logprobs import response_token_logprobs

    optim = OptimizerConfig(lr=1e-5)
    plan = MicroBatchPlan(max_tokens=s.max_tokens_per_micro_batch)
    model = _build_model(shape)
    if s.role == "sapo":
        from async_rl.workers.sapo import SapoRole

        role = SapoRole(model, optim, reserved_ids=(shape.vocab - 1, shape.vocab - 2), precision=s.precision,
                        max_tokens_per_micro_batch=s.max_tokens_per_micro_batch,
                        activation_checkpointing=s.activation_checkpointing, logits_chunk_tokens=s.logits_chunk_tokens,
                        kl_coef=0.01)

        def prepare(batch):
            from async_rl.driver.batch import turn_tensors
            from async_rl.driver.learner import shared_backbone_targets

            turns = turn_tensors(batch)
            return batch, turns, shared_backbone_targets(role, batch, turns, {})[1]

        def run(prepared):
            batch, turns, targets = prepared
            role.update(batch, turns, targets)

        return prepare, run
    if s.role == "critic":
        critic = CriticModel(model)
        if s.frozen_attention:
            freeze_attention(critic)
        engine = FSDPEngine(critic, optim, precision=s.precision, activation_checkpointing=s.activation_checkpointing)
    else:
        engine = FSDPEngine(model, optim, precision=s.precision, activation_checkpointing=s.activation_checkpointing)

    def run(batch):
        import torch

        engine.train_mode()
        response_len = batch["responses"].shape[1]
        denominator = engine.global_denominator(batch["response_mask"].sum())
        for rows in plan.split(batch):
            mb = {k: v[rows] for k, v in batch.items()}
            ids = torch.cat([mb["prompts"], mb["responses"]], dim=1)
            mask = torch.cat([mb["prompt_mask"], mb["response_attention"]], dim=1)
            if s.role == "critic":
                values = engine.module(ids, mask)[:, -response_len - 1:-1]
                loss_sum = ((values - mb["advantages"]) ** 2 * mb["response_mask"]).sum()
            else:
                lp, _ = response_token_logprobs(engine.module, ids, mask, response_len,
                                                chunk_tokens=s.logits_chunk_tokens)
                ratio = torch.exp(lp - mb["behaviour_log_probs"])
                loss_sum = -(ratio * mb["advantages"] * mb["response_mask"]).sum()
            engine.backward(loss_sum, denominator)
        engine.step()

    return (lambda batch: batch), run


def measure_one(shape: ModelShape, s: UpdateSetting) -> dict[str, float]:
    """Run in a fresh process (see module docstring); returns measured bytes."""
    import gc

    import torch

    torch.set_num_threads(1)
    # Imports, kernel and thread-pool initialisation belong to the process, not to the model: run the same
    # update once on a throwaway model of the same family (8-wide, 1 layer, 64 ids) before the baseline.
    throwaway = replace(shape, source_dir=None, hidden=8, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=4, vocab=64)
    small = replace(s, rows=1, response_len=4, prompt_len=4, max_tokens_per_micro_batch=None)
    prepare, run = _update_fn(throwaway, small)
    run(prepare(_batch(small, throwaway.vocab, seed=0)))
    del prepare, run
    gc.collect()
    before_model = _status_kib("VmRSS") * 1024
    prepare, run = _update_fn(shape, s)
    warm = replace(s, rows=1, response_len=8, prompt_len=8)
    run(prepare(_batch(warm, shape.vocab, seed=1)))  # lazy inits and the AdamW state
    prepared = prepare(_batch(s, shape.vocab, seed=2))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    steady = _status_kib("VmRSS") * 1024
    began = time.perf_counter()
    run(prepared)
    seconds = time.perf_counter() - began
    peak = _status_kib("VmHWM") * 1024
    return {"measured_peak": float(peak - before_model), "measured_steady": float(steady - before_model),
            "update_s": seconds}


def measure(shape: ModelShape, s: UpdateSetting, timeout_s: float = 900.0) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    payload = json.dumps({"shape": asdict(shape), "setting": asdict(s)})
    out = subprocess.run([sys.executable, __file__, "--measure-one", payload], env=env, capture_output=True,
                         text=True, timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measurement of {s} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _machine() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import machine_info

    info = machine_info()
    info["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return info


def describe(shape: ModelShape, s: UpdateSetting) -> str:
    parts = [shape.name, s.role, s.precision, f"{s.rows}x{s.seq_len}"]
    if s.max_tokens_per_micro_batch:
        parts.append(f"budget {s.max_tokens_per_micro_batch}")
    parts.append("ckpt" if s.activation_checkpointing else "no ckpt")
    if s.role != "critic":
        parts.append(f"chunks {s.logits_chunk_tokens}" if s.logits_chunk_tokens else "full logits")
    return ", ".join(parts)


def compare(shape: ModelShape, settings: list[UpdateSetting]) -> list[dict]:
    """Predicted vs measured peak per setting, each measured in a fresh process; printed as it goes."""
    checks = []
    for s in settings:
        predicted = predict(shape, s)
        measured = measure(shape, s)
        error = predicted["peak"] / measured["measured_peak"] - 1.0
        checks.append({"setting": describe(shape, s), "predicted_mib": predicted["peak"] / MIB,
                       "predicted_components_mib": {k: predicted[k] / MIB for k in
                                                    ("params", "adam", "grads", "activations", "transient",
                                                     "gathered", "phase_a", "phase_b")},
                       "measured_mib": measured["measured_peak"] / MIB,
                       "measured_steady_mib": measured["measured_steady"] / MIB,
                       "update_s_one_thread": round(measured["update_s"], 2), "relative_error": error})
        print(f"  {describe(shape, s):62s} predicted {predicted['peak'] / MIB:7.1f}  measured "
              f"{measured['measured_peak'] / MIB:7.1f}  ({error:+.0%}), update {measured['update_s']:.1f} s",
              flush=True)
    return checks


def smollm2_check() -> None:
    """The memory model against the real model (issue 36, item 5): SmolLM2-135M-Instruct, Llama architecture."""
    if not (SMOLLM2_DIR / "config.json").exists():
        raise SystemExit(f"no converted SmolLM2 in {SMOLLM2_DIR}: run `make smollm2` first")
    shape = shape_from_config(str(SMOLLM2_DIR), "SmolLM2-135M-Instruct")
    print(f"{shape.name}: {shape.num_params() / 1e6:.1f}e6 parameters (config.json); predicted vs measured, MiB, "
          "one thread per update")
    checks = compare(shape, SMOLLM2_SETTINGS)
    result = {"model": shape.name, "shape": asdict(shape), "num_params": shape.num_params(), "checks": checks,
              "max_abs_relative_error": max(abs(c["relative_error"]) for c in checks), "machine": _machine()}
    result["shape"]["source_dir"] = "outputs/models/smollm2"
    print(f"largest |error| {result['max_abs_relative_error']:.0%} (target: within 25%)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory_model_smollm2.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {RESULTS / 'memory_model_smollm2.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--predict", action="store_true", help="recipes table only, no measurement")
    parser.add_argument("--smollm2", action="store_true",
                        help="predict and measure updates of the real model (outputs/models/smollm2, make smollm2) "
                             "at the real-model recipe's sizes; saves results/memory_model_smollm2.json")
    parser.add_argument("--measure-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_one:
        spec = json.loads(args.measure_one)
        print(json.dumps(measure_one(ModelShape(**spec["shape"]), UpdateSetting(**spec["setting"]))))
        return
    if args.smollm2:
        smollm2_check()
        return

    print(f"Qwen3-4B: {QWEN3_4B.num_params() / 1e9:.2f}e9 parameters; one 8 x 80 GB node")
    print(f"{'recipe':36s} {'rows/mb':>8s} {'mbs':>4s} {'peak GiB':>9s}  fits 80 GB")
    table = recipes_table()
    for row in table:
        print(f"{row['label']:36s} {row['micro_batch_rows']:8d} {row['micro_batches']:4d} "
              f"{row['predicted_gib']:9.1f}  {'yes' if row['fits_80gb'] else 'NO'}")
    result = {"recipes": table}
    if not args.predict:
        print("\npredicted vs measured (CPU, world size 1; MiB; measured = peak RSS of the update minus RSS "
              "before the model was built)")
        checks = [check for shape, setting in CHECKS for check in compare(shape, [setting])]
        result["checks"] = checks
        result["max_abs_relative_error"] = max(abs(c["relative_error"]) for c in checks)
        result["machine"] = _machine()
        print(f"largest |error| {result['max_abs_relative_error']:.0%} (target: within 25%)")
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "memory_model.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {RESULTS / 'memory_model.json'}")


if __name__ == "__main__":
    main()

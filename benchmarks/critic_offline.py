"""Can a frozen-attention critic learn Li2SAO's readiness statistics on toy_keys? An offline replay.

For each warm start (the SFT default with ``blind_fraction`` = each value of ``--blind-fractions``) the script
samples ``--batches`` bootstrap batches (B = 32 = 8 prompts x 4) from the *fixed* warm-started policy with the
deterministic driver (the learner's train step is replaced by one that only records the batch, so the
policy never changes). Then, for each critic variant (attention frozen, spec §3, or trained too), a fresh
critic is fitted with exactly the learner's bootstrap critic step: residual targets ``R - μ_g``, the divergence
mask, the clipped residual loss of Eq. 10 around V_old, and the ranking loss of Eq. 11 (α 0.1, m 0.1), K
passes per batch. After each epoch over the training batches it reports e_k and a_k (Eq. 12-13) on the
held-out last ``--heldout`` batches, summed over them as the gate's statistics are.

Run: ``.venv/bin/python benchmarks/critic_offline.py [--blind-fractions 0.5,1.0] [--epochs 3]``;
writes benchmarks/results/critic_offline.json. Used by docs/toy_tasks.md ("Why the critic can learn here").
"""

from __future__ import annotations

import argparse
import time

import _common as C
import _training as T

B = 32
GROUP = 4


def warm_start(blind_fraction: float, seed: int = 0) -> str:
    """The default SFT warm start but for ``blind_fraction``, cached under outputs/bench_models/."""
    from async_rl.models.sft import sft_warm_start
    from async_rl.models.tiny import make_tiny_model

    root = T.MODEL_CACHE / f"tiny-toy_keys-s{seed}-sft{T._sft_settings_tag('toy_keys')}-blind{blind_fraction:g}"
    base, sft = root / "base", root / "sft"
    if not (base / "config.json").exists():
        make_tiny_model(base, seed=seed)
    if not (sft / "config.json").exists():
        print(f"SFT warm start (blind_fraction {blind_fraction:g}) into {sft} ...", flush=True)
        sft_warm_start(base, sft, env_name="toy_keys", seed=seed, blind_fraction=blind_fraction)
    return str(sft)


def sample_batches(model: str, num_batches: int, seed: int) -> list:
    """``num_batches`` bootstrap batches (lists of trajectories) from the fixed policy in ``model``."""
    import async_rl.envs.toy  # noqa: F401  (registers the toy envs)
    from async_rl.config import AlgorithmConfig, GateConfig
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.driver.learner import StepResult
    from async_rl.envs.toy import make_toy_tasks

    # the gate can never open (T_min beyond the run): every batch is a bootstrap batch of groups of 4
    algo = AlgorithmConfig(name="li2sao", train_batch_trajectories=B, group_size=GROUP, use_critic=True,
                           policy_loss="dis_clip", gate=GateConfig(t_min=num_batches + 1, t_max=num_batches + 2))
    spec = RunSpec(model_path=model, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 256, seed), seed=seed,
                   max_new_tokens=24, limits=EpisodeLimits(max_turns=4, max_response_tokens=160))
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=num_batches, max_inflight_trajectories=B),
                                        spec)
    recorded: list = []

    def record_only(trajectories):  # no actor or critic update: the next batches come from the same policy
        recorded.append(trajectories)
        driver.learner.step += 1
        return StepResult({"actor/updated": 0.0}, actor_updated=False)

    driver.learner.train_step = record_only
    driver.run()
    return recorded


def fit_and_measure(model: str, batches: list, heldout: int, freeze: bool, lr: float, epochs: int,
                    passes: int, seed: int) -> list[dict]:
    """Fresh critic from ``model``; (e_k, a_k) on the held-out batches before training and after each epoch."""
    import torch

    from async_rl.algos import (broadcast_to_tokens, divergence_mask, readiness_from_statistics,
                                readiness_statistics, residual_critic_targets, values_at_last_model_token)
    from async_rl.driver.batch import collate
    from async_rl.engine.base import OptimizerConfig
    from async_rl.models.loading import load_causal_lm, load_tokenizer
    from async_rl.workers.roles import CriticRole

    pad = load_tokenizer(model).pad_token_id
    collated = [(collate(t, pad), [x.group_id for x in t]) for t in batches]
    train, held = collated[:-heldout], collated[-heldout:]
    torch.manual_seed(seed)
    critic = CriticRole(load_causal_lm(model), OptimizerConfig(lr=lr, max_grad_norm=1.0, weight_decay=0.0),
                        freeze_attention=freeze)

    def measure(epoch: int) -> dict:
        total = None
        for batch, groups in held:
            terminal = values_at_last_model_token(critic.values(batch), batch["response_mask"])
            stats = readiness_statistics(terminal, batch["scores"], groups)
            total = stats if total is None else total + stats
        e_k, a_k = readiness_from_statistics(total)
        return {"epoch": epoch, "e_k": e_k, "a_k": a_k, "mixed_trajectories": float(total[0])}

    curve = [measure(0)]
    for epoch in range(1, epochs + 1):
        for batch, groups in train:  # the learner's bootstrap critic step (driver/learner.py)
            mask, scores = batch["response_mask"], batch["scores"]
            old_values = critic.values(batch)
            targets, keep = residual_critic_targets(broadcast_to_tokens(scores, mask), scores, groups, mask)
            critic_mask = divergence_mask(batch["responses"], mask, scores, groups,
                                          batch["response_attention"]) * keep.unsqueeze(1)
            ranking = {"scores": scores, "group_ids": groups, "margin": 0.1, "coef": 0.1}
            for _ in range(passes):
                critic.update(batch, targets, critic_mask, old_values, 0.2, ranking)
        curve.append(measure(epoch))
    return curve


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blind-fractions", default="0.5,1.0", help="warm starts to compare (comma-separated)")
    parser.add_argument("--batches", type=int, default=24, help="batches sampled per warm start")
    parser.add_argument("--heldout", type=int, default=6, help="last batches kept for measuring")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--passes", type=int, default=2, help="K critic passes per batch (spec §3: 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.heldout < args.batches:
        raise SystemExit(f"--heldout {args.heldout}: need 1 <= heldout < --batches ({args.batches})")
    fractions = [float(x) for x in args.blind_fractions.split(",") if x.strip()]
    C.set_threads()
    C.quiet_libraries()
    machine = C.machine_info()
    started = time.perf_counter()
    rows = []
    for fraction in fractions:
        model = warm_start(fraction, args.seed)
        batches = sample_batches(model, args.batches, args.seed)
        success = sum(t.success for b in batches for t in b) / sum(len(b) for b in batches)
        for freeze in (True, False):
            curve = fit_and_measure(model, batches, args.heldout, freeze, args.critic_lr, args.epochs, args.passes,
                                    args.seed)
            rows.append({"blind_fraction": fraction, "attention": "frozen" if freeze else "trained",
                         "sampled_success": success, "training_batches": args.batches - args.heldout,
                         "curve": curve})
            shown = " / ".join(f"({p['e_k']:.2f}, {p['a_k']:.2f})" for p in curve[1:])
            print(f"blind_fraction {fraction:g}, attention {rows[-1]['attention']}: success {success:.2f}; "
                  f"held-out (e_k, a_k) after each epoch {shown}", flush=True)
    results = {"benchmark": "critic_offline", "setup": vars(args), "runs": rows,
               "total_wall_s": time.perf_counter() - started, "machine": machine}
    path = C.save_json("critic_offline", results)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

"""Our names are registered in verl on import and via the entry point, without touching verl's entries."""

import json
import subprocess
import sys

import pytest
import torch

SNAPSHOT = r"""
import json, os
from verl.trainer.ppo import core_algos as c
before = {k: f"{v.__module__}.{v.__qualname__}" for reg in ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY")
          for k, v in getattr(c, reg).items()}
import async_rl
after = {k: f"{v.__module__}.{v.__qualname__}" for reg in ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY")
         for k, v in getattr(c, reg).items()}
print(json.dumps({"before": before, "after": after,
                  "adv": sorted(c.ADV_ESTIMATOR_REGISTRY), "loss": sorted(c.POLICY_LOSS_REGISTRY)}))
"""


def _run(code, **env):
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_registers_names_and_changes_no_verl_entry():
    res = _run(SNAPSHOT, VERL_USE_EXTERNAL_PLUGINS="none")
    before, after = res["before"], res["after"]
    assert not any(name in before for name in ("sao_gae", "li2sao_group", "sapo_turn", "dis", "dis_clip", "sapo_ar"))
    for name, target in before.items():
        assert after[name] == target, f"verl's entry {name} changed"
    assert {"sao_gae", "li2sao_group", "sapo_turn"} <= set(res["adv"])
    assert {"dis", "dis_clip", "sapo_ar"} <= set(res["loss"])
    assert after["sapo"].startswith("verl."), "verl's own 'sapo' loss must stay verl's"


@pytest.mark.slow
def test_entry_point_registers_in_stock_verl():
    code = ("import json, sys; from verl.trainer.ppo import core_algos as c; "
            "print(json.dumps({'adv': sorted(c.ADV_ESTIMATOR_REGISTRY), 'loss': sorted(c.POLICY_LOSS_REGISTRY),"
            " 'imported': 'async_rl' in sys.modules}))")
    res = _run(code, VERL_USE_EXTERNAL_PLUGINS="auto")
    assert res["imported"] and "sao_gae" in res["adv"] and "dis" in res["loss"]


def test_registered_functions_follow_verl_calling_convention():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    import async_rl  # noqa: F401

    mask = torch.ones(4, 3)
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    import numpy as np

    index = np.array(["a", "a", "b", "b"], dtype=object)
    adv, _ = get_adv_estimator_fn("li2sao_group")(token_level_rewards=rewards, response_mask=mask, index=index,
                                                  config=None)
    assert adv[0, 0] > 0 > adv[1, 0]
    # sao_gae without values (stock verl's call) fails with a message naming the fix
    try:
        get_adv_estimator_fn("sao_gae")(token_level_rewards=rewards, response_mask=mask, config=None)
    except ValueError as err:
        assert "values" in str(err)
    else:
        raise AssertionError("expected ValueError")
    adv, ret = get_adv_estimator_fn("sao_gae")(token_level_rewards=rewards, response_mask=mask,
                                               values=torch.zeros(4, 3), config=None)
    assert torch.allclose(ret[:, -1], rewards[:, -1])

    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                            "policy_loss": {"rollout_correction": {"rollout_is_threshold": "0.5_2.0"}},
                            "global_batch_info": {}})
    log_prob = torch.log(torch.tensor([[1.0, 2.5, 0.6]]))  # 2.5 lies outside (0.5, 2.0)
    loss, metrics = get_policy_loss_fn("dis")(torch.zeros(1, 3), log_prob, torch.ones(1, 3), torch.ones(1, 3),
                                              "token-mean", cfg, None)
    assert abs(loss.item() - (-(1.0 + 0.6) / 3)) < 1e-6
    assert abs(metrics["actor/dis_masked_frac"] - 1 / 3) < 1e-6


def test_sapo_ar_policy_term():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import async_rl  # noqa: F401

    # ratio 1.5 with A = 1 is clipped at 1.2: loss = -(1.2 + 1.0) / 2
    log_prob = torch.log(torch.tensor([[1.5, 1.0]]))
    loss, m = get_policy_loss_fn("sapo_ar")(torch.zeros(1, 2), log_prob, torch.ones(1, 2), torch.ones(1, 2),
                                            "token-mean", {"clip_ratio": 0.2}, None)
    assert abs(loss.item() + 1.1) < 1e-6 and m["actor/pg_clipfrac"] == 0.5

"""Why the tiny aime recipe's residual EV e_k sat at 0 (issue 19), measured on the recipe's own model.

Li2SAO's readiness (spec §4, Eq. 12-13) reads ``V(s_{i,T_i})`` at each response's last model token
(``<|im_end|>``, the state after the closing ``}`` of ``\\boxed{...}``). The recipe used to train the critic at
the 4B recipe's lr (5e-6) on one group per step for 4 steps, and e_k stayed at 0. The read-out is not the
limit: a frozen-attention critic built from the recipe's warm-started model, fit to the residual targets
``Z_i = R_i - μ_g`` at that position, separates right from wrong boxed answers (e_k and a_k above the gate's η_e and
η_a on wrong answers the fit did not see), while the old lr leaves e_k at 0 after as many steps. The fit (plain squared
error, full batch) is ``benchmarks/aime_tiny_gate.py``'s, and its results file has the measured values;
tests/test_recipes.py checks that the recipe's gate now opens on evidence.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gate_bench(load_benchmark):
    return load_benchmark("aime_tiny_gate")


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def recipe_model(request, gate_bench, tmp_path_factory):
    return gate_bench.recipe_model(tmp_path_factory.mktemp(f"aime{request.param}"), request.param)


def test_warm_started_critic_separates_right_from_wrong_answers(gate_bench, recipe_model):
    """On the fitted groups and on wrong answers the fit did not see (results/aime_tiny_gate.json has the
    values; the weakest seed is 0)."""
    fit = gate_bench.readout_fit(*recipe_model, lr=1e-3)
    assert fit["e_k_fit"] > 0.4, fit
    assert fit["e_k_unseen"] > 0.2 and fit["a_k_unseen"] > 0.65, fit  # η_e and η_a of the gate


def test_4b_critic_lr_leaves_e_k_at_zero(gate_bench, recipe_model):
    """At 5e-6 the values barely leave their initialisation in as many steps."""
    fit = gate_bench.readout_fit(*recipe_model, lr=5e-6)
    assert abs(fit["e_k_fit"]) < 0.01 and abs(fit["e_k_unseen"]) < 0.01, fit

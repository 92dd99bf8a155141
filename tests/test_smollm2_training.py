"""The product path on a real pretrained model (SmolLM2-135M-Instruct, model=smollm2) with a real task
(env=reasoning_gym): engine log-probs against the trainer's, SAPO's reserved readout ids on a real vocabulary, and
one training step of Li2SAO and of SAPO through the same driver the CLI builds. Short sequences only: one
forward+backward of 135M parameters costs seconds on a CPU. The converted model is the session's ``smollm2_dir``.
"""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.rollout.base import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow

# measured on this 2-core CPU (fp32 engine vs fp32 trainer, 3 prompts x 12 tokens): max |delta logp| 2.96e-5
# nats (KV-cached incremental decoding vs one forward); the tolerance leaves 30x margin
LOGPROB_ATOL = 1e-3
QUESTIONS = ["What is 3 + 5?", "Tom has 6 pens and buys 2 more. How many pens does he have now?",
             "Name a colour."]


@pytest.fixture(scope="module")
def threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def engine(smollm2_dir, threads):
    from async_rl.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(str(smollm2_dir), dtype="float32")


def _chat_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


def test_engine_logprobs_equal_the_trainers_teacher_forced_logprobs(engine, smollm2_dir):
    from async_rl.models.loading import load_causal_lm
    from async_rl.models.logprobs import response_token_logprobs

    prompts = _chat_prompts(engine.tokenizer)
    assert len({len(p) for p in prompts}) == 3  # a left-padded batch in the engine
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)
    outputs = engine.generate([GenerationRequest(i, p, sampling) for i, p in enumerate(prompts)])
    trainer_model = load_causal_lm(smollm2_dir, dtype="float32")  # as the actor loads it
    worst = 0.0
    for output in outputs:
        ids = torch.tensor([output.prompt_ids + output.token_ids])
        with torch.no_grad():
            lp, _ = response_token_logprobs(trainer_model, ids, torch.ones_like(ids), len(output.token_ids))
        delta = (torch.tensor(output.logprobs) - lp[0]).abs().max().item()
        worst = max(worst, delta)
        # real magnitudes: a pretrained model's sampled tokens are mostly likely ones (not ~log(1/49152) = -10.8)
        assert lp[0].mean().item() > -6.0
    print(f"engine vs trainer max |delta logp| = {worst:.2e}")
    assert worst < LOGPROB_ATOL, f"engine vs trainer max |delta logp| = {worst:.2e}"


def test_sapo_readout_ids_are_unused_specials_and_never_sampled(engine):
    from async_rl.workers.sapo import resolve_reserved_ids

    tokenizer = engine.tokenizer
    reserved = resolve_reserved_ids(tokenizer, ["<|value_plus|>", "<|value_minus|>"])  # the algorithm's default
    assert tokenizer.convert_ids_to_tokens(list(reserved)) == ["<jupyter_script>", "<empty_output>"]
    assert reserved == (15, 16)
    prompts = _chat_prompts(tokenizer)
    assert not set(reserved) & {t for p in prompts for t in p}  # the chat never writes them
    # make the readout ids the model's favourite next tokens: their output rows point along the final hidden
    # state of the first prompt (tied embeddings: the input rows change too, which no prompt uses)
    model = engine.model
    with torch.no_grad():
        hidden = model(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states[-1][0, -1]
        head = model.get_output_embeddings().weight
        saved = head[list(reserved)].clone()
        head[list(reserved)] = (40.0 * hidden / hidden.norm() ** 2).expand(2, -1)
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3)
        free = engine.generate([GenerationRequest(0, prompts[0], sampling)])[0]
        assert free.token_ids[0] in reserved  # unbanned, the boosted ids win: the check below can fail
        outputs = engine.generate([
            GenerationRequest(f"{i}-{j}", p, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True,
                                                           seed=3 + j, banned_token_ids=reserved))
            for i, p in enumerate(prompts) for j in range(2)])
        assert all(not set(o.token_ids) & set(reserved) for o in outputs)
        assert all(math.isfinite(lp) for o in outputs for lp in o.logprobs)
    finally:
        with torch.no_grad():
            head[list(reserved)] = saved


def _one_step(smollm2_dir, algo, steps=1):
    """``steps`` training steps on 1-digit sums (short prompts and answers); returns the driver, its history and
    every trajectory the learner trained on."""
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.reasoning_gym_env import make_reasoning_gym_tasks

    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    tasks = make_reasoning_gym_tasks("basic_arithmetic", config, 0, num_train=8, num_eval=0, answer_format="answer_tag")
    spec = RunSpec(model_path=str(smollm2_dir), env_name="reasoning_gym",
                   env_kwargs={"dataset": "basic_arithmetic", "dataset_config": config, "answer_format": "answer_tag",
                               "data_seed": 0, "num_train": 8, "num_eval": 0},
                   tasks=tasks, max_new_tokens=8, limits=EpisodeLimits(max_turns=1, max_response_tokens=8))
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=steps, chunk_tokens=8, synchronous=True), spec)
    trained = []
    original = driver.learner.train_step

    def spy(batch):
        trained.extend(batch)
        return original(batch)

    driver.learner.train_step = spy
    return driver, driver.run(), trained


def _finite_losses(row: dict) -> dict:
    losses = {k: v for k, v in row.items() if k.endswith("loss") and isinstance(v, (int, float))}
    assert losses, f"no loss in the step's metrics: {sorted(row)}"
    assert all(math.isfinite(v) for v in losses.values()), losses
    return losses


def _small_mismatch(row: dict) -> None:
    """The trainer's log-probs of the sampled tokens match the engine's: the driver's own mismatch metrics on the
    real model (fp32 both sides, measured ~1e-5 nats; the actor path logs them, SAPO's role does not)."""
    assert row["rollout/mismatch_tokens"] > 0
    assert 0 <= row["rollout/mismatch_abs_logprob_mean"] < LOGPROB_ATOL and abs(row["rollout/mismatch_kl"]) < 1e-4, \
        {k: v for k, v in row.items() if k.startswith("rollout/mismatch")}


@pytest.mark.e2e
def test_li2sao_trains_one_step_on_smollm2(smollm2_dir, threads):
    from async_rl.config import AlgorithmConfig, GateConfig

    algo = AlgorithmConfig(name="li2sao", train_batch_trajectories=2, group_size=2, use_critic=True,
                           actor_lr=1e-6, critic_lr=1e-5, policy_loss="dis_clip",
                           gate=GateConfig(t_min=0, patience=1, t_max=4))
    _, history, trained = _one_step(smollm2_dir, algo)
    assert len(history) == 1 and len(trained) == 2
    losses = _finite_losses(history[0])
    assert any(k.startswith("critic/") for k in losses) and any(k.startswith("actor/") for k in losses)
    _small_mismatch(history[0])


@pytest.mark.e2e
def test_sapo_trains_one_step_on_smollm2_and_never_samples_its_readout_ids(smollm2_dir, threads):
    from async_rl.config import AlgorithmConfig

    algo = AlgorithmConfig(name="sapo", train_batch_trajectories=2, group_size=1, actor_lr=1e-6)
    driver, history, trained = _one_step(smollm2_dir, algo)
    assert len(history) == 1 and len(trained) == 2
    _finite_losses(history[0])
    reserved = tuple(driver.learner.actor.reserved_ids)
    assert reserved == (15, 16)  # <jupyter_script>, <empty_output>: default_reserved_ids' rule 1
    sampled = [t for traj in trained for seg in traj.segments if seg.kind == "model" for t in seg.token_ids]
    assert len(sampled) >= 2 and not set(sampled) & set(reserved)

"""The knobs users know from verl and TRL: KL in the reward with its adaptive controller, DAPO's overlong
shaping, the entropy bonus. Hand-worked values for the pure pieces, then short runs on the tiny model."""

import asyncio
import math
import time

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from numerics_support import ADAM_WEIGHTS_ATOL
from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import OverlongConfig, SamplingConfig, TrainerConfig
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.rl.rollout.types import RolloutRun, make_prompt_group, sample_from_completion
from training.utils.rl.train_step import (
    BatchUpdate,
    KLCoefficient,
    adapt_kl_beta,
    chunk_advantages,
    kl_sums,
    overlong_penalty,
    pack_groups,
    train_batch,
)
from training.utils.run_files.logging import read_ledger
from training.utils.trainer import Datum, MicroBatch, Trainer


def segment(n_out: int, reward: float):
    return sample_from_completion([1, 2], list(range(10, 10 + n_out)), [-1.0] * n_out, reward=reward)


# ---- the pure pieces ---------------------------------------------------------------------------


def test_overlong_penalty_is_dapos_soft_punishment():
    # L_max = 10, L_cache = 4: 0 up to 6, then (6 − L)/4 down to −1 at 10, −1 beyond.
    assert [overlong_penalty(n, 10, 4) for n in (3, 6, 7, 8, 10, 12)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_adaptive_kl_controller_rule():
    # β = 0.1, target 0.1, n = 64 runs, horizon 1000: the error KL/target − 1 is clipped to ±0.2.
    assert adapt_kl_beta(0.1, 0.3, 0.1, 64, 1000) == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))   # error 2 -> 0.2
    assert adapt_kl_beta(0.1, 0.09, 0.1, 64, 1000) == pytest.approx(0.1 * (1 - 0.1 * 64 / 1000))  # error −0.1
    assert adapt_kl_beta(0.1, 0.0, 0.1, 64, 1000) == pytest.approx(0.1 * (1 - 0.2 * 64 / 1000))   # error −1 -> −0.2
    assert adapt_kl_beta(0.1, 0.1, 0.1, 64, 1000) == 0.1


def test_kl_sums_over_trained_tokens_by_estimator():
    # weights (0, 1, 1); π_old = (·, −1, −2), π_ref = (·, −1.5, −1); the first position is context.
    datum = Datum(input_ids=[1, 2, 3], target_ids=[2, 3, 4], weights=[0.0, 1.0, 1.0],
                  behaviour_logprobs=[0.0, -1.0, -2.0], advantage=0.0, prompt_len=2)
    old, ref = torch.tensor([9.0, -1.0, -2.0]), torch.tensor([-9.0, -1.5, -1.0])
    # k1 π_old − π_ref: 0.5 + (−1) = −0.5
    assert kl_sums([old], [ref], [datum], "k1") == [pytest.approx(-0.5)]
    # k3 exp(d) − d − 1 with d = π_ref − π_old = −0.5, 1: (e^−0.5 − 0.5) + (e − 2)
    assert kl_sums([old], [ref], [datum], "k3") == [pytest.approx(math.exp(-0.5) - 0.5 + math.e - 2)]


def groups_of_two():
    """Group a: run 0 has two segments (2 and 1 trained tokens, reward 1), run 1 one (1 token, reward 0).
    Group b: two one-segment runs of 1 token, reward 2 each."""
    a = make_prompt_group("a", [RolloutRun([segment(2, 1.0), segment(1, 1.0)]), RolloutRun([segment(1, 0.0)])])
    b = make_prompt_group("b", [RolloutRun([segment(1, 2.0)]), RolloutRun([segment(1, 2.0)])])
    return a, b


def test_pack_groups_tags_each_datum_with_its_group_and_run():
    a, b = groups_of_two()
    datums, run_of_D = pack_groups([a, b])
    assert run_of_D == [(0, 0), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert [sum(d.weights) for d in datums] == [2.0, 1.0, 1.0, 1.0, 1.0]


def test_chunk_advantages_by_hand():
    a, b = groups_of_two()
    cfg = rl_loop.Config(model="tiny-random", advantage_estimator="dr_grpo", completions_per_prompt=2)
    datums, run_of_D = pack_groups([a, b])
    plain = chunk_advantages([a, b], datums, run_of_D, cfg, 0.0, None)
    assert [d.advantage for d in datums] == [0.5, 0.5, -0.5, 0.0, 0.0]  # dr_grpo on the raw rewards
    assert plain.kl_penalty_R == [] and plain.overlong_R == []
    # Per-datum KL sums, β = 0.1: group a run 0: 0.1·(0.5 + 1.0) = 0.15, run 1: 0.1·0.2 = 0.02;
    # group b: 0 and 0.1·1.0 = 0.1. Overlong L_max = 3, L_cache = 2: run a0 (3 tokens) (1 − 3)/2 = −1, others 0.
    shaped_cfg = cfg.model_copy(update={"overlong_penalty": OverlongConfig(buffer=2, max_length=3)})
    shaping = chunk_advantages([a, b], datums, run_of_D, shaped_cfg, 0.1, [0.5, 1.0, 0.2, 0.0, 1.0])
    # Shaped rewards: a = (1 − 0.15 − 1, 0 − 0.02) = (−0.15, −0.02), mean −0.085 -> A = (−0.065, 0.065);
    #                 b = (2, 2 − 0.1) = (2, 1.9), mean 1.95 -> A = (0.05, −0.05).
    assert [d.advantage for d in datums] == pytest.approx([-0.065, -0.065, 0.065, 0.05, -0.05])
    assert shaping.kl_penalty_R == pytest.approx([0.15, 0.02, 0.0, 0.1])
    assert shaping.overlong_R == [-1.0, 0.0, 0.0, 0.0]
    assert a.rewards_G == [1.0, 0.0]  # the groups keep their raw rewards
    # Only the KL, group a alone: a = (1 − 0.15, −0.02), mean 0.415 -> ±0.435.
    datums_a, run_of_a = pack_groups([a])
    only_kl = chunk_advantages([a], datums_a, run_of_a, cfg, 0.1, [0.5, 1.0, 0.2])
    assert [d.advantage for d in datums_a] == pytest.approx([0.435, 0.435, -0.435])
    assert only_kl.overlong_R == []


def test_kl_coefficient_adapts_only_toward_a_target_and_checkpoints_only_then():
    fixed = KLCoefficient(0.1)
    fixed.update(0.3, 64)
    assert fixed.beta == 0.1 and fixed.state_dict() == {}
    adaptive = KLCoefficient(0.1, target=0.1, horizon=1000)
    adaptive.update(float("nan"), 64)
    assert adaptive.beta == 0.1
    adaptive.update(0.3, 64)
    assert adaptive.beta == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))
    assert adaptive.state_dict() == {"kl_beta": adaptive.beta}
    cfg = rl_loop.Config(model="tiny-random", kl_beta=0.1, kl_target=0.1, completions_per_prompt=2)
    assert KLCoefficient.for_run(cfg, {"kl_beta": 0.3}).beta == 0.3 and KLCoefficient.for_run(cfg, {}).beta == 0.1
    assert KLCoefficient.for_run(cfg.model_copy(update={"kl_target": None}), {"kl_beta": 0.3}).beta == 0.1


def test_config_checks_of_the_knobs():
    with pytest.raises(ValidationError, match="kl_placement='reward' needs kl_beta > 0"):
        rl_loop.Config(kl_placement="reward")
    with pytest.raises(ValidationError, match="kl_target needs kl_beta > 0"):
        rl_loop.Config(kl_target=0.1)
    with pytest.raises(ValidationError, match="kl_horizon=10 must exceed 0.2·P·G = 12.8"):
        rl_loop.Config(kl_beta=0.1, kl_target=0.1, kl_horizon=10)
    with pytest.raises(ValidationError, match="overlong_penalty.buffer=300 exceeds max_length=256"):
        rl_loop.Config(overlong_penalty=OverlongConfig(buffer=300))
    with pytest.raises(ValidationError, match="entropy_coef"):
        rl_loop.Config(entropy_coef=-0.1)
    assert rl_loop.Config(overlong_penalty=OverlongConfig(buffer=30, max_length=100)).overlong_penalty.max_length == 100


# ---- the entropy's gradient through the trainer -------------------------------------------------


def test_training_pass_entropy_carries_the_exact_gradient():
    """forward_backward(with_entropy, entropy_grad) with loss −mean(H): the gradient of a direct forward's H."""
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(260), device="cpu")
    tokens = [5, 17, 33, 80, 121, 7]
    datum = Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[0.0, 0.0, 1.0, 1.0, 1.0],
                  behaviour_logprobs=[-1.0] * 5, advantage=0.0, prompt_len=3)
    trainer = Trainer(model, TrainerConfig(precision="fp32"))

    def entropy_loss(logprobs, mb: MicroBatch):
        assert mb.extras["entropy"].requires_grad
        return -(mb.extras["entropy"] * mb.weights).sum() / mb.num_tokens_total, {}

    trainer.forward_backward([datum], entropy_loss, with_entropy=True, entropy_grad=True)
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logp = torch.log_softmax(model(torch.tensor([datum.input_ids])).logits[0].float(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    (-(entropy * torch.tensor(datum.weights)).sum() / 3).backward()
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and any(g.abs().max() > 0 for g in got.values())
    assert all(torch.allclose(got[k], want[k], atol=1e-6, rtol=1e-4) for k in want)


# ---- end to end on the tiny model ---------------------------------------------------------------

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(8)]
COMMON = dict(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=3,
              sampling=SamplingConfig(max_tokens=4, timeout_s=30), trainer=TrainerConfig(learning_rate=1e-3),
              progress=False)


def factory(make_setup):
    """No sampler: lengths and rewards vary with (row, draw)."""
    async def rollout_fn(row, sample_index):
        await asyncio.sleep(0)
        n_out = 1 + (sample_index + int(row["id"][1:])) % 3
        reward = float((sample_index * 7 + int(row["id"][1:])) % 4)
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index + k for k in range(n_out)],
                                      [-1.0 - 0.1 * k for k in range(n_out)], reward)

    return rollout_fn


def run(recipe, tmp_path, name, **overrides):
    cfg = recipe.Config(**(COMMON | overrides), log_path=str(tmp_path / name), output_dir=str(tmp_path / f"{name}_out"))
    summary = recipe.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    return [r for r in read_ledger(summary["ledger"]) if "train/loss" in r], load_file(
        str(tmp_path / f"{name}_out" / "model.safetensors"))


def test_kl_in_the_reward_end_to_end_and_chunked_like_one_batch(tmp_path):
    knobs = dict(kl_beta=0.5, kl_placement="reward", overlong_penalty=OverlongConfig(buffer=2, max_length=3))
    sync, sync_weights = run(rl_loop, tmp_path, "sync", **knobs)
    assert [r["step"] for r in sync] == [1, 2, 3]
    # The loss has no KL term, the KL to the reference is still measured; rollout/* keep the raw rewards.
    assert all(r["train/kl_loss"] == 0.0 and r["train/kl_beta"] == 0.5 for r in sync)
    assert sync[-1]["train/ref_kl"] > 0
    # Step 1 trains the reference's own weights: no KL, no penalty; later steps pay one.
    assert sync[0]["train/kl_reward_penalty_mean"] == pytest.approx(0.0, abs=1e-6)
    assert sync[1]["train/kl_reward_penalty_mean"] != 0.0 and sync[2]["train/kl_reward_penalty_mean"] != 0.0
    # Outputs of 1, 2, 3 tokens with L_max = 3, L_cache = 2: penalties 0, −0.5, −1.
    assert all(-1.0 <= r["train/overlong_penalty_mean"] < 0 for r in sync)
    # Two chunks of one group each, their gradients accumulated: the same steps as one batch.
    chunked, chunked_weights = run(async_rl_loop, tmp_path, "chunked", max_head_offpolicy_versions=0,
                                   pipeline_chunks_per_step=2, **knobs)
    assert [r["async/realized_chunks"] for r in chunked] == [2.0, 2.0, 2.0]
    # Both recipes' ledgers carry the trainer's phase times, inside the trainer's busy time.
    for r in sync + chunked:
        phases = [r[f"perf/{phase}_time"] for phase in ("ref_forward", "old_policy_forward", "fwd_bwd", "optim_step")]
        assert all(t > 0 for t in phases) and sum(phases) <= r["perf/train_time"], r
    for mine, ref in zip(chunked, sync):
        for key in ("train/loss", "train/grad_norm", "train/kl_reward_penalty_mean", "train/overlong_penalty_mean",
                    "rollout/raw_reward"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    assert all(torch.allclose(chunked_weights[k], sync_weights[k], atol=ADAM_WEIGHTS_ATOL) for k in sync_weights)
    # The shaping changed what was trained.
    plain, _ = run(rl_loop, tmp_path, "plain", kl_beta=0.5)
    assert plain[0]["train/loss"] != pytest.approx(sync[0]["train/loss"], abs=1e-6)


def test_adaptive_kl_beta_follows_the_rule_and_resumes(tmp_path):
    knobs = dict(kl_beta=0.1, kl_placement="reward", kl_target=0.001, kl_horizon=100, dcp_save_interval=1)
    cfg = rl_loop.Config(**(COMMON | knobs | dict(max_steps=2)), log_path=str(tmp_path / "run"))
    as_written = cfg.model_dump()
    rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert cfg.model_dump() == as_written, "β is run state: the config stays what the user wrote"
    resumed = cfg.model_copy(update=dict(max_steps=3))
    rl_loop.main(resumed, rollout_fn_factory=factory, rows=ROWS)
    steps = [r for r in read_ledger(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    betas = [r["train/kl_beta"] for r in steps]
    assert betas[0] == 0.1
    # β after step k from step k's train/ref_kl and its P·G = 8 runs; step 3 ran after the resume.
    for k in (1, 2):
        assert betas[k] == pytest.approx(adapt_kl_beta(betas[k - 1], steps[k - 1]["train/ref_kl"], 0.001, 8, 100))
    assert betas[2] != betas[1] != betas[0]


def test_entropy_bonus_end_to_end(tmp_path):
    base, base_weights = run(rl_loop, tmp_path, "base")
    bonus, bonus_weights = run(rl_loop, tmp_path, "bonus", entropy_coef=0.05)
    # Step 1 trains the same samples from the same weights: the token-mean loss only gains −c·mean(H).
    assert bonus[0]["train/loss"] == pytest.approx(base[0]["train/loss"] - 0.05 * base[0]["train/entropy"], abs=1e-6)
    assert bonus[0]["train/grad_norm"] != pytest.approx(base[0]["train/grad_norm"], abs=1e-6)
    assert not all(torch.equal(bonus_weights[k], base_weights[k]) for k in base_weights)
    # The chunked path (a training pass per chunk, normalised at the end) trains the same steps.
    chunked, chunked_weights = run(async_rl_loop, tmp_path, "chunked", entropy_coef=0.05,
                                   max_head_offpolicy_versions=0, pipeline_chunks_per_step=2)
    for mine, ref in zip(chunked, bonus):
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    # Summation order differs in float; AdamW divides by √v, which magnifies it where a gradient is tiny (1.8e-5 seen).
    assert all(torch.allclose(chunked_weights[k], bonus_weights[k], atol=1e-4) for k in bonus_weights)


# ---- per-phase timers ---------------------------------------------------------------------------


def test_phase_timers_measure_each_trainer_phase(monkeypatch):
    """Each phase's wall time lands in its own perf/<phase>_time, summed over chunks and optimizer steps."""
    torch.manual_seed(0)
    policy = Trainer(load_model_and_tokenizer(tiny_config(260), device="cpu")[0], TrainerConfig(precision="fp32"))
    reference = Trainer(load_model_and_tokenizer(tiny_config(260), device="cpu")[0], TrainerConfig(precision="fp32"),
                        trainable=False)
    delays = {"ref_forward": 0.05, "old_policy_forward": 0.10, "fwd_bwd": 0.02, "optim_step": 0.03}

    def slowed(obj, method, delay):
        inner = getattr(obj, method)

        def call(*args, **kwargs):
            time.sleep(delay)
            return inner(*args, **kwargs)

        monkeypatch.setattr(obj, method, call)

    slowed(reference, "logprobs", delays["ref_forward"])
    slowed(policy, "logprobs", delays["old_policy_forward"])
    slowed(policy, "forward_backward", delays["fwd_bwd"])
    slowed(policy, "optim_step", delays["optim_step"])
    groups = [make_prompt_group(f"g{i}", [RolloutRun([sample_from_completion([1, 40 + i, 50], [60 + i, 70], [-1.0] * 2,
                                                                              reward=float(r))]) for r in (0, 1)])
              for i in range(2)]
    # Two chunks, 2 PPO epochs: each chunk pays a reference and an anchor pass, the inner loop 2 passes and 2 steps.
    cfg = rl_loop.Config(model="tiny-random", kl_beta=0.1, ppo_epochs=2, completions_per_prompt=2)
    update = BatchUpdate(policy, reference, cfg, np.random.default_rng(0), KLCoefficient(cfg.kl_beta), planned_chunks=2)
    update.add(groups[:1])
    update.add(groups[1:])
    metrics = update.finish()
    calls = {"ref_forward": 2, "old_policy_forward": 2, "fwd_bwd": 2, "optim_step": 2}
    for phase, delay in delays.items():
        spent = metrics[f"perf/{phase}_time"]
        assert calls[phase] * delay <= spent < calls[phase] * delay + 1.0, (phase, spent)
    # One PPO epoch of one minibatch: π_old comes from the training pass, so no anchor pass runs.
    single = train_batch(policy, None, groups, rl_loop.Config(model="tiny-random", completions_per_prompt=2),
                         np.random.default_rng(0), KLCoefficient(0.0))
    assert single["perf/old_policy_forward_time"] == 0.0 and single["perf/ref_forward_time"] == 0.0
    assert single["perf/fwd_bwd_time"] >= delays["fwd_bwd"]

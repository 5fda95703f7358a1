"""LoRA training (`trainer.lora_rank > 0`) on the tiny random model: only adapters move, the
reference is the exact base model, merged exports match the adapter forward, the recipes serve
the trained policy from the embedded deployment (over the shared base or a merged copy), and
checkpoints hold and restore the adapters."""

import copy

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import DeploymentConfig, SamplingConfig, TrainerConfig
from training.utils.errors import ConfigError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.lora import adapters_disabled, adapters_enabled
from training.utils.rl import startup, training_run
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.run_files.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from training.utils.run_files.logging import read_ledger
from training.utils.trainer import AdapterDisabledReference, Datum, Trainer

VOCAB = 260
LORA = dict(lora_rank=4, lora_alpha=8.0)


def tiny_model():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer("tiny-random", device="cpu")
    return model


def datums(seed: int = 1, lengths=(12, 7, 20)) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index, length in enumerate(lengths):
        tokens = torch.randint(4, VOCAB, (length,), generator=generator).tolist()
        prompt_len = length // 3
        out.append(Datum(input_ids=tokens[:-1], target_ids=tokens[1:],
                         weights=[0.0] * (prompt_len - 1) + [1.0] * (length - prompt_len),
                         behaviour_logprobs=[-1.0] * (length - 1), advantage=(-1.0) ** index, prompt_len=prompt_len))
    return out


def pg_loss(logprobs, mb):
    return -(mb.advantages[:, None] * logprobs * mb.weights).sum() / mb.num_tokens_total, {}


def train(trainer: Trainer, steps: int, seed: int = 1) -> None:
    for step in range(steps):
        trainer.forward_backward(datums(seed + step), pg_loss)
        trainer.optim_step()


@pytest.fixture(scope="module")
def trained():
    """A LoRA policy after 3 optimizer steps, and a frozen copy of its model from before wrapping."""
    model = tiny_model()
    base = Trainer(copy.deepcopy(model), TrainerConfig(), trainable=False)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    policy = Trainer(model, TrainerConfig(learning_rate=1e-2, **LORA))
    train(policy, 3)
    return policy, base, initial


def test_config_validation():
    cfg = TrainerConfig(lora_rank=8)
    assert "q_proj" in cfg.lora_target_modules and "down_proj" in cfg.lora_target_modules
    for bad in (dict(lora_rank=-1), dict(lora_dropout=1.0), dict(lora_alpha=0), dict(lora_target_modules=[])):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            TrainerConfig(**bad)
    with pytest.raises(ConfigError, match=r"lora_target_modules names \['c_attn'\].*'q_proj'"):
        Trainer(tiny_model(), TrainerConfig(lora_rank=4, lora_target_modules=["q_proj", "c_attn"]))


def test_only_adapters_train_and_base_weights_stay_bit_identical(trained):
    policy, _, initial = trained
    optimized = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
    named = dict(policy.model.named_parameters())
    assert {n for n, p in named.items() if id(p) in optimized} == {n for n in named if ".lora_" in n}
    # 2 layers × 7 projections × (A, B).
    assert len(optimized) == 28 and policy.step == 3
    base_sd = policy.model.get_base_model().state_dict()
    lora_B = [t for n, t in base_sd.items() if ".lora_B." in n]
    assert all(t.abs().sum() > 0 for t in lora_B)  # B starts at 0: every adapter moved
    base_only = {n.replace(".base_layer.", "."): t for n, t in base_sd.items() if ".lora_" not in n}
    assert base_only.keys() == initial.keys()
    assert all(torch.equal(base_only[n], initial[n]) for n in initial)


def test_gradient_checkpointing_gives_the_same_adapter_update():
    plain, checkpointed = (Trainer(tiny_model(), TrainerConfig(learning_rate=1e-2, gradient_checkpointing=gc, **LORA))
                           for gc in (False, True))
    for trainer in (plain, checkpointed):
        train(trainer, 1)
    for (name, a), b in zip(plain.model.named_parameters(), checkpointed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_reference_is_the_base_model_exactly_after_training(trained):
    policy, base, _ = trained
    reference = policy.adapter_disabled_reference()
    batch = datums(seed=7)
    ref_lp, ref_entropy = reference.logprobs(batch, 0.7, with_entropy=True)
    base_lp, base_entropy = base.logprobs(batch, 0.7, with_entropy=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_lp, base_lp))
    assert all(torch.equal(a, b) for a, b in zip(ref_entropy, base_entropy))
    # The adapters are back on after the reference call, and the FLOP count (which reads peft's flag) knows when not.
    assert adapters_enabled(policy.model)
    with adapters_disabled(policy.model):
        assert not adapters_enabled(policy.model)
    policy_lp = policy.logprobs(batch, 0.7)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(policy_lp, base_lp))


def test_merged_export_matches_the_adapter_forward(trained, tmp_path):
    policy, _, initial = trained
    batch = datums(seed=9)
    expected = policy.logprobs(batch)
    merged = policy.state_dict_for_inference()
    assert merged.keys() == initial.keys()  # the base model's names, no adapter entries
    # Layers without an adapter are handed out live, not copied.
    live = policy.model.get_base_model().model.embed_tokens.weight
    assert merged["model.embed_tokens.weight"].data_ptr() == live.data_ptr()
    plain = tiny_model()
    plain.load_state_dict(merged)
    policy.save_hf(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(reloaded) is type(plain)  # a plain HF model, loadable without peft
    for model in (plain, reloaded):
        got = Trainer(model, TrainerConfig(), trainable=False).logprobs(batch)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_setup_trainers_shares_one_model_between_policy_and_reference():
    cfg = rl_loop.Config(model="tiny-random", kl_beta=0.1, trainer=TrainerConfig(**LORA), progress=False)
    policy, reference, _, _ = startup.setup_trainers(cfg, total_steps=2)
    assert policy.lora and isinstance(reference, AdapterDisabledReference) and reference.policy is policy
    no_kl = rl_loop.Config(model="tiny-random", trainer=TrainerConfig(**LORA), progress=False)
    assert startup.setup_trainers(no_kl, total_steps=2)[1] is None


ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]


def scripted_factory(setup):
    async def rollout_fn(row, sample_index):
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80 + sample_index], [-1.0, -2.0],
                                      reward=float(sample_index % 2))

    return rollout_fn


@pytest.mark.parametrize("lora_weights", ["shared", "merged"])
def test_rl_loop_with_lora_and_kl_serves_the_trained_policy(lora_weights, tmp_path, monkeypatch):
    built = {}

    def capture(*args, **kwargs):
        built["policy"], built["reference"], tokenizer, model = startup.setup_trainers(*args, **kwargs)
        return built["policy"], built["reference"], tokenizer, model

    monkeypatch.setattr(training_run, "setup_trainers", capture)
    served = {}

    async def evaluation_fn(setup, step):
        # Runs after the last step's weight sync: the deployment must serve the trained policy.
        if step == 3:
            prompt = ROWS[0]["prompt_token_ids"]
            served["completions"] = await setup.sampler.sample(prompt, n=4, max_tokens=6, temperature=1.0)
            served["greedy"] = (await setup.sampler.sample(prompt, max_tokens=6, temperature=0))[0]
        return {}

    cfg = rl_loop.Config(
        model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=3, kl_beta=0.1,
        log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4, timeout_s=30),
        trainer=TrainerConfig(learning_rate=1e-2, **LORA), progress=False,
        deployment=DeploymentConfig(dtype="float32", lora_weights=lora_weights),
    )
    summary = rl_loop.main(cfg, rollout_fn_factory=scripted_factory, rows=ROWS, evaluation_fn=evaluation_fn)
    assert summary["version"] == 3
    trained = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    # B = 0 at the start: the first step's policy is the base model exactly, then the KL grows.
    assert trained[0]["train/ref_kl"] == 0.0 and trained[-1]["train/ref_kl"] > 0

    policy, reference = built["policy"], built["reference"]
    assert isinstance(reference, AdapterDisabledReference)
    prompt = ROWS[0]["prompt_token_ids"]
    for c in served["completions"] + [served["greedy"]]:
        tokens = prompt + c.output_ids
        datum = Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[1.0] * (len(tokens) - 1),
                      behaviour_logprobs=[0.0] * (len(tokens) - 1), advantage=0.0, prompt_len=len(prompt))
        (trainer_lp,) = policy.logprobs([datum])
        (base_lp,) = reference.logprobs([datum])
        outputs = slice(len(prompt) - 1, None)
        torch.testing.assert_close(torch.tensor(c.logprobs), trainer_lp[outputs], atol=1e-4, rtol=0)
        assert (trainer_lp - base_lp).abs().max() > 1e-2  # what is served moved away from the base
    # Greedy: each served token is the trainer's argmax (up to the engine's numerical tolerance).
    tokens = prompt + served["greedy"].output_ids
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([tokens])).logits[0, len(prompt) - 1 : -1]
    chosen = logits.gather(1, torch.tensor(served["greedy"].output_ids)[:, None]).squeeze(1)
    assert (logits.max(1).values - chosen).max() <= 1e-4


def test_checkpoint_holds_only_the_adapters_and_resumes_exactly(tmp_path):
    def policy():
        return Trainer(tiny_model(), TrainerConfig(learning_rate=1e-2, lr_schedule="linear", total_steps=10, **LORA))

    first, rng = policy(), np.random.default_rng(5)
    train(first, 2)
    path = save_checkpoint(tmp_path, 2, policy=first, progress={"step": 2}, np_rng=rng)
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no frozen base weights on disk

    second = policy()  # same base (same seed), adapters at their initial values
    assert load_checkpoint(path, policy=second, np_rng=np.random.default_rng(0)) == {"step": 2}
    assert second.step == 2 and second.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    # Continuing both gives bit-identical adapters: weights, Adam moments and schedule all came back.
    train(first, 1, seed=11)
    train(second, 1, seed=11)
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), name


def test_async_recipe_resumes_a_lora_run_from_its_checkpoint(tmp_path):
    def cfg(max_steps):
        return async_rl_loop.Config(
            model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=max_steps,
            max_head_offpolicy_versions=0, dcp_save_interval=1, kl_beta=0.1, log_path=str(tmp_path / "run"),
            sampling=SamplingConfig(max_tokens=4, timeout_s=30), trainer=TrainerConfig(learning_rate=1e-2, **LORA),
            progress=False,
        )

    first = async_rl_loop.main(cfg(1), rollout_fn_factory=scripted_factory, rows=ROWS)
    assert first["steps"] == 1 and latest_checkpoint(tmp_path / "run").name == "step-00000001"
    resumed = async_rl_loop.main(cfg(2), rollout_fn_factory=scripted_factory, rows=ROWS)
    assert (resumed["start_step"], resumed["steps"]) == (1, 2)

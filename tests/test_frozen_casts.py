"""A LoRA trainer under bf16 autocast keeps its frozen matmul weights cast once (`trainer.frozen_weight_casts`):
logprobs, gradients and the adapters-off reference are bit-identical to casting per use, a written base weight is
cast again, and the embedded bf16 engine runs over those copies instead of a merged copy of its own."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from training.recipes import rl_loop
from training.utils.config.rl import DeploymentConfig, TrainerConfig
from training.utils.deploy import shares_lora_base, start_deployment
from training.utils.errors import ConfigError
from training.utils.models.frozen_casts import cast_of, keep_casts, kept_casts
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.lora import adapter_state, frozen_matmul_weights
from training.utils.rl import startup
from training.utils.rl.memory_budget import estimate_memory
from training.utils.rl.memory_telemetry import owner_bytes
from training.utils.trainer import Datum, Trainer
from training.utils.trainer.plan import TrainerPlan
from training.utils.trainer.precision import keep_frozen_casts

BF16_LORA = dict(learning_rate=5e-2, lora_rank=4, lora_alpha=8.0, precision="bf16-autocast")
PROMPT = [1, 40, 50, 60, 70]


def policy_pair() -> tuple[Trainer, Trainer, object]:
    """Two policies from one initial model: casts kept (`auto`, on this CPU) and cast per use (`off`)."""
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer("tiny-random", device="cpu")
    torch.manual_seed(1)  # the adapters' initial A
    kept = Trainer(copy.deepcopy(model), TrainerConfig(**BF16_LORA))
    torch.manual_seed(1)
    per_use = Trainer(model, TrainerConfig(**BF16_LORA, frozen_weight_casts="off"))
    return kept, per_use, tokenizer


def datums(seed: int) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(4):
        tokens = torch.randint(4, 260, (18,), generator=generator).tolist()
        out.append(Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[0.0] * 4 + [1.0] * 13,
                         behaviour_logprobs=[-1.0] * 17, advantage=1.0 if index % 2 else -1.0, prompt_len=5))
    return out


def loss(logprobs, mb):
    return -(mb.advantages[:, None] * logprobs * mb.weights).sum(), {}


def adapter_grads(policy: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in policy.model.named_parameters() if p.requires_grad}


def test_kept_casts_give_the_bits_casting_per_use_gives():
    kept, per_use, _ = policy_pair()
    weights = frozen_matmul_weights(kept.model)
    assert len(weights) == 7 * kept.model.config.num_hidden_layers + 1  # every adapted base, and the tied head
    assert all(cast_of(w, torch.bfloat16) is not None for w in weights)
    assert not kept_casts(per_use.model.parameters())
    for step in range(3):
        batch = datums(step)
        for policy in (kept, per_use):
            policy.forward_backward(batch, loss)
        grads = adapter_grads(kept), adapter_grads(per_use)
        assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
        assert any(float(g.abs().max()) > 0 for g in grads[0].values())
        for policy in (kept, per_use):
            policy.optim_step()
        for a, b in zip(kept.logprobs(batch, with_entropy=True), per_use.logprobs(batch, with_entropy=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        reference = [r.adapter_disabled_reference().logprobs(batch) for r in (kept, per_use)]
        assert all(torch.equal(x, y) for x, y in zip(*reference))
    # The adapters moved, so the reference is not the policy: the comparison above saw both paths.
    assert not torch.equal(kept.logprobs(batch)[0], kept.adapter_disabled_reference().logprobs(batch)[0])


def test_a_written_base_weight_is_cast_again_before_its_next_use():
    kept, per_use, _ = policy_pair()
    batch = datums(0)
    some = frozen_matmul_weights(kept.model)[3]
    with torch.no_grad():  # in place: its version counter moves
        for policy in (kept, per_use):
            frozen_matmul_weights(policy.model)[3].mul_(3.0)
    assert all(torch.equal(x, y) for x, y in zip(kept.logprobs(batch), per_use.logprobs(batch)))
    assert torch.equal(cast_of(some, torch.bfloat16), some.detach().to(torch.bfloat16))
    for policy in (kept, per_use):  # its storage replaced
        weight = frozen_matmul_weights(policy.model)[3]
        weight.data = torch.full_like(weight, 0.01)
    assert all(torch.equal(x, y) for x, y in zip(kept.logprobs(batch), per_use.logprobs(batch)))


def test_only_frozen_weights_keep_casts_and_only_where_the_setting_says():
    kept, _, _ = policy_pair()
    adapter = next(p for p in kept.model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="trains"):
        keep_casts([adapter], torch.bfloat16)
    base = frozen_matmul_weights(kept.model)[0]
    base.requires_grad_(True)  # unfrozen after its cast was made: the cast no longer stands in for it
    assert cast_of(base, torch.bfloat16) is None
    base.requires_grad_(False)
    assert cast_of(base, torch.bfloat16) is not None
    cpu = torch.device("cpu")
    decided = {(setting, precision, over): TrainerPlan.resolve(
        TrainerConfig(**{**BF16_LORA, "precision": precision}, frozen_weight_casts=setting), cpu,
        engine_over_casts=over).frozen_weight_casts
        for setting in ("off", "auto", "on") for precision in ("bf16-autocast", "fp32") for over in (False, True)}
    # Under bf16 autocast only; `auto` where the engine runs over them (a CPU), `on` anywhere, `off` never.
    assert {key for key, keep in decided.items() if keep} == {("auto", "bf16-autocast", True),
                                                             ("on", "bf16-autocast", False),
                                                             ("on", "bf16-autocast", True)}
    model, _ = load_model_and_tokenizer("tiny-random", device="cpu")
    policy = Trainer(model, TrainerConfig(**BF16_LORA, frozen_weight_casts="off"))
    assert not kept_casts(policy.model.parameters())
    keep_frozen_casts(policy.model, policy.cfg, True, sharded=True)  # FSDP2 gathers each weight per use
    assert not kept_casts(policy.model.parameters())
    with pytest.raises(ConfigError, match="frozen_weight_casts='on' does not apply under torchrun"):
        keep_frozen_casts(policy.model, TrainerConfig(**BF16_LORA, frozen_weight_casts="on"), True, sharded=True)


def test_the_bf16_engine_runs_over_the_trainers_casts_and_serves_each_synced_adapter():
    kept, per_use, tokenizer = policy_pair()
    casts = {t.data_ptr() for t in kept_casts(kept.model.parameters())}
    cfg = DeploymentConfig(dtype="bfloat16")
    assert shares_lora_base(kept.model, cfg) and not shares_lora_base(per_use.model, cfg)
    with pytest.raises(ConfigError, match="keeps no torch.bfloat16 copies"):
        shares_lora_base(per_use.model, cfg.model_copy(update={"lora_weights": "shared"}))

    async def main():
        deployment = await start_deployment(kept.model, tokenizer, cfg, model_name="tiny", sampling_timeout_s=60)
        try:
            engine = deployment.engine
            assert engine.shares_trainer_base and deployment.weight_sync.adapter_only
            served = {name: t for name, t in engine.model.named_parameters()}
            assert all(t.dtype == torch.bfloat16 for t in served.values())
            matmul = [t for name, t in served.items() if ".lora_" not in name and t.dim() == 2]
            assert matmul and all(t.data_ptr() in casts for t in matmul)  # the embedding and head: the tied cast
            own = [t for name, t in served.items() if ".lora_" in name or t.dim() == 1]
            own_bytes = sum(t.numel() * t.element_size() for t in [*own, *engine.model.buffers()])
            assert engine.memory_stats()["weights"] == own_bytes
            owners = owner_bytes(kept, None, deployment)  # the casts count once, as the trainer's
            assert owners["mem/trainer_params"] == sum(t.numel() * t.element_size() for t in
                                                       [*kept.model.parameters(), *kept_casts(kept.model.parameters())])
            assert owners["mem/engine_weights"] == own_bytes

            kept.forward_backward(datums(0), loss)
            kept.optim_step()
            metrics = await deployment.weight_sync.sync(kept.state_dict_for_inference(adapter_only=True), version=1)
            assert metrics["weight_sync_bytes"] == sum(4 * t.numel() for t in adapter_state(kept.model).values())
            for name, tensor in adapter_state(kept.model).items():  # each synced adapter, in the engine's dtype
                assert torch.equal(deployment.engine._weights._targets[name], tensor.to(torch.bfloat16)), name
            (completion,) = await deployment.sampler.sample(PROMPT, max_tokens=6, temperature=1.0)
            tokens = PROMPT + completion.output_ids
            datum = Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[1.0] * (len(tokens) - 1),
                          behaviour_logprobs=[0.0] * (len(tokens) - 1), advantage=0.0, prompt_len=len(PROMPT))
            (trainer_lp,) = kept.logprobs([datum])
            # bf16 norms and residuals in the engine, float32 in the trainer: close, not equal
            assert float((torch.tensor(completion.logprobs) - trainer_lp[len(PROMPT) - 1:]).abs().max()) < 0.1
        finally:
            await deployment.close()

    asyncio.run(main())


def test_the_memory_counts_hold_the_casts_once():
    cfg = rl_loop.Config(model="tiny-random", trainer=TrainerConfig(**BF16_LORA), progress=False,
                         deployment=DeploymentConfig(dtype="bfloat16"))
    policy, reference, _, _ = startup.setup_trainers(cfg, total_steps=2)
    casts = kept_casts(policy.model.parameters())
    cast_bytes = sum(2 * t.numel() for t in casts)
    assert casts and cast_bytes == sum(2 * w.numel() for w in frozen_matmul_weights(policy.model))
    parts = estimate_memory(cfg, policy, reference).parts()
    assert parts["bf16 copies of frozen weights (trainer.frozen_weight_casts)"] == cast_bytes
    # The engine holds its adapters, norms and buffers in bf16; the matmul weights are the casts above.
    params = list(policy.model.parameters())
    own = [p for p in params if p.requires_grad or p.dim() == 1]
    buffers = sum(b.numel() for b in policy.model.buffers())
    assert parts["engine weights"] == 2 * (sum(p.numel() for p in own) + buffers)
    # A deployment that holds a copy of its own anyway: `auto` keeps none, where they would only cost memory.
    for deployment in (DeploymentConfig(dtype="bfloat16", lora_weights="merged"), DeploymentConfig(dtype="float32"),
                       DeploymentConfig(kind="vllm", base_url="http://127.0.0.1:1", weight_sync="disk")):
        policy, _, _, _ = startup.setup_trainers(cfg.model_copy(update={"deployment": deployment}), total_steps=2)
        assert not policy.plan.frozen_weight_casts and not kept_casts(policy.model.parameters()), deployment

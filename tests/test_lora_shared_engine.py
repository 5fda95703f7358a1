"""The embedded engine of a LoRA policy over the trainer's own base tensors (`deployment.lora_weights`): no second
copy of the model, only the adapter crosses a sync, the engine serves exactly what the trainer computes, and no
update, in process or from disk, can write the trainer's frozen weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from training.recipes import rl_loop
from training.utils.config.rl import DeploymentConfig, TrainerConfig
from training.utils.deploy import shares_lora_base, start_deployment
from training.utils.errors import ConfigError, DeploymentError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.lora import ADAPTER, AdapterState, adapter_state, shared_base_copy
from training.utils.models.lora_layers import UnmergedLinear
from training.utils.rl import startup
from training.utils.rl.memory_budget import estimate_memory
from training.utils.trainer import Datum, Trainer

LORA = dict(lora_rank=4, lora_alpha=8.0)
PROMPT = [1, 40, 50, 60, 70]


def lora_policy() -> tuple[Trainer, object]:
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer("tiny-random", device="cpu")
    # float32 on any CPU: these tests share the float32 base; a bf16 engine over kept casts is test_frozen_casts.py's
    return Trainer(model, TrainerConfig(learning_rate=5e-2, precision="fp32", **LORA)), tokenizer


def train(policy: Trainer, steps: int) -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        tokens = torch.randint(4, 260, (16,), generator=generator).tolist()
        datum = Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[1.0] * 15,
                      behaviour_logprobs=[-1.0] * 15, advantage=1.0, prompt_len=1)
        policy.forward_backward([datum], lambda lp, mb: (-(lp * mb.weights).sum(), {}))
        policy.optim_step()


def served_against_trainer(policy: Trainer, completion, *, adapters: bool) -> float:
    """Largest |engine logprob - trainer logprob| over `completion`'s tokens, with the trainer's adapters on or off."""
    tokens = PROMPT + completion.output_ids
    datum = Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[1.0] * (len(tokens) - 1),
                  behaviour_logprobs=[0.0] * (len(tokens) - 1), advantage=0.0, prompt_len=len(PROMPT))
    scorer = policy if adapters else policy.adapter_disabled_reference()
    (trainer_lp,) = scorer.logprobs([datum])
    return float((torch.tensor(completion.logprobs) - trainer_lp[len(PROMPT) - 1:]).abs().max())


def base_tensors(policy: Trainer) -> dict[str, torch.Tensor]:
    return {name: t for name, t in policy.model.named_parameters() if not t.requires_grad}


def test_the_engine_shares_the_base_serves_each_synced_adapter_and_nothing_else():
    policy, tokenizer = lora_policy()
    base = base_tensors(policy)
    before = {name: t.clone() for name, t in base.items()}
    adapter_bytes = sum(4 * p.numel() for p in policy.model.parameters() if p.requires_grad)

    async def main():
        deployment = await start_deployment(policy.model, tokenizer, DeploymentConfig(dtype="float32"),
                                            model_name="tiny", sampling_timeout_s=60)
        try:
            engine = deployment.engine
            assert engine.shares_trainer_base and deployment.weight_sync.adapter_only
            # The engine's base tensors are the trainer's own; it owns the adapters and the rotary buffers only.
            trainer_ptrs = {t.data_ptr() for t in base.values()}
            engine_base = [t for name, t in engine.model.named_parameters() if ".lora_" not in name]
            assert len(engine_base) == len(base) and all(t.data_ptr() in trainer_ptrs for t in engine_base)
            buffer_bytes = sum(b.numel() * b.element_size() for b in engine.model.buffers())
            assert engine.memory_stats()["weights"] == adapter_bytes + buffer_bytes

            train(policy, 3)  # the trainer moves; the engine keeps serving version 0 until a sync
            (stale,) = await deployment.sampler.sample(PROMPT, max_tokens=6, temperature=1.0)
            assert served_against_trainer(policy, stale, adapters=False) < 1e-5
            assert served_against_trainer(policy, stale, adapters=True) > 1e-2

            export = policy.state_dict_for_inference(adapter_only=True)
            assert isinstance(export, AdapterState) and set(export) == set(adapter_state(policy.model))
            metrics = await deployment.weight_sync.sync(export, version=1)
            assert metrics["weight_sync_bytes"] == adapter_bytes  # the adapter crossed, not the model
            fresh = await deployment.sampler.sample(PROMPT, n=4, max_tokens=6, temperature=1.0)
            assert max(served_against_trainer(policy, c, adapters=True) for c in fresh) < 1e-5

            # A full export through the sync sends its adapter; full weights handed to the engine are refused by
            # name, before anything is copied.
            assert (await deployment.weight_sync.sync(policy.state_dict_for_inference(), 2))["weight_sync_bytes"] \
                == adapter_bytes
            with pytest.raises(ValueError, match="shares the trainer's frozen base"):
                await asyncio.to_thread(engine.update_weights, dict(policy.state_dict_for_inference()), 3)
            assert deployment.version == 2
            with pytest.raises(DeploymentError, match="without their adapter"):
                await deployment.weight_sync.sync({"lm_head.weight": torch.zeros(1)}, 3)
        finally:
            await deployment.close()

    asyncio.run(main())
    for name, tensor in base.items():  # bit-identical: nothing the engine did wrote the trainer's weights
        assert torch.equal(tensor, before[name]), name


def test_the_engines_adapted_projections_compute_what_peft_computes():
    policy, _ = lora_policy()
    train(policy, 2)  # nonzero B, so the adapter term counts
    engine_model, adapters = shared_base_copy(policy.model)
    peft_layers = {name.removeprefix("base_model.model."): m for name, m in policy.model.named_modules()
                   if UnmergedLinear.can_run(m)}
    ours = {name: m for name, m in engine_model.named_modules() if isinstance(m, UnmergedLinear)}
    assert set(ours) == set(peft_layers) and len(ours) == 7 * policy.model.config.num_hidden_layers
    own_adapter = {t.data_ptr() for t in adapters.values()}
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, layer in ours.items():
            # the sync's targets are this layer's tensors; the base is the trainer's
            assert {layer.lora_A.data_ptr(), layer.lora_B.data_ptr()} <= own_adapter
            assert layer.base_layer.weight is peft_layers[name].get_base_layer().weight
            x = torch.randn(3, 5, layer.base_layer.in_features, generator=generator)
            expected = peft_layers[name](x)
            assert float(expected.sub(layer.base_layer(x)).abs().max()) > 1e-4  # the adapter adds something
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    some_layer = next(iter(peft_layers.values()))
    some_layer.lora_A[ADAPTER].to(torch.float64)  # an adapter in another dtype than its base: peft's casts stay
    assert not UnmergedLinear.can_run(some_layer)


def test_a_full_weights_update_from_disk_cannot_write_the_trainers_base(tmp_path):
    policy, tokenizer = lora_policy()
    base = base_tensors(policy)
    before = {name: t.clone() for name, t in base.items()}

    async def main():
        cfg = DeploymentConfig(dtype="float32", weight_dir=str(tmp_path))
        deployment = await start_deployment(policy.model, tokenizer, cfg, model_name="tiny", sampling_timeout_s=60)
        try:
            # What an agent with a shell and the server's key could write: zeros under the base weights' names, as
            # a plain model names them and as the engine's own (adapter-wrapped) model does.
            for names in (policy.state_dict_for_inference(), deployment.engine.model.state_dict()):
                zeros = {name: torch.zeros_like(t) for name, t in names.items() if ".lora_" not in name}
                save_file(zeros, str(tmp_path / "model.safetensors"))
                with pytest.raises(ValueError, match="takes only the LoRA adapter"):
                    await asyncio.to_thread(deployment.engine.load_weights_from_disk, tmp_path / "model.safetensors",
                                            root=tmp_path)
            assert deployment.version == 0
        finally:
            await deployment.close()

    asyncio.run(main())
    for name, tensor in base.items():
        assert torch.equal(tensor, before[name]), name


def test_merged_engine_holds_its_own_copy_and_takes_full_weights():
    policy, tokenizer = lora_policy()
    train(policy, 2)

    async def main():
        cfg = DeploymentConfig(dtype="float32", lora_weights="merged")
        deployment = await start_deployment(policy.model, tokenizer, cfg, model_name="tiny", sampling_timeout_s=60)
        try:
            assert not deployment.engine.shares_trainer_base and not deployment.weight_sync.adapter_only
            trainer_ptrs = {t.data_ptr() for t in policy.model.parameters()}
            assert not any(t.data_ptr() in trainer_ptrs for t in deployment.engine.model.parameters())
            await deployment.weight_sync.sync(policy.state_dict_for_inference(), version=1)
            (completion,) = await deployment.sampler.sample(PROMPT, max_tokens=6, temperature=1.0)
            assert served_against_trainer(policy, completion, adapters=True) < 1e-4  # merged: rounding differs
        finally:
            await deployment.close()

    asyncio.run(main())


def test_lora_weights_auto_shares_only_where_it_can_and_shared_names_the_obstacle():
    policy, _ = lora_policy()
    assert shares_lora_base(policy.model, DeploymentConfig(dtype="float32"))
    assert not shares_lora_base(policy.model, DeploymentConfig(dtype="bfloat16"))  # a base in another dtype
    assert not shares_lora_base(policy.model, DeploymentConfig(dtype="float32", weight_sync="disk"))
    assert not shares_lora_base(policy.model, DeploymentConfig(dtype="float32", lora_weights="merged"))
    with pytest.raises(ConfigError, match=r"engine's dtype torch.bfloat16 .* deployment.dtype='float32'"):
        shares_lora_base(policy.model, DeploymentConfig(dtype="bfloat16", lora_weights="shared"))
    with pytest.raises(ConfigError, match="weight_sync='disk'"):
        shares_lora_base(policy.model, DeploymentConfig(dtype="float32", weight_sync="disk", lora_weights="shared"))
    full, _ = load_model_and_tokenizer("tiny-random", device="cpu")
    assert not shares_lora_base(full, DeploymentConfig(dtype="float32", lora_weights="shared"))  # nothing to share


@pytest.mark.parametrize("lora_weights", ["shared", "merged"])
def test_the_memory_estimate_counts_the_engine_weights_it_will_hold(lora_weights):
    cfg = rl_loop.Config(model="tiny-random", trainer=TrainerConfig(**LORA), progress=False,
                         deployment=DeploymentConfig(dtype="float32", lora_weights=lora_weights))
    policy, reference, _, _ = startup.setup_trainers(cfg, total_steps=2)
    params = list(policy.model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in policy.model.buffers())
    held = [p for p in params if p.requires_grad] if lora_weights == "shared" else \
        [p for p in params if not p.requires_grad]  # merged: the base's shapes, adapters folded in
    assert estimate_memory(cfg, policy, reference).parts()["engine weights"] == \
        4 * sum(p.numel() for p in held) + buffer_bytes

"""The trainer's LoRA layer (`lora_layers.AddedLoraLinear`): the adapter added into the base output in place computes
what peft's layer computes, forward and backward, in float32 and under bf16 autocast, and hands every other case
(adapters disabled, merged, dropout, a float32 adapter over a bfloat16 base) to peft; and under checkpointing its
frozen base matmul is not recomputed where it ends a layer."""

import copy
import shutil

import pytest
import torch

from test_lora import datums, pg_loss
from training.utils.config.rl import TrainerConfig
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.lora import ADAPTER, adapters_disabled, wrap_with_lora
from training.utils.models.lora_layers import AddedLoraLinear, PeftLinear, use_peft_forward
from training.utils.trainer import Trainer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(dropout: float = 0.0, dtype: torch.dtype = torch.float32, alpha: float = 8.0):
    """The tiny random model wrapped with rank-4 adapters whose B is nonzero (at initialisation B = 0 and the
    adapter adds nothing, which would hide a wrong sum)."""
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer("tiny-random", device="cpu", dtype=dtype)
    wrapped = wrap_with_lora(model, rank=4, alpha=alpha, dropout=dropout, target_modules=TARGETS)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.05)
    return wrapped


def with_peft_layers(model):
    """A copy of `model` whose adapted layers run peft's own forward (same parameters, same values)."""
    twin = copy.deepcopy(model)
    use_peft_forward(twin)
    return twin


def adapter_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def run(model, tokens, autocast: bool = False):
    """The model's logits on `tokens` and the gradients of the adapters of a loss on them."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=tokens).logits.float()
    logits.logsumexp(-1).sum().backward()
    return logits.detach(), adapter_grads(model)


TOKENS = torch.randint(4, 260, (3, 17), generator=torch.Generator().manual_seed(2))


def test_every_plain_adapter_layer_adds_in_place_and_matches_peft_forward_and_backward():
    model = lora_model()
    layers = [m for m in model.modules() if isinstance(m, PeftLinear)]
    assert len(layers) == 7 * model.config.num_hidden_layers and all(type(m) is AddedLoraLinear for m in layers)
    peft_model = with_peft_layers(model)
    got_logits, got_grads = run(model, TOKENS)
    want_logits, want_grads = run(peft_model, TOKENS)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 2 * len(layers)
    for name, grad in want_grads.items():
        assert float(grad.abs().max()) > 0, name  # every adapter tensor gets a gradient
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # and the sum is really there: without it the logits differ
    with torch.no_grad(), adapters_disabled(model):
        assert float((model(input_ids=TOKENS).logits - got_logits).abs().max()) > 1e-3


def test_under_bf16_autocast_the_adapter_runs_in_bf16_like_peft():
    model = lora_model()
    got_logits, got_grads = run(model, TOKENS, autocast=True)
    want_logits, want_grads = run(with_peft_layers(model), TOKENS, autocast=True)
    fp32_logits, _ = run(model, TOKENS)
    layer = next(m for m in model.modules() if isinstance(m, AddedLoraLinear))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 3, layer.in_features)).dtype == torch.bfloat16
    # bf16 rounds the fused sum differently from peft's: as close to peft's as bf16 allows
    assert float((got_logits - fp32_logits).abs().max()) > 1e-3  # autocast was on
    assert float((got_logits - want_logits).abs().max()) < 0.05
    for name, grad in want_grads.items():
        assert got_grads[name].dtype == torch.float32
        assert float((got_grads[name] - grad).norm() / grad.norm()) < 0.05, name


def test_cases_that_are_not_the_one_sum_run_peft_forward_exactly():
    # a float32 adapter over a bfloat16 base, outside autocast: peft's casts decide
    model = lora_model(dtype=torch.bfloat16)
    layer = next(m for m in model.modules() if isinstance(m, AddedLoraLinear))
    assert layer.lora_A[ADAPTER].weight.dtype == torch.float32 and layer.base_layer.weight.dtype == torch.bfloat16
    got, _ = run(model, TOKENS)
    want, _ = run(with_peft_layers(model), TOKENS)
    assert torch.equal(got, want)

    model = lora_model()
    peft_model = with_peft_layers(model)
    with torch.no_grad():
        with adapters_disabled(model), adapters_disabled(peft_model):  # the base model
            assert torch.equal(model(input_ids=TOKENS).logits, peft_model(input_ids=TOKENS).logits)
        merged = copy.deepcopy(model)
        merged.merge_adapter()
        torch.testing.assert_close(merged(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits,
                                   rtol=1e-4, atol=1e-4)

    # dropout on the adapter's input: the same mask as peft's for the same seed
    model = lora_model(dropout=0.3)
    peft_model = with_peft_layers(model)
    model.train(), peft_model.train()
    torch.manual_seed(5)
    got, got_grads = run(model, TOKENS)
    torch.manual_seed(5)
    want, want_grads = run(peft_model, TOKENS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_trainer_step_equals_the_step_with_peft_layers(checkpointing):
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer("tiny-random", device="cpu")
    cfg = TrainerConfig(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, gradient_checkpointing=checkpointing,
                        max_tokens_per_microbatch=32)
    torch.manual_seed(1)  # the same adapter initialisation in both
    ours = Trainer(copy.deepcopy(model), cfg)
    torch.manual_seed(1)
    theirs = Trainer(model, cfg)
    use_peft_forward(theirs.model)
    for step in range(2):
        for trainer in (ours, theirs):
            trainer.forward_backward(datums(1 + step), pg_loss)
            trainer.optim_step()
    for (name, got), (_, want) in zip(ours.model.named_parameters(), theirs.model.named_parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # compiling the layers takes about two minutes on 2 cores
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_layers_trace_the_in_place_sum():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer("tiny-random", device="cpu")
    cfg = dict(lora_rank=4, lora_alpha=8.0, max_tokens_per_microbatch=32)
    eager = Trainer(copy.deepcopy(model), TrainerConfig(**cfg))
    compiled = Trainer(model, TrainerConfig(compile_layers=True, **cfg))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for want, got in zip(eager.model.parameters(), compiled.model.parameters()):
            if want.requires_grad:  # the same adapter, B nonzero
                got.copy_(want.copy_(torch.randn(want.shape, generator=generator) * 0.05))
    want_lp, got_lp = eager.logprobs(datums(1)), compiled.logprobs(datums(1))
    for trainer in (eager, compiled):
        trainer.forward_backward(datums(1), pg_loss)
    assert compiled.compiled_layers is not None  # the start-up check kept the compiled layers
    for want, got in zip(want_lp, got_lp):
        assert float((want - got).abs().max()) < 1e-5
    for (name, want), (_, got) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        if want.requires_grad:
            assert float(want.grad.abs().max()) > 0, name
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_checkpointed_layer_recomputes_every_projection_but_the_last_base_matmul():
    """Under checkpointing the backward reruns each layer's forward only until the last tensor the layer saved is
    rebuilt. The frozen base of `down_proj` comes last and saves nothing, so it is not rerun: its weight is read once
    in the backward (for the gradient reaching its input), where `q_proj`'s is read twice (rerun, then gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from training.utils.trainer.activation_checkpointing import enable_activation_checkpointing

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default}

    class CountWeightReads(TorchDispatchMode):
        def __init__(self, weights):
            super().__init__()
            self.reads = {name: 0 for name in weights}
            self.pointers = {w.untyped_storage().data_ptr(): name for name, w in weights.items()}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for arg in args if func in MATMULS else ():
                if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() in self.pointers:
                    self.reads[self.pointers[arg.untyped_storage().data_ptr()]] += 1
            return func(*args, **(kwargs or {}))

    model = lora_model()
    plain_logits, plain_grads = run(model, TOKENS)
    enable_activation_checkpointing(model)
    model.train()
    layers = model.base_model.model.model.layers
    weights = {f"{name}{i}": getattr(layer.mlp if name == "down_proj" else layer.self_attn, name).base_layer.weight
               for i, layer in enumerate(layers) for name in ("q_proj", "down_proj")}
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=TOKENS).logits.float().logsumexp(-1).sum()
    counter = CountWeightReads(weights)
    with counter:
        loss.backward()
    for i in range(len(layers)):
        assert counter.reads[f"q_proj{i}"] == 2 and counter.reads[f"down_proj{i}"] == 1, counter.reads
    checkpointed_grads = adapter_grads(model)
    for name, grad in plain_grads.items():  # and the gradients are those of the unchecked model
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_base_weight_written_between_forward_and_backward_raises():
    model = lora_model()
    loss = model(input_ids=TOKENS).logits.float().logsumexp(-1).sum()
    with torch.no_grad():
        model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="frozen LoRA base weight of shape .* modified in place"):
        loss.backward()


def test_the_forward_rounds_alike_with_and_without_gradients():
    """The trainer's logprobs (no gradients) and its training forward sum in one order: bit-equal logits (with a
    scaling that is not a power of two, so where it is applied changes the rounding)."""
    model = lora_model(alpha=7.0)
    with torch.no_grad():
        scored = model(input_ids=TOKENS).logits
    with torch.inference_mode():
        inferred = model(input_ids=TOKENS).logits
    trained = model(input_ids=TOKENS).logits
    assert trained.requires_grad and torch.equal(scored, trained.detach()) and torch.equal(inferred, scored)

"""The local trainer: logprob parity with a plain forward, micro-batched gradients, metrics,
a supervised sanity run, the non-finite-gradient guard, LR schedules, export and the reference mode."""

import logging
import math
import shutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.utils.config.rl import TrainerConfig
from training.utils.errors import ConfigError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.trainer import (
    Datum,
    MicroBatch,
    Trainer,
    activation_checkpointing,
    fit_memory,
    lr_multiplier,
    plan_microbatches,
)
from training.utils.trainer.activation_checkpointing import KEPT_ATTENTION_OPS

VOCAB = 260


@pytest.fixture
def model():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")
    return model


def make_datum(tokens: list[int], prompt_len: int, advantage: float = 1.0) -> Datum:
    loss_mask = [0] * prompt_len + [1] * (len(tokens) - prompt_len)
    return Datum(
        input_ids=tokens[:-1],
        target_ids=tokens[1:],
        weights=[float(m) for m in loss_mask[1:]],
        behaviour_logprobs=[-1.0] * (len(tokens) - 1),
        advantage=advantage,
        prompt_len=prompt_len,
    )


def random_datums(lengths: list[int], seed: int = 1) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    datums = []
    for index, length in enumerate(lengths):
        tokens = torch.randint(4, VOCAB, (length,), generator=generator).tolist()
        datums.append(make_datum(tokens, prompt_len=max(1, length // 3), advantage=(-1.0) ** index * (index + 1)))
    return datums


def direct_logprobs_entropy(model, datum: Datum, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference computation: one full forward of one unpadded sequence."""
    logits = model(torch.tensor([datum.input_ids])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, torch.tensor(datum.target_ids)[:, None]).squeeze(1), entropy


def token_mean_pg_loss(logprobs, mb: MicroBatch):
    loss = -(mb.advantages[:, None] * logprobs * mb.weights).sum() / mb.num_tokens_total
    return loss, {}


def seq_mean_pg_loss(logprobs, mb: MicroBatch):
    per_seq = (logprobs * mb.weights).sum(1) / mb.weights.sum(1)
    return -(mb.advantages * per_seq).sum() / mb.num_seqs_total, {}


def nll_loss(logprobs, mb: MicroBatch):
    return -(logprobs * mb.weights).sum() / mb.num_tokens_total, {}


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# ---- logprobs -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_a_direct_forward(model, temperature):
    datums = random_datums([5, 30, 17, 9, 2])
    cfg = TrainerConfig(logprob_chunk_tokens=7, max_tokens_per_microbatch=40)
    trainer = Trainer(model, cfg)

    logprobs, entropies = trainer.logprobs(datums, temperature, with_entropy=True)
    plain = trainer.logprobs(datums, temperature)

    for datum, lp, ent, lp_plain in zip(datums, logprobs, entropies, plain):
        want_lp, want_ent = direct_logprobs_entropy(model, datum, temperature)
        assert lp.dtype == torch.float32 and lp.device.type == "cpu" and lp.shape == (len(datum.target_ids),)
        assert (lp - want_lp).abs().max() < 1e-5
        assert (ent - want_ent).abs().max() < 1e-5
        assert torch.equal(lp, lp_plain)


def test_temperature_changes_logprobs(model):
    datums = random_datums([12])
    trainer = Trainer(model, TrainerConfig())
    assert not torch.allclose(trainer.logprobs(datums, 1.0)[0], trainer.logprobs(datums, 0.5)[0])


# ---- micro-batching -------------------------------------------------------------------


def test_plan_microbatches_buckets_by_length():
    assert plan_microbatches([3, 10, 5, 5, 2], max_tokens=10) == [[1], [2, 3], [0, 4]]
    # A datum longer than the budget goes alone.
    assert plan_microbatches([50, 4, 4], max_tokens=8) == [[0], [1, 2]]


def test_plan_microbatches_packs_by_token_sum():
    # Padded, 6 and 4 cost 2 × 6 = 12 > 10; packed they cost 10. First-fit decreasing.
    assert plan_microbatches([6, 4, 3, 3, 2], max_tokens=10) == [[0], [1, 2], [3, 4]]
    assert plan_microbatches([6, 4, 3, 3, 2], max_tokens=10, packed=True) == [[0, 1], [2, 3, 4]]
    assert plan_microbatches([50, 4, 4], max_tokens=8, packed=True) == [[0], [1, 2]]


def test_packed_sequences_give_the_padded_logprobs_and_gradient(model):
    datums = random_datums([23, 6, 14, 31, 2, 9, 14])
    padded = Trainer(model, TrainerConfig(logprob_chunk_tokens=8, max_tokens_per_microbatch=64))
    packed = Trainer(model, TrainerConfig(logprob_chunk_tokens=8, max_tokens_per_microbatch=64, pack_sequences=True))
    rows_seen = []

    def loss_recording_rows(logprobs, mb):
        rows_seen.append(len(mb.datum_indices))
        return token_mean_pg_loss(logprobs, mb)

    want_lp, want_ent = padded.logprobs(datums, 0.7, with_entropy=True)
    got_lp, got_ent = packed.logprobs(datums, 0.7, with_entropy=True)
    for want, got in zip(want_lp + want_ent, got_lp + got_ent):
        assert want.shape == got.shape
        assert (want - got).abs().max() < 1e-5

    want_loss = padded.forward_backward(datums, token_mean_pg_loss)["loss"]
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    got_loss = packed.forward_backward(datums, loss_recording_rows)["loss"]
    # 92 tokens in 64-token rows: two packed micro-batches, each holding several datums.
    assert sorted(rows_seen) == [3, 4]
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    for name, grad in grads(model).items():
        assert (grad - want_grads[name]).abs().max() < 1e-6, name


def test_bf16_autocast_keeps_float32_weights_that_take_small_updates():
    """An update below bf16 resolution is lost in bf16 weights and kept by float32 master weights."""
    datums = random_datums([20, 12, 16])
    changed = {}
    for precision in ("bf16-autocast", "bf16"):
        torch.manual_seed(0)
        model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")
        trainer = Trainer(model, TrainerConfig(learning_rate=1e-5, precision=precision))
        weight = model.model.layers[0].mlp.up_proj.weight
        assert weight.dtype == (torch.float32 if precision == "bf16-autocast" else torch.bfloat16)
        before = weight.detach().clone()
        trainer.forward_backward(datums, token_mean_pg_loss)
        assert weight.grad.dtype == weight.dtype
        trainer.optim_step()
        changed[precision] = (weight.detach() != before).float().mean().item()
    # Adam's first step moves every weight by ~lr = 1e-5; bf16 resolves that only near 0.
    assert changed["bf16-autocast"] > 0.99
    assert changed["bf16"] < 0.5


def test_bf16_autocast_runs_the_matmuls_in_bf16(model):
    datums = random_datums([20, 12])
    exact = Trainer(model, TrainerConfig(precision="fp32")).logprobs(datums)
    autocast = Trainer(model, TrainerConfig(precision="bf16-autocast")).logprobs(datums)
    assert model.dtype == torch.float32
    gaps = [(a - b).abs().max().item() for a, b in zip(exact, autocast)]
    # bf16 matmuls move logprobs by ~1e-3, far above float32's ~1e-7 and far below a wrong result.
    assert 1e-4 < max(gaps) < 0.1


def test_a_model_in_another_dtype_is_converted_to_the_trainer_precision():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu", dtype=torch.bfloat16)
    Trainer(model, TrainerConfig())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("loss_fn", [token_mean_pg_loss, seq_mean_pg_loss])
def test_microbatched_gradient_equals_full_batch_gradient(model, loss_fn):
    datums = random_datums([23, 6, 14, 31, 9, 14])
    trainer = Trainer(model, TrainerConfig(logprob_chunk_tokens=8, max_tokens_per_microbatch=100_000))
    calls = []

    def counting_loss(logprobs, mb):
        calls.append(mb.datum_indices)
        return loss_fn(logprobs, mb)

    full = trainer.forward_backward(datums, counting_loss)
    full_grads = grads(model)
    model.zero_grad(set_to_none=True)
    assert len(calls) == 1

    calls.clear()
    fit_memory(trainer, trainer.plan.fitted(max_tokens_per_microbatch=32, gradient_checkpointing=False))
    micro = trainer.forward_backward(datums, counting_loss)
    micro_grads = grads(model)
    assert len(calls) >= 4
    assert sorted(i for indices in calls for i in indices) == list(range(len(datums)))

    assert full_grads.keys() == micro_grads.keys() and len(full_grads) > 0
    for name in full_grads:
        assert (full_grads[name] - micro_grads[name]).abs().max() < 1e-5, name
    assert micro["loss"] == pytest.approx(full["loss"], abs=1e-6)


def test_full_batch_gradient_equals_direct_autograd(model):
    """The chunked, checkpointed logprob path gives the same gradient as a plain forward."""
    datums = random_datums([11, 20, 7])
    trainer = Trainer(model, TrainerConfig(logprob_chunk_tokens=5))
    trainer.forward_backward(datums, token_mean_pg_loss, temperature=0.8)
    trainer_grads = grads(model)
    model.zero_grad(set_to_none=True)

    num_tokens = sum(sum(d.weights) for d in datums)
    loss = 0.0
    for datum in datums:
        logits = model(torch.tensor([datum.input_ids])).logits[0] / 0.8
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(datum.target_ids)[:, None]).squeeze(1)
        loss = loss - datum.advantage * (logp * torch.tensor(datum.weights)).sum() / num_tokens
    loss.backward()
    for name, want in grads(model).items():
        assert (trainer_grads[name] - want).abs().max() < 1e-5, name


def test_gradient_checkpointing_gives_the_same_gradient(model):
    datums = random_datums([15, 8])
    Trainer(model, TrainerConfig()).forward_backward(datums, token_mean_pg_loss)
    plain = grads(model)
    model.zero_grad(set_to_none=True)
    Trainer(model, TrainerConfig(gradient_checkpointing=True)).forward_backward(datums, token_mean_pg_loss)
    for name, value in grads(model).items():
        assert (plain[name] - value).abs().max() < 1e-5, name


@pytest.mark.parametrize("recompute_attention", [False, True])
def test_gradient_checkpointing_keeps_attention_and_recomputes_the_mlp(model, recompute_attention):
    """Each layer's attention kernel runs once in a checkpointed forward_backward (its output is kept), while the
    rest of the layer runs twice (forward, then the backward's recomputation); twice too with
    `recompute_attention`."""
    trainer = Trainer(model, TrainerConfig(gradient_checkpointing=True, recompute_attention=recompute_attention))
    attention, mlp = [], []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in KEPT_ATTENTION_OPS:
                attention.append(func)
            return func(*args, **(kwargs or {}))

    trainer.model.get_decoder().layers[0].mlp.register_forward_pre_hook(lambda *args: mlp.append(1))
    with Count():
        trainer.forward_backward(random_datums([15, 8]), token_mean_pg_loss)
    layers = trainer.model.config.num_hidden_layers
    assert len(mlp) == 2, "the MLP is recomputed"
    runs = (2 if recompute_attention else 1) * layers
    assert [str(op) for op in attention] == ["aten._scaled_dot_product_flash_attention_for_cpu.default"] * runs


def test_the_start_up_check_of_kept_attention_reports_what_fails(monkeypatch):
    """Off the CPU, checkpointing checks that keeping attention outputs works before it keeps them; here, where it
    works, the check passes, and a failure inside selective checkpointing is reported, not raised."""
    assert activation_checkpointing.kept_attention_problem(torch.device("cpu")) is None

    def broken(policy):
        raise RuntimeError("no selective checkpointing here")

    monkeypatch.setattr(activation_checkpointing, "create_selective_checkpoint_contexts", broken)
    problem = activation_checkpointing.kept_attention_problem(torch.device("cpu"))
    assert problem == "raised RuntimeError: no selective checkpointing here"


def test_microbatch_fields_and_extras(model):
    datums = random_datums([9, 4])
    old_logprobs = [torch.full((8,), -0.5), [-0.25] * 3]
    seen = []

    def inspecting_loss(logprobs, mb):
        seen.append(mb)
        # Logprobs exist only where a token is trained; context and padding read 0.
        assert torch.equal(logprobs != 0, mb.weights != 0)
        return nll_loss(logprobs, mb)

    trainer = Trainer(model, TrainerConfig(max_tokens_per_microbatch=8))
    trainer.forward_backward(datums, inspecting_loss, extras={"old_logprobs": old_logprobs})
    assert [mb.datum_indices for mb in seen] == [[0], [1]]
    short = seen[1]
    assert short.target_ids.shape == short.extras["old_logprobs"].shape == (1, 3)
    assert short.extras["old_logprobs"].tolist() == [[-0.25] * 3]
    assert short.num_seqs_total == 2
    assert short.num_tokens_total == sum(sum(d.weights) for d in datums)
    assert short.advantages.tolist() == [datums[1].advantage]
    assert short.behaviour_logprobs.tolist() == [[-1.0] * 3]


# ---- metrics --------------------------------------------------------------------------


def test_metrics_aggregate_by_weighted_mean_min_and_max(model):
    # Three micro-batches of one datum each (budget 10: 10 | 6 | 4, since 6 + 4 pads to 12).
    datums = [
        make_datum(list(range(4, 15)), prompt_len=8),  # 10 targets, 3 trained
        make_datum(list(range(4, 11)), prompt_len=5),  # 6 targets, 2 trained
        make_datum(list(range(4, 9)), prompt_len=4),  # 4 targets, 1 trained
    ]

    def loss_with_metrics(logprobs, mb):
        value = torch.tensor(float(mb.datum_indices[0] + 1))
        loss = logprobs.sum() * 0 + value
        return loss, {"score": value, "score_min": value, "score_max": value}

    trainer = Trainer(model, TrainerConfig(max_tokens_per_microbatch=10))
    metrics = trainer.forward_backward(datums, loss_with_metrics)
    assert metrics["score"] == pytest.approx((3 * 1 + 2 * 2 + 1 * 3) / 6)
    assert metrics["score_min"] == 1.0
    assert metrics["score_max"] == 3.0
    assert metrics["loss"] == pytest.approx(1 + 2 + 3)
    assert all(type(v) is float for v in metrics.values())


# ---- training -------------------------------------------------------------------------


def test_supervised_sanity_run_lowers_the_loss(model):
    texts = [b"the cat sat on the mat", b"two plus three is five", b"hello world, hello"]
    datums = [make_datum([4 + b for b in text], prompt_len=3) for text in texts]
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-2, max_grad_norm=1.0))
    losses = []
    for _ in range(25):
        losses.append(trainer.forward_backward(datums, nll_loss)["loss"])
        stats = trainer.optim_step()
        assert stats["skipped"] == 0.0 and math.isfinite(stats["grad_norm"])
    assert losses[0] > 5.0  # about ln(260) at random init
    assert losses[-1] < 0.3 * losses[0]
    assert trainer.step == 25


def test_non_finite_gradient_skips_the_step(model, caplog):
    datums = random_datums([10, 7])
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-2))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def nan_loss(logprobs, mb):
        return (logprobs * mb.weights).sum() * float("nan"), {}

    trainer.forward_backward(datums, nan_loss)
    with caplog.at_level(logging.WARNING, logger="training.utils.trainer"):
        stats = trainer.optim_step()

    assert stats["skipped"] == 1.0 and math.isnan(stats["grad_norm"]) and stats["lr"] == 1e-2
    assert trainer.skipped_steps == 1 and trainer.step == 0
    assert any("skipped optimizer step" in r.getMessage() for r in caplog.records)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None
    # The next good step applies normally.
    trainer.forward_backward(datums, nll_loss)
    assert trainer.optim_step()["skipped"] == 0.0 and trainer.step == 1


@pytest.mark.parametrize("lora", [False, True])
def test_divide_grads_divides_every_accumulated_gradient_in_place(model, lora):
    """Two equal calls accumulate twice one call's gradient; dividing by 2 gives that gradient back exactly.
    With LoRA only the adapters carry gradients, and the base stays without."""
    datums = random_datums([10, 7])
    trainer = Trainer(model, TrainerConfig(**(dict(lora_rank=4, lora_alpha=8.0) if lora else {})))
    trainer.forward_backward(datums, nll_loss)
    once = grads(trainer.model)
    trainer.forward_backward(datums, nll_loss)
    summed = grads(trainer.model)
    trainer.divide_grads(2.0)
    divided = grads(trainer.model)
    assert once and divided.keys() == summed.keys() == once.keys()
    assert all("lora_" in name for name in divided) if lora else len(divided) == len(list(model.parameters()))
    for name, grad in divided.items():
        assert torch.equal(grad, summed[name] / 2), name
        assert torch.equal(grad, once[name]), name


def test_grad_norm_is_reported_and_clipped(model):
    datums = random_datums([10, 7])
    trainer = Trainer(model, TrainerConfig(max_grad_norm=None))
    trainer.forward_backward(datums, nll_loss)
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert trainer.optim_step()["grad_norm"] == pytest.approx(unclipped)

    clipping = Trainer(model, TrainerConfig(max_grad_norm=1e-3))
    clipping.forward_backward(datums, nll_loss)
    captured = {}
    clipping.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: captured.update(
            norm=torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]]).item()
        )
    )
    assert clipping.optim_step()["grad_norm"] > 1e-3
    assert captured["norm"] == pytest.approx(1e-3, rel=1e-3)


# ---- LR schedule ----------------------------------------------------------------------


def test_lr_schedule_values():
    def schedule(kind):
        return TrainerConfig(lr_schedule=kind, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)

    constant, linear, cosine = schedule("constant"), schedule("linear"), schedule("cosine")
    for cfg in (constant, linear, cosine):
        assert lr_multiplier(0, cfg) == 0.5 and lr_multiplier(1, cfg) == 1.0 and lr_multiplier(2, cfg) == 1.0
    assert lr_multiplier(7, constant) == 1.0
    # Decay spans steps 2..10: progress 0.25 at step 4, 0.5 at step 6, 1 from step 10 on.
    assert lr_multiplier(4, linear) == pytest.approx(0.1 + 0.9 * 0.75)  # 0.775
    assert lr_multiplier(6, linear) == pytest.approx(0.55)
    assert lr_multiplier(10, linear) == pytest.approx(0.1)
    assert lr_multiplier(25, linear) == pytest.approx(0.1)
    assert lr_multiplier(4, cosine) == pytest.approx(0.868198, abs=1e-6)  # 0.1 + 0.9·½(1 + cos(π/4))
    assert lr_multiplier(6, cosine) == pytest.approx(0.55)
    assert lr_multiplier(10, cosine) == pytest.approx(0.1)


def test_trainer_applies_the_schedule(model):
    cfg = TrainerConfig(learning_rate=1e-3, lr_schedule="linear", warmup_steps=2, total_steps=6)
    trainer = Trainer(model, cfg)
    datums = random_datums([6])
    lrs = []
    for _ in range(6):
        trainer.forward_backward(datums, nll_loss)
        lrs.append(trainer.optim_step()["lr"])
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_decaying_schedule_needs_total_steps(model):
    with pytest.raises(ConfigError, match="total_steps"):
        Trainer(model, TrainerConfig(lr_schedule="cosine"))


# ---- errors ---------------------------------------------------------------------------


def test_bad_input_raises_clear_errors(model):
    trainer = Trainer(model, TrainerConfig())
    with pytest.raises(ValueError, match="empty"):
        trainer.logprobs([])
    with pytest.raises(ValueError, match="empty"):
        trainer.forward_backward([], nll_loss)
    broken = random_datums([5, 6])
    broken[1].target_ids = broken[1].target_ids[:-1]
    with pytest.raises(ValueError, match="datum 1.*target_ids"):
        trainer.logprobs(broken)
    with pytest.raises(ValueError, match="temperature"):
        trainer.logprobs(random_datums([5]), temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        trainer.forward_backward(random_datums([5]), nll_loss, temperature=-1.0)
    with pytest.raises(ValueError, match=r"extras\['old'\]\[0\]"):
        trainer.forward_backward(random_datums([5]), nll_loss, extras={"old": [[0.0] * 3]})


# ---- export and reference -------------------------------------------------------------


def test_save_hf_round_trip(model, tmp_path):
    _, tokenizer = load_model_and_tokenizer("tiny-random", device="cpu")
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-2))
    trainer.forward_backward(random_datums([8]), nll_loss)
    trainer.optim_step()
    trainer.save_hf(tmp_path, tokenizer)

    assert (tmp_path / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 30, 77, 100]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-6)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("hi") == tokenizer.encode("hi")


def test_state_dict_for_inference_shares_the_live_weights(model):
    state = Trainer(model, TrainerConfig()).state_dict_for_inference()
    params = dict(model.named_parameters())
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    for name, tensor in state.items():
        assert not tensor.requires_grad
        if name in params:
            assert tensor.data_ptr() == params[name].data_ptr()


def test_reference_trainer_is_frozen(model):
    reference = Trainer(model, TrainerConfig(), trainable=False)
    assert reference.optimizer is None and reference.scheduler is None
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    datums = random_datums([7, 12])
    want, _ = direct_logprobs_entropy(model, datums[1], 1.0)
    assert (reference.logprobs(datums)[1] - want).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="reference"):
        reference.forward_backward(datums, nll_loss)
    with pytest.raises(RuntimeError, match="reference"):
        reference.optim_step()
    with pytest.raises(RuntimeError, match="reference"):
        reference.divide_grads(2.0)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_layers_give_the_eager_logprobs_and_gradient(model):
    datums = random_datums([23, 6, 14, 31, 2, 9])
    eager = Trainer(model, TrainerConfig(max_tokens_per_microbatch=32))
    want_lp = eager.logprobs(datums)
    eager.forward_backward(datums, token_mean_pg_loss)
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)

    compiled = Trainer(model, TrainerConfig(max_tokens_per_microbatch=32, compile_layers=True))
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    got_lp = compiled.logprobs(datums)
    compiled.forward_backward(datums, token_mean_pg_loss)
    for want, got in zip(want_lp, got_lp):
        assert (want - got).abs().max() < 1e-5
    for name, grad in grads(model).items():
        assert (grad - want_grads[name]).abs().max() < 1e-6, name


# ---- the non-finite update guard ------------------------------------------------------


def adamw_state(trainer) -> dict[str, dict]:
    names = {p: name for name, p in trainer.model.named_parameters()}
    return {names[p]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for p, state in trainer.optimizer.state.items()}


def assert_same_state(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for key, value in want[name].items():
            assert torch.equal(torch.as_tensor(got[name][key]), torch.as_tensor(value)), (name, key)


def overflowing_learning_rate(trainer):
    # torch refuses the step's scalar lr / (1 − β1^t), which does not fit in float32.
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1e39


def overflowing_weight_decay(trainer):
    # 1 − lr·wd = −3e38 fits in float32, but a weight of 2 times it does not: an inf weight.
    trainer.model.model.layers[0].mlp.up_proj.weight.data[0, 0] = 2.0
    decayed = trainer.optimizer.param_groups[0]
    decayed["lr"], decayed["weight_decay"] = 1e19, 3e19


@pytest.mark.parametrize("poison", [overflowing_learning_rate, overflowing_weight_decay])
def test_a_non_finite_update_is_undone_and_skipped(model, caplog, poison):
    datums = random_datums([10, 7])
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-2))
    trainer.forward_backward(datums, nll_loss)
    assert trainer.optim_step()["skipped"] == 0.0
    poison(trainer)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = adamw_state(trainer)

    trainer.forward_backward(datums, nll_loss)
    with caplog.at_level(logging.WARNING, logger="training.utils.trainer"):
        stats = trainer.optim_step()

    assert stats["skipped"] == 1.0 and math.isfinite(stats["grad_norm"])
    assert trainer.skipped_steps == 1 and trainer.step == 1
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
        assert p.grad is None
    assert_same_state(adamw_state(trainer), state)
    [message] = [r.getMessage() for r in caplog.records if "skipped optimizer step" in r.getMessage()]
    assert "update" in message and "gradient norm is" not in message
    # With a sane learning rate (and no decay, as configured) again, the next step applies.
    for group in trainer.optimizer.param_groups:
        group["lr"], group["weight_decay"] = 1e-2, 0.0
    trainer.forward_backward(datums, nll_loss)
    assert trainer.optim_step()["skipped"] == 0.0 and trainer.step == 2


def test_a_learning_rate_the_config_accepts_but_float32_cannot_hold_skips_the_first_step(model):
    trainer = Trainer(model, TrainerConfig(learning_rate=1e39))
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.forward_backward(random_datums([10, 7]), nll_loss)
    assert trainer.optim_step()["skipped"] == 1.0
    assert trainer.skipped_steps == 1 and trainer.step == 0 and adamw_state(trainer) == {}
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name


def test_a_normal_step_changes_weights_and_state_without_an_undo_copy(model, monkeypatch):
    from training.utils.trainer import optim

    def no_copy(*args):
        raise AssertionError("a normal step took an undo copy")

    monkeypatch.setattr(optim, "snapshot_params", no_copy)
    datums = random_datums([10, 7])
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-2))
    weight = model.model.layers[0].mlp.up_proj.weight
    trainer.forward_backward(datums, nll_loss)
    trainer.optim_step()
    after_one = weight.detach().clone()
    state = adamw_state(trainer)["model.layers.0.mlp.up_proj.weight"]
    trainer.forward_backward(datums, nll_loss)
    assert trainer.optim_step()["skipped"] == 0.0
    later = adamw_state(trainer)["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(weight, after_one)
    assert later["step"].item() == 2 and not torch.equal(later["exp_avg"], state["exp_avg"])
    assert trainer.step == 2 and trainer.skipped_steps == 0


def test_a_non_finite_gradient_still_skips_with_the_state_untouched(model, caplog):
    datums = random_datums([10, 7])
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-2))
    trainer.forward_backward(datums, nll_loss)
    trainer.optim_step()
    state = adamw_state(trainer)

    trainer.forward_backward(datums, lambda logprobs, mb: ((logprobs * mb.weights).sum() * float("inf"), {}))
    with caplog.at_level(logging.WARNING, logger="training.utils.trainer"):
        stats = trainer.optim_step()
    assert stats["skipped"] == 1.0 and not math.isfinite(stats["grad_norm"])
    assert trainer.skipped_steps == 1 and trainer.step == 1
    assert_same_state(adamw_state(trainer), state)
    assert any("gradient norm is" in r.getMessage() for r in caplog.records)


def test_an_edited_adamw_state_that_overflows_raises(model):
    """Outside the bound's premise there is no undo copy: the step raises rather than train on."""
    datums = random_datums([10, 7])
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-2))
    trainer.forward_backward(datums, nll_loss)
    trainer.optim_step()
    state = trainer.optimizer.state[model.model.layers[0].mlp.up_proj.weight]
    state["exp_avg"].fill_(3e38)
    state["exp_avg_sq"].zero_()
    trainer.forward_backward(datums, nll_loss)
    with pytest.raises(RuntimeError, match="bound"):
        trainer.optim_step()


@pytest.mark.parametrize("fused", [False, True], ids=["per-tensor", "fused"])  # the trainer uses fused on CPU
@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.0, 0.5), (0.5, 0.3), (0.0, 0.0)])
def test_adam_step_bound_holds_for_wild_gradients(betas, fused):
    from training.utils.trainer.optim import adam_step_bound

    generator = torch.Generator().manual_seed(0)
    weights = torch.zeros(4096, requires_grad=True)
    optimizer = torch.optim.AdamW([weights], lr=1.0, betas=betas, weight_decay=0.0, fused=fused)
    largest_move = 0.0
    for _ in range(60):
        # Scales spanning 12 orders of magnitude from one step to the next.
        scale = 10.0 ** torch.randint(-8, 4, (4096,), generator=generator)
        weights.grad = torch.randn(4096, generator=generator) * scale
        before = weights.detach().clone()
        optimizer.step()
        largest_move = max(largest_move, (weights.detach() - before).abs().max().item())
    assert largest_move <= adam_step_bound(1.0, betas) * (1 + 1e-4)
    assert adam_step_bound(1.0, (0.9, 0.8)) == math.inf  # β1² ≥ β2: no step-independent bound


def test_max_abs_reads_every_tensor_and_reads_nan_as_inf():
    from training.utils.trainer.optim import max_abs

    mixed = [torch.tensor([1.0, -5.0]), torch.empty(0), torch.tensor([[2.0]], dtype=torch.bfloat16)]
    assert max_abs(mixed).item() == 5.0
    assert max_abs([torch.tensor([-7.5]), torch.tensor([3.0])]).item() == 7.5  # a negative extreme counts
    assert max_abs([torch.tensor([1.0, float("nan")]), torch.tensor([2.0])]).item() == math.inf
    assert max_abs([torch.tensor([-math.inf])]).item() == math.inf
    assert max_abs([torch.empty(0)]).item() == 0.0
    assert max_abs([]).item() == 0.0


# ---- the compiled layers' start-up check -----------------------------------------------


def fresh_model():
    torch.manual_seed(0)
    return load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")[0]


def raising_layer_call(layer):
    def call(*args, **kwargs):
        raise RuntimeError("the compiler failed\n(a page of details)")
    return call


def perturbed_layer_call(layer):
    def call(*args, **kwargs):
        return layer._call_impl(*args, **kwargs) + 0.5
    return call


@pytest.mark.parametrize(("make_call", "first_call", "reason"), [
    (raising_layer_call, "logprobs", "raised RuntimeError: the compiler failed"),
    (perturbed_layer_call, "forward_backward", "away from the eager ones"),
])
def test_a_failing_compilation_is_undone_with_one_warning(monkeypatch, caplog, make_call, first_call, reason):
    datums = random_datums([23, 6, 14, 31, 2, 9])
    eager_model = fresh_model()
    eager = Trainer(eager_model, TrainerConfig(max_tokens_per_microbatch=32))
    model = fresh_model()

    def fake_compile(self, *args, **kwargs):
        self._compiled_call_impl = make_call(self)

    monkeypatch.setattr(torch.nn.Module, "compile", fake_compile)
    trainer = Trainer(model, TrainerConfig(max_tokens_per_microbatch=32, compile_layers=True))
    with caplog.at_level(logging.WARNING, logger="training.utils.trainer"):
        if first_call == "logprobs":
            for got, want in zip(trainer.logprobs(datums), eager.logprobs(datums)):
                assert torch.equal(got, want)
        trainer.forward_backward(datums, token_mean_pg_loss)
        eager.forward_backward(datums, token_mean_pg_loss)
        for got, want in zip(trainer.logprobs(datums, with_entropy=True), eager.logprobs(datums, with_entropy=True)):
            assert all(torch.equal(g, w) for g, w in zip(got, want))

    eager_grads = grads(eager_model)
    for name, grad in grads(model).items():
        assert torch.equal(grad, eager_grads[name]), name
    assert trainer.compiled_layers is None
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    [warning] = [r.getMessage() for r in caplog.records if "compile_layers" in r.getMessage()]
    assert reason in warning and "(a page of details)" not in warning
    assert "set trainer.compile_layers=false" in warning.lower()


def test_compiled_logprob_tolerances():
    from training.utils.trainer.compiled import compiled_logprob_mismatch

    eager = torch.tensor([[-0.5, -3.0, -20.0, 0.0]])
    assert compiled_logprob_mismatch(eager + 5e-4, eager, "fp32") is None
    assert compiled_logprob_mismatch(eager + 5e-3, eager, "fp32") is not None
    assert compiled_logprob_mismatch(eager + 0.05, eager, "bf16-autocast") is None
    assert compiled_logprob_mismatch(eager + 1.0, eager, "bf16") is not None
    nan = torch.tensor([[float("nan"), -1.0]])
    assert compiled_logprob_mismatch(nan, torch.tensor([[-1.0, -1.0]]), "fp32") is not None
    assert compiled_logprob_mismatch(nan, nan.clone(), "fp32") is None


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_a_compilation_that_matches_eager_is_kept(model, monkeypatch, caplog):
    from training.utils.trainer import compiled

    verdicts = []
    mismatch = compiled.compiled_logprob_mismatch

    def recording_mismatch(*args):
        verdicts.append(mismatch(*args))
        return verdicts[-1]

    monkeypatch.setattr(compiled, "compiled_logprob_mismatch", recording_mismatch)
    datums = random_datums([23, 6, 14, 31, 2, 9])
    trainer = Trainer(model, TrainerConfig(max_tokens_per_microbatch=32, compile_layers=True))
    with caplog.at_level(logging.WARNING, logger="training.utils.trainer"):
        trainer.logprobs(datums)
        trainer.forward_backward(datums, token_mean_pg_loss)
        trainer.logprobs(datums)
    # One check per grad mode (each compiles its own graph), both passed.
    assert verdicts == [None, None]
    assert trainer.compiled_layers is not None and trainer.compiled_layers.checked_grad_modes == {False, True}
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert not [r for r in caplog.records if "compile_layers" in r.getMessage()]

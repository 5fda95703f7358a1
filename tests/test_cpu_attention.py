"""The CPU attention paths (decode, short rows) against torch's sdpa, and where they are switched on."""

import pytest
import torch
import torch.nn.functional as F

import training.utils.models.cpu_attention as cpu_attention
from training.utils.config.rl import DeploymentConfig, TrainerConfig
from training.utils.deploy.engine import Engine
from training.utils.models.cpu_attention import DECODE_NAME, NAME
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import make_test_tokenizer, tiny_config
from training.utils.trainer import Datum, Trainer


class Grouped(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def sdpa_reference(query, key, value, mask, dtype=torch.float32):
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query.to(dtype), key.to(dtype).repeat_interleave(groups, 1),
                                         value.to(dtype).repeat_interleave(groups, 1), attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_one_query_per_row_matches_sdpa(dtype, mask_kind):
    torch.manual_seed(0)
    rows, kv_heads, heads, keys, dim = 5, 2, 6, 11, 16
    # Keys and values as the engine holds them: strided views of longer buffers.
    key = torch.randn(rows, kv_heads, keys + 4, dim, dtype=dtype)[:, :, :keys]
    value = torch.randn(rows, kv_heads, keys + 4, dim, dtype=dtype)[:, :, :keys]
    query = torch.randn(rows, heads, 1, dim, dtype=dtype)
    visible = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    visible[1, ..., :4] = False  # a left-padded row
    visible[3, ..., :9] = False
    mask = {"bool": visible, "additive": torch.zeros(visible.shape).masked_fill(~visible, -1e9),
            "none": None}[mask_kind]

    out, weights = cpu_attention.cpu_attention(Grouped(), query, key, value, mask)

    assert weights is None and out.shape == (rows, 1, heads, dim) and out.dtype == dtype
    want = sdpa_reference(query, key, value, visible if mask is not None else None)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - want).abs().max() < tolerance


@pytest.fixture
def decode_chunk_rows(monkeypatch) -> list[int]:
    """The rows of each chunk `decode_attention` computes, in order."""
    calls = []
    rows_call = cpu_attention._decode_rows
    monkeypatch.setattr(cpu_attention, "_decode_rows", lambda q, *args: calls.append(len(q)) or rows_call(q, *args))
    return calls


@pytest.mark.parametrize("mask_kind", ["per row", "broadcast", "none"])
def test_decode_rows_in_chunks_give_the_same_bits_as_all_at_once(monkeypatch, decode_chunk_rows, mask_kind):
    torch.manual_seed(1)
    rows, kv_heads, heads, keys, dim = 7, 2, 6, 11, 16
    key = torch.randn(rows, kv_heads, keys + 4, dim, dtype=torch.bfloat16)[:, :, :keys]
    value = torch.randn(rows, kv_heads, keys + 4, dim, dtype=torch.bfloat16)[:, :, :keys]
    query = torch.randn(rows, heads, 1, dim, dtype=torch.bfloat16)
    visible = torch.ones(rows if mask_kind == "per row" else 1, 1, 1, keys, dtype=torch.bool)
    visible[-1, ..., :5] = False
    mask = None if mask_kind == "none" else visible
    whole, _ = cpu_attention.cpu_attention(Grouped(), query, key, value, mask)
    decode_chunk_rows.clear()
    # Room for the float32 keys of three rows: chunks of 3, 3 and 1 rows.
    monkeypatch.setattr(cpu_attention, "DECODE_CHUNK_BYTES", 3 * kv_heads * keys * dim * 4 + 1)

    chunked, _ = cpu_attention.cpu_attention(Grouped(), query, key, value, mask)

    assert decode_chunk_rows == [3, 3, 1]
    assert torch.equal(chunked, whole)


def test_float32_decode_rows_are_never_chunked(monkeypatch, decode_chunk_rows):
    key = value = torch.randn(7, 2, 11, 16)
    monkeypatch.setattr(cpu_attention, "DECODE_CHUNK_BYTES", 1)

    cpu_attention.cpu_attention(Grouped(), torch.randn(7, 6, 1, 16), key, value, None)

    assert decode_chunk_rows == [7]  # nothing to convert, so nothing to gain from chunks


def short_rows(dtype, rows=3, kv_heads=2, heads=6, queries=13, dim=16):
    torch.manual_seed(2)
    # As a decoder layer hands them over: (rows, queries, heads, dim) transposed, so not contiguous.
    query = torch.randn(rows, queries, heads, dim, dtype=dtype).transpose(1, 2).requires_grad_()
    key = torch.randn(rows, queries, kv_heads, dim, dtype=dtype).transpose(1, 2).requires_grad_()
    value = torch.randn(rows, queries, kv_heads, dim, dtype=dtype).transpose(1, 2).requires_grad_()
    visible = torch.ones(queries, queries, dtype=torch.bool).tril()[None, None].repeat(rows, 1, 1, 1)
    visible[1, :, :, 9:] = False  # row 1 right-padded after 9 tokens, its padded queries seeing nothing
    visible[1, :, 9:, :] = False
    return query, key, value, visible


def outputs_and_grads(attention, query, key, value, visible, upstream):
    for tensor in (query, key, value):
        tensor.grad = None
    out = attention(query, key, value, visible)
    (out.double() * upstream).sum().backward()
    return [out.detach().double(), query.grad.double(), key.grad.double(), value.grad.double()]


@pytest.mark.parametrize("inputs", ["bf16", "fp32 under bf16 autocast"])
def test_short_bf16_rows_match_sdpa_in_float64_outputs_and_gradients(inputs):
    query, key, value, visible = short_rows(torch.bfloat16 if inputs == "bf16" else torch.float32)
    upstream = torch.randn(3, 13, 6, 16, dtype=torch.float64)
    real = torch.ones(3, 13, 1, 1, dtype=torch.float64)
    real[1, 9:] = 0  # sdpa's output for a query that sees nothing is NaN: compared where a query sees keys

    def ours(q, k, v, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inputs != "bf16"):
            out, _ = cpu_attention.cpu_attention(Grouped(), q, k, v, mask)
        assert out.dtype == torch.bfloat16  # what sdpa returns under autocast too
        return out

    def reference(q, k, v, mask):
        return torch.nan_to_num(sdpa_reference(q, k, v, mask, torch.float64)) * real

    got = outputs_and_grads(ours, query, key, value, visible, upstream)
    want = outputs_and_grads(reference, query, key, value, visible, upstream)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert torch.isfinite(a).all(), name
        assert (a - b).abs().max() < 1.5e-2 * b.abs().max(), name
    assert got[0][1, 9:].abs().max() == 0 and got[1][1, :, 9:].abs().max() == 0  # padded queries: 0, no gradient


def test_short_rows_trace_as_one_graph_under_torch_compile():
    """`trainer.compile_layers` compiles each decoder layer: a host sync inside the attention (the check for
    queries that see no key) would split every layer into two graphs and lose most of what compiling fuses."""
    query, key, value, visible = short_rows(torch.bfloat16)
    explained = torch._dynamo.explain(cpu_attention.short_row_attention)(query, key, value, visible, None)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_float32_rows_and_longer_rows_go_to_sdpa(monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value, visible = short_rows(torch.float32)
    with torch.no_grad():
        ours, _ = cpu_attention.cpu_attention(Grouped(), query, key, value, visible)
        want, _ = sdpa_attention_forward(Grouped(), query, key, value, visible)
        assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(want))
        query, key, value = (t.bfloat16() for t in (query, key, value))
        monkeypatch.setattr(cpu_attention, "SHORT_ROW_KEYS", 12)  # 13 keys: one too many
        ours, _ = cpu_attention.cpu_attention(Grouped(), query, key, value, visible)
        want, _ = sdpa_attention_forward(Grouped(), query, key, value, visible)
        assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(want))


def test_a_causal_row_without_a_mask_is_causal():
    query, key, value, _ = short_rows(torch.bfloat16)
    with torch.no_grad():
        out, _ = cpu_attention.cpu_attention(Grouped(), query, key, value, None)
        want = sdpa_reference(query, key, value, torch.ones(13, 13, dtype=torch.bool).tril())
    assert (out.float() - want).abs().max() < 2e-2


def test_the_backward_keeps_no_queries_by_keys_tensor():
    """What the short-row path keeps for the backward is what sdpa keeps: inputs and mask, nothing the size of
    (heads × queries × keys), which for a 2048-token micro-batch of 512-token rows would be 1 GB over 30 layers."""
    rows, heads, queries = 2, 6, 200
    query = torch.randn(rows, heads, queries, 16, dtype=torch.bfloat16, requires_grad=True)
    key = torch.randn(rows, 2, queries, 16, dtype=torch.bfloat16, requires_grad=True)
    value = torch.randn(rows, 2, queries, 16, dtype=torch.bfloat16, requires_grad=True)
    visible = torch.ones(queries, queries, dtype=torch.bool).tril()[None, None]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        cpu_attention.cpu_attention(Grouped(), query, key, value, visible)
    assert saved and max(t.numel() for t in saved) < rows * heads * queries * queries / 4


@pytest.mark.parametrize("policy_attention", ["sdpa", NAME])
def test_the_engine_switches_its_own_cpu_copy_only_to_decode_attention(policy_attention):
    """Also when the copy is built from a trainer's model, already switched to the trainer's implementation."""
    tokenizer = make_test_tokenizer()
    policy, _ = load_model_and_tokenizer(tiny_config(len(tokenizer)))
    if policy_attention == NAME:
        Trainer(policy, TrainerConfig(learning_rate=1e-3))
    assert policy.config._attn_implementation == policy_attention
    engine_model = type(policy)(policy.config)
    engine_model.load_state_dict(policy.state_dict())
    engine = Engine(engine_model, tokenizer, DeploymentConfig())
    try:
        assert engine.model.config._attn_implementation == DECODE_NAME
        assert policy.config._attn_implementation == policy_attention
        query, key, value, visible = short_rows(torch.bfloat16)
        calls = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_attention, "short_row_attention", lambda *a: calls.append(1))
            cpu_attention.cpu_decode_attention(Grouped(), query, key, value, visible)
        assert not calls  # the engine's prefill stays sdpa
    finally:
        engine.close()


def test_the_trainer_runs_short_rows_here_with_logprobs_and_gradients_as_under_sdpa(monkeypatch):
    tokenizer = make_test_tokenizer()
    model, _ = load_model_and_tokenizer(tiny_config(len(tokenizer)))
    other = type(model)(model.config)  # shares the config: the switch must not reach it
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-3, precision="bf16-autocast"))
    assert model.config._attn_implementation == NAME and other.config._attn_implementation == "sdpa"
    assert trainer.prefix_sharing is not None  # cpu_sdpa takes sdpa's shared-prefix masks
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    datums = [Datum(input_ids=prompt + [20 + i, 30 + i], target_ids=prompt[1:] + [20 + i, 30 + i, 40 + i],
                    weights=[0.0] * 9 + [1.0] * 3, behaviour_logprobs=[-3.0] * 12, advantage=1.0 - i,
                    prompt_len=10) for i in range(3)]

    def loss(logprobs, mb):
        return -(mb.advantages[:, None] * logprobs * mb.weights).sum(), {}

    def logprobs_and_grads():
        trainer.optimizer.zero_grad(set_to_none=True)
        logprobs = trainer.logprobs(datums)
        trainer.forward_backward(datums, loss)
        return logprobs, [p.grad.clone() for p in model.parameters()]

    calls = []
    monkeypatch.setattr(cpu_attention.ShortRowAttention, "apply",
                        lambda *a, _apply=cpu_attention.ShortRowAttention.apply: calls.append(1) or _apply(*a))
    here_logprobs, here_grads = logprobs_and_grads()
    assert calls  # the path ran
    monkeypatch.setattr(cpu_attention, "SHORT_ROW_KEYS", 0)
    sdpa_logprobs, sdpa_grads = logprobs_and_grads()
    for a, b in zip(here_logprobs, sdpa_logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2
    grad_scale = max(g.abs().max() for g in sdpa_grads)
    assert max((a - b).abs().max() for a, b in zip(here_grads, sdpa_grads)) < 2e-2 * grad_scale


def test_two_threads_inside_the_short_row_path_keep_their_own_autocast(monkeypatch):
    """The trainer (under autocast) and the engine (without) run attention on two threads at once; neither may
    leave the other's autocast state changed. A shared autocast context object did: the main job's next linear
    layer then saw bf16 inputs beside float32 weights."""
    import threading

    both_inside = threading.Barrier(2, timeout=10)
    scores = cpu_attention._scores
    monkeypatch.setattr(cpu_attention, "_scores", lambda *a: (both_inside.wait(), scores(*a))[1])
    query, key, value, visible = short_rows(torch.bfloat16)
    states = {}

    def attend(autocast_on: bool) -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_on):
            cpu_attention.cpu_attention(Grouped(), query, key, value, visible)
            states[autocast_on] = torch.is_autocast_enabled("cpu")

    threads = [threading.Thread(target=attend, args=(on,)) for on in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert states == {True: True, False: False}

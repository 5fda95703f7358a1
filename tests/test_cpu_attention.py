"""The engine's CPU decode attention against torch's sdpa, and where it is switched on."""

import pytest
import torch
import torch.nn.functional as F

from training.utils.config import DeploymentConfig
from training.utils.deploy.cpu_attention import NAME, decode_attention
from training.utils.deploy.engine import Engine
from training.utils.model import load_model_and_tokenizer
from training.utils.tiny_model import make_test_tokenizer, tiny_config


class Grouped(torch.nn.Module):
    num_key_value_groups = 3


def sdpa_reference(query, key, value, mask):
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query.float(), key.float().repeat_interleave(groups, 1),
                                         value.float().repeat_interleave(groups, 1), attn_mask=mask)
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

    out, weights = decode_attention(Grouped(), query, key, value, mask)

    assert weights is None and out.shape == (rows, 1, heads, dim) and out.dtype == dtype
    want = sdpa_reference(query, key, value, visible if mask is not None else None)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - want).abs().max() < tolerance


def test_longer_queries_go_to_sdpa():
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    out, _ = decode_attention(Grouped(), query, key, value, None, is_causal=True)
    want = F.scaled_dot_product_attention(query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1),
                                          is_causal=True).transpose(1, 2)
    assert (out - want).abs().max() < 1e-6


def test_the_engine_switches_its_own_cpu_copy_only():
    tokenizer = make_test_tokenizer()
    policy, _ = load_model_and_tokenizer(tiny_config(len(tokenizer)))
    assert policy.config._attn_implementation == "sdpa"
    engine_model = type(policy)(policy.config)
    engine_model.load_state_dict(policy.state_dict())
    engine = Engine(engine_model, tokenizer, DeploymentConfig())
    try:
        assert engine.model.config._attn_implementation == NAME
        assert policy.config._attn_implementation == "sdpa"
    finally:
        engine.close()

"""Decode attention on the CPU: one query per row as two batched matmuls instead of sdpa's CPU kernels.

torch's CPU sdpa kernels tile the queries of every (row, head) pair in blocks made for long queries, so a
decode step (one query per row) pays that setup for a few dozen keys, in every layer. The engine's decode
attention is small: (rows, key/value heads, query heads per group, keys). Computed as q·kᵀ, softmax, ·v in
float32 it costs a fraction of that, and rounds no more than the kernel does. Everything else (prefill, any
query longer than one token, dropout, extra attention features) goes to transformers' sdpa unchanged.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "cpu_decode_sdpa"
"""The attention implementation the engine's CPU model runs under: sdpa's masks and sdpa, but for decode."""

UNSUPPORTED = ("softcap", "s_aux", "position_bias", "output_attentions")
"""Attention features some models pass (logit soft-capping, attention sinks, relative position biases, returned
weights) that this path does not compute: a call with any of them set goes to sdpa."""


def use_cpu_decode_attention(model: torch.nn.Module) -> None:
    """Switch a CPU model that runs sdpa to `NAME`; leave any other as it is.

    The implementation is read from the config, which a model built from another's config shares with it (and
    the trainer's shared-prefix masks take sdpa by name), so the model first gets a config of its own: every
    submodule's config, sub-configs included, is swapped for its copy.
    """
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return
    copies: dict[int, object] = {}
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) in copies:
            module.config = copies[id(config)]
    model.set_attn_implementation(NAME)


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (rows, heads, queries, dim) in, (rows, queries, heads, dim)
    out. One query per row on the CPU is computed here; the rest by `sdpa_attention_forward`."""
    if query.shape[2] != 1 or query.device.type != "cpu" or dropout or any(kwargs.get(name) for name in UNSUPPORTED):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    # Each key/value head serves a group of query heads: (rows, kv heads, group, dim) against its keys.
    query_RKGD = query.view(rows, kv_heads, heads // kv_heads, dim).float()
    scores_RKGL = torch.matmul(query_RKGD, key.float().transpose(-1, -2))
    scores_RKGL.mul_(scaling if scaling is not None else 1 / math.sqrt(dim))
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores_RKGL.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores_RKGL.add_(attention_mask)
    out_RKGD = torch.matmul(scores_RKGL.softmax(dim=-1), value.float())
    return out_RKGD.view(rows, 1, heads, dim).to(query.dtype), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)

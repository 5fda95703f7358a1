"""Attention on the CPU for the shapes an RL run makes: one query per row (the engine's decode), and short rows
(the trainer's micro-batches of prompts and their draws). The rest goes to sdpa.

torch's CPU sdpa kernels tile the queries of every (row, head) pair in blocks made for long sequences. On the short
rows of RL (a prompt and its draws, a chat turn) that tiling is most of the cost: on SmolLM2's shape, a trainer
micro-batch of eight 110-token rows spent about a fifth of its forward and backward in sdpa's CPU kernels
(benchmarks/RESULTS.md). Here the first two cases below are a few batched matmuls:

- decode: q·kᵀ, softmax, ·v in float32, per key/value head for its group of query heads, bf16 keys and values
  converted a few rows at a time once the context is long (`DECODE_CHUNK_BYTES`);
- short bf16 rows (at most `SHORT_ROW_KEYS` keys): the same with bf16 matmuls and a float32 softmax, as an
  autograd function that keeps only q, k, v and the mask for the backward, which recomputes the softmax (as a
  flash kernel does), so activation memory is what sdpa's is;
- the trainer's shared-prefix rows, where it passes their pieces (`PIECES`): sdpa on each prefix and each suffix
  apart, batched by length (`prefix_attention`), instead of on every pair of the row.

Under bf16 the scores are products of bf16 queries and keys summed in float32 and rounded once to bf16, the same
rounding every bf16 matmul of the model makes; the softmax and its normalisation run in float32.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "cpu_sdpa"
"""The trainer's CPU attention: sdpa's masks, decode and short rows computed here."""

DECODE_NAME = "cpu_decode_sdpa"
"""The engine's CPU attention: decode computed here, prefill by sdpa (short rows measured no faster there, and
their buffers of changing sizes left the allocator holding more)."""

SHORT_ROW_KEYS = 512
"""bf16 rows with at most this many keys take the matmul path; longer ones, and float32 rows (whose sdpa kernels
are as fast), go to sdpa (the crossover is measured in benchmarks/cpu_attention.py)."""

DECODE_CHUNK_BYTES = 4 << 20
"""Most bytes of float32 keys one chunk of decode rows converts at a time (and as many of values). Converted all
rows at once, a long context's keys and values are float32 copies of tens of MB per layer, written out to memory
and read back by the next matmul; a chunk's copies are still in the cache when the matmul reads them. Results are
the same bits either way (benchmarks/RESULTS.md has the measurements)."""

PIECES = "prefix_pieces"
"""The keyword under which a trainer's forward passes a micro-batch's `prefix_attention.PrefixPieces` down to each
layer's attention: its shared-prefix rows computed a piece at a time."""

SDPA_LIKE = ("sdpa", NAME, DECODE_NAME)
"""The implementations a switch starts from: sdpa, or one of these (the engine's copy of a trainer's model)."""

UNSUPPORTED = ("softcap", "s_aux", "position_bias", "output_attentions")
"""Attention features some models pass (logit soft-capping, attention sinks, relative position biases, returned
weights) that these paths do not compute: a call with any of them set goes to sdpa."""


def use_cpu_attention(model: torch.nn.Module, implementation: str = NAME) -> None:
    """Switch a CPU model that runs sdpa to `implementation` (`NAME` or `DECODE_NAME`); leave any other as it is.

    The implementation is read from the config, which a model built from another's config shares with it, so the
    model first gets a config of its own: every submodule's config, sub-configs included, is swapped for its copy.
    """
    current = model.config._attn_implementation
    if next(model.parameters()).device.type != "cpu" or current == implementation or current not in SDPA_LIKE:
        return
    copies: dict[int, object] = {}
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) in copies:
            module.config = copies[id(config)]
    model.set_attn_implementation(implementation)


def cpu_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, short_rows: bool = True, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: (rows, heads, queries, dim) in, (rows, queries, heads, dim)
    out. Decode, and with `short_rows` short rows, on the CPU are computed here, shared-prefix rows a piece at a
    time where the trainer passes their pieces (`PIECES`); the rest by `sdpa_attention_forward`."""
    pieces = kwargs.pop(PIECES, None)
    queries, keys = query.shape[2], key.shape[2]
    # Under autocast (the trainer's bf16) sdpa would run in the autocast dtype whatever the inputs' (rotary
    # embeddings leave queries and keys float32); so does the short-row path.
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    here = (query.device.type == "cpu" and not dropout and not any(kwargs.get(name) for name in UNSUPPORTED)
            and (attention_mask is None or attention_mask.dtype == torch.bool or queries == 1))
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if here and pieces is not None and queries > 1:
        return pieces.attend(query, key, value, scaling), None
    if here and queries == 1 and query.dtype in (torch.float32, torch.bfloat16):
        return decode_attention(query, key, value, attention_mask, scaling), None
    if (here and short_rows and dtype == torch.bfloat16 and keys <= SHORT_ROW_KEYS
            and (attention_mask is not None or not causal or queries == keys)):
        visible = attention_mask
        if visible is None and causal:
            visible = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril_()[None, None]
        return short_row_attention(query.to(dtype), key.to(dtype), value.to(dtype), visible, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def decode_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float | None) -> Tensor:
    """One query per row, in float32: (rows, kv heads, group, dim) against each key/value head's keys; bf16 keys
    and values in chunks of rows whose float32 copies fit `DECODE_CHUNK_BYTES` (float32 ones are not copied)."""
    rows, kv_heads, keys, dim = key.shape
    rows_per_chunk = max(1, DECODE_CHUNK_BYTES // (kv_heads * keys * dim * 4))
    if rows_per_chunk >= rows or key.dtype == torch.float32:
        return _decode_rows(query, key, value, attention_mask, scaling)
    per_row_mask = attention_mask is not None and attention_mask.shape[0] == rows
    return torch.cat([
        _decode_rows(query[first:first + rows_per_chunk], key[first:first + rows_per_chunk],
                     value[first:first + rows_per_chunk],
                     attention_mask[first:first + rows_per_chunk] if per_row_mask else attention_mask, scaling)
        for first in range(0, rows, rows_per_chunk)
    ])


def _decode_rows(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 scaling: float | None) -> Tensor:
    """`decode_attention` of these rows at once: (rows, 1, heads, dim) out."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    query_RKGD = query.reshape(rows, kv_heads, heads // kv_heads, dim).float()
    scores_RKGL = torch.matmul(query_RKGD, key.float().transpose(-1, -2))
    scores_RKGL.mul_(scaling if scaling is not None else 1 / math.sqrt(dim))
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores_RKGL.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores_RKGL.add_(attention_mask)
    out_RKGD = torch.matmul(scores_RKGL.softmax(dim=-1), value.float())
    return out_RKGD.view(rows, 1, heads, dim).to(query.dtype)


def short_row_attention(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None,
                        scaling: float | None) -> Tensor:
    """Rows of up to `SHORT_ROW_KEYS` keys: (rows, heads, queries, dim) in, (rows, queries, heads, dim) out.
    `visible` (bool, broadcastable to (rows, 1, queries, keys)) marks the keys each query attends to; None: all.
    A query that sees no key (a padded position) gets 0 and passes no gradient back."""
    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    blind_R1Q1 = None
    if visible is not None:
        blind_R1Q1 = ~visible.any(dim=-1, keepdim=True)
        # Its softmax would be 0/0; it attends to every key instead and its output is zeroed.
        if torch.compiler.is_compiling() or bool(blind_R1Q1.any()):  # compiled: no host sync, no graph break
            visible = visible | blind_R1Q1
    # A key/value head's group of query heads as one matrix of group × queries rows: no repeated keys.
    query_RKQD = query.reshape(rows, kv_heads, heads // kv_heads * queries, dim)
    visible_R1GQK = None if visible is None else visible[:, :, None]
    out_RKQD = ShortRowAttention.apply(query_RKQD, key, value, visible_R1GQK,
                                       scaling if scaling is not None else 1 / math.sqrt(dim))
    out_RQHD = out_RKQD.view(rows, heads, queries, dim).transpose(1, 2)
    if blind_R1Q1 is not None:
        out_RQHD = out_RQHD.masked_fill(blind_R1Q1.view(-1, queries, 1, 1), 0.0)
    return out_RQHD.contiguous()


class ShortRowAttention(torch.autograd.Function):
    """softmax(scale·q·kᵀ, masked)·v with q as (rows, kv heads, group·queries, dim); scores and softmax in
    float32, the matmuls in the inputs' dtype.

    Backward from P recomputed (nothing of (queries, keys) size is kept between the passes):
    dv = Pᵀ·dO, dS = P ⊙ (dO·vᵀ − rowsum(P ⊙ dO·vᵀ)), dq = scale·dS·k, dk = scale·dSᵀ·q.
    """

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, scale: float) -> Tensor:
        # The inputs' dtype, as in the backward, which autocast never sees. A context made per call: a shared
        # one (a decorator's) keeps the state it restores on itself, and the trainer's and the engine's threads
        # would restore each other's.
        with torch.autocast("cpu", enabled=False):
            probs = torch.softmax(_scores(query, key, visible, scale), dim=-1)
            out = torch.matmul(probs.to(value.dtype), value)
        ctx.save_for_backward(query, key, value, visible)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, key, value, visible = ctx.saved_tensors
        probs = torch.softmax(_scores(query, key, visible, ctx.scale), dim=-1)
        grad_value = torch.matmul(probs.to(value.dtype).transpose(-1, -2), grad_out)
        grad_probs = torch.matmul(grad_out, value.transpose(-1, -2)).float()
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, torch.float32)
        grad_scores = grad_scores.mul_(ctx.scale).to(query.dtype)
        grad_query = torch.matmul(grad_scores, key)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), query)
        return grad_query, grad_key, grad_value, None, None


def _scores(query: Tensor, key: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    """scale·q·kᵀ in float32 with invisible keys at −inf, (rows, kv heads, group·queries, keys)."""
    scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(scale)
    if visible is not None:
        rows, kv_heads, group_queries, keys = scores.shape
        queries = visible.shape[-2]
        scores.view(rows, kv_heads, group_queries // queries, queries, keys).masked_fill_(~visible, float("-inf"))
    return scores


def cpu_decode_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
    """`cpu_attention` without the short-row path: the engine's."""
    return cpu_attention(module, query, key, value, attention_mask, short_rows=False, **kwargs)


AttentionInterface.register(NAME, cpu_attention)
AttentionInterface.register(DECODE_NAME, cpu_decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionMaskInterface.register(DECODE_NAME, sdpa_mask)

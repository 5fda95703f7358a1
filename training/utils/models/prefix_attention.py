"""The trainer's CPU attention over shared-prefix rows, a piece at a time.

A shared-prefix row (`trainer/shared_prefix.py`) holds a prefix, then the suffixes of the datums that share it. Each
suffix sees the prefix and, causally, itself; the row's dense mask says so, but sdpa's CPU kernels compute every
(query, key) pair of the row whatever the mask hides. On a group of eight draws of a 210-token prompt, two thirds of
those pairs are hidden, and attention was a fifth of a multi-turn LoRA step (benchmarks/RESULTS.md).

Here the row is cut into pieces: each prefix (and each datum computed alone) is a piece whose queries see its own
tokens causally; each suffix is a piece whose queries see its prefix and, causally, its own tokens. Pieces of like
lengths are padded into one batch (`plan_pieces` chooses the batches: the fewest padded pairs, counting each call's
fixed cost), each batch one sdpa call: causal without a mask for prefixes, under a mask for suffixes. One gather each
builds the batches' queries, keys and values, and one gather puts the outputs back on the row's grid (0 at padding),
so the backward is one scatter-add each. The result is the dense mask's, to float rounding (the pairs are summed
in other blocks); a padded query duplicates a real one and its output is dropped, so it passes no gradient back.
Short draws keep the dense mask: a piece of few queries costs about a full query block, so the trainer takes the
pieces only where a cost model that counts that says they pay (`PrefixPieces.pay`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from training.utils.models.cpu_attention import SHORT_ROW_KEYS, short_row_attention

CALL_PAIRS = 8192
"""One batch's fixed cost in (query, key) pairs, what `plan_pieces` weighs a further batch by: an sdpa call's
forward and backward with its autograd nodes, about as long as that many more pairs take on SmolLM2's heads."""

QUERY_BLOCK = 64
"""sdpa's CPU kernel computes a row's queries in blocks, and a piece of fewer queries runs its small block about as
slowly as a full one: the cost model counts each piece as at least this many queries."""

DENSE_SHARE = 0.7
"""Pieces replace the dense mask only where their modelled cost is at most this share of the row's square; the rest
pays for the gathers. Set on SmolLM2's shapes (benchmarks/cpu_attention.py `--shared-workloads`, every micro-batch by
pieces): draws of 14-106 tokens after 210-token prompts (micro-batches modelled at 0.38-0.63) gained; draws of 24
tokens (0.75) and of 4-12 (2.6) lost, though their pieces computed 0.28 and 0.59 of the dense pairs."""

MAX_BATCH_PIECES = 64
"""The most pieces one batch holds: bounds `plan_pieces`' search on micro-batches of many short datums, where a
call's fixed cost is small beside so many rows anyway."""


@dataclass(frozen=True)
class Piece:
    """Queries that see a run of keys (a prefix: all of it) and, causally, their own tokens; flat positions in the
    (rows · width) grid."""

    prefix_start: int
    prefix_len: int
    """0 for a prefix or a datum alone: its queries see only themselves."""
    start: int
    length: int


@dataclass(frozen=True)
class PieceBatch:
    """Pieces padded to one shape: `rows` of `queries` queries and `keys` keys (the longest prefix, then the
    longest piece)."""

    rows: int
    queries: int
    keys: int
    visible: Tensor | None
    """(rows, 1, queries, keys) bool; None for pieces without a prefix, which are causal."""


@dataclass(frozen=True)
class PrefixPieces:
    """A micro-batch's attention as batches of pieces (`plan_pieces`): where each batch's queries and keys come from
    in the grid, and where each grid position's output is in the batches' outputs."""

    batches: tuple[PieceBatch, ...]
    query_index: Tensor
    """(Σ rows · queries,) flat grid positions of the batches' queries, batch by batch."""
    key_index: Tensor
    """(Σ rows · keys,) flat grid positions of the batches' keys and values."""
    output_index: Tensor
    """(grid,) each grid position's row in the batches' outputs laid end to end, then a zero row (padding)."""

    def cost(self) -> int:
        """The modelled cost in (query, key) pairs: `plan_pieces`' own, `CALL_PAIRS` a batch."""
        return sum(b.rows * max(b.queries, QUERY_BLOCK) * b.keys + CALL_PAIRS for b in self.batches)

    def pay(self, rows: int, width: int) -> bool:
        """Whether these pieces beat the dense mask of `rows` rows of `width` tokens (`DENSE_SHARE`)."""
        return self.cost() <= DENSE_SHARE * (rows * width * width + CALL_PAIRS)

    def to(self, device: torch.device) -> PrefixPieces:
        batches = tuple(PieceBatch(b.rows, b.queries, b.keys, None if b.visible is None else b.visible.to(device))
                        for b in self.batches)
        return PrefixPieces(batches, self.query_index.to(device), self.key_index.to(device),
                            self.output_index.to(device))

    def attend(self, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        """transformers' attention-function contract: (rows, heads, width, dim) queries, (rows, kv heads, width, dim)
        keys and values in; (rows, width, heads, dim) out."""
        rows, heads, width, dim = query.shape
        kv_heads = key.shape[1]
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        scale = scaling if scaling is not None else 1 / math.sqrt(dim)
        # (grid, heads, dim): a view where the projection's layout survived the transpose, a copy otherwise.
        query_GHD = query.transpose(1, 2).reshape(rows * width, heads, dim).index_select(0, self.query_index)
        key_GKD = key.transpose(1, 2).reshape(rows * width, kv_heads, dim).index_select(0, self.key_index)
        value_GKD = value.transpose(1, 2).reshape(rows * width, kv_heads, dim).index_select(0, self.key_index)
        queries = [b.rows * b.queries for b in self.batches]
        keys = [b.rows * b.keys for b in self.batches]
        outputs = []
        for batch, query_b, key_b, value_b in zip(self.batches, query_GHD.split(queries), key_GKD.split(keys),
                                                  value_GKD.split(keys), strict=True):
            q = query_b.view(batch.rows, batch.queries, heads, dim).transpose(1, 2)
            k = key_b.view(batch.rows, batch.keys, kv_heads, dim).transpose(1, 2)
            v = value_b.view(batch.rows, batch.keys, kv_heads, dim).transpose(1, 2)
            outputs.append(_attend_batch(q, k, v, batch.visible, scale, dtype).reshape(-1, heads, dim))
        outputs.append(outputs[-1].new_zeros(1, heads, dim))
        return torch.cat(outputs).index_select(0, self.output_index).view(rows, width, heads, dim)


def _attend_batch(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, scale: float,
                  dtype: torch.dtype) -> Tensor:
    """One batch of pieces, (rows, queries, heads, dim) out: bf16 short rows as `cpu_attention` computes them (its
    crossover), the rest by sdpa's fused CPU kernel, which reads grouped keys and values without repeating them."""
    queries, keys = query.shape[2], key.shape[2]
    if dtype == torch.bfloat16 and keys <= SHORT_ROW_KEYS:
        if visible is None:
            visible = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril_()[None, None]
        return short_row_attention(query.to(dtype), key.to(dtype), value.to(dtype), visible, scale)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, is_causal=visible is None,
                                         scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def plan_pieces(pieces: list[Piece], grid: int, call_pairs: int = CALL_PAIRS) -> PrefixPieces:
    """Batch `pieces` (covering every real position of a grid of `grid` positions once) for `PrefixPieces.attend`.

    Pieces with a prefix and pieces without are batched apart (the latter need no mask). Within each, sorted by
    keys then queries, the batches are runs of neighbours, chosen exactly by dynamic programming over where each
    run starts: a run costs its rows × longest queries (at least `QUERY_BLOCK`) × its keys, plus `call_pairs`; it
    holds at most `MAX_BATCH_PIECES`.
    """
    batches: list[PieceBatch] = []
    query_index: list[Tensor] = []
    key_index: list[Tensor] = []
    output_index = torch.full((grid,), -1, dtype=torch.long)
    written = 0
    for group in ([p for p in pieces if p.prefix_len == 0], [p for p in pieces if p.prefix_len > 0]):
        for run in _runs(sorted(group, key=lambda p: (p.prefix_len + p.length, p.length)), call_pairs):
            prefix_len, length = max(p.prefix_len for p in run), max(p.length for p in run)
            steps = torch.arange(length)
            visible = torch.zeros(len(run), length, prefix_len + length, dtype=torch.bool) if prefix_len else None
            for row, piece in enumerate(run):
                own = piece.start + steps.clamp(max=piece.length - 1)  # padding repeats the last query
                query_index.append(own)
                if prefix_len:
                    key_index.append(torch.cat([piece.prefix_start + torch.arange(prefix_len).clamp(
                        max=piece.prefix_len - 1), own]))
                    visible[row, :, :piece.prefix_len] = True
                    visible[row, :, prefix_len:] = steps[:, None] >= steps[None, :]
                    visible[row, :, prefix_len + piece.length:] = False
                else:
                    key_index.append(own)
                output_index[piece.start:piece.start + piece.length] = written + row * length + steps[:piece.length]
            batches.append(PieceBatch(len(run), length, prefix_len + length,
                                      None if visible is None else visible[:, None]))
            written += len(run) * length
    output_index[output_index < 0] = written  # padding reads the zero row after the batches
    return PrefixPieces(tuple(batches), torch.cat(query_index), torch.cat(key_index), output_index)


def _runs(pieces: list[Piece], call_pairs: int) -> list[list[Piece]]:
    """The cheapest split of `pieces`, in order, into runs of neighbours (`plan_pieces`)."""
    best = [0.0] + [math.inf] * len(pieces)
    start_of = [0] * (len(pieces) + 1)
    for end in range(1, len(pieces) + 1):
        prefix_len = length = 0
        for start in range(end - 1, max(end - MAX_BATCH_PIECES, 0) - 1, -1):
            prefix_len, length = max(prefix_len, pieces[start].prefix_len), max(length, pieces[start].length)
            cost = best[start] + (end - start) * max(length, QUERY_BLOCK) * (prefix_len + length) + call_pairs
            if cost < best[end]:
                best[end], start_of[end] = cost, start
    runs, end = [], len(pieces)
    while end > 0:
        runs.append(pieces[start_of[end]:end])
        end = start_of[end]
    return runs[::-1]

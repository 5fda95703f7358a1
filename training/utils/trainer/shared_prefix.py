"""Shared-prefix rows: datums that begin alike, computed with their common prefix once.

A group's draws of one prompt share the prompt, and the turns of one conversation share its
history. A `PrefixBundle` computes such datums as one row: the shared prefix, then each datum's
own suffix. Each suffix attends to the prefix and, causally, to itself; its position ids continue
from the prefix length. So every token sees what it sees in its own sequence, and its hidden state
is the same. A datum's token t reads its hidden state from the prefix when t < prefix_len, else
from the datum's suffix. The last prefix position predicts each datum's first own token, so that
one hidden state is read by every datum, each applying its own target; its gradient sums theirs.

- `prefix_bundles`: which datums share a row. Sorted by input ids, datums with a common prefix
  become neighbours; the runs of neighbours that make the least estimated compute share rows.
- `shared_layout`: the model's inputs for one micro-batch of bundles, where each datum's tokens are, and
  its pieces (each prefix, each suffix), which the trainer's CPU attention computes apart (`prefix_attention`).
- `shared_prefix_mask`: the attention mask of a layout, in the form the attention implementation takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from training.utils.errors import ConfigError
from training.utils.models.cpu_attention import NAME
from training.utils.models.prefix_attention import Piece

MIN_SHARED_TOKENS = 8
"""The shortest common prefix that forms a shared row; shorter ones save less than the 4-D mask costs."""

MASK_FORMS = {"sdpa": "bool", NAME: "bool", "eager": "additive", "flex_attention": "block"}
"""The attention implementations that take a custom mask, and the form each takes. Flash-attention
kernels only separate sequences by position ids restarting at 0, which a suffix's do not. (The engine's
`cpu_decode_sdpa` is not here: a trainer switches any sdpa-like CPU model to `cpu_sdpa` first.)"""


@dataclass(frozen=True)
class PrefixBundle:
    """Datums computed as one row: their first `prefix_len` input ids once, then each datum's own rest."""

    indices: tuple[int, ...]
    """The datums, as indices into the call's list."""
    prefix_len: int
    """Tokens computed once. A datum alone is all prefix."""
    length: int
    """Tokens computed: prefix_len + Σ (datum length − prefix_len)."""

    @classmethod
    def single(cls, index: int, length: int) -> PrefixBundle:
        return cls((index,), length, length)


@dataclass(frozen=True)
class PrefixSharing:
    """How a trainer shares prefixes: the mask form of its attention, and what a dense mask costs."""

    attention: str
    """The model's attention implementation, a key of `MASK_FORMS`."""
    pair_cost: float
    """One attended (query, key) pair of a dense mask, in tokens of decoder matmul work; 0 for a block
    mask, which skips the blocks a bundle's suffixes do not see."""

    @classmethod
    def for_model(cls, setting: str, model: torch.nn.Module) -> PrefixSharing | None:
        """The sharing `TrainerConfig.share_prefixes` asks for on `model`; None when off."""
        # HF keeps the implementation on the config under this name only.
        attention = model.config._attn_implementation
        if setting == "off" or (setting == "auto" and attention not in MASK_FORMS):
            return None
        if attention not in MASK_FORMS:
            raise ConfigError(
                f"trainer.share_prefixes='on' needs an attention implementation that takes a custom mask "
                f"({', '.join(MASK_FORMS)}); the model uses {attention!r}. Set share_prefixes='auto' to share "
                "only where the attention allows it, or 'off'."
            )
        return cls(attention, 0.0 if MASK_FORMS[attention] == "block" else dense_pair_cost(model))


def dense_pair_cost(model: torch.nn.Module) -> float:
    """FLOPs of one attended pair over FLOPs of one token through the decoder's matmuls.

    A token costs 2 FLOPs per decoder matmul weight; a pair costs 4 per layer and attention width
    (q·k, then the weighted v). About 1/3000 for SmolLM2-135M: a dense mask's row² matters from
    rows of a few thousand tokens.
    """
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    matmul_weights = sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    return 2 * config.num_hidden_layers * config.num_attention_heads * head_dim / matmul_weights


def common_prefix_len(a: list[int], b: list[int]) -> int:
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return min(len(a), len(b))


def prefix_bundles(input_ids_D: list[list[int]], max_tokens: int, pair_cost: float) -> list[PrefixBundle]:
    """Bundle datums that share a prefix of at least `MIN_SHARED_TOKENS`: the cheapest split of the datums, in
    input-id order, into runs computed as one row each.

    A run's row is its common prefix once, then each datum's rest; its estimated compute is its tokens plus
    `pair_cost` per pair of its dense mask, and it must fit `max_tokens` (a datum alone always does). Sorted by
    input ids, datums that begin alike are neighbours, so the cheapest split into runs of neighbours is found
    exactly, by dynamic programming over where each run starts. A greedy pass would let a datum that shares only
    a chat template's header with the run before it join that run, and then its own group's draws, each sharing
    the whole prompt with it, could share only the header with the run.
    """
    def cost(length: int) -> float:
        return length + pair_cost * length * length

    order = sorted(range(len(input_ids_D)), key=lambda i: input_ids_D[i])
    lengths = [len(input_ids_D[i]) for i in order]
    # shared_with_previous[k]: tokens the k-th datum in order shares with the one before it.
    shared_with_previous = [0] + [common_prefix_len(input_ids_D[a], input_ids_D[b]) for a, b in zip(order, order[1:])]
    # best[end]: the least cost of the first `end` datums in order; run_start[end] and run_prefix[end]: where the
    # last run of that split starts, and its shared prefix.
    best, run_start = [0.0] * (len(order) + 1), [0] * (len(order) + 1)
    run_prefix = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        last = end - 1
        best[end], run_start[end], run_prefix[end] = best[last] + cost(lengths[last]), last, lengths[last]
        prefix, total = lengths[last], lengths[last]
        for start in range(last - 1, -1, -1):
            prefix = min(prefix, shared_with_previous[start + 1])
            if prefix < MIN_SHARED_TOKENS:
                break  # the prefix only shrinks as the run grows backwards
            total += lengths[start]
            length = total - (end - start - 1) * prefix
            if length > max_tokens:
                break  # and the run only grows
            if best[start] + cost(length) < best[end]:
                best[end], run_start[end], run_prefix[end] = best[start] + cost(length), start, prefix
    bundles: list[PrefixBundle] = []
    end = len(order)
    while end > 0:
        start, prefix = run_start[end], run_prefix[end]
        indices = tuple(order[start:end])
        bundles.append(PrefixBundle(indices, prefix, prefix + sum(lengths[k] - prefix for k in range(start, end))))
        end = start
    return bundles[::-1]


@dataclass
class SharedLayout:
    """The model's inputs for a micro-batch of bundles: one row per bundle, or (packed) all in one row."""

    input_ids: Tensor
    """(R, W) long, padding 0."""
    position_ids: Tensor
    """(R, W) long: a suffix continues from its prefix length."""
    sequence_ids: Tensor
    """(R, W) long: the bundle of each token; −1 at padding."""
    segment_ids: Tensor
    """(R, W) long: 0 for a prefix, j + 1 for the j-th datum's suffix (within its bundle)."""
    token_index_D: list[Tensor]
    """Per datum (bundle by bundle), the flat index in (R·W) of each of its tokens."""
    pieces: list[Piece]
    """Each prefix and each suffix, in (R·W) positions: what `prefix_attention` computes the attention of."""


def shared_layout(input_ids_D: list[list[int]], bundles: list[PrefixBundle], *, packed: bool) -> SharedLayout:
    """Lay out each bundle as its prefix, then its datums' suffixes; rows right-padded to the longest."""
    rows: list[dict[str, list[int]]] = []
    columns_D: list[tuple[int, Tensor]] = []
    pieces: list[tuple[int, int, int, int, int]] = []  # row, prefix column, prefix length, column, length
    for number, bundle in enumerate(bundles):
        if not (packed and rows):
            rows.append({"input_ids": [], "position_ids": [], "sequence_ids": [], "segment_ids": []})
        row = rows[-1]
        prefix_len, start = bundle.prefix_len, len(row["input_ids"])
        _extend(row, input_ids_D[bundle.indices[0]][:prefix_len], 0, number, 0)
        pieces.append((len(rows) - 1, start, 0, start, prefix_len))
        for segment, index in enumerate(bundle.indices, start=1):
            ids, suffix_start = input_ids_D[index], len(row["input_ids"])
            _extend(row, ids[prefix_len:], prefix_len, number, segment)
            if len(ids) > prefix_len:
                pieces.append((len(rows) - 1, start, prefix_len, suffix_start, len(ids) - prefix_len))
            t = torch.arange(len(ids))
            columns_D.append((len(rows) - 1, torch.where(t < prefix_len, start + t, suffix_start + t - prefix_len)))
    width = max(len(row["input_ids"]) for row in rows)
    padded = {
        name: pad_sequence([torch.tensor(row[name]) for row in rows], batch_first=True,
                           padding_value=-1 if name == "sequence_ids" else 0)
        for name in rows[0]
    }
    return SharedLayout(**padded, token_index_D=[row * width + columns for row, columns in columns_D],
                        pieces=[Piece(row * width + prefix_column, prefix_len, row * width + column, length)
                                for row, prefix_column, prefix_len, column, length in pieces])


def _extend(row: dict[str, list[int]], ids: list[int], first_position: int, sequence: int, segment: int) -> None:
    row["input_ids"] += ids
    row["position_ids"] += range(first_position, first_position + len(ids))
    row["sequence_ids"] += [sequence] * len(ids)
    row["segment_ids"] += [segment] * len(ids)


def shared_prefix_mask(sequence_ids: Tensor, segment_ids: Tensor, attention: str):
    """The (R, 1, W, W) mask of a `SharedLayout` for `attention` (a key of `MASK_FORMS`).

    A query sees a key of its own bundle, at or before it, in the prefix or in its own suffix.
    Padding is a sequence of its own, so no row of the mask is empty (an empty row would make
    sdpa's output NaN, and NaN values poison the weighted sum even where their weight is 0).
    `visible` is in flex attention's `mask_mod` form; the dense forms evaluate it on index grids.
    """
    def visible(b, h, q, kv):
        return ((sequence_ids[b, q] == sequence_ids[b, kv]) & (q >= kv)
                & ((segment_ids[b, kv] == 0) | (segment_ids[b, kv] == segment_ids[b, q])))

    rows, width = sequence_ids.shape
    form = MASK_FORMS[attention]
    if form == "block":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(visible, rows, None, width, width, device=sequence_ids.device)
    positions = torch.arange(width, device=sequence_ids.device)
    allowed = visible(torch.arange(rows, device=sequence_ids.device)[:, None, None], None,
                      positions[None, :, None], positions[None, None, :])[:, None]
    if form == "bool":
        return allowed
    # eager adds the mask to the scores; float32's min zeroes a key's weight whatever the scores' dtype.
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, torch.finfo(torch.float32).min)

"""Shared-prefix rows: datums that begin alike, computed with their common prefix once.

A group's draws of one prompt share the prompt, and the turns of one conversation share its
history. A `PrefixBundle` computes such datums as one row: the shared prefix, then each datum's
own suffix. Each suffix attends to the prefix and, causally, to itself; its position ids continue
from the prefix length. So every token sees what it sees in its own sequence, and its hidden state
is the same. A datum's token t reads its hidden state from the prefix when t < prefix_len, else
from the datum's suffix. The last prefix position predicts each datum's first own token, so that
one hidden state is read by every datum, each applying its own target; its gradient sums theirs.

- `prefix_bundles`: which datums share a row. Sorted by input ids, datums with a common prefix
  become neighbours, and a neighbour joins while that lowers the estimated compute.
- `shared_layout`: the model's inputs for one micro-batch of bundles, and where each datum's tokens are.
- `shared_prefix_mask`: the attention mask of a layout, in the form the attention implementation takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from training.utils.errors import ConfigError

MIN_SHARED_TOKENS = 8
"""The shortest common prefix that forms a shared row; shorter ones save less than the 4-D mask costs."""

MASK_FORMS = {"sdpa": "bool", "eager": "additive", "flex_attention": "block"}
"""The attention implementations that take a custom mask, and the form each takes. Flash-attention
kernels only separate sequences by position ids restarting at 0, which a suffix's do not."""


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
    """Bundle datums that share a prefix of at least `MIN_SHARED_TOKENS`, in input-id order.

    A datum joins the bundle before it when the joined row's estimated compute (tokens plus
    `pair_cost` per pair of its dense mask) is below the two rows' apart, and the joined row still
    fits `max_tokens`. So a datum that shares only a chat template's header with a bundle of
    another prompt stays out: joining would shrink that bundle's prefix.
    """
    def cost(length: int) -> float:
        return length + pair_cost * length * length

    bundles: list[PrefixBundle] = []
    order = sorted(range(len(input_ids_D)), key=lambda i: input_ids_D[i])
    for index in order:
        length = len(input_ids_D[index])
        if bundles:
            last = bundles[-1]
            shared = min(last.prefix_len, common_prefix_len(input_ids_D[last.indices[0]], input_ids_D[index]))
            # The prefix shrinks to `shared`: computed once less, but each datum already in the bundle
            # computes what it lost in its own suffix.
            joined = last.length + length - shared + (len(last.indices) - 1) * (last.prefix_len - shared)
            if shared >= MIN_SHARED_TOKENS and joined <= max_tokens and cost(joined) < cost(last.length) + cost(length):
                bundles[-1] = PrefixBundle((*last.indices, index), shared, joined)
                continue
        bundles.append(PrefixBundle.single(index, length))
    return bundles


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


def shared_layout(input_ids_D: list[list[int]], bundles: list[PrefixBundle], *, packed: bool) -> SharedLayout:
    """Lay out each bundle as its prefix, then its datums' suffixes; rows right-padded to the longest."""
    rows: list[dict[str, list[int]]] = []
    columns_D: list[tuple[int, Tensor]] = []
    for number, bundle in enumerate(bundles):
        if not (packed and rows):
            rows.append({"input_ids": [], "position_ids": [], "sequence_ids": [], "segment_ids": []})
        row = rows[-1]
        prefix_len, start = bundle.prefix_len, len(row["input_ids"])
        _extend(row, input_ids_D[bundle.indices[0]][:prefix_len], 0, number, 0)
        for segment, index in enumerate(bundle.indices, start=1):
            ids, suffix_start = input_ids_D[index], len(row["input_ids"])
            _extend(row, ids[prefix_len:], prefix_len, number, segment)
            t = torch.arange(len(ids))
            columns_D.append((len(rows) - 1, torch.where(t < prefix_len, start + t, suffix_start + t - prefix_len)))
    width = max(len(row["input_ids"]) for row in rows)
    padded = {
        name: pad_sequence([torch.tensor(row[name]) for row in rows], batch_first=True,
                           padding_value=-1 if name == "sequence_ids" else 0)
        for name in rows[0]
    }
    return SharedLayout(**padded, token_index_D=[row * width + columns for row, columns in columns_D])


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

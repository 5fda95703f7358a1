"""Datums and micro-batches: what the trainer computes on, and how a call's datums are laid out.

- `Datum`: one rollout segment shifted by one for next-token training.
- `plan_microbatches`: which datums (or prefix bundles) share a micro-batch under the token budget.
- `collate`: a micro-batch's tensors, right-padded, or packed end to end in one row, or with shared
  prefixes computed once (`shared_prefix`); the loss sees the same per-datum grid in every layout.
- `MicroBatch`: what a loss function sees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from training.utils.models.prefix_attention import Piece
from training.utils.runtime import distributed
from training.utils.trainer.shared_prefix import PrefixBundle, shared_layout


@dataclass
class Datum:
    """One segment shifted by one for next-token training."""

    input_ids: list[int]
    """tokens[:-1]"""
    target_ids: list[int]
    """tokens[1:]"""
    weights: list[float]
    """loss_mask[1:]: 1.0 where the target is trained."""
    behaviour_logprobs: list[float]
    """logprobs[1:]: the sampler's logprob of each target."""
    advantage: float
    prompt_len: int
    """Tokens before the first trainable token (the first target index with weight 1 is prompt_len - 1)."""
    versions: list[int] | None = None
    """versions[1:] when the sampler reported them."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class MicroBatch:
    """What a loss function sees: one micro-batch, right-padded to its longest datum, on the model's device."""

    target_ids: Tensor
    """(b, T) long: the next-token targets."""
    weights: Tensor
    """(b, T) float: 1.0 on trained tokens, 0 on context and padding."""
    behaviour_logprobs: Tensor
    """(b, T) float: the sampler's logprob of each target, 0 at padding."""
    advantages: Tensor
    """(b,) float: one advantage per datum."""
    extras: dict[str, Tensor]
    """Per-datum arrays passed to `forward_backward(extras=...)`, each (b, T) float, 0 at padding."""
    datum_indices: list[int]
    """Positions of this micro-batch's rows in the list given to `forward_backward`."""
    num_tokens_total: float
    """Sum of weights over every datum of the `forward_backward` call: the token-mean denominator."""
    num_seqs_total: int
    """Number of datums in the `forward_backward` call: the sequence-mean denominator."""


LossFn = Callable[[Tensor, MicroBatch], tuple[Tensor, dict[str, Tensor]]]
"""`loss_fn(logprobs (b, T), micro_batch) -> (scalar loss, metrics)`; see `Trainer.forward_backward`."""


@dataclass
class PaddedBatch:
    """One micro-batch's tensors, right-padded; `positions` index the flattened (b·T) grid.

    The model sees `input_ids` with `attention_mask` and `position_ids`: the padded grid itself,
    or (packed) one row of the datums end to end, without a mask, position ids restarting at each
    datum, or (shared prefixes) a `SharedLayout` whose mask the trainer builds from `sequence_ids`
    and `segment_ids` for its attention. `hidden_index` says where each of `positions` is in the
    model's flattened output.
    """

    input_ids: Tensor
    attention_mask: Tensor | None
    position_ids: Tensor | None
    target_ids: Tensor
    weights: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    extras: dict[str, Tensor]
    positions: Tensor
    """(N,) flat indices of the tokens whose logprob is computed."""
    hidden_index: Tensor
    """(N,) the same tokens' flat indices in the model's input."""
    sequence_ids: Tensor | None = None
    """With shared prefixes: `SharedLayout.sequence_ids`, else None."""
    segment_ids: Tensor | None = None
    """With shared prefixes: `SharedLayout.segment_ids`, else None."""
    pieces: list[Piece] | None = None
    """With shared prefixes: `SharedLayout.pieces`, else None."""

    @property
    def shape(self) -> torch.Size:
        """(b, T) of the padded grid the loss sees."""
        return self.target_ids.shape

    def to(self, device: torch.device) -> PaddedBatch:
        return PaddedBatch(**{
            name: (value.to(device) if isinstance(value, Tensor) else
                   {k: v.to(device) for k, v in value.items()} if isinstance(value, dict) else value)
            for name, value in vars(self).items()
        })



def plan_microbatches(lengths: list[int], max_tokens: int, *, packed: bool = False) -> list[list[int]]:
    """Group rows (datums, or prefix bundles) into micro-batches of at most `max_tokens` computed tokens;
    returns lists of indices.

    Padded (default): longest first, fill each micro-batch while longest × count ≤ max_tokens.
    Packed: first-fit decreasing on the sum of lengths (a packed row holds no padding).
    A datum longer than the budget goes alone.
    """
    longest_first = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if packed:
        bins: list[list[int]] = []
        filled: list[int] = []
        for index in longest_first:
            fit = next((b for b, used in enumerate(filled) if used + lengths[index] <= max_tokens), None)
            if fit is None:
                bins.append([])
                filled.append(0)
                fit = len(bins) - 1
            bins[fit].append(index)
            filled[fit] += lengths[index]
        return bins
    microbatches: list[list[int]] = []
    current: list[int] = []
    for index in longest_first:
        # current[0] is the longest in `current`, so it sets the padded width.
        if current and lengths[current[0]] * (len(current) + 1) > max_tokens:
            microbatches.append(current)
            current = []
        current.append(index)
    microbatches.append(current)
    return microbatches


def plan_ranks(
    bundles: list[PrefixBundle], max_tokens: int, *, packed: bool, world: int
) -> list[list[list[PrefixBundle]]]:
    """Each of `world` ranks' micro-batches: its share of the bundles (`distributed.rank_shares`,
    balanced by tokens, the same on every rank), planned by `plan_microbatches`."""
    lengths = [bundle.length for bundle in bundles]
    return [
        [[bundles[share[i]] for i in mb] for mb in plan_microbatches([lengths[i] for i in share], max_tokens,
                                                                       packed=packed)] if share else []
        for share in distributed.rank_shares(lengths, world)
    ]


def computed_tokens(lengths: list[int], *, packed: bool) -> int:
    """Tokens a micro-batch of rows of these lengths runs through the model, padding included."""
    return sum(lengths) if packed else len(lengths) * max(lengths)


def check_datums(datums: list[Datum]) -> None:
    """Raise ValueError, naming the datum, if the list is empty or a datum's arrays differ in length."""
    if not datums:
        raise ValueError("got an empty list of datums; pass at least one")
    for index, datum in enumerate(datums):
        n = len(datum.input_ids)
        if n == 0:
            raise ValueError(f"datum {index} has no input_ids")
        for name, values in (
            ("target_ids", datum.target_ids),
            ("weights", datum.weights),
            ("behaviour_logprobs", datum.behaviour_logprobs),
        ):
            if len(values) != n:
                raise ValueError(f"datum {index}: input_ids has {n} entries but {name} has {len(values)}")


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def check_extras(extras: dict[str, list], datums: list[Datum]) -> None:
    for name, rows in extras.items():
        if len(rows) != len(datums):
            raise ValueError(f"extras[{name!r}] has {len(rows)} entries for {len(datums)} datums")
        for index, (row, datum) in enumerate(zip(rows, datums)):
            if len(row) != len(datum.target_ids):
                raise ValueError(
                    f"extras[{name!r}][{index}] has {len(row)} entries but datum {index} has "
                    f"{len(datum.target_ids)} targets"
                )


def pad_rows(rows: list, dtype: torch.dtype) -> Tensor:
    """Right-pad 1-D rows (lists or tensors) with 0 into a (b, T) CPU tensor."""
    return pad_sequence([torch.as_tensor(row, dtype=dtype, device="cpu") for row in rows], batch_first=True)


def collate(
    datums: list[Datum], bundles: list[PrefixBundle], extras: dict[str, list], *, trained_only: bool, packed: bool
) -> PaddedBatch:
    """Pad (or pack) the bundled datums on the CPU; pick the positions whose logprob is needed.

    Rows of the loss's grid are the datums bundle by bundle. `trained_only` keeps positions with
    non-zero weight (the only ones a loss can use), else all real tokens. Positions are found on
    the CPU so the device never syncs to size them. A micro-batch without a bundle of several
    datums keeps the plain padded or packed layout.
    """
    indices = [index for bundle in bundles for index in bundle.indices]
    chosen = [datums[i] for i in indices]
    input_ids = pad_rows([d.input_ids for d in chosen], torch.long)
    attention_mask = pad_rows([[1] * len(d.input_ids) for d in chosen], torch.long)
    weights = pad_rows([d.weights for d in chosen], torch.float32)
    positions = (weights != 0 if trained_only else attention_mask.bool()).flatten().nonzero().squeeze(1)
    position_ids, hidden_index, sequence_ids, segment_ids, pieces = None, positions, None, None, None
    if any(len(bundle.indices) > 1 for bundle in bundles):
        layout = shared_layout([d.input_ids for d in datums], bundles, packed=packed)
        input_ids, attention_mask, position_ids = layout.input_ids, None, layout.position_ids
        sequence_ids, segment_ids, pieces = layout.sequence_ids, layout.segment_ids, layout.pieces
        hidden_index = pad_rows(layout.token_index_D, torch.long).flatten()[positions]
    elif packed:
        lengths = torch.tensor([len(d.input_ids) for d in chosen])
        input_ids = input_ids[attention_mask.bool()][None]
        position_ids = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
        row_starts = lengths.cumsum(0) - lengths
        width = attention_mask.shape[1]
        hidden_index = row_starts[positions // width] + positions % width
        attention_mask = None
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        target_ids=pad_rows([d.target_ids for d in chosen], torch.long),
        weights=weights,
        behaviour_logprobs=pad_rows([d.behaviour_logprobs for d in chosen], torch.float32),
        advantages=torch.tensor([d.advantage for d in chosen], dtype=torch.float32),
        extras={name: pad_rows([rows[i] for i in indices], torch.float32) for name, rows in extras.items()},
        positions=positions,
        hidden_index=hidden_index,
        sequence_ids=sequence_ids,
        segment_ids=segment_ids,
        pieces=pieces,
    )


def filler_batch() -> PaddedBatch:
    """One token (id 0) whose logprob is computed and never trained."""
    token = torch.zeros((1, 1), dtype=torch.long)
    zeros = torch.zeros((1, 1))
    position = torch.zeros(1, dtype=torch.long)
    return PaddedBatch(input_ids=token, attention_mask=torch.ones_like(token), position_ids=None, target_ids=token,
                        weights=zeros, behaviour_logprobs=zeros, advantages=torch.zeros(1), extras={},
                        positions=position, hidden_index=position)


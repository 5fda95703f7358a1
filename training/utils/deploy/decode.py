"""The engine's batched KV cache, free of threads and requests: prefill, decode, and rows joining and leaving.

Layout (shapes: R row slots, B live rows, H key/value heads, C columns, L filled columns,
D head dim, V vocabulary):

    column:   0   1   2   3   4   5        every row ends at column L-1 ("right-aligned",
    row 0:    .   .   p   p   o   o        padded on the left), so one decode step writes
    row 1:    p   p   p   p   p   o        one new column for all rows at once.
    row 2:    .   .   .   p   o   o        `.` = padding (attention mask 0)

A row's positions count only its own tokens (position ids are explicit), so padding changes
nothing but wasted attention columns. This is how `model.generate` lays out a left-padded
batch, which is why greedy outputs match it.

Each layer's keys/values live in buffers of shape (R, H, C, D) with spare rows and columns
(`SlotLayer`): a decode step writes one column in place (transformers' `DynamicLayer`
instead re-concatenates the whole cache every step). Live rows are the first B slots.
- New rows are prefilled on their own (left-padded among themselves) and copied into free
  slots, right-aligned to column L (`insert`): only the new rows are written. A prompt
  longer than L, or more rows than free slots, rebuilds the batch once (`gather`), with
  free slots up to the next power of two of its rows. A rebuild consumes the batches it
  copies from: each old layer's buffers go as soon as that layer is copied, so it needs one
  layer's buffers more than the new batch, not a second batch.
- Finished rows are dropped by moving the last live rows into their slots (`remove`):
  only the moved rows are copied, and the caller reorders its own row list the same way.
- When every live row has a long stretch of padding on its left (the rows that needed
  the width are gone), `maybe_trim` rebuilds the batch without it.
- A prefill may start from keys/values computed before for a prompt's first tokens (the
  engine's prefix cache): they fill the first columns, and only the rest is fed (`prefill`).

A batch with `stable_buffers` (what captured CUDA-graph steps need, `graphs.py`) keeps its
buffers for good: rebuilds copy into them, columns grow by doubling, and an emptied batch is
kept for the next rows. `generation` changes only when the buffers are reallocated. Every
slot's mask is 0 from column L on, so a step may attend over any number of columns >= L+1.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from training.utils.deploy.prefix_cache import CachedKV

# Columns added whenever a buffer runs out: large enough that growth is rare, small enough
# that the spare columns cost little memory next to the live ones.
_GROW_COLUMNS = 64
# Buffer allocations, numbered: a batch's `generation` names the buffers it holds.
_generations = itertools.count()


# Per model class. A plain dict, not functools.cache: the compiled decode step traces this lookup.
_cache_arg_names: dict[type, str] = {}


def cache_kwarg(model, cache: Cache) -> dict:
    """The keyword `model.forward` takes its KV cache under, in this transformers version."""
    name = _cache_arg_names.get(type(model))
    if name is None:
        # transformers renamed `past_key_values` to `cache` (5.2x) and warns on the old name.
        params = inspect.signature(type(model).forward).parameters
        name = _cache_arg_names[type(model)] = "cache" if "cache" in params else "past_key_values"
    return {name: cache}


class SlotLayer(DynamicLayer):
    """One layer's keys/values: buffers (R, H, C, D) of which rows [:B] and columns [:L] are live.

    `keys`/`values` are views of the live part, as transformers expects of a `DynamicLayer`;
    `update` writes the new columns in place and returns the widened views.
    """

    def __init__(self, keys_buf: torch.Tensor | None, values_buf: torch.Tensor | None, rows: int, length: int):
        super().__init__()
        self.keys_buf = keys_buf
        self.values_buf = values_buf
        self.rows = rows
        self.length = length
        if keys_buf is not None:
            self.dtype, self.device = keys_buf.dtype, keys_buf.device
            self.is_initialized = True
            self._refresh_views()

    def _refresh_views(self) -> None:
        self.keys = self.keys_buf[: self.rows, :, : self.length]
        self.values = self.values_buf[: self.rows, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if self.keys_buf is None:
            # A fresh layer (prefill): allocate from the first states' shape.
            self.keys_buf = _with_spare(key_states)
            self.values_buf = _with_spare(value_states)
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        elif end > self.keys_buf.shape[2]:
            # Rare: `KVBatch.ensure_capacity` grows every buffer before a decode step.
            self.grow_columns(end)
        self.keys_buf[: self.rows, :, self.length : end] = key_states
        self.values_buf[: self.rows, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def grow_columns(self, min_columns: int, doubling: bool = False) -> None:
        columns = max(min_columns, self.keys_buf.shape[2]) + _GROW_COLUMNS
        if doubling:
            columns = next_power_of_two(min_columns)
        for name in ("keys_buf", "values_buf"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], columns, old.shape[3])
            new[: self.rows, :, : self.length] = old[: self.rows, :, : self.length]
            setattr(self, name, new)
        self._refresh_views()

    def release(self) -> None:
        """Drop the buffers (the batch holding this layer was consumed by `KVBatch.gather`)."""
        self.keys_buf = self.values_buf = self.keys = self.values = None

    def buffer_bytes(self) -> int:
        """Bytes of the key and value buffers; 0 once released. Safe to call from another thread."""
        keys, values = self.keys_buf, self.values_buf  # read once: a rebuild on the engine thread may release them
        return (keys.nbytes if keys is not None else 0) + (values.nbytes if values is not None else 0)

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        self._refresh_views()


def _with_spare(t: torch.Tensor) -> torch.Tensor:
    """A zeroed (B, H, L + spare, D) buffer for the (B, H, L, D) states `t` (which `update` then writes)."""
    return t.new_zeros(t.shape[0], t.shape[1], t.shape[2] + _GROW_COLUMNS, t.shape[3])


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _num_layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


class KVBatch:
    """KV cache, attention mask and next positions of B right-aligned rows in R >= B slots."""

    def __init__(
        self, layers: list[SlotLayer], mask_buf: torch.Tensor, next_pos: torch.Tensor, rows: int, length: int
    ):
        self.layers = layers
        self.cache = Cache(layers=layers)
        self.mask_buf = mask_buf  # (R, C) int64, 1 on real tokens
        self.next_pos = next_pos  # (R,) int64: a row's next position id = its token count
        self.rows = rows  # B
        self.length = length  # L: filled columns, the same for every row
        self.stable_buffers = False
        self.generation = next(_generations)

    @property
    def row_capacity(self) -> int:
        return self.mask_buf.shape[0]

    def _set_rows(self, rows: int) -> None:
        self.rows = rows
        for layer in self.layers:
            layer.rows = rows
            layer._refresh_views()

    @classmethod
    def prefill(
        cls, model, prompts_P: Sequence[Sequence[int]], cached_P: Sequence[CachedKV | None] | None = None
    ) -> tuple[KVBatch, torch.Tensor]:
        """Run the prompts through the model, left-padded; return the batch and last-token logits (P, V).

        `cached_P[i]`, if given and not None, holds the keys/values of `prompts_P[i][:m]`, m its
        `length` (a `PrefixCache` match): only the rest of that prompt is fed, after
        them. Every row with cached tokens must have the same number of tokens left, the most
        of any row, so that no row has padding between its cached and its new tokens:
        `usable_prefix_lengths` says how much of each match that allows.
        """
        cached_P = cached_P if cached_P is not None else [None] * len(prompts_P)
        reused_P = [0 if kv is None else kv.length for kv in cached_P]
        new_P = [len(p) - m for p, m in zip(prompts_P, reused_P, strict=True)]
        width = max(new_P)
        if any(m and n != width for m, n in zip(reused_P, new_P)) or min(new_P) < 1:
            raise ValueError(f"cached prefixes leave {new_P} new tokens of prompts {[len(p) for p in prompts_P]}; "
                             "rows with cached tokens need the most of them and at least one")
        past = max(reused_P)
        ids = torch.zeros(len(prompts_P), width, dtype=torch.long)
        mask = torch.zeros(len(prompts_P), past + width, dtype=torch.long)
        for i, (prompt, m) in enumerate(zip(prompts_P, reused_P)):
            ids[i, width - len(prompt) + m :] = torch.tensor(prompt[m:], dtype=torch.long)
            mask[i, past + width - len(prompt) :] = 1
        device = model.device
        ids, mask = ids.to(device), mask.to(device)
        # Pad positions get position 0; they are masked out, so the value only has to be valid.
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)[:, past:]
        if past:
            layers = _cached_layers(cached_P, past, width + _GROW_COLUMNS)
        else:
            layers = [SlotLayer(None, None, len(prompts_P), 0) for _ in range(_num_layers(model))]
        batch = cls(layers, mask, mask.sum(-1), len(prompts_P), past)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **cache_kwarg(model, batch.cache),
            use_cache=True,
            # The last column as an index tensor, not `logits_to_keep=1`: the int form hands lm_head a strided
            # (P, 1, H) slice, and torch's matmul then expands and copies the (H, V) weight once per row.
            logits_to_keep=torch.tensor([width - 1], device=device),
        )
        # Pad columns never take part in attention, but a masked weight of 0 times a NaN value
        # is still NaN, so make sure whatever attention produced at pad positions is finite.
        pad = (mask == 0)[:, None, :, None]
        for layer in layers:
            layer.keys_buf[:, :, : past + width].masked_fill_(pad, 0.0)
            layer.values_buf[:, :, : past + width].masked_fill_(pad, 0.0)
        batch.length = past + width
        batch.mask_buf = _pad_columns(mask, layers[0].keys_buf.shape[2])
        return batch, out.logits[:, -1, :]

    def row_kv(self, row: int, tokens: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """A copy of the keys/values of `tokens[start:end]`, where `tokens` are row `row`'s last ones: (layers, 2,
        H, end - start, D)."""
        end = tokens if end is None else end
        first_column = self.length - tokens
        first = self.layers[0].keys_buf
        out = first.new_empty(len(self.layers), 2, first.shape[1], end - start, first.shape[3])
        for i, layer in enumerate(self.layers):
            out[i, 0] = layer.keys_buf[row, :, first_column + start : first_column + end]
            out[i, 1] = layer.values_buf[row, :, first_column + start : first_column + end]
        return out

    @property
    def column_capacity(self) -> int:
        return self.mask_buf.shape[1]

    def reserved_bytes(self) -> int:
        """Bytes of every layer's key/value buffers, spare rows and columns included (layers built from cached
        prefixes are views that split one buffer, so their sizes add up to it)."""
        return sum(layer.buffer_bytes() for layer in self.layers)

    def token_bytes(self) -> int:
        """Bytes of one row's keys and values at one column, over every layer: the live part is B x L of them."""
        total = 0
        for layer in self.layers:
            keys = layer.keys_buf  # read once (see `buffer_bytes`)
            if keys is not None:
                total += 2 * keys.shape[1] * keys.shape[3] * keys.element_size()
        return total

    def ensure_capacity(self, columns: int) -> None:
        """Grow every buffer so that `columns` columns fit (called before a decode step)."""
        if columns <= self.column_capacity:
            return
        for layer in self.layers:
            layer.grow_columns(columns, doubling=self.stable_buffers)
        self.mask_buf = _pad_columns(self.mask_buf, self.layers[0].keys_buf.shape[2])
        self.generation = next(_generations)

    def with_stable_buffers(self, row_capacity: int) -> KVBatch:
        """This batch's rows in buffers kept for good (see the module docstring), `row_capacity` rows."""
        batch = KVBatch.gather([(self, None)], row_capacity, min_columns=next_power_of_two(self.length + 1))
        batch.stable_buffers = True
        return batch

    def decode(self, model, tokens_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row; return next-token logits (B, V)."""
        B, L = self.rows, self.length
        self.ensure_capacity(L + 1)
        self.mask_buf[:B, L] = 1
        out = model(
            input_ids=tokens_B[:, None],
            attention_mask=self.mask_buf[:B, : L + 1],
            position_ids=self.next_pos[:B, None],
            **cache_kwarg(model, self.cache),
            use_cache=True,
        )
        self.length = L + 1
        self.next_pos[:B] += 1
        return out.logits[:, -1, :]

    def remove(self, dead: Sequence[int]) -> list[int]:
        """Drop rows `dead` in place; returns, for each new row, the old row it holds.

        The last live rows move into the holes, so only they are copied.
        """
        dead_set = set(dead)
        B, L = self.rows, self.length
        kept = B - len(dead_set)
        holes = [i for i in sorted(dead_set) if i < kept]
        movers = [j for j in range(kept, B) if j not in dead_set]
        order = list(range(kept))
        if holes:
            h = torch.tensor(holes, device=self.mask_buf.device)
            m = torch.tensor(movers, device=self.mask_buf.device)
            for layer in self.layers:
                layer.keys_buf[h, :, :L] = layer.keys_buf[m, :, :L]
                layer.values_buf[h, :, :L] = layer.values_buf[m, :, :L]
            self.mask_buf[h, :L] = self.mask_buf[m, :L]
            self.next_pos[h] = self.next_pos[m]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        self._set_rows(kept)
        return order

    def insert(self, new: KVBatch, row_capacity: int = 0) -> KVBatch:
        """Append `new`'s rows after the live rows; returns the batch holding them (self if they fit in place)."""
        B, k, L = self.rows, new.rows, self.length
        if B + k > self.row_capacity or new.length > L:
            return self._rebuild([(self, None), (new, None)], row_capacity)
        start = L - new.length
        for la, lb in zip(self.layers, new.layers, strict=True):
            for buf, live in ((la.keys_buf, lb.keys), (la.values_buf, lb.values)):
                buf[B : B + k, :, :start] = 0  # finite filler under the mask (see `prefill`)
                buf[B : B + k, :, start:L] = live
        self.mask_buf[B : B + k, :start] = 0
        self.mask_buf[B : B + k, start:L] = new.mask_buf[:k, : new.length]
        self.next_pos[B : B + k] = new.next_pos[:k]
        self._set_rows(B + k)
        return self

    def maybe_trim(self, row_capacity: int = 0) -> KVBatch:
        """Rebuild without the left padding every live row has, once it is at least half the width."""
        if self.rows == 0:
            self.mask_buf.zero_()
            self.set_length(0)
            return self
        lead = self.length - int(self.next_pos[: self.rows].max())
        if lead >= max(_GROW_COLUMNS, self.length // 2):
            return self._rebuild([(self, None)], row_capacity)
        return self

    def set_length(self, length: int) -> None:
        """Set L, the filled columns, on the batch and its layers' views."""
        self.length = length
        for layer in self.layers:
            layer.length = length
            layer._refresh_views()

    def _rebuild(self, parts: Sequence[tuple[KVBatch, Sequence[int] | None]], row_capacity: int) -> KVBatch:
        """`gather(parts)`: a new batch, or with stable buffers, the same rows copied into this batch's buffers.

        A new batch gets spare rows up to the next power of two of its rows, at most `row_capacity`: later rows
        then join in place, rebuilding only when the rows double, and a few long rows (an agent's) do not reserve
        keys/values for all `row_capacity` slots at their width."""
        if not self.stable_buffers:
            rows = sum(batch.rows if picked is None else len(picked) for batch, picked in parts)
            return KVBatch.gather(parts, min(row_capacity, next_power_of_two(rows)), consume=True)
        staged = KVBatch.gather(parts)
        if staged.rows > self.row_capacity:
            raise ValueError(f"{staged.rows} rows do not fit the {self.row_capacity} slots of a stable batch")
        self.ensure_capacity(staged.length + 1)
        B, L = staged.rows, staged.length
        for mine, theirs in zip(self.layers, staged.layers, strict=True):
            mine.keys_buf[:B, :, :L] = theirs.keys
            mine.values_buf[:B, :, :L] = theirs.values
        self.mask_buf.zero_()
        self.mask_buf[:B, :L] = staged.mask_buf[:B, :L]
        self.next_pos[:B] = staged.next_pos[:B]
        self._set_rows(B)
        self.set_length(L)
        return self

    @staticmethod
    def gather(
        parts: Sequence[tuple[KVBatch, Sequence[int] | None]], row_capacity: int = 0, min_columns: int = 0,
        consume: bool = False,
    ) -> KVBatch:
        """A new batch of the listed rows of each part (None = all live rows; repeats allowed), in order.

        The width is the longest selected row (shared left padding is dropped); rows are
        allocated for max(selected rows, row_capacity), columns for max(width + spare, min_columns).
        `consume`: the parts' batches are discarded after this call, so each of their layers is released
        once copied; the copy then holds one layer's buffers twice at most, not the whole cache.
        """
        device = parts[0][0].mask_buf.device
        picks = []
        for batch, rows in parts:
            index = torch.arange(batch.rows, device=device) if rows is None else torch.as_tensor(rows, device=device)
            if len(index):
                picks.append((batch, index.long()))
        total = sum(len(index) for _, index in picks)
        width = max((int(batch.next_pos.index_select(0, index).max()) for batch, index in picks), default=0)
        capacity = max(total, row_capacity)
        columns = max(width + _GROW_COLUMNS, min_columns)
        # Where each part's rows go: destination rows, and its last w columns -> the last w columns.
        moves, at = [], 0
        for batch, index in picks:
            w = min(width, batch.length)
            moves.append((batch, index, slice(at, at + len(index)), slice(batch.length - w, batch.length), w))
            at += len(index)
        layers = []
        for i, layer in enumerate(parts[0][0].layers):
            shape = (capacity, layer.keys_buf.shape[1], columns, layer.keys_buf.shape[3])
            keys, values = layer.keys_buf.new_zeros(shape), layer.values_buf.new_zeros(shape)
            for batch, index, dst, src, w in moves:
                keys[dst, :, width - w : width] = batch.layers[i].keys_buf[:, :, src].index_select(0, index)
                values[dst, :, width - w : width] = batch.layers[i].values_buf[:, :, src].index_select(0, index)
            layers.append(SlotLayer(keys, values, total, width))
            if consume:
                for batch, _ in parts:
                    batch.layers[i].release()
        mask = torch.zeros(capacity, columns, dtype=torch.long, device=device)
        next_pos = torch.zeros(capacity, dtype=torch.long, device=device)
        for batch, index, dst, src, w in moves:
            mask[dst, width - w : width] = batch.mask_buf[:, src].index_select(0, index)
            next_pos[dst] = batch.next_pos.index_select(0, index)
        return KVBatch(layers, mask, next_pos, total, width)


def usable_prefix_lengths(prompt_lengths: Sequence[int], matched: Sequence[int]) -> list[int]:
    """How many of each prompt's `matched` cached tokens one prefill forward can use (`KVBatch.prefill`).

    The forward feeds every row as many new tokens as the row with the most left, so a row with a
    longer match recomputes its last few cached tokens instead of padding: the same cost, and its
    cached and new tokens stay adjacent. A prompt shorter than that is fed whole.
    """
    width = max(n - m for n, m in zip(prompt_lengths, matched, strict=True))
    return [max(0, n - width) for n in prompt_lengths]


def _cached_layers(cached_P: Sequence[CachedKV | None], past: int, spare: int) -> list[SlotLayer]:
    """Layers holding each row's cached keys/values right-aligned in the first `past` columns, with `spare`
    columns more for the tokens to feed."""
    like = next(kv for kv in cached_P if kv is not None).pieces[0]
    layers, _, heads, _, dim = like.shape
    buf = like.new_zeros(layers, 2, len(cached_P), heads, past + spare, dim)
    for row, kv in enumerate(cached_P):
        if kv is not None:
            kv.copy_to(buf[:, :, row, :, past - kv.length : past])
    return [SlotLayer(buf[i, 0], buf[i, 1], len(cached_P), past) for i in range(layers)]


def _pad_columns(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    if mask.shape[1] >= capacity:
        return mask
    return torch.cat([mask, mask.new_zeros(mask.shape[0], capacity - mask.shape[1])], dim=1)

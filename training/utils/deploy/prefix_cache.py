"""The engine's prefix cache: keys/values of recent prompts and finished sequences, by their token ids.

A prompt that starts with cached tokens prefills only the rest (`KVBatch.prefill(..., cached_P)`):
the G draws of one row sent as G requests prefill the prompt once, and the next turn of a chat
(previous prompt + reply + new message) prefills only the new message. Keys/values depend only
on the tokens before them, so any prefix of an entry serves, and the longest common prefix with
any entry is the match. The engine adds every prompt it prefilled and every sequence that
finished on the weights it started on, and empties the cache at each weight update: a token is
never sampled from keys/values of older weights (docs/engine-decode-loop.md: Prefix cache).

Entries hold their keys/values as 16-token blocks, each keyed by a chained hash of every token up
to its end (as vLLM's block hashes), and entries with a common prefix share its blocks: the G
finished draws of a row hold their prompt once, and a CLI agent's sessions their system prompt
once. So the byte bound counts each block once, and a lookup costs one hash per prompt block, not
a comparison with every entry. An entry's last partial block is its own; a prompt shorter than
one block never hits.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

BLOCK_TOKENS = 16
"""Tokens per shared, hashed block: entries shorter than this are not kept."""

CONTEXTS_KEPT = 4
"""Full-context prompts the default cache holds at most (`deployment.prefix_cache_bytes=None`). A prompt longer than
the budget is never kept, so a budget below one context would serve nothing to an agent whose prompts approach it;
with room for a few, a row's later draws and each session's next turn find their prefix even while other rows'
prompts come and go. Memory is spent only on what is cached: a step of short prompts fills little of it."""

DEFAULT_MAX_BYTES = 512 << 20
"""Bytes the default cache holds at most (`deployment.prefix_cache_bytes=None`, whose docstring says why), unless
one context's keys/values take more: then that, so the longest prompt still fits."""


@dataclass(frozen=True)
class CachedKV:
    """Keys/values of a cached prefix of `length` tokens, as the pieces that hold them in order: (layers, 2, H,
    n_i, D) each, shared with the cache (read, never write)."""

    pieces: tuple[torch.Tensor, ...]
    length: int

    def head(self, tokens: int) -> CachedKV:
        """Its first `tokens` tokens."""
        pieces, left = [], tokens
        for piece in self.pieces:
            if left <= 0:
                break
            pieces.append(piece[:, :, :, :left])
            left -= piece.shape[3]
        return CachedKV(tuple(pieces), min(tokens, self.length))

    def copy_to(self, out: torch.Tensor) -> None:
        """Write them into `out`, (layers, 2, H, length, D)."""
        start = 0
        for piece in self.pieces:
            out[:, :, :, start : start + piece.shape[3]] = piece
            start += piece.shape[3]


def prefix_cache_budget(configured: int | None, context_tokens: int, token_bytes: int) -> int:
    """Bytes the engine's prefix cache may hold (0: off): `configured`, or unset, `DEFAULT_MAX_BYTES` but at least
    one context's keys/values and at most `CONTEXTS_KEPT` contexts' (`token_bytes` a token)."""
    if configured is not None:
        return int(configured)
    context_bytes = int(context_tokens) * token_bytes
    return min(CONTEXTS_KEPT * context_bytes, max(DEFAULT_MAX_BYTES, context_bytes))


@dataclass(eq=False)
class _Block:
    parent: int  # the key of the block before it (0 for the first): with `tokens`, what its key stands for
    tokens: tuple[int, ...]  # its BLOCK_TOKENS token ids
    kv: torch.Tensor  # (layers, 2, H, BLOCK_TOKENS, D); freed with the last entry holding it (`_by_block`)


@dataclass(eq=False)
class _Entry:
    tokens: np.ndarray  # (n,) int64
    hashes: list[int]  # the keys of its full blocks, in order
    tail: torch.Tensor | None  # (layers, 2, H, n % BLOCK_TOKENS, D): its own, after the last full block


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """Hash b covers tokens[: (b + 1) * BLOCK_TOKENS]: equal hashes mean equal prefixes (barring collisions,
    which a lookup's exact comparison catches)."""
    hashes, h = [], 0
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hash((h, *tokens[start : start + BLOCK_TOKENS]))
        hashes.append(h)
    return hashes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class PrefixCache:
    """Keys/values of token sequences, at most `max_bytes` bytes in all (a block shared by several entries counts
    once), least recently used entries evicted first.

    Owned by the engine thread (not thread-safe); `num_bytes` and `take_most_bytes` may be used from any thread.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.num_tokens = 0
        """Tokens whose keys/values are held, a shared block's once."""
        self.num_bytes = 0
        """Bytes of the keys/values held, counted as blocks come and go (one int: a read from another thread is
        whole)."""
        self._most_bytes = 0  # the most `num_bytes` since `take_most_bytes` last read it
        self._token_bytes = 0  # keys/values of one token, known from the first entry: skips copying what cannot fit
        self._blocks: dict[int, _Block] = {}  # block key -> the block, while `_by_block` names entries holding it
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_block: dict[int, set[int]] = {}  # block key -> entries holding that prefix (never empty)
        self._by_end: dict[int, set[int]] = {}  # key of an entry's last full block -> those entries
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> tuple[CachedKV | None, int]:
        """(keys/values of prompt[:m], m) for the longest cached m < len(prompt); (None, 0) without a hit. At most
        len(prompt) - 1: the last prompt token's forward gives the first token's logits."""
        limit = len(prompt) - 1
        deepest = None
        for h in block_hashes(prompt[:limit]):
            if h not in self._by_block:
                break
            deepest = h
        if deepest is None:
            return None, 0
        tokens = np.asarray(prompt[:limit], dtype=np.int64)
        best, length = max(((eid, common_prefix(self._entries[eid].tokens, tokens)) for eid in self._by_block[deepest]),
                           key=lambda pair: pair[1])
        if length == 0:  # only a hash collision matched
            return None, 0
        self._entries.move_to_end(best)
        entry = self._entries[best]
        pieces = [self._blocks[h].kv for h in entry.hashes] + ([entry.tail] if entry.tail is not None else [])
        return CachedKV(tuple(pieces), len(entry.tokens)).head(length), length

    def add(self, tokens: Sequence[int], read_kv: Callable[[int, int], torch.Tensor]) -> None:
        """Keep the keys/values of `tokens`; `read_kv(start, end)` copies out those of tokens[start:end], (layers,
        2, H, end - start, D), and is called only for blocks no entry holds yet. Entries that `tokens` extends are
        dropped; an entry that holds all of `tokens` is only marked used. A sequence larger than the bound is not
        kept and evicts nothing (the first `add`, before a token's size is known, copies it to find out), and
        neither is one whose block key another block holds for other tokens."""
        if len(tokens) < BLOCK_TOKENS or not self._fits(len(tokens) * self._token_bytes):
            return
        array = np.asarray(tokens, dtype=np.int64)
        hashes = block_hashes(tokens)
        for eid in list(self._by_block.get(hashes[-1], ())):  # entries sharing all of our full blocks
            if common_prefix(self._entries[eid].tokens, array) == len(array):
                self._entries.move_to_end(eid)  # one of them already holds all of `tokens`
                return
        spans = [tuple(array[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS].tolist()) for b in range(len(hashes))]
        parents = [0, *hashes[:-1]]
        if any((block := self._blocks.get(h)) is not None and (block.parent, block.tokens) != (parent, span)
               for h, parent, span in zip(hashes, parents, spans)):
            return  # a hash collision: another prefix's keys/values must not stand for ours
        new = [b for b, h in enumerate(hashes) if h not in self._blocks]
        full = len(hashes) * BLOCK_TOKENS
        first = new[0] * BLOCK_TOKENS if new else full  # copied from the first block no entry holds on
        kv = read_kv(first, len(array)) if first < len(array) else None
        if kv is not None:
            self._token_bytes = kv.nbytes // kv.shape[3]
        if not self._fits(len(array) * self._token_bytes):
            return
        for b in new:  # each its own storage: a view would keep all of `kv` alive while any block of it lives
            start = b * BLOCK_TOKENS - first
            self._blocks[hashes[b]] = _Block(parents[b], spans[b], kv[:, :, :, start : start + BLOCK_TOKENS].clone())
            self._count(BLOCK_TOKENS, self._blocks[hashes[b]].kv.nbytes)
        tail = None if len(array) == full else kv if first == full else kv[:, :, :, full - first :].clone()
        if tail is not None:
            self._count(tail.shape[3], tail.nbytes)
        eid = next(self._ids)
        self._entries[eid] = _Entry(array, hashes, tail)
        for h in hashes:
            self._by_block.setdefault(h, set()).add(eid)
        self._by_end.setdefault(hashes[-1], set()).add(eid)
        for other in {other for h in hashes for other in self._by_end.get(h, ())} - {eid}:  # may be our prefixes
            if common_prefix(self._entries[other].tokens, array) == len(self._entries[other].tokens):
                self._remove(other)  # its blocks stay: ours hold them too
        while not self._fits(self.num_bytes):
            self._remove(next(iter(self._entries)))  # never the new entry: it fits alone, so it is never reached
        self._most_bytes = max(self._most_bytes, self.num_bytes)

    def take_most_bytes(self) -> int:
        """The most bytes held since the previous call (or since the cache was made), and start counting anew. The
        cache is emptied at every weight sync, so what it holds at a step's end says little of what it held.
        From another thread, an entry added during the call may count toward the next call instead."""
        most, self._most_bytes = self._most_bytes, self.num_bytes  # `add` keeps the most at or above what is held
        return most

    def clear(self) -> None:
        self._blocks.clear()
        self._entries.clear()
        self._by_block.clear()
        self._by_end.clear()
        self.num_tokens = 0
        self.num_bytes = 0

    def _fits(self, nbytes: int) -> bool:
        return nbytes <= self.max_bytes

    def _count(self, tokens: int, nbytes: int) -> None:
        self.num_tokens += tokens
        self.num_bytes += nbytes

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        for h in entry.hashes:
            _discard(self._by_block, h, eid)
            if h not in self._by_block:  # its last entry
                self._count(-BLOCK_TOKENS, -self._blocks.pop(h).kv.nbytes)
        _discard(self._by_end, entry.hashes[-1], eid)
        if entry.tail is not None:
            self._count(-entry.tail.shape[3], -entry.tail.nbytes)


def _discard(index: dict[int, set[int]], key: int, eid: int) -> None:
    ids = index[key]
    ids.discard(eid)
    if not ids:
        del index[key]

"""The engine's prefix cache: keys/values of recent prompts and finished sequences, by their token ids.

A prompt that starts with cached tokens prefills only the rest (`KVBatch.prefill(..., cached_P)`):
the G draws of one row sent as G requests prefill the prompt once, and the next turn of a chat
(previous prompt + reply + new message) prefills only the new message. Keys/values depend only
on the tokens before them, so any prefix of an entry serves, and the longest common prefix with
any entry is the match. The engine adds every prompt it prefilled and every sequence that
finished on the weights it started on, and empties the cache at each weight update: a token is
never sampled from keys/values of older weights (docs/engine-decode-loop.md: Prefix cache).

Entries are found through chained hashes of their 16-token blocks (as vLLM's block hashes), so a
lookup costs one hash per prompt block, not a comparison with every entry; the last partial
block is compared token by token. A prompt shorter than one block never hits.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

BLOCK_TOKENS = 16
"""Tokens per hashed block: entries shorter than this are not kept."""

CONTEXTS_KEPT = 4
"""Full-context prompts the default cache holds (`deployment.prefix_cache_tokens=None`). An entry is never shared
with another (a row's G finished draws are G entries, each its whole prompt), and a prompt longer than the budget
is never kept, so a budget below one context would serve nothing to an agent whose prompts approach it; with room
for a few, a row's later draws and each session's next turn find their prefix even while other rows' prompts
come and go. Memory is spent only on what is cached: a step of short prompts fills little of it."""

DEFAULT_MAX_BYTES = 512 << 20
"""Bytes the default cache holds at most (`deployment.prefix_cache_bytes=None`, whose docstring says why), unless
one context's keys/values take more: then that, so the longest prompt still fits."""


def prefix_cache_bounds(tokens: int | None, max_bytes: int | None, context_tokens: int,
                        token_bytes: int) -> tuple[int, int]:
    """(tokens, bytes) the engine's prefix cache may hold; the cache is off when either is 0. `tokens`: as set, or
    `CONTEXTS_KEPT` prompts of the context served; `max_bytes`: as set, or `DEFAULT_MAX_BYTES` but at least one
    context's keys/values (`token_bytes` a token)."""
    token_bound = CONTEXTS_KEPT * int(context_tokens) if tokens is None else int(tokens)
    byte_bound = max(DEFAULT_MAX_BYTES, int(context_tokens) * token_bytes) if max_bytes is None else int(max_bytes)
    return token_bound, byte_bound


@dataclass(eq=False)
class _Entry:
    tokens: np.ndarray  # (n,) int64
    kv: torch.Tensor  # (layers, 2, H, n, D): keys and values of `tokens`, positions 0..n-1
    hashes: list[int]  # chained hash of each full block


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
    """Keys/values of token sequences, at most `max_tokens` tokens and `max_bytes` bytes in all (None: no byte
    bound), least recently used evicted first.

    Owned by the engine thread (not thread-safe); `num_bytes` and `take_most_bytes` may be used from any thread.
    """

    def __init__(self, max_tokens: int, max_bytes: int | None = None):
        self.max_tokens = int(max_tokens)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.num_tokens = 0
        self.num_bytes = 0
        """Bytes of the keys/values held, counted as entries come and go (one int: a read from another thread is
        whole)."""
        self._most_bytes = 0  # the most `num_bytes` since `take_most_bytes` last read it
        self._token_bytes = 0  # keys/values of one token, known from the first entry: skips copying what cannot fit
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_block: dict[int, set[int]] = {}  # block hash -> entries holding that prefix
        self._by_end: dict[int, set[int]] = {}  # hash of an entry's last full block -> those entries
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> tuple[torch.Tensor | None, int]:
        """(keys/values (layers, 2, H, m, D) of prompt[:m], m) for the longest cached m < len(prompt); (None, 0)
        without a hit. At most len(prompt) - 1: the last prompt token's forward gives the first token's logits."""
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
        return self._entries[best].kv[:, :, :, :length], length

    def add(self, tokens: Sequence[int], read_kv: Callable[[], torch.Tensor]) -> None:
        """Keep the keys/values of `tokens`, (layers, 2, H, len(tokens), D), which `read_kv()` copies out (called
        only if they are kept: not when an entry holds them already); entries that `tokens` extends are dropped.
        A sequence longer than either bound is not kept, and evicts nothing."""
        if not BLOCK_TOKENS <= len(tokens) <= self.max_tokens or not self._fits(len(tokens) * self._token_bytes):
            return
        array = np.asarray(tokens, dtype=np.int64)
        hashes = block_hashes(tokens)
        for eid in list(self._by_block.get(hashes[-1], ())):  # entries sharing all of our full blocks
            if common_prefix(self._entries[eid].tokens, array) == len(array):
                self._entries.move_to_end(eid)  # one of them already holds all of `tokens`
                return
        kv = read_kv()
        self._token_bytes = kv.nbytes // len(array)
        if not self._fits(kv.nbytes):
            return
        for eid in {eid for h in hashes for eid in self._by_end.get(h, ())}:  # entries that may be our prefixes
            entry = self._entries[eid]
            if common_prefix(entry.tokens, array) == len(entry.tokens):
                self._remove(eid)
        eid = next(self._ids)
        self._entries[eid] = _Entry(array, kv, hashes)
        for h in hashes:
            self._by_block.setdefault(h, set()).add(eid)
        self._by_end.setdefault(hashes[-1], set()).add(eid)
        self.num_tokens += len(array)
        self.num_bytes += kv.nbytes
        while self.num_tokens > self.max_tokens or not self._fits(self.num_bytes):
            self._remove(next(iter(self._entries)))
        self._most_bytes = max(self._most_bytes, self.num_bytes)

    def take_most_bytes(self) -> int:
        """The most bytes held since the previous call (or since the cache was made), and start counting anew. The
        cache is emptied at every weight sync, so what it holds at a step's end says little of what it held.
        From another thread, an entry added during the call may count toward the next call instead."""
        most, self._most_bytes = self._most_bytes, self.num_bytes  # `add` keeps the most at or above what is held
        return most

    def clear(self) -> None:
        self._entries.clear()
        self._by_block.clear()
        self._by_end.clear()
        self.num_tokens = 0
        self.num_bytes = 0

    def _fits(self, nbytes: int) -> bool:
        return self.max_bytes is None or nbytes <= self.max_bytes

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        for h in entry.hashes:
            _discard(self._by_block, h, eid)
        _discard(self._by_end, entry.hashes[-1], eid)
        self.num_tokens -= len(entry.tokens)
        self.num_bytes -= entry.kv.nbytes


def _discard(index: dict[int, set[int]], key: int, eid: int) -> None:
    ids = index[key]
    ids.discard(eid)
    if not ids:
        del index[key]

"""The engine's request bookkeeping: a `generate` call checked into a `SequenceGroup` of n
`SequenceState`s (sharing a prompt and sampling parameters), the per-row sampling tensors of a
batch, when a sequence stops, and the `Completion` it becomes. The scheduling loop is `engine.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from training.utils.deploy.completion import Completion, InvalidRequestError
from training.utils.deploy.next_token import SamplingParams_B

_MAX_N = 1024


@dataclass(eq=False)
class SequenceGroup:
    """One `generate` call: n sequences sharing a prompt and sampling parameters."""

    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: frozenset[int]
    stop: tuple[str, ...]
    seed: int | None
    deliver: Callable[[list[Completion] | BaseException], None]
    seqs: list[SequenceState] = field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False


@dataclass(eq=False)
class SequenceState:
    """One of a group's sequences: what has been sampled so far and why it stopped."""

    group: SequenceGroup
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_string: bool = False

    def finish_reason_after(self, token: int, tokenizer) -> str | None:
        """Why the sequence stops now that `token` was appended; None while it goes on."""
        group = self.group
        if token in group.stop_ids:
            return "stop"
        if group.stop:
            longest = max(len(s) for s in group.stop)
            # Each character is at most 4 bytes and each token at least one, so this window
            # holds the whole stop string if the newest token completed it.
            tail = tokenizer.decode(self.output_ids[-(4 * longest + 4) :], skip_special_tokens=False)
            if any(s in tail for s in group.stop):
                self.stopped_by_string = True
                return "stop"
        if len(self.output_ids) >= group.max_tokens:
            return "length"
        return None

    def completion(self, tokenizer) -> Completion:
        text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        if self.stopped_by_string:
            cut = [i for i in (text.find(s) for s in self.group.stop) if i >= 0]
            text = text[: min(cut)] if cut else text
        return Completion(
            output_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "abort",
            versions=list(self.versions),
            text=text,
            prompt_ids=list(self.group.prompt_ids),
        )


def make_group(
    prompt_ids, n, max_tokens, temperature, top_p, top_k, stop_token_ids, stop, seed,
    *, vocab_size: int, max_context_tokens: int, eos_token_ids: frozenset[int],
) -> SequenceGroup:
    """The group of a `generate` call; `InvalidRequestError` (naming the field) for a bad request."""
    prompt = _int_list(prompt_ids, "prompt")
    if not prompt:
        raise InvalidRequestError("prompt is empty", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", "prompt")
    if not _is_int(n) or not 1 <= n <= _MAX_N:
        raise InvalidRequestError(f"n must be an integer in [1, {_MAX_N}], got {n!r}", "n")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    if len(prompt) + max_tokens > max_context_tokens:
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
            f"{max_context_tokens} tokens",
            "max_tokens",
        )
    if not _is_number(temperature) or not temperature >= 0:
        raise InvalidRequestError(f"temperature must be >= 0, got {temperature!r}", "temperature")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    if not _is_int(top_k) or top_k < -1:
        raise InvalidRequestError(f"top_k must be an integer >= 0 (0 or -1 = off), got {top_k!r}", "top_k")
    stop_ids = _int_list(stop_token_ids or [], "stop_token_ids")
    if isinstance(stop, str):
        stop = [stop]
    stop = tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    if seed is not None and not _is_int(seed):
        raise InvalidRequestError(f"seed must be an integer, got {seed!r}", "seed")
    group = SequenceGroup(
        prompt_ids=prompt,
        n=n,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(0, top_k),
        stop_ids=eos_token_ids | frozenset(stop_ids),
        stop=stop,
        seed=seed,
        deliver=lambda result: None,
    )
    for i in range(n):
        generator = None
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed) + i)
        group.seqs.append(SequenceState(group, generator))
    group.remaining = n
    return group


def sampling_params(seqs: list[SequenceState], device) -> SamplingParams_B:
    """The sampling parameters of batch rows `seqs`, one entry per row."""
    return SamplingParams_B(
        temperature=torch.tensor([s.group.temperature for s in seqs], dtype=torch.float32, device=device),
        top_p=torch.tensor([s.group.top_p for s in seqs], dtype=torch.float32, device=device),
        top_k=torch.tensor([s.group.top_k for s in seqs], dtype=torch.long, device=device),
        generators=[s.generator for s in seqs],
    )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _int_list(values, param: str) -> list[int]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | torch.Tensor):
        raise InvalidRequestError(f"{param} must be a list of token ids, got {type(values).__name__}", param)
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = list(values)
    if not all(_is_int(t) for t in out):
        raise InvalidRequestError(f"{param} must contain only integer token ids", param)
    return out

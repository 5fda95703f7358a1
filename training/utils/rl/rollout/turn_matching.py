"""Turn matching: decide how an agent's request relates to the turns a session already recorded.

An unmodified agent resends its whole conversation on every request. To train on one
trajectory, the shim must tell whether a request continues what it returned last (APPEND),
starts a session (NEW), or rewrites history (WIPE: a retry, a compaction, a sub-agent with
its own system prompt). The request is reduced to a list of opaque *units* by a
fingerprinter, and units are compared by prefix:

    classify(stored, incoming):  NEW     if stored is empty
                                 APPEND  if stored is a prefix of incoming (an exact repeat included)
                                 WIPE    otherwise, with the common prefix length

The default fingerprinter hashes each normalized message (`[H(system)] + [H(m) for m in
messages]`), so what a client may legitimately re-serialize (cache markers, tool-call
`index`, argument whitespace and key order, reasoning it does not echo) is not identity.
`resolve_parent` matches a request against the units of *(request + the reply the shim
returned)* of every recorded node, so each request gets an explicit parent in the turn tree,
and `turn_label` names what a WIPE is: a *branch* (it resumes an earlier point: a retry, an
edited history) or a *compaction* (it matches no recorded turn: a summary, a sub-agent).
Everything here is pure: no I/O, no session state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from training.utils.errors import ConfigError

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
"""Claude Code sends this as a system block with a nonce that changes on every request."""

VOLATILE_KEYS = frozenset({"cache_control", "provider_metadata"})
"""Keys removed at any depth: clients move cache breakpoints and attach provider data freely."""

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
"""Assistant reasoning is never part of identity: OpenAI-style clients do not echo it back."""


class TurnKind(StrEnum):
    NEW = "new"
    APPEND = "append"
    WIPE = "wipe"


@dataclass(frozen=True)
class TurnDecision:
    kind: TurnKind
    matched_prefix_len: int
    """Units shared with what the request was matched against (diagnostic)."""
    parent: int | None = None
    """Turn-tree node the request continues; None for a new root."""


@dataclass
class TurnRequest:
    """What a fingerprinter reads from one request."""

    system: Any
    """Leading system prompt: text, Anthropic system blocks, or None."""
    messages: list[dict]
    """Chat messages after the leading system one."""
    prompt_ids: list[int] | None = None
    """The rendered prompt; only the token-prefix strategy reads it."""


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Number of leading positions where `a` and `b` are equal."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def classify(stored_units: Sequence | None, incoming_units: Sequence) -> TurnDecision:
    """NEW if nothing is stored, APPEND if `stored_units` is a prefix of `incoming_units`, else WIPE."""
    if not stored_units:
        return TurnDecision(TurnKind.NEW, 0)
    matched = common_prefix_len(stored_units, incoming_units)
    kind = TurnKind.APPEND if matched == len(stored_units) else TurnKind.WIPE
    return TurnDecision(kind, matched)


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys; the one serialization every identity hash uses."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON; a string that is not valid JSON stays verbatim."""
    if isinstance(arguments, str):
        try:
            return canonical_json(json.loads(arguments))
        except ValueError:
            return arguments
    return canonical_json(arguments)


def strip_volatile(value: Any) -> Any:
    """A copy of `value` without `cache_control` / `provider_metadata` keys at any depth."""
    if isinstance(value, dict):
        return {k: strip_volatile(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, (list, tuple)):
        return [strip_volatile(v) for v in value]
    return value


def _normalize_tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    # `index` is a streaming-only field that clients do not echo.
    call = {k: v for k, v in call.items() if k != "index"}
    function = call.get("function")
    if isinstance(function, dict) and "arguments" in function:
        call["function"] = {**function, "arguments": canonical_arguments(function["arguments"])}
    return call


def normalize_message(message: dict) -> dict:
    """The identity of a chat message: what a client may re-serialize freely is removed.

    Strips `cache_control` / `provider_metadata` at any depth and reasoning keys at the top;
    drops `tool_calls[].index`; canonicalizes `function.arguments`. For an assistant message,
    null / missing content equals "" and an empty `tool_calls` equals none, because clients
    echo either form. Never mutates `message`.
    """
    out = strip_volatile(message)
    for key in REASONING_KEYS:
        out.pop(key, None)
    if "tool_calls" in out:
        if out["tool_calls"]:
            out["tool_calls"] = [_normalize_tool_call(c) for c in out["tool_calls"]]
        else:
            del out["tool_calls"]
    if out.get("role") == "assistant" and out.get("content") is None:
        out["content"] = ""
    return out


def _block_text(block: Any) -> str:
    if isinstance(block, str):
        return block
    if isinstance(block, dict) and isinstance(block.get("text"), str):
        return block["text"]
    return canonical_json(strip_volatile(block))


def normalize_system(system: Any) -> str | None:
    """The identity of a system prompt as text, or None when there is none.

    Anthropic system blocks are flattened (joined with newlines, `cache_control` ignored), and
    lines starting with `x-anthropic-billing-header:` are dropped whether they came as their
    own block or inside already flattened text.
    """
    if system is None:
        return None
    blocks = system if isinstance(system, (list, tuple)) else [system]
    text = "\n".join(_block_text(b) for b in blocks)
    lines = text.split("\n")
    return "\n".join(line for line in lines if not line.lstrip().startswith(BILLING_HEADER_PREFIX))


def unit_hash(value: Any) -> str:
    """H(x) = sha256 hex of canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


class MessageHashFingerprinter:
    """Units = [H(normalized system)] + [H(normalized message) for each message].

    The system prompt is always unit 0 (None hashes as null), so changing it is a WIPE at 0.
    """

    name = "message_hash"

    def units(self, request: TurnRequest) -> list[str]:
        return [unit_hash(normalize_system(request.system))] + [
            unit_hash(normalize_message(m)) for m in request.messages
        ]


class TokenPrefixFingerprinter:
    """Units = the rendered prompt ids: APPEND only when the earlier prompt is a token-exact prefix."""

    name = "token_prefix"

    def units(self, request: TurnRequest) -> list[int]:
        if request.prompt_ids is None:
            raise ValueError("the token_prefix turn-matching strategy needs the request's prompt_ids")
        return list(request.prompt_ids)


FINGERPRINTERS = {f.name: f for f in (MessageHashFingerprinter, TokenPrefixFingerprinter)}


def make_fingerprinter(name: str = "message_hash") -> MessageHashFingerprinter | TokenPrefixFingerprinter:
    """Build the fingerprinter for a turn-matching strategy name."""
    if name not in FINGERPRINTERS:
        raise ConfigError(f"unknown turn-matching strategy {name!r}; valid: {', '.join(FINGERPRINTERS)}")
    return FINGERPRINTERS[name]()


def resolve_parent(
    incoming_units: Sequence,
    response_units: Mapping[int, Sequence],
    current_leaf: int | None,
    stored_units: Sequence | None,
) -> TurnDecision:
    """Pick the recorded node a request continues.

    `response_units[node]` are the units of that node's request plus the reply the shim
    returned. Candidates are nodes whose response units are a prefix of `incoming_units`; the
    longest wins, ties go to the higher (more recent) node id. The winner gives APPEND when it
    is `current_leaf`, else WIPE with `parent` = that node (a branch: a retry, or the main agent
    resuming after a sub-agent). With no candidate: NEW when nothing is recorded yet, else WIPE
    to a new root (`parent` None); `matched_prefix_len` then comes from
    `classify(stored_units, incoming_units)` and is diagnostic only.
    """
    best: tuple[int, int] | None = None  # (units length, node id); max() applies both rules
    for node, units in response_units.items():
        if len(units) <= len(incoming_units) and common_prefix_len(units, incoming_units) == len(units):
            best = max(best, (len(units), node)) if best else (len(units), node)
    if best is not None:
        matched, node = best
        kind = TurnKind.APPEND if node == current_leaf else TurnKind.WIPE
        return TurnDecision(kind, matched, parent=node)
    matched = classify(stored_units, incoming_units).matched_prefix_len
    kind = TurnKind.WIPE if response_units else TurnKind.NEW
    return TurnDecision(kind, matched, parent=None)


def turn_label(decision: TurnDecision, incoming_units: Sequence, root_units: Iterable[Sequence]) -> str:
    """What a matched request is, as a session counts it: "new", "append", or for a WIPE "branch" or "compaction".

    A WIPE is a branch when it resumes an earlier point than the latest turn: it continues an earlier
    turn (`decision.parent`), or starts like a recorded first request (`root_units`: the units of each
    root turn's request), as a retry or an edited history does. It is a compaction when it matches no
    recorded turn at all: the client summarised, or a sub-agent started.
    """
    if decision.kind is not TurnKind.WIPE:
        return decision.kind.value
    if decision.parent is not None:
        return "branch"
    retries_a_first_turn = any(common_prefix_len(root, incoming_units) == len(root) for root in root_units)
    return "branch" if retries_a_first_turn else "compaction"

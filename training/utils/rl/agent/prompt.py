"""A turn's prompt ids, built token-exactly from its request (`SessionPrompts.build`).

Replies already sampled must reach the model again as the ids it sampled: re-tokenizing a
reply's text can change them, and the trainer would score tokens the model never produced.
So a session keeps, per recorded turn, a `ChatAssembler` snapshot of its prompt and sampled
ids, and a request that continues that turn extends the snapshot; anything else, or a
snapshot that cannot be extended, is a fresh render of the whole request (stitching then
splits where the ids disagree, losing nothing). Before either, replies the client echoes
are restored to what the model wrote (clients drop reasoning and re-serialize arguments),
and a trailing assistant message is split off as a prefill the model continues. `build` does
these in that order, each helper once: the identities (`turn_matching`), then the template form of
the messages (`chat_format.py`), then the ids (`rollout/messages.py`'s `ChatAssembler`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Any, NamedTuple

from training.utils.deploy.completion import Completion
from training.utils.rl.agent.chat_format import ChatFormat, ParsedOutput
from training.utils.rl.agent.chat_request import ChatRequest, WireError
from training.utils.rl.rollout.messages import ChatAssembler, ChatAssemblyError
from training.utils.rl.rollout.turn_matching import normalize_message, unit_hash

logger = logging.getLogger(__name__)

# What extending or rendering with a `ChatAssembler` may raise: its own errors, and whatever a chat
# template raises on input it does not support (the chat format's render then reports it as a 400).
_ASSEMBLY_FAILURES = (ChatAssemblyError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class Render(NamedTuple):
    """A request's history rendered up to the generation prompt."""

    ids: list[int]
    assembler: ChatAssembler | None
    """Holds the history up to these ids, to extend after the turn; None when the chat format rendered them."""
    how: str
    """"snapshot" (extended the parent's exact ids), "fresh" (whole request rendered) or "template"
    (rendered by the chat format because the assembler could not round-trip the text)."""


class Prompt(NamedTuple):
    """A request's prompt: its ids and how they were built."""

    restored: ChatRequest
    """The request with echoed replies restored to the recorded ones and without its prefill: what was rendered."""
    ids: list[int]
    """The rendered history, the generation prompt, then the prefill's ids."""
    assembler: ChatAssembler | None
    how: str
    """`Render.how`."""
    prefill: str | None
    """The client's trailing assistant text the model continues (None: no prefill)."""
    prefill_ids: list[int]


class SessionPrompts:
    """One session's prompts: the snapshot after each recorded turn and the replies it recorded, by identity."""

    def __init__(self, chat_format: ChatFormat, tokenizer: Any, key: str):
        self._chat_format = chat_format
        self._tokenizer = tokenizer
        self._key = key
        self._snapshots: dict[int, ChatAssembler | None] = {}
        self._recorded: dict[str, dict] = {}

    def restore_recorded(self, request: ChatRequest) -> ChatRequest:
        """The request with each echoed assistant message replaced by the recorded reply it identifies.

        Clients drop what they do not show (OpenAI clients never echo reasoning); rendering the
        recorded message keeps the history what the model produced. Matching is by identity
        (normalized content and tool calls), never by position, so an inserted summary message
        takes nothing from a recorded turn. The input is not mutated.
        """
        if not self._recorded:
            return request
        messages = []
        for message in request.messages:
            if message.get("role") == "assistant":
                recorded = self._recorded.get(unit_hash(normalize_message(message)))
                if recorded is not None:
                    message = copy.deepcopy(recorded)
            messages.append(message)
        return replace(request, messages=messages)

    def build(self, request: ChatRequest, parent: int | None) -> tuple[Prompt, bool]:
        """The request's prompt, extending recorded turn `parent`'s exact ids when it can, else rendered afresh; and
        whether an extension was tried and failed (the caller counts it)."""
        restored, prefill, prefill_ids = self._split_prefill(self.restore_recorded(request))
        messages = self._chat_format.template_messages(restored)
        tools = self._chat_format.tools_for_template(restored)
        render = None if parent is None else self._extend(messages, tools, parent)
        fell_back = parent is not None and render is None
        if render is None:
            render = self._fresh(restored, messages, tools)
        return Prompt(restored, render.ids + prefill_ids, render.assembler, render.how, prefill, prefill_ids), fell_back

    def _split_prefill(self, request: ChatRequest) -> tuple[ChatRequest, str | None, list[int]]:
        """The request without a trailing assistant message, that message's text to continue (or None), and its ids.

        Anthropic's prefill: the reply continues the text in place, so the prompt is the history, the
        generation prompt, then this text, with no end of turn between them.
        """
        if not request.messages or request.messages[-1].get("role") != "assistant":
            return request, None, []
        last = request.messages[-1]
        if last.get("tool_calls"):
            raise WireError(f"messages[{len(request.messages) - 1}] (the last message) is an assistant message with "
                            "tool calls: send their results before asking for the next reply", param="messages")
        text = self._chat_format.template_message(last)["content"]
        ids = self._tokenizer.encode(text, add_special_tokens=False) if text else []
        return replace(request, messages=request.messages[:-1]), text, ids

    def _fresh(self, request: ChatRequest, messages: list[dict], tools: list[dict] | None) -> Render:
        """The whole request rendered anew (`messages` and `tools` are its template form)."""
        assembler = ChatAssembler(self._tokenizer, tools=tools, **self._chat_format.template_kwargs)
        try:
            return Render(assembler.prompt_ids(messages), assembler, "fresh")
        except _ASSEMBLY_FAILURES as e:
            # e.g. a tokenizer that does not round-trip the template text: no snapshot for this turn.
            logger.debug("session %s: fresh assembly failed (%r); using the chat format's render", self._key, e)
        return Render(list(self._chat_format.render(request)), None, "template")

    def _extend(self, messages: list[dict], tools: list[dict] | None, parent: int) -> Render | None:
        """The request rendered as a continuation of recorded turn `parent`'s exact ids; None when it cannot be."""
        snapshot = self._snapshots.get(parent)
        if snapshot is None or snapshot.tools != tools:
            return None
        assembler = _clone_assembler(snapshot)
        try:
            return Render(assembler.prompt_ids(messages), assembler, "snapshot")
        except _ASSEMBLY_FAILURES as e:
            logger.debug("session %s: cannot extend turn %d token-exactly (%r)", self._key, parent, e)
        return None

    def snapshot_after(self, restored: ChatRequest, assembler: ChatAssembler | None, prefill_ids: list[int],
                       completion: Any, message: dict) -> ChatAssembler | None:
        """The assembler holding this turn's prompt + sampled ids, to extend on the next turn; None when the reply
        does not render as one appended assistant message (the next turn is then rendered afresh)."""
        if assembler is None:
            return None
        before = self._chat_format.template_messages(restored)
        after = self._chat_format.template_messages(replace(restored, messages=restored.messages + [message]))
        if len(after) != len(before) + 1 or after[:-1] != before or after[-1].get("role") != "assistant":
            return None
        if prefill_ids:
            completion = _with_prefill(completion, prefill_ids)
        try:
            assembler.add_completion(completion, message=after[-1])
        except (ChatAssemblyError, ValueError) as e:
            logger.debug("session %s: no snapshot after this turn (%s)", self._key, e)
            return None
        return assembler

    def remember(self, node: int, snapshot: ChatAssembler | None, identity: str, message: dict) -> None:
        """Keep a recorded turn's snapshot (to extend) and its reply under its identity (to restore)."""
        self._snapshots[node] = snapshot
        self._recorded[identity] = message


def recorded_message(parsed: ParsedOutput, echoed: dict) -> dict:
    """The reply as the model wrote it (argument key order, reasoning), with the ids the client echoes.

    A fresh render of this message reproduces the sampled text, where the client's echo (arguments
    re-serialized with sorted keys, reasoning dropped) would not; both have the same identity, so
    restoring by identity stays exact. Falls back to the echo plus reasoning if they ever differ.
    """
    message = parsed.to_message()
    echoed_calls = echoed.get("tool_calls") or []
    if len(echoed_calls) == len(message.get("tool_calls") or []):
        for call, echoed_call in zip(message.get("tool_calls") or [], echoed_calls):
            call["id"] = echoed_call["id"]
        if unit_hash(normalize_message(message)) == unit_hash(normalize_message(echoed)):
            return message
    message = copy.deepcopy(echoed)
    if parsed.reasoning and not message.get("reasoning_content"):
        message["reasoning_content"] = parsed.reasoning
    return message


def _with_prefill(completion: Any, prefill_ids: list[int]) -> Completion:
    """The completion as a snapshot holds it: the prefill is part of the reply, and the prompt ends before it.

    Only the ids matter (a snapshot tracks tokens, `_clone_assembler`); the prefill's logprobs are placeholders.
    """
    prompt = list(completion.prompt_ids)
    return Completion(
        output_ids=list(prefill_ids) + list(completion.output_ids),
        logprobs=[0.0] * len(prefill_ids) + list(completion.logprobs),
        finish_reason=completion.finish_reason,
        versions=[],
        prompt_ids=prompt[: len(prompt) - len(prefill_ids)],
    )


def _clone_assembler(snapshot: ChatAssembler) -> ChatAssembler:
    """A copy to extend; the snapshot itself stays as recorded (it may be branched from again).

    Shares the tokenizer, template settings and history messages (never mutated), copies the
    token list. The clone tracks tokens only: logprobs, masks and versions start empty, because
    the trace is the recorded `TurnRecord`s, and a snapshot per turn then costs one id list.
    """
    clone = copy.copy(snapshot)
    clone.history = list(snapshot.history)
    clone.tokens = list(snapshot.tokens)
    clone.logprobs, clone.loss_mask, clone.versions = [], [], []
    clone.finish_reasons = list(snapshot.finish_reasons)
    return clone

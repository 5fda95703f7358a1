"""One agent session of the shim: its turn tree, how a request finds its parent, how its prompt is built.

A rollout opens a session and gives its key to the agent; every model call the agent makes
with that key lands here, one request at a time in arrival order (`TurnQueue`). A request
goes through four steps (the server runs them, `server.py`):

1. `prepare`: fingerprint the request and resolve its parent among the recorded turns
   (`resolve_parent`: NEW, APPEND, or WIPE with an explicit parent), then build the prompt
   ids. Continuing a recorded turn extends that turn's `ChatAssembler` snapshot, so replies
   already sampled keep their exact ids (re-tokenizing a reply can change them); anything
   else, or a snapshot that cannot be extended, is a fresh render of the whole request.
2. The server samples and builds the wire response.
3. `stage`: everything about recording that can fail (response fingerprints, the snapshot
   after this turn), done before the reply is sent, so a failure can still be a 503.
4. `commit`, once the reply reached the client: add the turn to the tree. A turn the client
   never saw is never recorded, or the agent's next request would diverge from the record.

At the end, `segments()` materializes the tree: chains frozen by a WIPE first (kind
"wipe", in freeze order), then the current leaf ("final"), then any other leaf ("branch").
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from training.utils.config import AgentShimConfig
from training.utils.errors import RecoverableRolloutError, TrainingError
from training.utils.rl.agent.chat_format import ChatFormat
from training.utils.rl.agent.chat_request import ChatRequest
from training.utils.rl.agent.hermes import ParsedOutput
from training.utils.rl.rollout.messages import ChatAssembler, ChatAssemblyError
from training.utils.rl.rollout.stitching import Segment, TurnRecord, TurnTree
from training.utils.rl.rollout.turn_matching import (
    TurnDecision,
    TurnKind,
    TurnRequest,
    make_fingerprinter,
    normalize_message,
    resolve_parent,
    unit_hash,
)

logger = logging.getLogger(__name__)

# What extending or rendering with a `ChatAssembler` may raise: its own errors, and whatever a chat
# template raises on input it does not support (the chat format's render then reports it as a 400).
_ASSEMBLY_FAILURES = (ChatAssemblyError, TypeError, ValueError, KeyError, IndexError, AttributeError)

COUNTERS = (
    "turns",
    "new",
    "appends",
    "wipes",
    "branches",
    "auxiliary",
    "integrity_failures",
    "sampling_failures",
    "context_overflows",
    "parser_fallbacks",
    "render_fallbacks",
    "recording_failures",
    "client_disconnects",
)
"""Per-session event counts. `turns` recorded turns, of which `new` / `appends` / `wipes`
(`branches`: WIPEs that continue an earlier turn rather than start a new root); `auxiliary`
answered tool-less calls never recorded; `integrity_failures` sampler answers that broke the
trace contract (also counted in `sampling_failures`); `render_fallbacks` continuations that
could not extend the parent's exact tokens and were rendered afresh (stitching then splits);
`client_disconnects` replies the client was gone for (nothing recorded)."""


class ContextOverflowError(TrainingError, ValueError):
    """The prompt leaves no room to generate within `max_context_tokens` (HTTP 400)."""

    def __init__(self, message: str, prompt_tokens: int = 0, limit: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def __reduce__(self):
        return (type(self), (str(self), self.prompt_tokens, self.limit))


class SessionTimeoutError(RecoverableRolloutError, TimeoutError):
    """A session still had a request in flight when `finish_session` gave up waiting for it."""


class QueueTimeoutError(TrainingError, TimeoutError):
    """A request waited longer than its timeout for the session's earlier requests (HTTP 503)."""


class TurnQueue:
    """First come, first served: one request of a session at a time, in arrival order.

    Each request puts a future at the tail and waits for the one before it, so no lock is
    held: the only shared state is the tail, swapped without awaiting. A request that gives
    up waiting (timeout, cancellation) passes its place on only once its predecessor is done,
    so a later request can never overtake an earlier one.
    """

    def __init__(self) -> None:
        self._tail: asyncio.Future | None = None

    @contextlib.asynccontextmanager
    async def turn(self, timeout: float):
        previous, mine = self._tail, asyncio.get_running_loop().create_future()
        self._tail = mine
        if previous is not None and not previous.done():
            try:
                await asyncio.wait_for(asyncio.shield(previous), timeout)
            except BaseException as e:
                previous.add_done_callback(lambda _: _release(mine))
                if isinstance(e, TimeoutError):
                    raise QueueTimeoutError(
                        f"waited {timeout:g}s for this session's earlier request to finish"
                    ) from None
                raise
        try:
            yield
        finally:
            _release(mine)

    async def drained(self, timeout: float) -> None:
        """Wait until every request queued so far is done."""
        tail = self._tail
        if tail is not None and not tail.done():
            await asyncio.wait_for(asyncio.shield(tail), timeout)


def _release(slot: asyncio.Future) -> None:
    if not slot.done():
        slot.set_result(None)


@dataclass
class PreparedTurn:
    """A request resolved against the session and rendered, ready to sample."""

    request: ChatRequest
    """The request as the client sent it (translated to chat messages)."""
    restored: ChatRequest
    """The same request with echoed replies replaced by the recorded ones (what is rendered)."""
    prompt_ids: list[int]
    max_tokens: int
    trainable: bool
    """False for an auxiliary (tool-less, `record_toolless=False`) call: answered, never recorded."""
    units: list | None = None
    decision: TurnDecision | None = None
    assembler: ChatAssembler | None = None
    """Holds the history up to this prompt; None when the prompt came from the template alone."""
    render: str = "fresh"
    """"snapshot" (extended the parent's exact ids), "fresh" (whole request rendered) or "template"
    (rendered by the chat format because the assembler could not round-trip the text)."""


@dataclass
class StagedTurn:
    """A sampled turn with everything recording needs, computed before the reply is sent."""

    prepared: PreparedTurn
    record: TurnRecord
    response_id: str
    response_units: list | None = None
    snapshot: ChatAssembler | None = None
    identity: str | None = None
    message: dict = field(default_factory=dict)
    """The assistant chat message as recorded (with reasoning the client may not echo)."""


class ShimSession:
    """State of one agent session: turn tree, response fingerprints, snapshots, counters.

    `key` is what the agent presents as its API key; `affinity` is forwarded to the
    deployment with every sample (keeps one trajectory on one replica) and is deliberately
    distinct from the key and from `run_id`, so none of them leaks into the others.
    """

    def __init__(
        self,
        key: str,
        base_url: str,
        affinity: str,
        run_id: str | None,
        *,
        chat_format: ChatFormat,
        tokenizer: Any,
        template_kwargs: dict[str, Any],
        cfg: AgentShimConfig,
        max_tokens: int,
    ):
        self.key = key
        self.base_url = base_url
        """Shim URL without `/v1` (Anthropic clients); OpenAI clients use `base_url + "/v1"`."""
        self.affinity = affinity
        self.run_id = run_id
        self.closed = False
        """Set by `finish_session` / `discard_session`: requests still queued get 401."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.kinds: list[str] = []
        """Decision of each recorded turn, in order ("new", "append", "wipe")."""
        self.first_error: str | None = None
        """Message of the first integrity or recording failure, for the run's metadata."""
        self.unrecorded_replies = 0
        """Replies the client received but that could not be recorded (a bug): the trace has a hole,
        so `finish_session` raises instead of returning segments."""
        self.queue = TurnQueue()
        self._chat_format = chat_format
        self._tokenizer = tokenizer
        self._template_kwargs = dict(template_kwargs)
        self._cfg = cfg
        self._max_tokens = int(max_tokens)
        self._fingerprinter = make_fingerprinter(cfg.turn_matching)
        self._tree = TurnTree()
        self._leaf: int | None = None
        self._stored_units: list | None = None
        self._frozen: list[int] = []
        self._response_units: dict[int, list] = {}
        self._snapshots: dict[int, ChatAssembler | None] = {}
        self._recorded: dict[str, dict] = {}
        self._accepting = True

    def __repr__(self) -> str:
        return f"ShimSession(key={self.key!r}, run_id={self.run_id!r}, turns={self.counters['turns']})"

    @property
    def num_turns(self) -> int:
        return self.counters["turns"]

    def count(self, name: str) -> None:
        self.counters[name] += 1

    # ------------------------------------------------------------------ 1. prepare

    def prepare(self, request: ChatRequest) -> PreparedTurn:
        """Resolve the request's parent and build its prompt.

        Raises `ContextOverflowError` when no room is left to generate, and `WireError` (400) when
        the chat template cannot render the request at all.
        """
        trainable = self._cfg.record_toolless or bool(request.tools)
        restored = self.restore_recorded(request)
        units = decision = None
        if not trainable:
            prompt, assembler, how = self._fresh_prompt(restored)
        elif self._fingerprinter.name == "token_prefix":
            # The units are the prompt itself, so the prompt is rendered before matching: a request
            # continues a turn only when this fresh render starts with that turn's prompt + output.
            prompt, assembler, how = self._fresh_prompt(restored)
            units = self._fingerprinter.units(TurnRequest(request.system, request.messages, prompt))
            decision = resolve_parent(units, self._response_units, self._leaf, self._stored_units)
        else:
            units = self._fingerprinter.units(TurnRequest(request.system, request.messages))
            decision = resolve_parent(units, self._response_units, self._leaf, self._stored_units)
            if decision.parent is None:
                prompt, assembler, how = self._fresh_prompt(restored)
            else:
                prompt, assembler, how = self._continued_prompt(restored, decision.parent)
        max_tokens = self._turn_max_tokens(request, len(prompt))
        return PreparedTurn(request, restored, prompt, max_tokens, trainable, units, decision, assembler, how)

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

    def _fresh_prompt(self, request: ChatRequest) -> tuple[list[int], ChatAssembler | None, str]:
        assembler = ChatAssembler(
            self._tokenizer, tools=self._chat_format.tools_for_template(request), **self._template_kwargs
        )
        try:
            return assembler.prompt_ids(self._chat_format.template_messages(request)), assembler, "fresh"
        except _ASSEMBLY_FAILURES as e:
            # e.g. a tokenizer that does not round-trip the template text: no snapshot for this turn.
            logger.debug("session %s: fresh assembly failed (%r); using the chat format's render", self.key, e)
        return list(self._chat_format.render(request)), None, "template"

    def _continued_prompt(self, request: ChatRequest, parent: int) -> tuple[list[int], ChatAssembler | None, str]:
        snapshot = self._snapshots.get(parent)
        if snapshot is not None and snapshot.tools == self._chat_format.tools_for_template(request):
            assembler = _clone_assembler(snapshot)
            try:
                return assembler.prompt_ids(self._chat_format.template_messages(request)), assembler, "snapshot"
            except _ASSEMBLY_FAILURES as e:
                logger.debug("session %s: cannot extend turn %d token-exactly (%r)", self.key, parent, e)
        # Stitching splits the segment where this render and the recorded ids disagree: nothing is lost.
        self.count("render_fallbacks")
        return self._fresh_prompt(request)

    def _turn_max_tokens(self, request: ChatRequest, prompt_len: int) -> int:
        limits = [self._max_tokens]
        if request.max_tokens is not None:
            limits.append(int(request.max_tokens))
        limit = self._cfg.max_context_tokens
        if limit:
            room = limit - prompt_len
            if room <= 0:
                self.count("context_overflows")
                raise ContextOverflowError(
                    f"the prompt is {prompt_len} tokens, which leaves no room to generate within the "
                    f"context limit of {limit} tokens (agent_shim.max_context_tokens); shorten or compact "
                    "the conversation",
                    prompt_len,
                    limit,
                )
            limits.append(room)
        return min(limits)

    # ------------------------------------------------------------------ 3. stage

    def stage(
        self, prepared: PreparedTurn, completion: Any, record: TurnRecord, parsed: ParsedOutput,
        echoed: dict, response_id: str,
    ) -> StagedTurn:
        """Compute what recording needs; raises on any failure, changing nothing.

        `completion` is the sampler's `Completion` (checked into `record`), `echoed` the
        assistant chat message a client echoes back for the wire response sent.
        """
        message = _recorded_message(parsed, echoed)
        staged = StagedTurn(prepared, record, response_id, message=message)
        record.metadata.update(response_id=response_id, parser_fallback=bool(parsed.parser_fallback),
                               render=prepared.render)
        if not prepared.trainable:
            return staged
        request = prepared.request
        record.metadata["decision"] = prepared.decision.kind.value
        if self._fingerprinter.name == "token_prefix":
            staged.response_units = list(prepared.prompt_ids) + list(record.output_ids)
        else:
            staged.response_units = self._fingerprinter.units(TurnRequest(request.system, request.messages + [echoed]))
        staged.identity = unit_hash(normalize_message(echoed))
        staged.snapshot = self._snapshot_after(prepared, completion, message)
        return staged

    def _snapshot_after(self, prepared: PreparedTurn, completion: Any, message: dict) -> ChatAssembler | None:
        """The assembler holding this turn's prompt + sampled ids, to extend on the next turn."""
        assembler = prepared.assembler
        if assembler is None:
            return None
        restored = prepared.restored
        before = self._chat_format.template_messages(restored)
        after = self._chat_format.template_messages(replace(restored, messages=restored.messages + [message]))
        if len(after) != len(before) + 1 or after[:-1] != before or after[-1].get("role") != "assistant":
            return None  # the reply does not render as one appended assistant message
        try:
            assembler.add_completion(completion, message=after[-1])
        except (ChatAssemblyError, ValueError) as e:
            logger.debug("session %s: no snapshot after this turn (%s)", self.key, e)
            return None
        return assembler

    # ------------------------------------------------------------------ 4. commit

    def commit(self, staged: StagedTurn) -> int | None:
        """Record a turn whose reply reached the client; returns its tree node (None if not recorded)."""
        if not self._accepting:
            return None  # discarded, or finish_session gave up on this request
        prepared = staged.prepared
        if not prepared.trainable:
            self.count("auxiliary")
            return None
        decision = prepared.decision
        if decision.kind is TurnKind.WIPE and self._leaf is not None:
            self._frozen.append(self._leaf)
            self.count("wipes")
        if decision.parent is not None and decision.parent in self._frozen:
            self._frozen.remove(decision.parent)  # about to get a child: no longer a leaf
        if decision.kind is TurnKind.WIPE and decision.parent is not None:
            self.count("branches")
        node = self._tree.add(staged.record, decision.parent, response_id=staged.response_id)
        self._response_units[node] = staged.response_units
        self._snapshots[node] = staged.snapshot
        self._recorded[staged.identity] = staged.message
        self._leaf = node
        self._stored_units = prepared.units
        self.kinds.append(decision.kind.value)
        self.count("turns")
        if decision.kind is TurnKind.NEW:
            self.count("new")
        elif decision.kind is TurnKind.APPEND:
            self.count("appends")
        return node

    # ------------------------------------------------------------------ end of the run

    def stop_recording(self) -> None:
        """No turn is recorded from now on (the session was discarded or abandoned)."""
        self._accepting = False

    def segments(self) -> list[Segment]:
        """The recorded tree as training segments: frozen chains ("wipe"), the current leaf ("final"),
        then any other leaf ("branch"); a shared prefix is trained on the first of them only."""
        selected = [(leaf, "wipe") for leaf in self._frozen]
        if self._leaf is not None:
            selected.append((self._leaf, "final"))
        taken = {leaf for leaf, _ in selected}
        selected += [(leaf, "branch") for leaf in self._tree.leaves() if leaf not in taken]
        if not selected:
            return []
        return self._tree.materialize(
            selected, policy=self._cfg.stitching, max_context_tokens=self._cfg.max_context_tokens or 0
        )

    def summary(self) -> dict[str, Any]:
        """Run metadata: counters, the decision sequence and the first failure."""
        out: dict[str, Any] = {f"shim/{k}": v for k, v in self.counters.items()}
        out["shim/turn_kinds"] = list(self.kinds)
        if self.first_error:
            out["shim/first_error"] = self.first_error
        return out


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


def _recorded_message(parsed: ParsedOutput, echoed: dict) -> dict:
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

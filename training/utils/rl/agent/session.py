"""One agent session of the shim: its turn tree, how a request finds its parent, how its prompt is built.

A rollout opens a session and gives its key to the agent; every model call the agent makes
with that key lands here, one request at a time in arrival order (`TurnQueue`). A request
goes through four steps (the server runs them, `server.py`):

1. `prepare`: fingerprint the request and resolve its parent among the recorded turns
   (`resolve_parent`: NEW, APPEND, or WIPE with an explicit parent), then build the prompt
   ids. Continuing a recorded turn extends that turn's `ChatAssembler` snapshot, so replies
   already sampled keep their exact ids (re-tokenizing a reply can change them); anything
   else, or a snapshot that cannot be extended, is a fresh render of the whole request. A
   trailing assistant message is a prefill: the prompt ends with the assistant header and its
   text, and the model continues it.
2. The server samples and builds the wire response.
3. `stage`: everything about recording that can fail (response fingerprints, the snapshot
   after this turn), done before the reply is sent, so a failure can still be a 503.
4. `commit`, once the reply reached the client: add the turn to the tree. A turn the client
   never saw is never recorded, or the agent's next request would diverge from the record.

A WIPE is a *branch* when the request resumes from an earlier point than the latest turn (a
retry, an edited history: it continues an earlier turn, or starts like the first request) and a
*compaction* when its history matches no recorded turn at all (the client summarised, or a
sub-agent started). Either way the chain it leaves is frozen. At the end, `segments()`
materializes the tree: the frozen chains first (kind "branch", in freeze order), then the
current leaf ("final"), then any other leaf ("branch").
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from training.utils.config import AgentShimConfig
from training.utils.deploy.completion import Completion
from training.utils.errors import RecoverableRolloutError, TrainingError
from training.utils.rl.agent.chat_format import ChatFormat
from training.utils.rl.agent.chat_request import ChatRequest, WireError
from training.utils.rl.agent.hermes import ParsedOutput
from training.utils.rl.rollout.messages import ChatAssembler, ChatAssemblyError
from training.utils.rl.rollout.stitching import Segment, TurnRecord, TurnTree
from training.utils.rl.rollout.turn_matching import (
    TurnDecision,
    TurnKind,
    TurnRequest,
    common_prefix_len,
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
    "branches",
    "compactions",
    "auxiliary",
    "integrity_failures",
    "sampling_failures",
    "context_overflows",
    "parser_fallbacks",
    "render_fallbacks",
    "recording_failures",
    "client_disconnects",
)
"""Per-session event counts. `turns` recorded turns, of which `new` / `appends` / `branches` (resumed from
an earlier point than the latest turn: retries, edits) / `compactions` (a history that matches no recorded
turn: a summary, a sub-agent's first request); `auxiliary` answered tool-less calls never recorded;
`integrity_failures` sampler answers that broke the trace contract (also counted in `sampling_failures`);
`render_fallbacks` continuations that could not extend the parent's exact tokens and were rendered afresh
(stitching then splits); `client_disconnects` replies the client was gone for (nothing recorded)."""


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
    """The same request with echoed replies replaced by the recorded ones and without a prefill (what is
    rendered before the generation prompt)."""
    prompt_ids: list[int]
    """The ids sent: the rendered history, the generation prompt, then the prefill's ids."""
    max_tokens: int
    limited_by: str
    """Which limit set `max_tokens`: "client" (its own max_tokens), "trainer" (`sampling.max_tokens`) or
    "context" (the room left in the context)."""
    trainable: bool
    """False for an auxiliary (tool-less, `record_toolless=False`) call: answered, never recorded."""
    units: list | None = None
    decision: TurnDecision | None = None
    assembler: ChatAssembler | None = None
    """Holds the history up to this prompt; None when the prompt came from the template alone."""
    render: str = "fresh"
    """"snapshot" (extended the parent's exact ids), "fresh" (whole request rendered) or "template"
    (rendered by the chat format because the assembler could not round-trip the text)."""
    prefill: str | None = None
    """The client's trailing assistant text the model continues (None: no prefill)."""
    prefill_ids: list[int] = field(default_factory=list)
    """Its ids, the end of `prompt_ids`."""


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
    kind: str = ""
    """What the turn is: "new", "append", "branch" or "compaction" (`ShimSession._turn_kind`)."""


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
        """What each recorded turn was, in order: "new", "append", "branch" or "compaction"."""
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
        self._root_requests: list[list] = []  # request units of each root turn: a request starting with one is a retry
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
        restored, prefill = self._split_prefill(self.restore_recorded(request))
        prefill_ids = self._tokenizer.encode(prefill, add_special_tokens=False) if prefill else []
        units = decision = None
        if not trainable:
            prompt, assembler, how = self._fresh_prompt(restored)
        elif self._fingerprinter.name == "token_prefix":
            # The units are the prompt itself, so the prompt is rendered before matching: a request
            # continues a turn only when this fresh render starts with that turn's prompt + output.
            prompt, assembler, how = self._fresh_prompt(restored)
            units = self._fingerprinter.units(TurnRequest(request.system, request.messages, prompt + prefill_ids))
            decision = resolve_parent(units, self._response_units, self._leaf, self._stored_units)
        else:
            units = self._fingerprinter.units(TurnRequest(request.system, request.messages))
            decision = resolve_parent(units, self._response_units, self._leaf, self._stored_units)
            if decision.parent is None:
                prompt, assembler, how = self._fresh_prompt(restored)
            else:
                prompt, assembler, how = self._continued_prompt(restored, decision.parent)
        prompt = prompt + prefill_ids
        max_tokens, limited_by = self._turn_max_tokens(request, len(prompt))
        return PreparedTurn(request, restored, prompt, max_tokens, limited_by, trainable, units, decision,
                            assembler, how, prefill, prefill_ids)

    def _split_prefill(self, request: ChatRequest) -> tuple[ChatRequest, str | None]:
        """The request without a trailing assistant message, and that message's text to continue (or None).

        Anthropic's prefill: the reply continues the text in place, so the prompt is the history, the
        generation prompt, then this text, with no end of turn between them.
        """
        if not request.messages or request.messages[-1].get("role") != "assistant":
            return request, None
        last = request.messages[-1]
        if last.get("tool_calls"):
            raise WireError(f"messages[{len(request.messages) - 1}] (the last message) is an assistant message with "
                            "tool calls: send their results before asking for the next reply", param="messages")
        text = self._chat_format.template_message(last)["content"]
        return replace(request, messages=request.messages[:-1]), text

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

    def _turn_max_tokens(self, request: ChatRequest, prompt_len: int) -> tuple[int, str]:
        """The least of the trainer's cap, the client's own and the room left, with which one it is (the client's
        when it ties: it asked for that many)."""
        limits = [(self._max_tokens, "trainer")]
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
            limits.append((room, "context"))
        if request.max_tokens is not None:
            limits.insert(0, (int(request.max_tokens), "client"))
        return min(limits, key=lambda limit_and_owner: limit_and_owner[0])

    # ------------------------------------------------------------------ 3. stage

    def stage(
        self, prepared: PreparedTurn, completion: Any, record: TurnRecord, parsed: ParsedOutput,
        echoed: dict, response_id: str,
    ) -> StagedTurn:
        """Compute what recording needs; raises on any failure, changing nothing.

        `completion` is the sampler's `Completion` (checked into `record`), `echoed` the
        assistant chat message a client echoes back for the wire response sent. After a prefill the
        client holds the prefill and the reply as one message, so that is what is recorded and matched.
        """
        if prepared.prefill is not None:
            prefilled = prepared.request.messages[-1].get("content") or ""
            parsed = replace(parsed, content=prefilled + parsed.content)
            echoed = {**echoed, "content": prefilled + (echoed.get("content") or "")}
        message = _recorded_message(parsed, echoed)
        staged = StagedTurn(prepared, record, response_id, message=message)
        record.metadata.update(response_id=response_id, parser_fallback=bool(parsed.parser_fallback),
                               render=prepared.render)
        if not prepared.trainable:
            return staged
        request = prepared.request
        history = request.messages[:-1] if prepared.prefill is not None else request.messages
        staged.kind = self._turn_kind(prepared.decision, prepared.units)
        record.metadata["decision"] = staged.kind
        if self._fingerprinter.name == "token_prefix":
            staged.response_units = list(prepared.prompt_ids) + list(record.output_ids)
        else:
            staged.response_units = self._fingerprinter.units(TurnRequest(request.system, history + [echoed]))
        staged.identity = unit_hash(normalize_message(echoed))
        staged.snapshot = self._snapshot_after(prepared, completion, message)
        return staged

    def _turn_kind(self, decision: TurnDecision, units: list) -> str:
        """"new", "append", "branch" (resumes an earlier point: continues an earlier turn, or starts like a first
        request) or "compaction" (matches no recorded turn)."""
        if decision.kind is not TurnKind.WIPE:
            return decision.kind.value
        if decision.parent is not None:
            return "branch"
        retries_a_first_turn = any(common_prefix_len(root, units) == len(root) for root in self._root_requests)
        return "branch" if retries_a_first_turn else "compaction"

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
        if prepared.prefill_ids:
            completion = _with_prefill(completion, prepared.prefill_ids)
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
        if decision.parent is not None and decision.parent in self._frozen:
            self._frozen.remove(decision.parent)  # about to get a child: no longer a leaf
        node = self._tree.add(staged.record, decision.parent, response_id=staged.response_id)
        if decision.parent is None:
            self._root_requests.append(prepared.units)
        self._response_units[node] = staged.response_units
        self._snapshots[node] = staged.snapshot
        self._recorded[staged.identity] = staged.message
        self._leaf = node
        self._stored_units = prepared.units
        self.kinds.append(staged.kind)
        self.count("turns")
        self.count(_KIND_COUNTERS[staged.kind])
        return node

    # ------------------------------------------------------------------ end of the run

    def stop_recording(self) -> None:
        """No turn is recorded from now on (the session was discarded or abandoned)."""
        self._accepting = False

    def segments(self) -> list[Segment]:
        """The recorded tree as training segments: frozen chains ("branch"), the current leaf ("final"),
        then any other leaf ("branch"); a shared prefix is trained on the first of them only."""
        selected = [(leaf, "branch") for leaf in self._frozen]
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


_KIND_COUNTERS = {"new": "new", "append": "appends", "branch": "branches", "compaction": "compactions"}


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

"""One agent session: each request matched to a recorded turn and prompted, each answered turn recorded in its tree.

A rollout opens a session and gives its key to the agent; every model call the agent makes
with that key lands here, one at a time in arrival order (`turn_queue.py`), and goes through
these steps (`model_call.py` runs them, sampling and checking the answer between 1 and 2):

1. `prepare`: match the request against the recorded turns (`rollout/turn_matching.py`: NEW,
   APPEND, or WIPE with an explicit parent; a WIPE is a branch or a compaction), then build its
   prompt ids (`prompt.py`: continuing a recorded turn extends that turn's exact ids); an SDK's
   retry of a request already answered finds the reply kept for it (`replay`) instead.
2. `stage`: everything about recording that can fail (the units later requests are matched
   against, the snapshot after this turn), done before the reply is sent, so a failure can
   still be a 503.
3. `commit`, once the reply reached the client: add the turn to the tree (`TurnTree`). A turn
   the client never saw is never recorded, or the agent's next request would diverge from it.
   The reply as sent is kept with the request's hash (`remember_answer`), so that an SDK's retry
   of that very request is answered from the record instead of sampled again.

A WIPE is a *branch* when the request resumes from an earlier point than the latest turn (a
retry, an edited history) and a *compaction* when its history matches no recorded turn at all
(the client summarised, or a sub-agent started); either way the chain it leaves is frozen. At
the end, `result` materializes the tree: the frozen chains first (kind "branch", in freeze
order), then the current leaf ("final"), then any other leaf ("branch").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

from training.utils.config.rl import AgentShimConfig
from training.utils.rl.agent.chat_format import ChatFormat, ParsedOutput
from training.utils.rl.agent.chat_request import ChatRequest, ContextOverflowError, WireReply, overflow_message
from training.utils.rl.agent.prompt import SessionPrompts, recorded_message
from training.utils.rl.agent.turn_queue import TurnQueue
from training.utils.rl.rollout.messages import ChatAssembler
from training.utils.rl.rollout.stitching import Segment, TraceIntegrityError, TurnRecord, TurnTree, segments_to_run
from training.utils.rl.rollout.turn_matching import (
    TurnDecision,
    TurnKind,
    TurnRequest,
    make_fingerprinter,
    normalize_message,
    resolve_parent,
    turn_label,
    unit_hash,
)
from training.utils.rl.rollout.types import RolloutRun

ANSWERS_KEPT = 16
"""Replies a session keeps for replaying retries, the latest first. An SDK retries the call it has just made, and
each agent (the main one, each sub-agent running beside it) has one call in flight at a time, so the last few
answers hold every reply a retry can ask for; older ones are dropped to bound the session's memory."""

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
    "retries_replayed",
)
"""Per-session event counts. `turns` recorded turns, of which `new` / `appends` / `branches` (resumed from
an earlier point than the latest turn: retries, edits) / `compactions` (a history that matches no recorded
turn: a summary, a sub-agent's first request); `auxiliary` answered tool-less calls never recorded;
`integrity_failures` sampler answers that broke the trace contract (also counted in `sampling_failures`);
`render_fallbacks` continuations that could not extend the parent's exact tokens and were rendered afresh
(stitching then splits); `client_disconnects` replies the client was gone for (nothing recorded);
`retries_replayed` SDK retries of a request already answered, sent the recorded reply again (nothing sampled,
nothing recorded)."""

_KIND_COUNTERS = {"new": "new", "append": "appends", "branch": "branches", "compaction": "compactions"}


class Match(NamedTuple):
    """A request matched against a session's recorded turns (None and "" for an auxiliary call, never matched)."""

    units: list | None
    decision: TurnDecision | None
    kind: str
    """`turn_matching.turn_label`: "new", "append", "branch" or "compaction"."""
    key: str
    """`request_hash(request)`."""


@dataclass
class PreparedTurn:
    """A request matched against the session and rendered, ready to sample."""

    request: ChatRequest
    """The request as the client sent it (decoded to chat messages)."""
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
    """False for an auxiliary (tool-less, `record_toolless=False`) call: answered, never matched nor recorded."""
    units: list | None = None
    decision: TurnDecision | None = None
    kind: str = ""
    """What the turn is: "new", "append", "branch" or "compaction" (`turn_matching.turn_label`)."""
    assembler: ChatAssembler | None = None
    """Holds the history up to this prompt; None when the prompt came from the template alone."""
    render: str = "fresh"
    """How the prompt was built (`prompt.Render.how`)."""
    prefill: str | None = None
    """The client's trailing assistant text the model continues (None: no prefill)."""
    prefill_ids: list[int] = field(default_factory=list)
    """Its ids, the end of `prompt_ids`."""
    request_hash: str = ""
    """`request_hash(request)`: what an SDK retry of this request has in common with it."""
    replay: WireReply | None = None
    """The reply already sent to this very request, when it is an SDK's retry of it (nothing to sample)."""


@dataclass
class StagedTurn:
    """A sampled turn with everything recording needs, computed before the reply is sent."""

    prepared: PreparedTurn
    record: TurnRecord
    """What was sampled, checked against the prompt sent."""
    response_id: str
    message: dict = field(default_factory=dict)
    """The assistant chat message as recorded (with reasoning the client may not echo)."""
    response_units: list | None = None
    """The units of the request plus the reply as the client echoes it: what later requests are matched on."""
    snapshot: ChatAssembler | None = None
    """The prompt and sampled ids after this turn, for the next turn to extend (`prompt.SessionPrompts`)."""
    identity: str | None = None
    """The reply's identity (`turn_matching.unit_hash` of its normalized message), to restore it when echoed."""


def turn_max_tokens(prompt_len: int, *, trainer: int, client: int | None, context: int | None) -> tuple[int, str]:
    """The least of the trainer's cap, the client's own and the room `context` leaves, with which one it is
    ("trainer", "client" or "context"; the client's when it ties: it asked for that many).

    A `ContextOverflowError` when the prompt leaves no room at all.
    """
    limits = [(trainer, "trainer")]
    if context:
        room = context - prompt_len
        if room <= 0:
            raise ContextOverflowError(overflow_message(prompt_len, context), prompt_len, context)
        limits.append((room, "context"))
    if client is not None:
        limits.insert(0, (int(client), "client"))
    return min(limits, key=lambda limit_and_owner: limit_and_owner[0])


def request_hash(request: ChatRequest) -> str:
    """The hash of every field of a decoded request: equal for an SDK's retry, which re-sends the same body.

    Taken over the decoded request, so two bodies that differ only where the shim reads nothing (a sampling
    parameter the trainer overrides, metadata) hash alike: the shim would answer them alike."""
    return unit_hash({f.name: getattr(request, f.name) for f in fields(request)})


class ShimSession:
    """State of one agent session: turn tree, response fingerprints, prompts, counters.

    `key` is what the agent presents as its API key; `affinity` is forwarded to the
    deployment with every sample (keeps one trajectory on one replica) and is deliberately
    distinct from the key and from `run_id`, so none of them leaks into the others.
    """

    def __init__(self, key: str, base_url: str, affinity: str, run_id: str | None, *, chat_format: ChatFormat,
                 tokenizer: Any, cfg: AgentShimConfig, max_tokens: int, context_tokens: int | None,
                 binder: Any = None):
        self.key = key
        self.base_url = base_url
        """Shim URL without `/v1` (Anthropic clients); OpenAI clients use `base_url + "/v1"`."""
        self.affinity = affinity
        self.run_id = run_id
        self.closed = False
        """Set when the session is finished or discarded: requests still queued get 401."""
        self.socket: str | None = None
        """The Unix socket the session is bound to (`bind`): its key is good there alone, and nowhere once unbound."""
        self._binder = binder
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.kinds: list[str] = []
        """What each recorded turn was, in order: "new", "append", "branch" or "compaction"."""
        self.first_error: str | None = None
        """Message of the first integrity or recording failure, for the run's metadata."""
        self.unrecorded_replies = 0
        """Replies the client received but that could not be recorded (a bug): the trace has a hole,
        so `result` raises instead of returning segments."""
        self.queue = TurnQueue()
        self.chat_format = chat_format
        self.prompts = SessionPrompts(chat_format, tokenizer, key)
        self._cfg = cfg
        self._max_tokens = int(max_tokens)
        self._context_tokens = context_tokens
        """The run's context limit (prompt + reply); None when the deployment does not say."""
        self._fingerprinter = make_fingerprinter(cfg.turn_matching)
        self._tree = TurnTree()
        self._leaf: int | None = None
        self._stored_units: list | None = None
        self._frozen: list[int] = []
        self._root_requests: list[list] = []  # request units of each root turn: a request starting with one is a retry
        self._response_units: dict[int, list] = {}
        self._answers: OrderedDict[tuple[str, str], WireReply] = OrderedDict()
        self._accepting = True

    def __repr__(self) -> str:
        return f"ShimSession(key={self.key!r}, run_id={self.run_id!r}, turns={self.counters['turns']})"

    async def bind(self) -> str:
        """Bind the session to a Unix socket of its own, the way a sandboxed agent reaches the shim: from then on its
        key is refused on every other connection, and that socket takes no other key. Returns the socket's path."""
        return await self._binder.bind(self)

    async def unbind(self) -> None:
        """Stop listening on the session's socket; its key stays good nowhere else."""
        await self._binder.unbind(self)

    @property
    def num_turns(self) -> int:
        return self.counters["turns"]

    @property
    def label(self) -> str:
        """How logs name the session: its run id, else the start of its key."""
        return self.run_id or self.key[:13]

    def count(self, name: str) -> None:
        self.counters[name] += 1

    def fail(self, counter: str, message: str) -> None:
        """Count a failure and keep the first failure's message for the run's metadata."""
        self.count(counter)
        self.first_error = self.first_error or message

    # ------------------------------------------------------------------ 1. prepare

    def prepare(self, request: ChatRequest, *, replay_route: str | None = None) -> PreparedTurn:
        """Match the request to its parent, then build its prompt; with `replay_route` (the request is an SDK's
        retry on that route) the reply kept for an identical request, if any, is its `replay`.

        Raises `ContextOverflowError` when no room is left to generate, and `WireError` (400) when
        the chat template cannot render the request at all.
        """
        trainable = bool(self._cfg.record_toolless or request.tools)  # else auxiliary: answered, never recorded
        # The token_prefix units are the prompt itself, so that prompt is rendered afresh before matching: a request
        # continues a turn only when this fresh render starts with that turn's prompt + output.
        by_prompt = self._fingerprinter.name == "token_prefix"
        match = self._match(request, None) if trainable and not by_prompt else None
        prompt, fell_back = self.prompts.build(request, None if match is None else match.decision.parent)
        if fell_back:
            # Stitching splits the segment where this render and the recorded ids disagree: nothing is lost.
            self.count("render_fallbacks")
        if match is None:
            match = self._match(request, prompt.ids) if trainable else Match(None, None, "", request_hash(request))
        units, decision, kind, key = match
        try:
            max_tokens, limited_by = turn_max_tokens(len(prompt.ids), trainer=self._max_tokens,
                                                     client=request.max_tokens, context=self._context_tokens)
        except ContextOverflowError:
            self.count("context_overflows")
            raise
        replay = None if replay_route is None else self._answers.get((replay_route, key))
        if replay is not None:
            self.count("retries_replayed")
        return PreparedTurn(request, prompt.restored, prompt.ids, max_tokens, limited_by, trainable, units, decision,
                            kind, prompt.assembler, prompt.how, prompt.prefill, prompt.prefill_ids, key, replay)

    def _match(self, request: ChatRequest, prompt_ids: list[int] | None) -> Match:
        """Everything turn matching says of the request, against the turns recorded so far."""
        units = self._fingerprinter.units(TurnRequest(request.system, request.messages, prompt_ids))
        decision = resolve_parent(units, self._response_units, self._leaf, self._stored_units)
        return Match(units, decision, turn_label(decision, units, self._root_requests), request_hash(request))

    # ------------------------------------------------------------------ 2. stage

    def stage(
        self, prepared: PreparedTurn, completion: Any, record: TurnRecord, parsed: ParsedOutput,
        echoed: dict, response_id: str,
    ) -> StagedTurn:
        """Compute what recording needs; raises on any failure, changing nothing but the parser-fallback count.

        `completion` is the sampler's `Completion` (checked into `record`), `echoed` the
        assistant chat message a client echoes back for the wire response sent. After a prefill the
        client holds the prefill and the reply as one message, so that is what is recorded and matched.
        """
        if parsed.parser_fallback:
            self.count("parser_fallbacks")
        if prepared.prefill is not None:
            prefilled = prepared.request.messages[-1].get("content") or ""
            parsed = replace(parsed, content=prefilled + parsed.content)
            echoed = {**echoed, "content": prefilled + (echoed.get("content") or "")}
        record.metadata.update(response_id=response_id, parser_fallback=bool(parsed.parser_fallback),
                               render=prepared.render)
        response_units = identity = None
        if prepared.trainable:
            record.metadata["decision"] = prepared.kind
            request = prepared.request
            history = request.messages[:-1] if prepared.prefill is not None else request.messages
            if self._fingerprinter.name == "token_prefix":
                response_units = list(prepared.prompt_ids) + list(record.output_ids)
            else:
                response_units = self._fingerprinter.units(TurnRequest(request.system, history + [echoed]))
            identity = unit_hash(normalize_message(echoed))
        message = recorded_message(parsed, echoed)
        staged = StagedTurn(prepared, record, response_id, message, response_units, identity=identity)
        if prepared.trainable:
            staged.snapshot = self.prompts.snapshot_after(prepared.restored, prepared.assembler,
                                                          prepared.prefill_ids, completion, message)
        return staged

    # ------------------------------------------------------------------ 3. commit

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
        self.prompts.remember(node, staged.snapshot, staged.identity, staged.message)
        self._leaf = node
        self._stored_units = prepared.units
        self.kinds.append(prepared.kind)
        self.count("turns")
        self.count(_KIND_COUNTERS[prepared.kind])
        return node

    # ------------------------------------------------------------------ replies kept for retries

    def remember_answer(self, route: str, prepared: PreparedTurn, sent: WireReply) -> None:
        """Keep the reply as sent to `prepared`'s request on `route`, for a retry of it (the latest `ANSWERS_KEPT`)."""
        key = (route, prepared.request_hash)
        self._answers[key] = sent
        self._answers.move_to_end(key)
        while len(self._answers) > ANSWERS_KEPT:
            self._answers.popitem(last=False)

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
            selected, policy=self._cfg.stitching, max_context_tokens=self._context_tokens or 0
        )

    def result(self, reward: float | None) -> list[Segment] | RolloutRun | None:
        """What the session recorded: its segments, or with `reward` one `RolloutRun` of them all (None when
        nothing is trainable). A `TraceIntegrityError` when a reply reached the agent unrecorded."""
        if self.unrecorded_replies:
            raise TraceIntegrityError(
                f"agent-shim session {self.label!r}: {self.unrecorded_replies} reply(ies) reached "
                f"the agent but could not be recorded ({self.first_error}); the trace has a hole"
            )
        segments = self.segments()
        if reward is None:
            return segments
        return segments_to_run(segments, reward, run_id=self.run_id, metadata=self.summary())

    def summary(self) -> dict[str, Any]:
        """Run metadata: counters, the decision sequence and the first failure."""
        out: dict[str, Any] = {f"shim/{k}": v for k, v in self.counters.items()}
        out["shim/turn_kinds"] = list(self.kinds)
        if self.first_error:
            out["shim/first_error"] = self.first_error
        return out

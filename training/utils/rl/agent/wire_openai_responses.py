"""The OpenAI Responses wire format (`WIRE`): `POST /v1/responses` (JSON, or SSE with `stream: true`). Codex speaks it.

Request -> `ChatRequest`: `instructions` is the system text, and a leading `system` or
`developer` message item joins it after a blank line; a later one is folded in place into a
`<system-reminder>` user message. `input` is a string (one user message) or a list of items:

    message (user / developer / system)  -> a chat message; content a string, null, or input_text /
                                            output_text / refusal parts joined by "\\n"
    reasoning, assistant message,        -> one assistant message per reply, in the order a reply
    function_call ...                       has them (reasoning, message, calls): reasoning_content,
                                            content, tool_calls (call_id, canonical JSON arguments)
    function_call_output                 -> a `tool` message with its tool_call_id

Images, files and audio are noted as unseen (the server refuses them, or lets them through as
placeholders, `agent_shim.unseen_content`). Tools of type `function` are offered to the model;
every other tool type (web_search, file_search, a freeform `custom` tool, local_shell, mcp, ...)
is one the shim's tool-call format cannot express or only OpenAI's servers run, and is left out.
`max_output_tokens` is the client's cap; `include: ["message.output_text.logprobs"]` returns the
sampled tokens' logprobs (`top_logprobs` > 0 is a 400). `store`, `tool_choice`, `reasoning`,
`text`, `truncation`, `temperature` and other fields are ignored. The shim keeps no responses,
so `previous_response_id`, `conversation` and `prompt` (all naming stored state) are a 400, and
so are item types it never returns (`item_reference`, `custom_tool_call`, `web_search_call`, ...).

Responses: output items in the order reasoning (when the model wrote a think block), message
(when there is text or no call), one `function_call` per parsed tool call. A reply reported
cut is `status: "incomplete"` (`max_output_tokens`); anything else, a trainer-cap cut
included (`agent_shim.report_trainer_cap_as`), is `completed`. With
`include: ["reasoning.encrypted_content"]` (what Codex sends, with `store: false`) a reasoning
item's `encrypted_content` carries the reasoning, sealed to the session and to its reply
(`reasoning_seal.py`); sent back, it restores exactly what was sampled. A prompt over the
context is OpenAI's `context_length_exceeded`: a 400 to a JSON request, and to a stream a
`response.failed` event, which is where Codex looks for it.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from training.utils.rl.agent import chat_request
from training.utils.rl.agent.chat_format import ParsedOutput
from training.utils.rl.agent.chat_request import (
    ChatRequest,
    UnseenPart,
    WireError,
    system_reminder,
)
from training.utils.rl.agent.reasoning_seal import ReasoningSeal
from training.utils.rl.agent.responses_stream import failed_events, response_events
from training.utils.rl.agent.wire_format import Route, TurnCodec, WireFormat
from training.utils.rl.agent.wire_openai import openai_error_body
from training.utils.rl.rollout.turn_matching import normalize_message, unit_hash

ENCRYPTED_REASONING = "reasoning.encrypted_content"
TEXT_LOGPROBS = "message.output_text.logprobs"

# The parts that hold text (an input_text or output_text part under `text`); any other part is media the
# text-only prompt cannot carry.
_TEXT_PARTS = ("input_text", "output_text", "refusal")
_TEXT_KEYS = {"input_text": "text", "output_text": "text"}
_REASONING_PARTS = ("reasoning_text", "text")
# The order a reply's items come in: an item of a lower rank (or a second message) starts the next reply.
_REPLY_RANK = {"reasoning": 0, "message": 1, "function_call": 2}
_ROLES = ("user", "assistant", "system", "developer")
# Fields naming state a server keeps between requests, which the shim never does.
_STORED_STATE = {
    "previous_response_id": "the shim keeps no responses (as with store: false): send the whole conversation as "
                            "input, reasoning items with their encrypted_content (include: "
                            f"['{ENCRYPTED_REASONING}'])",
    "conversation": "the shim keeps no conversations: send the whole conversation as input",
    "prompt": "the shim keeps no prompt templates: send the instructions and input themselves",
}


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(12)


def _new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# ---------------------------------------------------------------------------- requests


def responses_request(body: Any, seal: ReasoningSeal) -> ChatRequest:
    """Validate a Responses request body and translate it; WireError names the bad field. `seal` opens the
    reasoning items' `encrypted_content` (this session's)."""
    if not isinstance(body, dict):
        raise WireError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, why in _STORED_STATE.items():
        if body.get(key) is not None:
            raise WireError(f"{key} is not supported: {why}", param=key)
    if body.get("background"):
        raise WireError("background is not supported: the shim answers each request while it is open",
                        param="background")
    unseen: list[UnseenPart] = []
    messages, sealed = input_messages(_input_items(body.get("input")), unseen)
    system = body.get("instructions")
    if system is not None and not isinstance(system, str):
        raise WireError(f"instructions must be a string, got {type(system).__name__}", param="instructions")
    if messages and messages[0]["role"] == "system":
        lead = messages.pop(0)["content"]
        system = lead if system is None else f"{system}\n\n{lead}"
    include = chat_request.string_list(body, "include", allow_string=False)
    request = ChatRequest(
        system=system,
        messages=[system_reminder(m["content"]) if m["role"] == "system" else m for m in messages],
        tools=_tools(body.get("tools")),
        max_tokens=chat_request.optional_int(body, "max_output_tokens", minimum=1),
        stop=[],
        stream=chat_request.flag(body, "stream"),
        model=chat_request.model(body),
        unseen=unseen,
        logprobs=_logprobs_requested(body, include),
    )
    open_reasoning(sealed, seal)  # last: every field is read before the blobs are opened
    return request


def _input_items(value: Any) -> list:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise WireError("input must be a string or a non-empty list of items", param="input")
    return value


def _logprobs_requested(body: dict, include: list[str]) -> bool:
    """The sampled tokens' own logprobs are returned when `include` asks; alternatives (`top_logprobs`) are
    never sampled, so asking for them is a 400 rather than an answer without them."""
    top = chat_request.optional_int(body, "top_logprobs", minimum=0)
    if top:
        raise WireError(f"top_logprobs={top} is not supported: the shim returns only the sampled tokens' logprobs "
                        f"(include: ['{TEXT_LOGPROBS}'], top_logprobs 0 or absent)", param="top_logprobs")
    return TEXT_LOGPROBS in include


@dataclass
class SealedReasoning:
    """A reply's reasoning carried as `encrypted_content`, read but not yet opened (`open_reasoning`)."""

    message: dict
    """The reply's chat message, which gets the reasoning as its `reasoning_content`."""
    where: str
    """The blob's field, for the 400 that names it."""
    blob: str


def input_messages(items: list, unseen: list[UnseenPart]) -> tuple[list[dict], list[SealedReasoning]]:
    """The chat messages of a list of input (or output) items, in order (system messages are the caller's to
    place), and the sealed reasoning of their replies, for `open_reasoning`."""
    messages: list[dict] = []
    sealed: list[SealedReasoning] = []
    reply: _Reply | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = _item_type(item, where)
        rank = _REPLY_RANK.get(kind) if kind != "message" or item.get("role") == "assistant" else None
        if reply is not None and (rank is None or not reply.takes(rank)):
            messages.append(reply.message(sealed))
            reply = None
        if rank is None:
            messages.append(_chat_message(kind, item, where, unseen))
            continue
        reply = reply or _Reply()
        reply.add(kind, item, where, unseen)
    if reply is not None:
        messages.append(reply.message(sealed))
    return messages, sealed


def open_reasoning(sealed: list[SealedReasoning], seal: ReasoningSeal) -> None:
    """Give each reply its sealed reasoning; a WireError 400 naming the blob when this session did not issue it, or
    issued it with another reply."""
    for item in sealed:
        reasoning, identity = seal.open(item.blob, item.where)
        if identity != reply_identity(item.message):
            raise WireError(f"{item.where} was sent with another reply: a reasoning item goes back with the items "
                            "that followed it in its response", param=item.where)
        item.message["reasoning_content"] = reasoning


def _item_type(item: Any, where: str) -> str:
    if not isinstance(item, dict):
        raise WireError(f"{where} must be an object, got {type(item).__name__}", param=where)
    kind = item.get("type", "message" if "role" in item else None)  # {"role", "content"} is a message
    if kind in ("message", "function_call", "function_call_output", "reasoning"):
        return kind
    if kind == "item_reference":
        raise WireError(f"{where} is an item_reference: the shim keeps no items, send the item itself",
                        param=f"{where}.type")
    raise WireError(f"{where}.type {kind!r} is not an item the shim takes: message, function_call, "
                    "function_call_output or reasoning (it offers the model function tools only)",
                    param=f"{where}.type")


def _chat_message(kind: str, item: dict, where: str, unseen: list[UnseenPart]) -> dict:
    """A user, system or developer message, or a function call's output, as one chat message."""
    if kind == "function_call_output":
        call_id = chat_request.nonempty_string(item.get("call_id"), f"{where}.call_id")
        return {"role": "tool", "content": _content_text(item.get("output"), f"{where}.output", unseen),
                "tool_call_id": call_id}
    role = item.get("role")
    if role not in _ROLES:
        raise WireError(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}", param=f"{where}.role")
    content = _content_text(item.get("content"), f"{where}.content", unseen)
    return {"role": "system" if role == "developer" else role, "content": content}


def _content_text(content: Any, where: str, unseen: list[UnseenPart]) -> str:
    return chat_request.content_text(content, where, text_types=_TEXT_PARTS, part="part", unseen=unseen,
                               accepted="a string, null or a list of content parts", text_keys=_TEXT_KEYS)


class _Reply:
    """The items of one assistant reply, gathered into one chat message."""

    def __init__(self):
        self._rank = -1
        self._texts: list[str] = []
        self._tool_calls: list[dict] = []
        self._reasoning: str | None = None
        self._sealed: tuple[str, str] | None = None  # (where, the blob): its reasoning, opened with the request's end

    def takes(self, rank: int) -> bool:
        """Whether an item of `rank` continues this reply (only calls may follow calls)."""
        return rank > self._rank or rank == _REPLY_RANK["function_call"]

    def add(self, kind: str, item: dict, where: str, unseen: list[UnseenPart]) -> None:
        self._rank = _REPLY_RANK[kind]
        if kind == "reasoning":
            self._reasoning = self._reasoning_text(item, where)
        elif kind == "message":
            self._texts.append(_content_text(item.get("content"), f"{where}.content", unseen))
        else:
            self._tool_calls.append(_function_call(item, where))

    def message(self, sealed: list[SealedReasoning]) -> dict:
        """The reply as a chat message; its reasoning, when sealed, goes to `sealed`, to be opened."""
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(self._texts)}
        if self._tool_calls:
            message["tool_calls"] = self._tool_calls
        if self._sealed is not None:
            sealed.append(SealedReasoning(message, *self._sealed))
        elif self._reasoning is not None:
            message["reasoning_content"] = self._reasoning
        return message

    def _reasoning_text(self, item: dict, where: str) -> str | None:
        """None when the item carries `encrypted_content` (kept sealed, to be opened), else its `content` text (as a
        Chat Completions client's echoed `reasoning_content` is taken), else None (a summary is not the
        reasoning)."""
        blob = item.get("encrypted_content")
        if blob is not None:
            if not isinstance(blob, str):
                raise WireError(f"{where}.encrypted_content must be a string", param=f"{where}.encrypted_content")
            self._sealed = (f"{where}.encrypted_content", blob)
            return None
        content = item.get("content")
        if content is None:
            return None
        if not isinstance(content, list):
            raise WireError(f"{where}.content must be a list of reasoning_text parts", param=f"{where}.content")
        texts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") not in _REASONING_PARTS \
                    or not isinstance(part.get("text"), str):
                raise WireError(f"{at} must be a reasoning_text part with a string text", param=at)
            texts.append(part["text"])
        return "\n".join(texts)


def _function_call(item: dict, where: str) -> dict:
    call_id = chat_request.nonempty_string(item.get("call_id"), f"{where}.call_id")
    name = chat_request.nonempty_string(item.get("name"), f"{where}.name")
    arguments = item.get("arguments")
    if arguments is None or arguments == "":
        arguments = "{}"
    if not isinstance(arguments, str):
        raise WireError(f"{where}.arguments must be a string of JSON", param=f"{where}.arguments")
    chat_request.embedded_json(arguments, f"{where}.arguments")
    return chat_request.tool_call(call_id, name, arguments)


def _tools(value: Any) -> list[dict]:
    """The request's tools the model is offered (entries `_function_tool` skips left out), names unique."""
    tools = [_function_tool(tool, where) for where, tool in chat_request.tool_entries(value)]
    return chat_request.unique_tool_names([tool for tool in tools if tool is not None], "tools[{}].name")


def _function_tool(tool: dict, where: str) -> dict | None:
    kind = tool.get("type")
    if not isinstance(kind, str):
        raise WireError(f"{where}.type must be a string, got {kind!r}", param=f"{where}.type")
    if kind != "function":
        return None  # a tool only OpenAI's servers run, or one the tool-call format cannot express
    parameters = tool.get("parameters")
    return chat_request.function_tool(tool.get("name"), tool.get("description"),
                                {"type": "object", "properties": {}} if parameters is None else parameters,
                                params=(f"{where}.name", f"{where}.description", f"{where}.parameters"))


def reply_identity(message: dict) -> str:
    """What a sealed reasoning is bound to: the identity turn matching gives its reply (reasoning not included)."""
    return unit_hash(normalize_message(message))


# ---------------------------------------------------------------------------- responses


def responses_response(
    parsed: ParsedOutput, response_id: str, *, model: str, finish_reason: str, prompt_tokens: int, output_tokens: int,
    seal: ReasoningSeal, request: ChatRequest, instructions: str | None, encrypted_reasoning: bool,
    token_logprobs: list[tuple[str, float]] | None = None,
) -> dict:
    """A Responses `response` object for `request`: output items reasoning, message, function calls. The reasoning
    item carries `encrypted_content` (sealed by `seal`) when `encrypted_reasoning`; `token_logprobs` (text and
    logprob of each sampled token) go on the message's text when the client asked for them."""
    cut = finish_reason == "length"
    visible: list[dict] = []
    if parsed.content or not parsed.tool_calls:
        visible.append(_message_item(parsed.content, token_logprobs, cut))
    visible += [_function_call_item(call) for call in parsed.tool_calls]
    output = visible
    if parsed.reasoning is not None:
        (message,), _ = input_messages(visible, [])  # no reasoning among them: nothing sealed
        blob = seal.seal(parsed.reasoning, reply_identity(message)) if encrypted_reasoning else None
        output = [_reasoning_item(parsed.reasoning, blob), *visible]
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": instructions,
        "max_output_tokens": request.max_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "tool_choice": "auto",
        "tools": [{"type": "function", "strict": None, **tool["function"]} for tool in request.tools],
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        },
    }


def _message_item(text: str, token_logprobs: list[tuple[str, float]] | None, cut: bool) -> dict:
    logprobs = [{"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                for token, logprob in token_logprobs or []]
    return {"type": "message", "id": _new_item_id("msg"), "role": "assistant", "status": "incomplete" if cut
            else "completed", "content": [{"type": "output_text", "text": text, "annotations": [],
                                           "logprobs": logprobs}]}


def _function_call_item(call: dict) -> dict:
    function = call["function"]
    return {"type": "function_call", "id": _new_item_id("fc"), "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": "completed"}


def _reasoning_item(reasoning: str, blob: str | None) -> dict:
    return {"type": "reasoning", "id": _new_item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning}], "encrypted_content": blob,
            "status": "completed"}


def responses_overflow_message(prompt_tokens: int, limit: int) -> str:
    """OpenAI's words for an input over the context (the code, `context_length_exceeded`, is what clients act on)."""
    return (f"Your input exceeds the context window of this model ({prompt_tokens} tokens > {limit} maximum). "
            "Please adjust your input and try again.")


# ---------------------------------------------------------------------------- one model call


class ResponsesTurn:
    """The codec of one `POST /v1/responses`: bound to its session (whose reasoning blobs it seals and opens) and,
    once `parse` has run, to its request (whose `include` and `instructions` the response follows)."""

    def __init__(self, seal: ReasoningSeal):
        self.seal = seal
        self.request: ChatRequest | None = None
        self.instructions: str | None = None
        self.encrypted_reasoning = False
        self.codec = TurnCodec(parse=self.parse, respond=self.respond, stream=response_stream, echo=self.echo,
                               new_id=new_response_id, overflow=self.overflow)

    def parse(self, body: Any) -> ChatRequest:
        self.request = responses_request(body, self.seal)
        self.instructions = body.get("instructions")
        self.encrypted_reasoning = ENCRYPTED_REASONING in (body.get("include") or [])
        return self.request

    def respond(self, parsed: ParsedOutput, response_id: str, *, stop_sequence: str | None = None,
                **kwargs: Any) -> dict:
        del stop_sequence  # a Responses request has no stop sequences of its own
        return responses_response(parsed, response_id, seal=self.seal, request=self.request,
                                  instructions=self.instructions, encrypted_reasoning=self.encrypted_reasoning,
                                  **kwargs)

    def echo(self, response: dict) -> dict:
        """The chat message `parse` makes of this response's output when a client sends it back."""
        (message,), sealed = input_messages(response["output"], [])
        open_reasoning(sealed, self.seal)
        return message

    def overflow(self, message: str) -> web.Response | None:
        """A stream's answer to a prompt over the context: `response.failed`, which is where Codex looks for it (then
        compacts); None for a JSON request, which gets the wire's 400."""
        if self.request is None or not self.request.stream:
            return None
        response = {"id": new_response_id(), "object": "response", "created_at": int(time.time()),
                    "status": "failed", "error": {"code": "context_length_exceeded", "message": message},
                    "incomplete_details": None, "instructions": self.instructions, "model": self.request.model,
                    "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": None}
        return web.Response(body=b"".join(failed_events(response)), content_type="text/event-stream")


def response_stream(response: dict, request: ChatRequest | None = None) -> list[bytes]:
    """`TurnCodec.stream`: the response as its events (the same whatever the `request`)."""
    del request
    return response_events(response)


def session_codec(session_key: str) -> TurnCodec:
    """The codec of one `POST /v1/responses`, bound to the session the request's key names."""
    return ResponsesTurn(ReasoningSeal(session_key)).codec


WIRE = WireFormat(
    name="openai_responses",
    prefix="/v1/responses",
    routes=(Route("POST", "/v1/responses", session_codec=session_codec),),
    error_body=openai_error_body,
    overflow_message=responses_overflow_message,
    overflow_param="input",
)
